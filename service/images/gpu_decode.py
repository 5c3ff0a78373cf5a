"""JPEGs decoded on the GPU in batches (nvJPEG, through torchvision.io.decode_jpeg(device="cuda"): the hardware decoder
on an A100, H100 or H200), then resized and cropped on the GPU in one kernel (kernels/resize.py, the CPU path's
arithmetic: preprocess.py): the engine-side step for JPEG requests on a GPU host, where a front end's core would
otherwise spend about 2 ms per 500x375 photo (bench/results/h200/probe_jpeg_decode_h200.txt: Pillow's decode and
the CPU resize 1.9 ms; nvJPEG 28 us an image in batches of 256).

The split (FUSEDSERVE_IMAGE_DECODE, service/config.py): a front end reads each file's header (`header`: Pillow, no
pixel decoded), so that the format, the pixel limit and the colour mode are checked before the request joins a batch;
a JPEG nvJPEG takes travels encoded to the engine (service/link/wire.py's IMAGES block), every other file (PNG, WebP,
CMYK, or a bad file, which the CPU path refuses with its 4xx) is prepared in the front end as before. The engine
decodes its batch's JPEGs in one decode_jpeg call (`BatchDecoder`, chunked past GPU_BATCH_PIXELS), then resizes and
crops every one of them into its row in one kernel (kernels/resize.py); the runner copies the rows into the graph's
input, and the first conv normalizes them as it does tensors.

Optional: `available()` is True only where torchvision imports beside this torch and decodes a JPEG on the GPU (its
PyPI wheel is built against the CUDA torch and fails at import beside the CPU one, so CI never has it); everywhere
else the CPU path (prepare.py) runs. A JPEG nvJPEG refuses fails only its own request, which the front end then
decodes with Pillow (wire.DECODE_ON_CPU).

tests/test_images_gpu.py (marked gpu) checks its rows against the CPU path's on the same files, and the digits
model's top-1 on them; tests/test_images_routing.py the split, the wire and the fallbacks on the CPU.
"""

from __future__ import annotations

import functools
import io
import logging
import warnings
from collections.abc import Callable

import numpy as np
import torch
from PIL import Image

from .decode import check_size, decode, sniff
from .preprocess import Preprocess

log = logging.getLogger(__name__)

# Colour modes (Pillow's names, from the header) nvJPEG decodes into the model's channels as Pillow would: RGB into
# RGB or BGR, RGB and L into L (its luma). Anything else (a grayscale JPEG for an RGB model, CMYK, YCCK) is prepared in
# the front end, which converts it as users expect (decode.py).
GPU_MODES = {"RGB": ("RGB",), "BGR": ("RGB",), "L": ("L", "RGB")}
# Pixels decoded by one decode_jpeg call: nvJPEG's outputs (3 bytes a pixel) and its buffers stay within ~0.5 GB
# however large the batch's files are (a 256-image batch of 500x375 photos is 48 MP: one call).
GPU_BATCH_PIXELS = 64_000_000


