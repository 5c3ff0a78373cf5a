"""kernels/resize.py's resize_crop against its torch reference (kernels/reference.py: the service's CPU preprocessing,
an antialiased interpolate in float32, rounded, then CenterCrop): bilinear and bicubic, RGB, BGR and gray, images
smaller and larger than the resize and the crop, primes, one pixel, a large downscale, several sizes in one launch,
rows written where asked and nowhere else.

Tolerance: the kernel sums each output pixel's taps in torch's order in float32; the two may still round a sum that
lands within an ulp of a half differently (FMA contraction on a GPU), so at most one level, on at most 3% of the
values. Seen: none on the CPU's interpreter; 2.0% on an H200 for a 20x20 image upscaled to 24 (weights of twelfths put
many sums on a half exactly), under 0.5% elsewhere. A wrong tap, weight, centre or crop offset moves most values by
many levels.

Without CUDA these run through Triton's interpreter; on a GPU host the same tests run compiled, and the photo-sized
test (256 photos of about 500x375, as the JPEG path sees them) runs too.
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.resize import _geometry, crop_offsets, resize_crop, resized_size

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MAX_LEVELS, MAX_SHARE_OFF = 1, 0.03

# (image sizes (H, W), crop (height, width), resize of the shorter side or None)
CASES = [
    pytest.param([(37, 50), (50, 37), (20, 20), (1, 1)], (16, 16), 24, id="mixed-down-up-one-pixel"),
    pytest.param([(97, 61)], (13, 17), 19, id="primes"),
    pytest.param([(13, 7)], (16, 17), None, id="no-resize-padded-crop"),
    pytest.param([(24, 30)], (24, 30), None, id="no-resize-whole-image"),
    pytest.param([(6, 5)], (11, 9), 7, id="upscale-then-padded"),
    pytest.param([(71, 131)], (8, 8), 13, id="downscale-5x"),  # 14 taps an axis, 25 bicubic
    pytest.param([(21, 21), (21, 23)], (17, 19), 20, id="square-and-odd-crop"),
]


def _images(sizes, channels, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (channels, h, w), dtype=torch.uint8, generator=g) for h, w in sizes]


def _check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == torch.uint8 and got.shape == want.shape, (what, got.shape, want.shape)
    d = (got.cpu().int() - want.int()).abs()
    share = (d > 0).float().mean().item()
    assert d.max().item() <= MAX_LEVELS and share <= MAX_SHARE_OFF, (what, d.max().item(), share)


@pytest.mark.parametrize("sizes, crop, resize", CASES)
@pytest.mark.parametrize(
    "interpolation, channels, flip",
    [("bilinear", 3, False), ("bicubic", 3, True), ("bilinear", 1, False)],
    ids=["bilinear-rgb", "bicubic-bgr", "bilinear-gray"],
)
def test_resize_crop_matches_the_reference(sizes, crop, resize, interpolation, channels, flip):
    images = _images(sizes, channels, seed=len(sizes) * 1000 + crop[0])
    # out filled with noise first: every value must be the kernel's
    out = torch.randint(0, 256, (len(images), channels, *crop), dtype=torch.uint8).to(DEVICE)
    got = resize_crop([im.to(DEVICE) for im in images], *crop, resize, interpolation=interpolation,
                      flip_channels=flip, out=out)  # fmt: skip
    assert got is out
    for i, im in enumerate(images):
        want = reference.resize_crop(im, *crop, resize, interpolation=interpolation, flip_channels=flip)
        _check(got[i], want, f"image {i} {tuple(im.shape)}")


def test_the_batch_geometry_is_the_per_image_one():
    """_geometry's numpy arrays give each image what resized_size and crop_offsets give it alone (the kernel's
    placement), over random sizes, resizes (or none) and crops."""
    g = torch.Generator().manual_seed(3)
    sizes = torch.randint(1, 3000, (500, 2), generator=g).numpy()
    for resize, crop in [(256, (224, 224)), (7, (9, 5)), (None, (31, 40)), (300, (17, 301))]:
        rh, rw, top, left, _, _ = _geometry(sizes, *crop, resize, 1.0)
        for i, (h, w) in enumerate(sizes.tolist()):
            size = (h, w) if resize is None else resized_size(h, w, resize)
            assert (rh[i], rw[i]) == size and (top[i], left[i]) == crop_offsets(*size, *crop), (h, w, resize, crop)


def test_bicubic_overshoot_is_clamped():
    """A bicubic filter's negative lobes overshoot at a hard edge: the kernel clamps to 0..255 as torch does."""
    im = torch.zeros((3, 20, 20), dtype=torch.uint8)
    im[:, :, 10:] = 255
    im[1] = torch.randint(0, 256, (20, 20), dtype=torch.uint8)
    want = reference.resize_crop(im, 12, 12, 13, interpolation="bicubic")
    raw = torch.nn.functional.interpolate(im[None].float(), size=(13, 13), mode="bicubic", antialias=True)[0]
    raw = raw[:, :12, :12]  # the crop: rows and columns 0..11 (13 - 12 = 1, rounded to 0 each side)
    over, under = raw > 255.5, raw < -0.5
    assert over.any() and under.any()  # the case exercises the clamp at both ends
    got = resize_crop([im.to(DEVICE)], 12, 12, 13, interpolation="bicubic")[0].cpu()
    assert (got[over] == 255).all() and (got[under] == 0).all()
    # the 0/255 edge puts many sums on a half exactly, where float32 order decides: one level, not a share
    assert (got.int() - want.int()).abs().max() <= MAX_LEVELS


