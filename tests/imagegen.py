"""Image files for the image tests, made fresh with Pillow: photos-like random images, the digits as PNG and JPEG,
and the awkward files clients send (grayscale, CMYK, palette, 16-bit, truncated, a decompression bomb)."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image

from .digits import held_out_split

# A held-out digit's raw pixels 0..16 as an 8-bit image: v * 255 / 16 rounded (16 -> 255). A model that takes the raw
# values declares std 255 / 16 (mean 0), so the image gives them back within 0.5 / 15.94 = 0.031.
DIGIT_SCALE = 255 / 16


def encode(pixels: np.ndarray, fmt: str, **options) -> bytes:
    """(H, W, 3) or (H, W) uint8 -> the file's bytes in `fmt` (JPEG, PNG, WEBP); Pillow's options (quality=95)."""
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt, **options)
    return buf.getvalue()


def photo(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """(height, width, 3) uint8: smooth colour gradients with noise, compressible as a photo is (a JPEG of white noise
    is mostly its own artifacts)."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    phase = rng.uniform(0, 2 * np.pi, 3)
    freq = rng.uniform(2, 6, 3) / max(height, width)
    base = [127 + 100 * np.sin(2 * np.pi * f * (x + 0.7 * y) + p) for f, p in zip(freq, phase, strict=True)]
    img = np.stack(base, axis=-1) + rng.normal(0, 8, (height, width, 3))
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def digit_images(count: int, upscale: int = 1) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
    """(raw rows (count, 1, 8, 8) float32 0..16, their gray images (8 * upscale square, uint8), labels) of the first
    `count` held-out digits; an upscaled image repeats each pixel (nearest)."""
    X, y = held_out_split()
    X = X[:count]
    images = []
    for row in X:
        img = np.rint(row.reshape(8, 8) * DIGIT_SCALE).astype(np.uint8)
        images.append(np.kron(img, np.ones((upscale, upscale), np.uint8)) if upscale > 1 else img)
    return X.reshape(-1, 1, 8, 8).astype(np.float32), images, y[:count]


def cmyk_jpeg(rng: np.random.Generator, height: int = 24, width: int = 32) -> tuple[bytes, np.ndarray]:
    """A CMYK JPEG (as print workflows save them) and Pillow's RGB of the CMYK pixels it was made from."""
    cmyk = Image.fromarray(rng.integers(0, 256, (height, width, 4), dtype=np.uint8), mode="CMYK")
    buf = io.BytesIO()
    cmyk.save(buf, format="JPEG", quality=95)
    return buf.getvalue(), np.asarray(cmyk.convert("RGB"))


def palette_png(rng: np.random.Generator, height: int = 20, width: int = 30) -> tuple[bytes, np.ndarray]:
    """A palette PNG of 16 random colours and the RGB image it holds."""
    palette = rng.integers(0, 256, (16, 3), dtype=np.uint8)
    index = rng.integers(0, 16, (height, width), dtype=np.uint8)
    im = Image.fromarray(index, mode="P")
    im.putpalette(palette.reshape(-1).tolist())
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue(), palette[index]


def png16(rng: np.random.Generator, height: int = 12, width: int = 10) -> tuple[bytes, np.ndarray]:
    """A 16-bit grayscale PNG and its samples (height, width) uint16."""
    samples = rng.integers(0, 65536, (height, width), dtype=np.uint16)
    buf = io.BytesIO()
    Image.fromarray(samples).save(buf, format="PNG")  # a 2-D uint16 array: mode I;16
    return buf.getvalue(), samples


def truncated(data: bytes, keep: float = 0.6) -> bytes:
    return data[: int(len(data) * keep)]


def png_bomb(side: int = 30_000) -> bytes:
    """A valid gray PNG of side x side zero pixels: 900 MB decoded at 30,000, under 1 MB on the wire. Each block of
    100 rows compresses to the same bytes after a full flush (the compressor forgets its history), so it is made from
    one block, not from 900 MB of zeros."""
    row = side + 1  # the filter byte, then the samples
    block = bytes(row * 100)
    c = zlib.compressobj(9)
    first = c.compress(block) + c.flush(zlib.Z_FULL_FLUSH)
    again = c.compress(block) + c.flush(zlib.Z_FULL_FLUSH)
    blocks, rest = divmod(side, 100)
    tail = c.compress(bytes(row * rest)) + c.flush(zlib.Z_FULL_FLUSH) if rest else b""
    adler = 1
    for _ in range(blocks):
        adler = zlib.adler32(block, adler)
    adler = zlib.adler32(bytes(row * rest), adler)
    # the stream's end: an empty final block, then the Adler-32 of everything
    idat = first + again * (blocks - 1) + tail + b"\x03\x00" + struct.pack(">I", adler)

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)  # 8-bit gray
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
