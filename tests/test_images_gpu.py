"""service/images/gpu_decode.py on a GPU host: JPEGs decoded in batches by nvJPEG (torchvision.io.decode_jpeg on
CUDA) and preprocessed on the GPU give the CPU path's rows (Pillow's libjpeg-turbo, then the same torch resize on the
CPU) within a stated tolerance, and the digits model's top-1 on them; files nvJPEG does not take (CMYK, PNG) go the
CPU path in the same call, and bad files are refused as on the CPU.

Tolerance: two JPEG decoders differ in their IDCT and chroma upsampling by a few levels on some pixels; after a
resize that averages neighbours, a mean of at most 1 level and a maximum of at most 16 (uint8 units) over the output.

Needs CUDA and a torchvision that imports beside this torch (`pip install torchvision` of the release built for it;
its PyPI wheel breaks beside the CPU torch, so CI never has it): skipped otherwise, saying which is missing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from service.images import gpu_decode
from service.images.decode import ImageError
from service.images.prepare import prepare
from service.images.preprocess import Preprocess

from .imagegen import DIGIT_SCALE, cmyk_jpeg, digit_images, encode, photo, png_bomb, truncated
from .server import REPO

pytestmark = pytest.mark.gpu

MAX_PIXELS = 50_000_000
MEAN_LEVELS, MAX_LEVELS = 1.0, 16


@pytest.fixture(scope="module", autouse=True)
def _needs_nvjpeg():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: on a GPU host, tests/gpu_suite.sh runs it (tests/README.md)")
    if gpu_decode._decode_jpeg() is None:
        pytest.skip("torchvision does not import beside this torch: pip install the torchvision built for it")
    if not gpu_decode.available():
        pytest.skip("torchvision.io.decode_jpeg(device='cuda') fails here (no nvJPEG?)")


def _cpu_rows(files, pre) -> np.ndarray:
    return np.stack([prepare(data, pre, MAX_PIXELS, what) for what, data in files])


def _compare(gpu: torch.Tensor, cpu: np.ndarray, what: str) -> None:
    assert gpu.is_cuda and gpu.dtype == torch.uint8 and tuple(gpu.shape) == cpu.shape, (what, gpu.shape, cpu.shape)
    d = np.abs(gpu.cpu().numpy().astype(np.int16) - cpu.astype(np.int16))
    print(f"{what}: mean {d.mean():.3f} levels, max {d.max()}, share off {np.mean(d > 0):.2%}")
    assert d.mean() <= MEAN_LEVELS and d.max() <= MAX_LEVELS, (what, d.mean(), d.max())


@pytest.mark.parametrize("channels", ["RGB", "BGR"])
def test_photos_decode_on_the_gpu_as_on_the_cpu(channels):
    rng = np.random.default_rng()
    sizes = [(375, 500), (500, 375), (768, 1024), (240, 320), (1080, 1920), (230, 230)]
    files = [(f"photo {h}x{w}", encode(photo(rng, h, w), "JPEG", quality=90)) for h, w in sizes]
    pre = Preprocess(224, 224, resize=256, channels=channels)
    _compare(gpu_decode.GpuJpegDecoder(pre, MAX_PIXELS)(files), _cpu_rows(files, pre), channels)


def test_the_digits_keep_their_top1():
    """digits-resnet (imported from its .onnx as served) on its 360 held-out digits as 32x32 JPEGs resized to 8x8: the
    GPU path's rows give the CPU path's top-1."""
    from service.model.executors import Executor
    from service.model.loader import load_model

    _, images, _ = digit_images(360, upscale=4)
    files = [(f"digit {i}", encode(im, "JPEG", quality=95)) for i, im in enumerate(images)]
    pre = Preprocess(8, 8, resize=8, channels="L")
    gpu = gpu_decode.GpuJpegDecoder(pre, MAX_PIXELS)(files)
    cpu = _cpu_rows(files, pre)
    _compare(gpu, cpu, "digits")
    model = load_model(REPO / "model_weights" / "digits-resnet" / "digits-resnet.onnx")
    ex = Executor(model, "unfused", torch.device("cuda"), torch.float32)
    top1 = [ex.forward(x.float().cuda() / DIGIT_SCALE).argmax(1).cpu() for x in (gpu, torch.from_numpy(cpu))]
    assert torch.equal(top1[0], top1[1])


def test_files_nvjpeg_does_not_take_go_the_cpu_path_in_order():
    rng = np.random.default_rng()
    cmyk, _ = cmyk_jpeg(rng, 300, 400)
    files = [
        ("jpeg", encode(photo(rng, 300, 400), "JPEG", quality=90)),
        ("cmyk", cmyk),
        ("png", encode(photo(rng, 280, 260), "PNG")),
        ("gray", encode(photo(rng, 256, 256)[:, :, 0], "JPEG")),
    ]
    pre = Preprocess(224, 224, resize=256)
    _compare(gpu_decode.GpuJpegDecoder(pre, MAX_PIXELS)(files), _cpu_rows(files, pre), "mixed")  # fmt: skip


@pytest.mark.parametrize(
    ("data", "status", "message"),
    [(truncated(encode(photo(np.random.default_rng(0), 64, 64), "JPEG")), 422, "not a valid JPEG file"),
     (png_bomb(), 413, "30000x30000")],
    ids=["truncated", "bomb"],
)  # fmt: skip
def test_bad_files_are_refused_as_on_the_cpu(data, status, message):
    good = encode(photo(np.random.default_rng(), 64, 64), "JPEG")
    with pytest.raises(ImageError) as e:
        gpu_decode.GpuJpegDecoder(Preprocess(32, 32, resize=32), MAX_PIXELS)([("good", good), ("file 2", data)])
    assert e.value.status == status and message in e.value.message and "file 2" in e.value.message