def test_rows_are_written_where_asked_and_nowhere_else():
    images = _images([(30, 40), (40, 30)], 3, seed=7)
    out = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8).to(DEVICE)
    before = out.clone()
    resize_crop([im.to(DEVICE) for im in images], 16, 16, 20, out=out, rows=[3, 1])
    assert torch.equal(out[0], before[0]) and torch.equal(out[2], before[2])
    _check(out[3], reference.resize_crop(images[0], 16, 16, 20), "row 3")
    _check(out[1], reference.resize_crop(images[1], 16, 16, 20), "row 1")


def test_images_are_read_where_they_lie():
    """The kernel reads each image at its own address (its byte offset from the lowest-addressed one): views of one
    buffer in an order other than their addresses', an image alone in memory of its own, and one not contiguous (a
    transposed view, copied alone), each into its row."""
    sizes = [(23, 31), (17, 29), (29, 19)]
    pixels = [_images([hw], 3, seed=11 + i)[0] for i, hw in enumerate(sizes)]
    n0, n1 = pixels[0].numel(), pixels[1].numel()
    buffer = torch.empty(n0 + n1 + 64, dtype=torch.uint8, device=DEVICE)
    second = buffer[5 : 5 + n1].view(pixels[1].shape)  # a lower address than the first's, at an odd byte
    first = buffer[n1 + 40 : n1 + 40 + n0].view(pixels[0].shape)
    first.copy_(pixels[0])
    second.copy_(pixels[1])
    third = pixels[2].transpose(1, 2).contiguous().to(DEVICE).transpose(1, 2)  # (3, 29, 19) not contiguous
    assert not third.is_contiguous()
    out = resize_crop([first, second, third], 12, 12, 14)
    for i, image in enumerate(pixels):
        _check(out[i], reference.resize_crop(image, 12, 12, 14), f"image {i}")


@pytest.mark.parametrize(
    "images, kwargs, message",
    [
        ([], {}, "at least one image"),
        ([torch.zeros(3, 4, 4, dtype=torch.uint8), torch.zeros(1, 4, 4, dtype=torch.uint8)], {}, "image 1"),
        ([torch.zeros(3, 4, 4)], {}, "uint8"),
        ([torch.zeros(2, 4, 4, dtype=torch.uint8)], {}, "1 or 3"),
        ([torch.zeros(3, 0, 4, dtype=torch.uint8)], {}, "empty"),
        ([torch.zeros(3, 4, 4, dtype=torch.uint8)], {"interpolation": "nearest"}, "bilinear, bicubic"),
        ([torch.zeros(3, 4, 4, dtype=torch.uint8)], {"rows": [0, 1]}, "2 rows for 1 images"),
        ([torch.zeros(3, 4, 4, dtype=torch.uint8)], {"rows": [5]}, "rows must be in"),
    ],
    ids=["none", "mixed-channels", "float", "two-channels", "empty", "nearest", "rows-count", "row-range"],
)
def test_bad_arguments_are_refused_by_name(images, kwargs, message):
    with pytest.raises(ValueError, match=message):
        resize_crop([im.to(DEVICE) for im in images], 4, 4, None, **kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the photo-sized batch is minutes interpreted")
def test_a_batch_of_photos_matches_the_reference():
    """256 images of the JPEG benchmark's four sizes (bench/serve/images.py), shorter side 256, crop 224."""
    sizes = [((375, 500), (500, 375), (333, 500), (400, 400))[i % 4] for i in range(256)]
    images = _images(sizes, 3, seed=11)
    got = resize_crop([im.cuda() for im in images], 224, 224, 256)
    for i in range(0, 256, 17):
        _check(got[i], reference.resize_crop(images[i], 224, 224, 256), f"photo {i}")
