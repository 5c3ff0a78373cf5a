"""service/images/preprocess.py against references written here: an antialiased resize built from its definition
(the triangle filter widened by the scale factor, as Pillow's and torchvision's resizes define it; the weights of each
output pixel in float64), torchvision's CenterCrop arithmetic, and Pillow's own resize of the same image (what
torchvision's PIL path computes). torchvision itself does not install beside the CPU torch (its PyPI wheel is built
against the CUDA torch), so it is not the reference here.

Tolerance: 1 in uint8 units against the float64 reference (our float32 filter rounds once, the reference exactly, so a
value within float32 error of .5 may round the other way; such pixels are counted and must be under 1%) and 1 against
Pillow (which rounds to 8 bits between its two passes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from service.images.preprocess import Preprocess, center_crop, resize_shorter, resized_size

from .imagegen import photo


def _aa_weights(n_in: int, n_out: int, cubic: bool = False) -> np.ndarray:
    """(n_out, n_in) float64: row i holds the weights of output pixel i. The filter (triangle of radius 1, or Keys'
    cubic with a = -0.5 of radius 2) is widened by the scale factor when downscaling; pixel centres at +0.5."""
    scale = n_in / n_out
    stretch = max(scale, 1.0)
    radius = (2.0 if cubic else 1.0) * stretch

    def kernel(t: np.ndarray) -> np.ndarray:
        t = np.abs(t)
        if not cubic:
            return np.clip(1.0 - t, 0.0, None)
        a = -0.5
        return np.where(t < 1, ((a + 2) * t - (a + 3)) * t * t + 1,
                        np.where(t < 2, (((t - 5) * t + 8) * t - 4) * a, 0.0))  # fmt: skip

    w = np.zeros((n_out, n_in))
    for i in range(n_out):
        center = (i + 0.5) * scale
        lo, hi = max(int(center - radius + 0.5), 0), min(int(center + radius + 0.5), n_in)
        j = np.arange(lo, hi)
        k = kernel((j - center + 0.5) / stretch)
        w[i, lo:hi] = k / k.sum()
    return w


def reference_resize(img: np.ndarray, shorter: int, cubic: bool = False) -> np.ndarray:
    """(C, H, W) uint8 -> resized as torchvision's Resize(shorter, antialias=True), in float64, rounded."""
    h, w = img.shape[1:]
    nh, nw = (shorter, int(shorter * w / h)) if h <= w else (int(shorter * h / w), shorter)
    wh, ww = _aa_weights(h, nh, cubic), _aa_weights(w, nw, cubic)
    out = wh @ img.astype(np.float64) @ ww.T  # (nh, h) @ (c, h, w) @ (w, nw), batched over c
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def reference_crop(img: np.ndarray, height: int, width: int) -> np.ndarray:
    """torchvision.transforms.functional.center_crop on a large enough (C, H, W) image."""
    h, w = img.shape[1:]
    top, left = int(round((h - height) / 2.0)), int(round((w - width) / 2.0))
    return img[:, top : top + height, left : left + width]


def _diff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.abs(a.astype(np.int16) - b.astype(np.int16))


@pytest.mark.parametrize(
    ("size", "shorter"),
    [((375, 500), 256), ((500, 375), 256), ((333, 333), 224), ((64, 48), 232), ((1080, 1920), 224), ((31, 7), 8)],
)
@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
def test_resize_equals_the_antialiased_reference(size, shorter, interpolation):
    rng = np.random.default_rng()
    img = photo(rng, *size).transpose(2, 0, 1).copy()
    got = resize_shorter(torch.from_numpy(img), shorter, interpolation).numpy()
    want = reference_resize(img, shorter, cubic=interpolation == "bicubic")
    assert got.shape == want.shape and min(got.shape[1:]) == shorter
    d = _diff(got, want)
    assert d.max() <= 1, f"max |diff| {d.max()}"
    assert (d > 0).mean() < 0.01, f"{(d > 0).mean():.2%} of pixels off by one"


@pytest.mark.parametrize(("size", "shorter"), [((375, 500), 256), ((480, 640), 224), ((50, 70), 128)])
def test_resize_agrees_with_pillow(size, shorter):
    """torchvision's PIL path: Image.resize(BILINEAR) (antialiased: Pillow's filters widen when reducing). Pillow
    rounds to 8 bits between its horizontal and vertical passes, so about a sixth of its pixels are 1 off."""
    rng = np.random.default_rng()
    img = photo(rng, *size)
    nh, nw = resized_size(*size, shorter)
    want = np.asarray(Image.fromarray(img).resize((nw, nh), Image.BILINEAR, reducing_gap=None))
    got = resize_shorter(torch.from_numpy(img).permute(2, 0, 1), shorter).permute(1, 2, 0).numpy()
    d = _diff(got, want)
    assert d.max() <= 1 and d.mean() < 0.25, (d.max(), d.mean())


def test_resized_size_truncates_as_torchvision():
    assert resized_size(375, 500, 256) == (256, 341)  # 256 * 500 / 375 = 341.33
    assert resized_size(500, 375, 256) == (341, 256)
    assert resized_size(224, 224, 224) == (224, 224)


@pytest.mark.parametrize(("h", "w", "ch", "cw"), [(256, 341, 224, 224), (255, 300, 224, 223), (9, 9, 8, 8)])
def test_center_crop_takes_the_middle(h, w, ch, cw):
    img = torch.randint(0, 256, (3, h, w), dtype=torch.uint8)
    assert torch.equal(center_crop(img, ch, cw), torch.from_numpy(reference_crop(img.numpy(), ch, cw)))


def test_center_crop_pads_a_small_image_with_zeros():
    img = torch.randint(1, 256, (1, 5, 6), dtype=torch.uint8)
    out = center_crop(img, 8, 9)  # pad 3 rows (1 top, 2 bottom) and 3 columns (1 left, 2 right)
    assert out.shape == (1, 8, 9)
    assert torch.equal(out[:, 1:6, 1:7], img)
    assert int(out.sum()) == int(img.sum())


def test_preprocess_resizes_crops_and_orders_channels():
    rng = np.random.default_rng()
    img = photo(rng, 300, 400)
    rgb = Preprocess(224, 224, resize=256)(torch.from_numpy(img)).numpy()
    want = reference_crop(reference_resize(img.transpose(2, 0, 1), 256), 224, 224)
    assert rgb.shape == (3, 224, 224) and _diff(rgb, want).max() <= 1
    bgr = Preprocess(224, 224, resize=256, channels="BGR")(torch.from_numpy(img)).numpy()
    assert np.array_equal(bgr, rgb[::-1])
    gray = Preprocess(8, 8)(torch.from_numpy(img[:8, :10, :1])).numpy()  # no resize: the crop alone
    assert np.array_equal(gray, img[None, :8, 1:9, 0])


def test_description_round_trips():
    pre = Preprocess(224, 224, resize=256, interpolation="bicubic", channels="BGR", mean=(1.0, 2, 3), std=(4.0, 5, 6))
    doc = pre.describe()
    assert doc["crop"] == [224, 224] and doc["normalize"] == {"mean": [1.0, 2, 3], "std": [4.0, 5, 6]}
    assert Preprocess.from_description(doc) == pre
