"""service/images/gpu_decode.py on a GPU host: JPEGs decoded in batches by nvJPEG (torchvision.io.decode_jpeg on
CUDA) and preprocessed on the GPU give the CPU path's rows (Pillow's libjpeg-turbo, then the same torch resize on the
CPU) within a stated tolerance, and the digits model's top-1 on them; files nvJPEG does not take (CMYK, PNG) go the
CPU path in the same call, and bad files are refused as on the CPU.

Then the service's GPU path (issue 50): an engine decoding a batch's JPEGs in one call and copying request rows from
front ends' arenas registered with CUDA gives the outputs the staged path gives (rows: equal; JPEGs: the digits' top-1),
and the real service with FUSEDSERVE_IMAGE_DECODE=gpu and FUSEDSERVE_PINNED_ARENAS=on keeps every held-out digit's
top-1, fed as JPEG and PNG files, with a file nvJPEG does not take answered as on the CPU.

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
# nvJPEG against Pillow (libjpeg-turbo) on the same file: their chroma upsampling differs (libjpeg-turbo's "fancy"
# triangular filter), so colour edges move by tens of levels while the mean stays under one. Measured on an H200:
# mean 0.80 levels, max 20, 41% of the values off by one or more (six synthetic photos, quality 90). A swapped channel
# order or a crop off by a pixel moves the mean by tens of levels.
MEAN_LEVELS, MAX_LEVELS = 1.0, 48


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


# ---------------------------------------------------------------------------- the engine's GPU path (issue 50)


def _digits_model(tmp_path, uint8: bool):
    """digits-resnet imported as the service serves images of it: gray 8x8, normalization in the first conv."""
    from service.cli import main as cli_main
    from service.model.loader import load_model

    out = tmp_path / ("digits-u8" if uint8 else "digits-images")
    args = ["import", str(REPO / "model_weights" / "digits-resnet" / "digits-resnet.onnx"), str(out), "--resize", "8",
            "--mean", "0", "--std", str(DIGIT_SCALE)]  # fmt: skip
    assert cli_main(args + (["--input-dtype", "uint8"] if uint8 else [])) == 0
    return out, load_model(out)


def _runner(model, direct: bool, arenas=None):
    from service.model.runner import ModelRunner

    runner = ModelRunner(model, "unfused", torch.device("cuda"), "float32", max_batch_size=64, direct_input=direct,
                         kernel_timing_every=0)  # fmt: skip
    runner.pinned = arenas
    runner.warmup(64)
    return runner


def test_an_engine_copies_from_registered_arenas_and_decodes_jpegs_in_one_call(tmp_path):
    """A real Engine on the GPU, its front end's arena registered: UINT8 rows reach the graph by direct copies (no
    staging) and answer exactly as a staged runner's; a batch of JPEG requests is decoded in one nvJPEG call and keeps
    the CPU path's top-1; a file nvJPEG does not take is sent back to its front end alone."""
    import asyncio
    import time

    from service.engine.pinned import PinnedArenas
    from service.frontend.engine_client import EngineClient, EngineError, ImageRequest
    from service.link import wire

    from .test_link import EngineThread, ready_states, wait_until

    _, model = _digits_model(tmp_path, uint8=True)
    pre = Preprocess.of(model.spec)
    arenas = PinnedArenas(True)
    direct = _runner(model, True, arenas)
    staged = _runner(model, False)
    raw, images, _ = digit_images(96)
    pixels = np.rint(raw * DIGIT_SCALE).clip(0, 255).astype(np.uint8)  # (96, 1, 8, 8)
    jpegs = [encode(im, "JPEG", quality=95) for im in images[:48]]

    async def scenario(path):
        client = EngineClient([path], ready_states(), model.output_features, arena_size=64 << 20)
        client.start()
        await wait_until(lambda: client._wire[0] is not None)
        now = time.monotonic
        rows = [client.submit(pixels[a : a + 16], now() + 30, now())[1] for a in range(0, 96, 16)]
        got_rows = await asyncio.wait_for(asyncio.gather(*rows), 60)
        items = [_items_l(jpegs[a : a + 12]) for a in range(0, 48, 12)]
        got_jpegs = await asyncio.wait_for(asyncio.gather(
            *(client.submit(ImageRequest(it, []), now() + 30, now())[1] for it in items)), 60)  # fmt: skip
        # A file nvJPEG refuses (no JPEG after its first marker; the front end's header check would have kept it, so
        # it is handed over directly): its request alone goes back to the front end.
        bad = [(wire.ENCODED_JPEG, b"\xff\xd8\xff\xe0" + bytes(range(256)) * 4 + b"\xff\xd9", 8, 8)]
        pair = [ImageRequest(bad, []), ImageRequest(_items_l(jpegs[:4]), [])]
        futs = [client.submit(r, now() + 30, now())[1] for r in pair]
        mixed = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 60)
        client.close()
        return got_rows, got_jpegs, mixed

    def _items_l(files):
        return [(k, d, h, w) for k, d, h, w in (_one(f) for f in files)]

    def _one(f):
        hw = gpu_decode.header(f, MAX_PIXELS, "L")
        assert hw is not None
        return (wire.ENCODED_JPEG, f, *hw)

    path = str(tmp_path / "engine.sock")
    et = EngineThread(path, direct)
    engine = et.engine
    engine.input_shape, engine.features = tuple(model.input_shape), model.input_features
    engine.queue.max_batch_size = 64
    engine.jpeg = gpu_decode.BatchDecoder(pre, "cuda")
    engine.pinned = arenas
    with et:
        got_rows, got_jpegs, mixed = asyncio.run(scenario(path))
    assert arenas.registered_total == 1, "the front end's arena was not registered with CUDA"
    assert direct.direct_copies > 0, "no batch was copied from the registered arena"
    # Batches of other sizes than the staged runner's here: cuDNN may pick other algorithms, so close, not equal
    # (test_direct_copies_from_a_registered_buffer_give_the_staged_outputs compares equal batches exactly).
    want = np.concatenate([staged.run(pixels[a : a + 16]) for a in range(0, 96, 16)])
    got = np.concatenate([o for o, _ in got_rows])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert np.array_equal(got.argmax(1), want.argmax(1))
    assert engine.jpeg.calls >= 1
    cpu = np.stack([prepare(f, pre, MAX_PIXELS) for f in jpegs])
    top_cpu = staged.run(cpu).argmax(1)
    assert np.array_equal(np.concatenate([o for o, _ in got_jpegs]).argmax(1), top_cpu)
    refused, fine = mixed
    assert isinstance(refused, EngineError) and refused.status == wire.DECODE_ON_CPU, refused
    assert np.array_equal(fine[0].argmax(1), top_cpu[:4])


