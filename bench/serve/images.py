"""Encoded-image request bodies for an image model that declares its preprocessing (config.json's input.image):
Triton's binary extension with one BYTES tensor `image` of N files, as Triton's image clients send them. `--v2 jpeg`
sends JPEG photos of about 500x375 at quality 90 (synthesized: smooth colour fields with noise, compressing as
photos do), `--v2 png` the same pixels as PNG. Each body's JSON header is padded to HEAD_BYTES, so one
Inference-Header-Content-Length serves every body of a phase.
"""

from __future__ import annotations

import io

import numpy as np
import orjson

PROTOCOLS = {"v2_jpeg": ("JPEG", {"quality": 90}), "v2_png": ("PNG", {})}
HEAD_BYTES = 256  # the JSON header, padded with spaces (JSON allows them after the value)
SIZES = ((375, 500), (500, 375), (333, 500), (400, 400))  # photos' usual shapes, about 500x375


def photo(rng: np.random.Generator, height: int, width: int, channels: int) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    planes = []
    for _ in range(channels):
        f, p = rng.uniform(2, 6) / max(height, width), rng.uniform(0, 2 * np.pi)
        planes.append(127 + 100 * np.sin(2 * np.pi * f * (x + 0.7 * y) + p) + rng.normal(0, 6, (height, width)))
    img = np.clip(np.rint(np.stack(planes, axis=-1)), 0, 255).astype(np.uint8)
    return img[:, :, 0] if channels == 1 else img


def encoded(protocol: str, count: int, seed: int, channels: int) -> list[bytes]:
    from PIL import Image

    fmt, options = PROTOCOLS[protocol]
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        buf = io.BytesIO()
        Image.fromarray(photo(rng, *SIZES[i % len(SIZES)], channels)).save(buf, format=fmt, **options)
        out.append(buf.getvalue())
    return out


def bodies(protocol: str, images: int, count: int, seed: int, channels: int) -> list[bytes]:
    """`count` bodies of `images` files each (drawn from a pool of 2 x images distinct files)."""
    pool = encoded(protocol, 2 * images, seed, channels)
    rng = np.random.default_rng(seed + 1)
    out = []
    for _ in range(count):
        files = [pool[i] for i in rng.choice(len(pool), images, replace=False)]
        data = b"".join(len(f).to_bytes(4, "little") + f for f in files)
        head = orjson.dumps({
            "inputs": [{"name": "image", "datatype": "BYTES", "shape": [images],
                        "parameters": {"binary_data_size": len(data)}}],
            "outputs": [{"name": n, "parameters": {"binary_data": True}} for n in ("logits", "label")],
        })  # fmt: skip
        assert len(head) <= HEAD_BYTES, len(head)
        out.append(head.ljust(HEAD_BYTES) + data)
    return out


def header() -> bytes:
    return f"Inference-Header-Content-Length: {HEAD_BYTES}\r\n".encode()
