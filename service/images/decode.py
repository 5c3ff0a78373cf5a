"""One encoded image -> its pixels: (height, width, channels) uint8, RGB or L, or ImageError naming what is wrong.

The header is read first (Pillow's Image.open reads no pixel data) and the image's size checked against the pixel
limit before any decoding: a 30,000 x 30,000 PNG of zeros is 0.9 MB on the wire and 900 MB (2.7 GB as RGB) decoded.
Only the JPEG, PNG and WebP decoders are ever asked (Image.open's `formats`): Pillow would otherwise try each of its
~40 format plugins on bytes that match none.

What users expect of the awkward files, as torchvision's decode_image(mode=RGB) does: grayscale, CMYK and palette
images converted to the model's channels; 16-bit PNGs scaled to 8 bits (value * 255 / 65535, rounded); an alpha
channel dropped; an animated file's first frame.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image, UnidentifiedImageError

# Pillow's own bomb check (a warning past 89 MP, an error past 179 MP) is replaced by the caller's `max_pixels`, which
# the settings choose (FUSEDSERVE_IMAGE_MAX_PIXELS) and which every image meets before it is decoded.
Image.MAX_IMAGE_PIXELS = None

# The magic bytes of each format the service takes, and Pillow's name for it.
FORMATS = {"jpeg": "JPEG", "png": "PNG", "webp": "WEBP"}
MEDIA_TYPES = {"image/jpeg": "jpeg", "image/png": "png", "image/webp": "webp"}


class ImageError(ValueError):
    """An image the service refuses: the HTTP status (422 unreadable, 413 too large) and a message naming why."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def sniff(data: bytes) -> str | None:
    """ "jpeg", "png" or "webp" from the file's first bytes, or None."""
    if data[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return None


def check_size(width: int, height: int, max_pixels: int, what: str) -> None:
    """ImageError 413 for an image (as its header gives its size) of more than `max_pixels` pixels."""
    if width * height > max_pixels:
        raise ImageError(
            413, f"{what} is {width}x{height} ({width * height:,} pixels); at most {max_pixels:,} "
            "(FUSEDSERVE_IMAGE_MAX_PIXELS), checked from its header before decoding"
        )  # fmt: skip


def decode(data: bytes, channels: str, max_pixels: int, what: str = "the image") -> np.ndarray:
    """`data` (a JPEG, PNG or WebP file) -> (height, width, 3) uint8 RGB, or (height, width, 1) for `channels` "L"
    (BGR is RGB here: preprocess.py flips it); ImageError otherwise. `what` names the image in messages
    ("instances[2]", "part 3 ('cat.jpg')")."""
    if not data:
        raise ImageError(422, f"{what} is empty (0 bytes); send a JPEG, PNG or WebP file")
    kind = sniff(data)
    if kind is None:
        raise ImageError(422, f"{what} is not a JPEG, PNG or WebP file (it starts with {bytes(data[:8])!r})")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Pillow's warnings of odd metadata: the pixels are what count here
            im = Image.open(io.BytesIO(data), formats=[FORMATS[kind]])
            check_size(*im.size, max_pixels, what)
            im.load()
    except ImageError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError) as e:
        # "image file is truncated (3 bytes not processed)", "broken data stream", "Truncated File Read", ...
        raise ImageError(422, f"{what} is not a valid {kind.upper()} file: {e}") from None
    return _pixels(im, channels)


def _pixels(im: Image.Image, channels: str) -> np.ndarray:
    """Pillow's image in any mode -> (height, width, 3 or 1) uint8 of `channels`."""
    gray = channels == "L"
    if im.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):  # 16-bit gray PNG: scaled to 8 bits, not clipped
        wide = np.asarray(im).astype(np.uint32)
        if im.mode == "I":  # 32-bit container of 16-bit samples
            wide = np.clip(wide, 0, 65535)
        eight = ((wide * 255 + 32767) // 65535).astype(np.uint8)
        im = Image.fromarray(eight)  # 2-D uint8: mode L
    if im.mode == "P" or im.mode == "PA":
        im = im.convert("RGBA")  # the palette's colours (and its transparency, dropped below)
    # L: ITU-R 601-2 luma of colour, as torchvision's rgb_to_grayscale; RGB: of L, LA, CMYK, RGBA, 1, YCbCr
    want = "L" if gray else "RGB"
    arr = np.asarray(im if im.mode == want else im.convert(want))
    return arr[:, :, None] if arr.ndim == 2 else arr