def test_the_service_keeps_the_digits_top1_with_jpegs_decoded_on_the_gpu(tmp_path):
    """The real service, FUSEDSERVE_IMAGE_DECODE=gpu and FUSEDSERVE_PINNED_ARENAS=on: every held-out digit as a JPEG
    and as a PNG file (multipart) gets the tensor path's top-1, a CMYK JPEG and a truncated one are answered as on the
    CPU (200 and 422), and the engine's log says its arenas are registered."""
    import httpx

    from .imagegen import cmyk_jpeg, digit_images
    from .server import running_servers

    model_dir, _ = _digits_model(tmp_path, uint8=True)
    env = {"model": str(model_dir), "max_batch_size": 256, "image_decode": "gpu", "pinned_arenas": "on",
           "device": "cuda", "workers": 2}  # fmt: skip
    raw, images, _ = digit_images(360)
    pixels = np.rint(raw * DIGIT_SCALE).clip(0, 255).astype(np.uint8)
    timeout = httpx.Timeout(120.0, connect=5.0)
    (tmp_path / "logs").mkdir()
    with running_servers({"s": ("fused", env)}, tmp_path / "logs", timeout_s=600) as s:
        url = s["s"].url
        top1 = []
        for at in range(0, 360, 180):
            r = httpx.post(f"{url}/predict", json={"inputs": pixels[at : at + 180].tolist()}, timeout=timeout)
            assert r.status_code == 200, r.text[:300]
            top1 += r.json()["predictions"]
        for fmt, options in (("JPEG", {"quality": 95}), ("PNG", {})):
            got = []
            for at in range(0, 360, 120):
                files = [("file", (f"{i}.{fmt.lower()}", encode(im, fmt, **options))) for i, im in
                         enumerate(images[at : at + 120])]  # fmt: skip
                r = httpx.post(f"{url}/predict", files=files, timeout=timeout)
                assert r.status_code == 200, r.text[:300]
                got += r.json()["predictions"]
            assert got == top1, fmt
        cmyk, _ = cmyk_jpeg(np.random.default_rng(0), 24, 32)
        r = httpx.post(f"{url}/predict", content=cmyk, headers={"content-type": "image/jpeg"}, timeout=timeout)
        assert r.status_code == 200, r.text[:300]
        bad = truncated(encode(images[0], "JPEG"))
        r = httpx.post(f"{url}/predict", content=bad, headers={"content-type": "image/jpeg"}, timeout=timeout)
        assert r.status_code == 422 and "not a valid JPEG" in r.text
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "logs").glob("*.log"))
    assert "JPEGs decoded on the GPU (nvJPEG); front ends' arenas registered with CUDA" in logs, logs[-3000:]
    assert "registered with CUDA: its rows are copied" in logs and "could not register" not in logs


