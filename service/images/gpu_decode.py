"""JPEGs decoded on the GPU in batches (nvJPEG, through torchvision.io.decode_jpeg(device="cuda")), then resized and
cropped on the GPU by the same torch code as the CPU path (preprocess.py): the engine-side step for JPEG requests on a
GPU host, where a front end's core would otherwise spend about 3 ms per 500x375 photo (decode 2 ms, resize 1 ms).

Optional: `GpuJpegDecoder.available()` is True only where torchvision imports beside this torch and decodes a JPEG on
the GPU (its PyPI wheel is built against the CUDA torch and fails at import beside the CPU one, so CI never has it);
everywhere else, and for any file it does not take, the CPU path (prepare.py) runs. Each file's header is read on the
CPU first (Pillow, no pixels decoded), so that the pixel limit, the format and the colour mode are checked before any
GPU work: a CMYK or non-JPEG file goes to the CPU path, which converts it as users expect.

tests/test_images_gpu.py (marked gpu) checks its rows against the CPU path's on the same files, and the digits
model's top-1 on them.
"""

from __future__ import annotations

import functools
import io
import logging

import numpy as np
import torch
from PIL import Image

from .decode import check_size, decode, sniff
from .preprocess import Preprocess

log = logging.getLogger(__name__)

# nvJPEG decodes these as they are; anything else (CMYK, YCCK, 16-bit lossless JPEG) takes the CPU path.
GPU_MODES = ("RGB", "L")


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


class GpuJpegDecoder:
    """Encoded files -> (n, channels, height, width) uint8 on the GPU: the JPEGs in one nvJPEG batch, the rest (and
    any JPEG the header check sends there) decoded on the CPU and copied over."""

    def __init__(self, preprocess: Preprocess, max_pixels: int, device: str = "cuda"):
        self.preprocess = preprocess
        self.max_pixels = max_pixels
        self.device = torch.device(device)
        self.gray = preprocess.channels == "L"

    def __call__(self, files: list[tuple[str, bytes]]) -> torch.Tensor:
        """`files`: (what names it in messages, its bytes); ImageError for the first that cannot be read."""
        on_gpu = [i for i, (what, data) in enumerate(files) if self._gpu_takes(data, what)]
        rows: list[torch.Tensor | None] = [None] * len(files)
        if on_gpu:
            decode_jpeg, mode = _decode_jpeg()
            data = [torch.frombuffer(bytearray(files[i][1]), dtype=torch.uint8) for i in on_gpu]
            try:
                images = decode_jpeg(data, mode=mode.GRAY if self.gray else mode.RGB, device=self.device)
            except RuntimeError:  # one file nvJPEG refuses fails the batch: each on the CPU path, which words it
                images, on_gpu = [], []
            for i, image in zip(on_gpu, images, strict=True):
                rows[i] = self.preprocess.chw(image)
        for i, (what, data) in enumerate(files):
            if rows[i] is None:
                pixels = decode(data, "L" if self.gray else "RGB", self.max_pixels, what)
                rows[i] = self.preprocess(torch.from_numpy(np.ascontiguousarray(pixels)).to(self.device))
        return torch.stack(rows)

    def _gpu_takes(self, data: bytes, what: str) -> bool:
        """A JPEG of a mode nvJPEG decodes, within the pixel limit (ImageError past it); False for the CPU path."""
        # No end-of-image marker: truncated. libjpeg-turbo says so (and the CPU path refuses it); nvJPEG may not.
        if sniff(data) != "jpeg" or not data.rstrip(b"\0").endswith(b"\xff\xd9"):
            return False
        try:
            with Image.open(io.BytesIO(data), formats=["JPEG"]) as im:
                width, height, mode = *im.size, im.mode
        except Exception:  # noqa: BLE001 - a header Pillow cannot read: the CPU path says what is wrong with it
            return False
        check_size(width, height, self.max_pixels, what)
        return mode in GPU_MODES
