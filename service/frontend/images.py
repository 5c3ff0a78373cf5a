"""Encoded images -> the model's input rows, in a front end: each image decoded (Pillow) and preprocessed (torch on
the CPU) in a thread of the front end's image pool (FUSEDSERVE_IMAGE_DECODE_THREADS), so that a request's images
decode side by side and the event loop serves other requests meanwhile. The rows then take the tensor path (uint8,
a quarter of float32's bytes to the engine, whose first conv normalizes them).

Decoding a 500x375 JPEG takes about 2 ms of a core and resizing it 1 ms: far more than the event loop may block for
(a single-row MLP request is answered in under 0.1 ms), so never on the loop.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..images.decode import ImageError
from ..images.prepare import prepare
from ..images.preprocess import Preprocess
from .image_forms import Images
from .inputs import InputError
from .state import FrontendState


class ImagePipeline:
    """One front end's image decoding: its preprocessing, pixel limit and thread pool."""

    def __init__(self, state: FrontendState):
        model = state.model
        self.preprocess = Preprocess.from_description(model.image)
        self.max_pixels = state.settings.image_max_pixels
        self.float_input = model.input_dtype != "uint8"  # a float32 model takes the pixels as floats 0-255
        self.pool = ThreadPoolExecutor(state.settings.image_decode_threads, thread_name_prefix="fs-image")
        # One core per resize: the front ends are already one per core, and torch's default (a thread per core for
        # each resize) would run cores x threads x front ends threads on the host's cores.
        import torch

        torch.set_num_threads(1)

    async def rows(self, images: Images) -> np.ndarray:
        """(n, channels, height, width) uint8 (float32 for a float model); InputError naming the first image, in
        request order, that could not be read."""
        loop = asyncio.get_running_loop()
        pre, limit = self.preprocess, self.max_pixels
        done = await asyncio.gather(
            *(loop.run_in_executor(self.pool, prepare, data, pre, limit, what) for what, data in images),
            return_exceptions=True,
        )
        for result in done:
            if isinstance(result, ImageError):
                raise InputError(result.status, result.message, "too_large" if result.status == 413 else "invalid")
            if isinstance(result, BaseException):
                raise result
        rows = np.stack(done)
        return rows.astype(np.float32) if self.float_input else rows


def pipeline(state: FrontendState) -> ImagePipeline:
    """The front end's pipeline, made at its first image request (a model without images never makes one)."""
    made = state.__dict__.get("image_pipeline")
    if made is None:
        made = state.__dict__["image_pipeline"] = ImagePipeline(state)
    return made