def test_direct_copies_from_a_registered_buffer_give_the_staged_outputs(tmp_path):
    """The same 64-row batch through the staged runner (rows copied into pinned staging, copy inside the graph) and the
    direct one (a registered shared mapping, one async copy per contiguous run, the graph without its copy in; split
    in two parts of one run and one of another): identical outputs; the mapping reads as pinned to torch."""
    import mmap

    from service.engine.pinned import PinnedArenas, address

    _, model = _digits_model(tmp_path, uint8=True)
    arenas = PinnedArenas(True)
    direct = _runner(model, True, arenas)
    staged = _runner(model, False)
    raw, _, _ = digit_images(64)
    x = np.rint(raw * DIGIT_SCALE).clip(0, 255).astype(np.uint8)
    buf = mmap.mmap(-1, 1 << 20)
    assert arenas.register(buf), "cudaHostRegister failed on an anonymous shared mapping"
    shared = np.frombuffer(buf, dtype=np.uint8, count=x.size, offset=4096).reshape(x.shape)
    shared[:] = x
    assert torch.from_numpy(shared).is_pinned()  # CUDA knows the range: its copies are DMA
    other = np.ascontiguousarray(x[40:])  # not registered: staged through host_in, then copied
    parts = [shared[:24], shared[24:40], other]
    got = direct.collect(direct.launch(parts))
    assert direct.direct_copies == 1  # the two adjacent parts: one copy
    np.testing.assert_array_equal(got, staged.run(x))
    del shared, parts
    arenas.retire(buf)
    arenas.release_retired()
    assert not arenas.contains(address(buf), 1)


def test_a_failed_registration_leaves_no_error_for_the_next_kernel():
    """Registering a range CUDA already has fails (PinnedArenas.register answers False) and the runtime's last error
    is cleared: the next kernel launch's check must not raise it as its own."""
    import mmap

    from service.engine.pinned import PinnedArenas

    buf = mmap.mmap(-1, 1 << 20)
    first, second = PinnedArenas(True), PinnedArenas(True)
    assert first.register(buf)
    try:
        assert not second.register(buf)  # the same pages again: refused by CUDA
        x = torch.randn(64, 64, device="cuda")
        y = x * 2 + 1  # torch's own kernels, whose launch check reads the runtime's last error
        torch.testing.assert_close((y @ y).cpu(), (x.cpu() * 2 + 1) @ (x.cpu() * 2 + 1), rtol=1e-3, atol=1e-3)
        torch.cuda.synchronize()
    finally:
        first.retire(buf)
        first.release_retired()
