"""The CPU path of one image: decode (Pillow) then preprocess (torch on the CPU) into the model's input row."""

from __future__ import annotations

import warnings

import numpy as np
import torch

from .decode import decode
from .preprocess import Preprocess


def prepare(data: bytes, pre: Preprocess, max_pixels: int, what: str = "the image") -> np.ndarray:
    """An encoded image -> (channels, height, width) uint8 as the model takes it, or decode.ImageError."""
    pixels = decode(data, "L" if pre.channels == "L" else "RGB", max_pixels, what)
    with warnings.catch_warnings():
        # Pillow's arrays are read-only; torch warns of that once, and preprocessing only reads them
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.from_numpy(pixels)
    return pre(tensor).numpy()
