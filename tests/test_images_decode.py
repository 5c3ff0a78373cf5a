"""service/images/decode.py: what each kind of file a client may send becomes, and what is refused with which status
and message, before any pixel of a too-large image is decoded."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from service.images.decode import ImageError, decode, sniff
from service.images.prepare import prepare
from service.images.preprocess import Preprocess

from .imagegen import cmyk_jpeg, encode, palette_png, photo, png16, png_bomb, truncated

MAX_PIXELS = 40_000_000
# A JPEG is lossy: its pixels are checked equal to Pillow's own decode of the file (libjpeg-turbo, as torchvision's
# decode_jpeg on the CPU), and near the image it was made from only loosely: JPEG's loss on small noisy images (4:2:0
# chroma, quality 95) reached a mean of 22 levels here, where an unrelated image of the same kind is about 60 off.
JPEG_MEAN = 32.0


def _diff(a, b) -> np.ndarray:
    return np.abs(a.astype(np.int16) - b.astype(np.int16))


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_rgb_files_decode_to_their_pixels(fmt):
    rng = np.random.default_rng()
    img = photo(rng, int(rng.integers(20, 90)), int(rng.integers(20, 90)))
    options = {"lossless": True} if fmt == "WEBP" else {"quality": 95} if fmt == "JPEG" else {}
    got = decode(encode(img, fmt, **options), "RGB", MAX_PIXELS)
    assert got.shape == img.shape and got.dtype == np.uint8
    if fmt == "JPEG":
        data = encode(img, fmt, **options)
        assert np.array_equal(decode(data, "RGB", MAX_PIXELS), np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))
        assert _diff(got, img).mean() < JPEG_MEAN
    else:
        assert np.array_equal(got, img)


def test_grayscale_jpeg_becomes_rgb_and_rgb_becomes_gray():
    rng = np.random.default_rng()
    gray = photo(rng, 30, 40)[:, :, 0]
    data = encode(gray, "JPEG", quality=95)
    rgb = decode(data, "RGB", MAX_PIXELS)
    assert rgb.shape == (30, 40, 3)
    assert np.array_equal(rgb[:, :, 0], rgb[:, :, 1]) and np.array_equal(rgb[:, :, 1], rgb[:, :, 2])
    assert np.array_equal(rgb[:, :, 0], np.asarray(Image.open(io.BytesIO(data))))
    color = photo(rng, 10, 12)
    luma = decode(encode(color, "PNG"), "L", MAX_PIXELS)[:, :, 0]
    want = (color.astype(np.float64) @ [0.299, 0.587, 0.114]).round()  # ITU-R 601-2, as torchvision's grayscale
    assert _diff(luma, want).max() <= 1


def test_cmyk_jpeg_becomes_rgb():
    data, want = cmyk_jpeg(np.random.default_rng())
    assert Image.open(io.BytesIO(data)).mode == "CMYK"
    got = decode(data, "RGB", MAX_PIXELS)
    assert got.shape == want.shape
    assert np.array_equal(got, np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))
    assert _diff(got, want).mean() < 2 * JPEG_MEAN  # uniform noise in four channels, each JPEG-coded


def test_palette_png_becomes_its_colours():
    data, want = palette_png(np.random.default_rng())
    assert np.array_equal(decode(data, "RGB", MAX_PIXELS), want)


def test_16_bit_png_is_scaled_not_clipped():
    data, samples = png16(np.random.default_rng())
    got = decode(data, "L", MAX_PIXELS)[:, :, 0]
    want = np.rint(samples.astype(np.float64) * 255 / 65535)
    assert np.array_equal(got, want)
    rgb = decode(data, "RGB", MAX_PIXELS)
    assert np.array_equal(rgb[:, :, 1], want)


def test_alpha_is_dropped():
    rng = np.random.default_rng()
    rgba = np.concatenate([photo(rng, 9, 11), rng.integers(0, 256, (9, 11, 1), dtype=np.uint8)], axis=2)
    assert np.array_equal(decode(encode(rgba, "PNG"), "RGB", MAX_PIXELS), rgba[:, :, :3])


@pytest.mark.parametrize(
    ("make", "status", "message"),
    [
        (lambda rng: b"", 422, "is empty (0 bytes)"),
        (lambda rng: b"GIF89a" + bytes(40), 422, "is not a JPEG, PNG or WebP file"),
        (lambda rng: b'{"inputs": [[1, 2]]}', 422, "is not a JPEG, PNG or WebP file"),
        (lambda rng: truncated(encode(photo(rng, 64, 64), "JPEG", quality=90)), 422, "not a valid JPEG file"),
        (lambda rng: truncated(encode(photo(rng, 64, 64), "PNG")), 422, "not a valid PNG file"),
        (lambda rng: b"\x89PNG\r\n\x1a\n" + bytes(rng.integers(0, 256, 200, dtype=np.uint8)), 422, "not a valid PNG"),
        (lambda rng: b"\xff\xd8\xff" + bytes(rng.integers(0, 256, 200, dtype=np.uint8)), 422, "not a valid JPEG"),
        (lambda rng: b"RIFF\x10\x00\x00\x00WEBPVP8 " + bytes(20), 422, "not a valid WEBP file"),
    ],
    ids=["empty", "gif", "json", "truncated-jpeg", "truncated-png", "corrupt-png", "corrupt-jpeg", "corrupt-webp"],
)
def test_bad_files_are_refused_naming_the_problem(make, status, message):
    with pytest.raises(ImageError) as e:
        decode(make(np.random.default_rng()), "RGB", MAX_PIXELS, what="part 2 ('x.jpg')")
    assert e.value.status == status and message in e.value.message and "part 2 ('x.jpg')" in e.value.message


def test_a_decompression_bomb_is_refused_from_its_header(monkeypatch):
    bomb = png_bomb()
    assert len(bomb) < 1 << 20 and sniff(bomb) == "png"

    def never(self):
        raise AssertionError("decoded the pixels of an image over the limit")

    monkeypatch.setattr(Image.Image, "load", never)
    monkeypatch.setattr("PIL.ImageFile.ImageFile.load", never)
    with pytest.raises(ImageError) as e:
        decode(bomb, "RGB", MAX_PIXELS)
    assert e.value.status == 413
    assert "30000x30000 (900,000,000 pixels); at most 40,000,000" in e.value.message


def test_the_pixel_limit_is_the_callers():
    img = photo(np.random.default_rng(), 10, 10)
    assert decode(encode(img, "PNG"), "RGB", 100).shape == (10, 10, 3)
    with pytest.raises(ImageError, match="10x10 .100 pixels.; at most 99"):
        decode(encode(img, "PNG"), "RGB", 99)


def test_prepare_gives_the_models_row():
    rng = np.random.default_rng()
    img = photo(rng, 120, 90)
    row = prepare(encode(img, "PNG"), Preprocess(64, 64, resize=72, channels="BGR"), MAX_PIXELS)
    assert row.shape == (3, 64, 64) and row.dtype == np.uint8
    gray = prepare(encode(img, "PNG"), Preprocess(64, 64, resize=72, channels="L"), MAX_PIXELS)
    assert gray.shape == (1, 64, 64)
