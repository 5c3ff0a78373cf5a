"""Encoded images -> the model's input rows, in a front end: each image decoded (Pillow) and preprocessed (torch on
the CPU) in a thread of the front end's image pool (FUSEDSERVE_IMAGE_DECODE_THREADS), so that a request's images
decode side by side and the event loop serves other requests meanwhile. The rows then take the tensor path (uint8,
a quarter of float32's bytes to the engine, whose first conv normalizes them).

Decoding a 500x375 JPEG takes about 2 ms of a core and resizing it 1 ms: far more than the event loop may block for
(a single-row MLP request is answered in under 0.1 ms), so never on the loop.

Where the engines decode JPEGs on their GPU (FUSEDSERVE_IMAGE_DECODE, service/images/gpu_decode.py), only each file's
header is read here (~20 us: format, pixel limit, colour mode), and a JPEG nvJPEG takes travels encoded (an
ImageRequest); the request's other files (PNG, WebP, CMYK or grayscale JPEGs for an RGB model) are prepared here as
before and travel beside them, and a bad file is refused here with its 4xx, before the request joins a batch.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..images.decode import ImageError
from ..images.gpu_decode import header
from ..images.prepare import prepare
from ..images.preprocess import Preprocess
from ..link import wire
from .engine_client import ImageRequest
from .image_forms import Images
from .inputs import InputError
from .state import FrontendState


class ImagePipeline:
    """One front end's image decoding: its preprocessing, pixel limit and thread pool."""

    def __init__(self, state: FrontendState):
        model = state.model
        self.engines = state.engines
        self.preprocess = Preprocess.from_description(model.image)
        self.max_pixels = state.settings.image_max_pixels
        self.float_input = model.input_dtype != "uint8"  # a float32 model takes the pixels as floats 0-255
        self.pool = ThreadPoolExecutor(state.settings.image_decode_threads, thread_name_prefix="fs-image")
        # One core per resize: the front ends are already one per core, and torch's default (a thread per core for
        # each resize) would run cores x threads x front ends threads on the host's cores.
        import torch

        torch.set_num_threads(1)

    async def rows(self, images: Images) -> np.ndarray | ImageRequest:
        """(n, channels, height, width) uint8 (float32 for a float model), or an ImageRequest where the engines decode
        JPEGs and some file is one they take; InputError naming the first image, in request order, that could not
        be read."""
        if self.engines.decodes_jpeg():
            loop = asyncio.get_running_loop()
            try:
                sizes = await loop.run_in_executor(self.pool, self._headers, images)
            except ImageError as e:
                raise _input_error(e) from None
            if any(hw is not None for hw in sizes):
                return await self._image_request(images, sizes)
        return await self.cpu_rows(images)

    async def cpu_rows(self, images: Images) -> np.ndarray:
        """Every file decoded and prepared here: (n, channels, height, width) uint8 (float32 for a float model)."""
        rows = np.stack(await self._prepare(images))
        return rows.astype(np.float32) if self.float_input else rows

    async def _prepare(self, images: Images) -> list[np.ndarray]:
        loop = asyncio.get_running_loop()
        pre, limit = self.preprocess, self.max_pixels
        done = await asyncio.gather(
            *(loop.run_in_executor(self.pool, prepare, data, pre, limit, what) for what, data in images),
            return_exceptions=True,
        )
        for result in done:
            if isinstance(result, ImageError):
                raise _input_error(result)
            if isinstance(result, BaseException):
                raise result
        return done

    def _headers(self, images: Images) -> list[tuple[int, int] | None]:
        """Each file's (height, width) where the GPU decoder takes it as it is, else None (in the image pool: one hop
        for the request's headers); ImageError 413 for one past the pixel limit."""
        channels, limit = self.preprocess.channels, self.max_pixels
        return [header(data, limit, channels, what) for what, data in images]

    async def _image_request(self, images: Images, sizes: list[tuple[int, int] | None]) -> ImageRequest:
        """The JPEGs as they are, the other files prepared here (refused here if bad), in request order."""
        others = [im for im, hw in zip(images, sizes, strict=True) if hw is None]
        prepared = iter(await self._prepare(others)) if others else iter(())
        items = []
        for (_, data), hw in zip(images, sizes, strict=True):
            if hw is not None:
                items.append((wire.ENCODED_JPEG, data, *hw))
            else:
                items.append((wire.PREPARED_ROW, next(prepared).tobytes(), 0, 0))
        return ImageRequest(items, images)


def _input_error(e: ImageError) -> InputError:
    return InputError(e.status, e.message, "too_large" if e.status == 413 else "invalid")


def pipeline(state: FrontendState) -> ImagePipeline:
    """The front end's pipeline, made at its first image request (a model without images never makes one)."""
    made = state.__dict__.get("image_pipeline")
    if made is None:
        made = state.__dict__["image_pipeline"] = ImagePipeline(state)
    return made