@functools.cache
def _decode_jpeg():
    """torchvision.io's (decode_jpeg, ImageReadMode), or None where torchvision does not import beside this torch."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except Exception as e:  # noqa: BLE001 - ImportError, or RuntimeError ("operator torchvision::nms does not exist")
        log.debug("no GPU JPEG decoding: torchvision does not import (%s)", e)
        return None
    return decode_jpeg, ImageReadMode


@functools.cache
def available(device: str = "cuda") -> bool:
    """Whether JPEGs decode on `device` here: torchvision imports, CUDA is there, and a JPEG made here decodes."""
    found = _decode_jpeg()
    if found is None or not torch.cuda.is_available():
        return False
    decode_jpeg, mode = found
    buf = io.BytesIO()
    Image.fromarray(np.full((16, 16, 3), 128, np.uint8)).save(buf, format="JPEG")
    try:
        out = decode_jpeg([torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)], mode=mode.RGB,
                          device=device)  # fmt: skip
        return tuple(out[0].shape) == (3, 16, 16) and out[0].is_cuda
    except Exception as e:  # noqa: BLE001 - a torchvision built without nvJPEG, a driver too old, ...
        log.info("no GPU JPEG decoding: torchvision.io.decode_jpeg(device=%r) failed: %s", device, e)
        return False


def resolve(setting: str, device_type: str) -> bool:
    """Whether an engine on `device_type` decodes JPEGs (FUSEDSERVE_IMAGE_DECODE: auto, cpu, gpu); gpu where they
    cannot decode there is a RuntimeError at start, not a silent fallback."""
    if setting == "cpu":
        return False
    works = device_type == "cuda" and available()
    if setting == "gpu" and not works:
        why = "the engine runs on the CPU" if device_type != "cuda" else (
            "torchvision does not import beside this torch" if _decode_jpeg() is None
            else "torchvision.io.decode_jpeg(device='cuda') fails here")  # fmt: skip
        raise RuntimeError(f"FUSEDSERVE_IMAGE_DECODE=gpu but JPEGs cannot be decoded on the GPU: {why}")
    return works


def header(data: bytes, max_pixels: int, channels: str, what: str = "the image") -> tuple[int, int] | None:
    """A file the GPU decoder takes as it is: (height, width) from its header, read with Pillow's lazy open (no pixel
    decoded, ~20 us); ImageError 413 past `max_pixels`; None for anything else (not a JPEG, a mode nvJPEG does not
    convert as Pillow would, a header Pillow cannot read, no end-of-image marker), which the CPU path prepares or
    refuses with its own words."""
    # No end-of-image marker: truncated. libjpeg-turbo says so (and the CPU path refuses it); nvJPEG may not.
    if sniff(data) != "jpeg" or not bytes(data[-16:]).rstrip(b"\0").endswith(b"\xff\xd9"):
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(io.BytesIO(data), formats=["JPEG"]) as im:
                (width, height), mode = im.size, im.mode
                # An Adobe JPEG whose colour transform is 0 holds RGB itself, not YCbCr: Pillow knows, nvJPEG may not.
                rgb_coded = im.info.get("adobe") is not None and im.info.get("adobe_transform") == 0
    except Exception:  # noqa: BLE001 - a header Pillow cannot read: the CPU path says what is wrong with it
        return None
    check_size(width, height, max_pixels, what)
    if mode not in GPU_MODES.get(channels, ()) or width < 1 or height < 1 or rgb_coded:
        return None
    return height, width


def _nvjpeg(files: list[torch.Tensor], gray: bool, device: torch.device) -> list[torch.Tensor]:
    decode_jpeg, mode = _decode_jpeg()
    return decode_jpeg(files, mode=mode.GRAY if gray else mode.RGB, device=device)


class BatchDecoder:
    """An engine's batch of image requests -> each request's rows, (n, channels, height, width) uint8 on the device:
    every JPEG of the batch decoded in one call (`decode`: nvJPEG by default), the rows prepared in the front end
    (wire.PREPARED_ROW) copied over. A request of which a file fails to decode gets None (its front end then decodes it
    on the CPU); the others are not affected."""

    def __init__(self, preprocess: Preprocess, device: str | torch.device = "cuda",
                 decode: Callable[[list[torch.Tensor], bool, torch.device], list[torch.Tensor]] | None = None,
                 batch_pixels: int = GPU_BATCH_PIXELS):  # fmt: skip
        self.preprocess = preprocess
        self.device = torch.device(device)
        self.gray = preprocess.channels == "L"
        self.channels = 1 if self.gray else 3
        self.decode = decode or _nvjpeg
        self.batch_pixels = batch_pixels
        self.calls = 0  # decode calls made (the test of one call per batch reads it)

    def __call__(self, requests: list[list[tuple[int, memoryview, int, int]]]) -> list[torch.Tensor | None]:
        """`requests`: per request its images as (wire kind, bytes, height, width)."""
        from ..link import wire

        pre = self.preprocess
        shape = (self.channels, pre.height, pre.width)
        total = sum(len(r) for r in requests)
        out = torch.empty((total, *shape), dtype=torch.uint8, device=self.device)
        jpegs: list[tuple[int, int, memoryview, int]] = []  # (request, row in out, bytes, pixels)
        row = 0
        for r, images in enumerate(requests):
            for kind, data, height, width in images:
                if kind == wire.ENCODED_JPEG:
                    jpegs.append((r, row, data, height * width))
                else:
                    with warnings.catch_warnings():  # read-only bytes: only read
                        warnings.simplefilter("ignore", UserWarning)
                        out[row].copy_(torch.frombuffer(data, dtype=torch.uint8).view(shape))
                row += 1
        failed: set[int] = set()
        decoded: list[tuple[int, torch.Tensor]] = []  # (row in out, (C, H, W) on the device)
        for chunk in _chunks(jpegs, self.batch_pixels):
            decoded += self._decode_chunk(chunk, failed)
        if decoded:
            self._prepare([im for _, im in decoded], out, [at for at, _ in decoded])
        results: list[torch.Tensor | None] = []
        row = 0
        for r, images in enumerate(requests):
            results.append(None if r in failed else out[row : row + len(images)])
            row += len(images)
        return results

    def _prepare(self, images: list[torch.Tensor], out: torch.Tensor, rows: list[int]) -> None:
        """Resize and crop the decoded images into their rows of `out`: on CUDA in one kernel for the whole batch
        (kernels/resize.py, each image read where nvJPEG left it; bench/probes/jpeg_decode.py times it against
        torch's ops), elsewhere (the tests' fake decoders on the CPU) by the CPU path's torch code."""
        pre = self.preprocess
        if self.device.type == "cuda":
            from kernels.resize import resize_crop

            resize_crop(images, pre.height, pre.width, pre.resize, interpolation=pre.interpolation,
                        flip_channels=pre.channels == "BGR", out=out, rows=rows)  # fmt: skip
            return
        prepared = pre.many(images)
        if rows == list(range(rows[0], rows[0] + len(rows))):
            out[rows[0] : rows[0] + len(rows)] = prepared
        else:
            out[torch.tensor(rows, device=self.device)] = prepared

    def _decode_chunk(self, chunk: list[tuple[int, int, memoryview, int]], failed: set[int]):
        """One decode call for the chunk; if it raises (one file nvJPEG refuses fails the call), each half again, down
        to single files, so that only the requests of the files that fail alone are marked `failed` (one bad file in
        256: ~16 calls, not 256)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # frombuffer of read-only bytes: decode_jpeg only reads them
            files = [torch.frombuffer(data, dtype=torch.uint8) for _, _, data, _ in chunk]
        self.calls += 1
        try:
            images = self.decode(files, self.gray, self.device)
            if len(images) != len(files):
                raise RuntimeError(f"{len(images)} images decoded from {len(files)} files")
        except Exception as e:  # noqa: BLE001 - nvJPEG's RuntimeError for a file it does not take, whatever its words
            if len(chunk) == 1:
                log.info("GPU JPEG decoding refused a file (%s: %s); its request is decoded on the CPU",
                         type(e).__name__, e)  # fmt: skip
                failed.add(chunk[0][0])
                return []
            half = len(chunk) // 2
            return self._decode_chunk(chunk[:half], failed) + self._decode_chunk(chunk[half:], failed)
        out = []
        for (r, at, _, _), im in zip(chunk, images, strict=True):
            if im.dim() == 3 and im.shape[0] == self.channels and im.shape[1] > 0 and im.shape[2] > 0:
                out.append((at, im))
            else:  # not what was asked for (a decoder's channels for an odd file): the CPU path decides
                failed.add(r)
        return out


def _chunks(jpegs: list, budget: int):
    """`jpegs` in runs of at most `budget` pixels (a file larger than that alone)."""
    run, pixels = [], 0
    for j in jpegs:
        if run and pixels + j[3] > budget:
            yield run
            run, pixels = [], 0
        run.append(j)
        pixels += j[3]
    if run:
        yield run


class GpuJpegDecoder:
    """Encoded files -> (n, channels, height, width) uint8 on the GPU, in one process (tests, tools): the JPEGs the
    header check sends to the GPU in one nvJPEG batch (BatchDecoder), the rest (and any JPEG nvJPEG refuses) decoded
    on the CPU (Pillow) and copied over; ImageError for the first file that cannot be read, as the CPU path words it."""

    def __init__(self, preprocess: Preprocess, max_pixels: int, device: str = "cuda"):
        self.preprocess = preprocess
        self.max_pixels = max_pixels
        self.batch = BatchDecoder(preprocess, device)
        self.device = self.batch.device

    def __call__(self, files: list[tuple[str, bytes]]) -> torch.Tensor:
        from ..link import wire

        pre = self.preprocess
        gray = pre.channels == "L"
        images = []
        for what, data in files:
            hw = header(data, self.max_pixels, pre.channels, what)
            if hw is not None:
                images.append((wire.ENCODED_JPEG, memoryview(data), *hw))
            else:
                pixels = decode(data, "L" if gray else "RGB", self.max_pixels, what)
                row = pre(torch.from_numpy(np.ascontiguousarray(pixels))).numpy()
                images.append((wire.PREPARED_ROW, memoryview(row.tobytes()), 0, 0))
        rows = self.batch([[im] for im in images])
        out = []
        for (what, data), got in zip(files, rows, strict=True):
            if got is None:  # nvJPEG refused it: the CPU path, as the front end would take it
                pixels = decode(data, "L" if gray else "RGB", self.max_pixels, what)
                got = pre(torch.from_numpy(np.ascontiguousarray(pixels)).to(self.device))[None]
            out.append(got)
        return torch.cat(out)
