"""Resize of the shorter side and center crop of a batch of decoded images, in one Triton kernel: the GPU step between
nvJPEG's decode and the model's first conv (service/images/gpu_decode.py).

torch runs it as a float32 copy of each image, an antialiased interpolate (upsample_bilinear2d_aa), a round, a clamp,
a cast and a crop's copy: six kernels per size of image and 2.9 ms for 256 photos of about 500x375 on an H200
(bench/results/h200/probe_jpeg_decode_h200.txt), 40% of what nvJPEG takes to decode them. Here each output pixel is
computed where it lands: only the crop's pixels are resized, uint8 in and uint8 out, every image of the batch in one
launch whatever its size.

Semantics: torch's `F.interpolate(x.float(), size, mode, antialias=True, align_corners=False)` followed by
`round().clamp(0, 255)` and torchvision's CenterCrop (zero padding where the resized image is smaller than the crop),
as service/images/preprocess.py computes them on the CPU (kernels/reference.py: `resize_crop`). The antialiased filter
is separable: for an output coordinate o of a side resized from `n` to `m` pixels, scale s = n / m, support
r = (1 or 2 for bilinear or bicubic) * max(s, 1), centre c = s * (o + 0.5), taps lo = max(int(c - r + 0.5), 0) to
min(int(c + r + 0.5), n), each weighed by the filter at (tap - c + 0.5) / max(s, 1), normalised to sum 1 (torch's
_compute_weights_aa); each row's taps are summed along x first, then the rows along y, as torch sums them. Rounded half
to even, as torch.round. Equal to torch's CPU result but for a level on rare pixels where float32 sums land within an
ulp of a half (tests/test_kernels_resize.py states the share).

Shapes: `images`, a list of (C, H, W) uint8 tensors (C 1 or 3) of any sizes on one device; the result (or `out`)
(N, C, height, width) uint8, image i written to row `rows[i]`.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from .launch import grid_launch
from .runtime import check_device

FILTERS = {"bilinear": 0, "bicubic": 1}
SUPPORT = {"bilinear": 1.0, "bicubic": 2.0}  # torch's interp_size / 2
BLOCK_H, BLOCK_W = 16, 32  # 512 output pixels a program: 224x224 is 14 x 7 programs an image


@triton.jit
def _aa_filter(x, BICUBIC: tl.constexpr):
    x = tl.abs(x)
    if BICUBIC:  # Keys' cubic with a = -0.5, as torch's antialiased bicubic
        w = tl.where(
            x < 1.0, (1.5 * x - 2.5) * x * x + 1.0, tl.where(x < 2.0, (((x - 5.0) * x + 8.0) * x - 4.0) * -0.5, 0.0)
        )
    else:
        w = tl.maximum(1.0 - x, 0.0)
    return w


@triton.jit
def _span(o, n, m, SUPPORT: tl.constexpr):
    """For output coordinates o (int32) of a side resized from n to m pixels: (first tap, taps, centre, 1 / scale
    as the filter takes it) as torch computes them in float32."""
    scale = n.to(tl.float32) / m.to(tl.float32)
    support = SUPPORT * tl.maximum(scale, 1.0)
    invscale = tl.where(scale >= 1.0, 1.0 / scale, 1.0)
    centre = scale * (o.to(tl.float32) + 0.5)
    lo = tl.maximum((centre - support + 0.5).to(tl.int32), 0)  # truncation, as C++'s static_cast
    hi = tl.minimum((centre + support + 0.5).to(tl.int32), n)
    return lo, hi - lo, centre, invscale


@triton.jit
def _round_half_even(v):
    r = tl.floor(v + 0.5)
    tie = (r - v) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def _resize_crop_kernel(
    src_ptr, params_ptr, dst_ptr,
    taps_y, taps_x,  # the most taps any output pixel of the batch has along y and x
    OH: tl.constexpr, OW: tl.constexpr, C: tl.constexpr, FLIP: tl.constexpr,
    BICUBIC: tl.constexpr, SUPPORT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    img = tl.program_id(0)
    tiles_w = tl.cdiv(OW, BLOCK_W)
    ty, tx = tl.program_id(1) // tiles_w, tl.program_id(1) % tiles_w
    p = params_ptr + img * 8  # per image: offset, H, W, resized H, resized W, top, left, row (int64)
    offset = tl.load(p)
    H, W = tl.load(p + 1).to(tl.int32), tl.load(p + 2).to(tl.int32)
    RH, RW = tl.load(p + 3).to(tl.int32), tl.load(p + 4).to(tl.int32)
    top, left = tl.load(p + 5).to(tl.int32), tl.load(p + 6).to(tl.int32)
    row = tl.load(p + 7)

    oy = ty * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]  # output pixel, then its place in the resized image
    ox = tx * BLOCK_W + tl.arange(0, BLOCK_W)[None, :]
    ry, rx = oy + top, ox + left
    inside_y = (ry >= 0) & (ry < RH)
    inside_x = (rx >= 0) & (rx < RW)
    ylo, ysize, cy, invy = _span(ry, H, RH, SUPPORT)
    xlo, xsize, cx, invx = _span(rx, W, RW, SUPPORT)
    ysize = tl.where(inside_y, ysize, 0)
    xsize = tl.where(inside_x, xsize, 0)

    # The weights' sums, to normalise each tap's weight as torch does (weight / total, once per tap).
    total_y = tl.zeros([BLOCK_H, 1], tl.float32)
    for k in range(0, taps_y):
        w = _aa_filter(((ylo + k).to(tl.float32) - cy + 0.5) * invy, BICUBIC)
        total_y += tl.where(k < ysize, w, 0.0)
    total_x = tl.zeros([1, BLOCK_W], tl.float32)
    for k in range(0, taps_x):
        w = _aa_filter(((xlo + k).to(tl.float32) - cx + 0.5) * invx, BICUBIC)
        total_x += tl.where(k < xsize, w, 0.0)
    total_y = tl.where(total_y != 0.0, total_y, 1.0)
    total_x = tl.where(total_x != 0.0, total_x, 1.0)

    plane = H * W
    acc0 = tl.zeros([BLOCK_H, BLOCK_W], tl.float32)
    acc1 = tl.zeros([BLOCK_H, BLOCK_W], tl.float32)
    acc2 = tl.zeros([BLOCK_H, BLOCK_W], tl.float32)
    for ky in range(0, taps_y):
        wy = _aa_filter(((ylo + ky).to(tl.float32) - cy + 0.5) * invy, BICUBIC) / total_y
        wy = tl.where(ky < ysize, wy, 0.0)
        line = src_ptr + offset + (ylo + ky).to(tl.int64) * W
        h0 = tl.zeros([BLOCK_H, BLOCK_W], tl.float32)
        h1 = tl.zeros([BLOCK_H, BLOCK_W], tl.float32)
        h2 = tl.zeros([BLOCK_H, BLOCK_W], tl.float32)
        for kx in range(0, taps_x):
            wx = _aa_filter(((xlo + kx).to(tl.float32) - cx + 0.5) * invx, BICUBIC) / total_x
            wx = tl.where(kx < xsize, wx, 0.0)
            m = (ky < ysize) & (kx < xsize)
            at = line + xlo + kx
            h0 += tl.load(at, mask=m, other=0).to(tl.float32) * wx
            if C == 3:
                h1 += tl.load(at + plane, mask=m, other=0).to(tl.float32) * wx
                h2 += tl.load(at + 2 * plane, mask=m, other=0).to(tl.float32) * wx
        acc0 += h0 * wy
        if C == 3:
            acc1 += h1 * wy
            acc2 += h2 * wy

    # Outside the resized image (a crop larger than it): torchvision's zero padding. The sums there are 0 already.
    inside = (oy < OH) & (ox < OW)
    out = dst_ptr + row * (C * OH * OW) + oy * OW + ox
    v0 = tl.minimum(tl.maximum(_round_half_even(acc0), 0.0), 255.0).to(tl.uint8)
    if C == 3:
        v1 = tl.minimum(tl.maximum(_round_half_even(acc1), 0.0), 255.0).to(tl.uint8)
        v2 = tl.minimum(tl.maximum(_round_half_even(acc2), 0.0), 255.0).to(tl.uint8)
        if FLIP:  # BGR: the model's channel 0 is the image's blue
            v0, v2 = v2, v0
        tl.store(out + OH * OW, v1, mask=inside)
        tl.store(out + 2 * OH * OW, v2, mask=inside)
    tl.store(out, v0, mask=inside)


def resized_size(height: int, width: int, shorter: int) -> tuple[int, int]:
    """torchvision's Resize(int): the shorter side to `shorter`, the longer to int(shorter * long / short)."""
    if height <= width:
        return shorter, int(shorter * width / height)
    return int(shorter * height / width), shorter


def crop_offsets(height: int, width: int, crop_h: int, crop_w: int) -> tuple[int, int]:
    """Where output pixel (0, 0) of torchvision's CenterCrop(crop_h, crop_w) lies in a (height, width) image: the
    top-left offset rounded as Python rounds (half to even), less the zero padding put before a smaller image."""
    pad_top, pad_left = max(crop_h - height, 0) // 2, max(crop_w - width, 0) // 2
    h, w = max(height, crop_h), max(width, crop_w)
    return int(round((h - crop_h) / 2.0)) - pad_top, int(round((w - crop_w) / 2.0)) - pad_left


def _geometry(sizes: np.ndarray, height: int, width: int, resize: int | None, support: float):
    """resized_size, crop_offsets and the most taps along y and x (torch's span bound: 2 * support * max(scale, 1),
    and 3 more for the truncations) for every (H, W) of `sizes` at once, as numpy arrays: a Python loop over a
    batch's 256 images took longer than the kernel."""
    h, w = sizes[:, 0], sizes[:, 1]
    if resize is None:
        rh, rw = h.copy(), w.copy()
    else:
        tall = h > w
        # int(shorter * long / short) in float64, as resized_size computes it
        rh = np.where(tall, (resize * h / w).astype(np.int64), resize)
        rw = np.where(tall, resize, (resize * w / h).astype(np.int64))
    pad_top, pad_left = np.maximum(height - rh, 0) // 2, np.maximum(width - rw, 0) // 2
    # np.round rounds half to even, as Python's round
    top = np.round((np.maximum(rh, height) - height) / 2.0).astype(np.int64) - pad_top
    left = np.round((np.maximum(rw, width) - width) / 2.0).astype(np.int64) - pad_left
    taps_y = int((2 * support * np.maximum(h / rh, 1.0)).astype(np.int64).max()) + 3
    taps_x = int((2 * support * np.maximum(w / rw, 1.0)).astype(np.int64).max()) + 3
    return rh, rw, top, left, taps_y, taps_x


def _sources(images: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor, np.ndarray]:
    """The images as the kernel reads them (to be kept until it has run), the tensor its pointer is given and each
    image's byte offset from it (uint8: an element a byte).

    Each image is read where it lies: the offsets are from the lowest-addressed image, so no copy gathers the batch
    into one buffer (torch.cat of 256 decoded photos was a Python call per image and a copy of every pixel); an image
    that is not contiguous is copied alone. (Triton's interpreter reads a CPU tensor's memory where it is too.)"""
    images = [im if im.is_contiguous() else im.contiguous() for im in images]
    addresses = np.array([im.data_ptr() for im in images], dtype=np.int64)
    return images, images[int(addresses.argmin())], addresses - addresses.min()


def resize_crop(
    images: list[torch.Tensor],
    height: int,
    width: int,
    resize: int | None,
    *,
    interpolation: str = "bilinear",
    flip_channels: bool = False,
    out: torch.Tensor | None = None,
    rows: list[int] | None = None,
) -> torch.Tensor:
    """Each (C, H, W) uint8 image resized (shorter side to `resize`; None: as it is), center-cropped to
    (height, width) and written to out[rows[i]] (rows: 0..n-1 by default); `flip_channels` reverses RGB to BGR.
    Returns `out`, (N, C, height, width) uint8, made when not given."""
    if interpolation not in FILTERS:
        raise ValueError(f"interpolation {interpolation!r}: resize_crop takes {', '.join(FILTERS)}")
    if not images:
        raise ValueError("resize_crop needs at least one image")
    shapes = [tuple(im.shape) for im in images]
    c, device = shapes[0][0], images[0].device
    if any(len(shape) != 3 or shape[0] != c for shape in shapes) or {im.dtype for im in images} != {torch.uint8}:
        i = next(i for i, (im, shape) in enumerate(zip(images, shapes, strict=True))
                 if len(shape) != 3 or shape[0] != c or im.dtype != torch.uint8)  # fmt: skip
        raise ValueError(f"image {i}: {shapes[i]} {images[i].dtype}; every image must be (C, H, W) uint8 with the "
                         f"first's C ({c})")  # fmt: skip
    if len({im.device for im in images}) != 1:
        raise ValueError(f"the images are on {sorted(str(d) for d in {im.device for im in images})}: one device")
    if c not in (1, 3):
        raise ValueError(f"images have {c} channels; resize_crop takes 1 or 3")
    sizes = np.array([shape[1:] for shape in shapes], dtype=np.int64)
    if (sizes < 1).any():
        i = int(np.flatnonzero((sizes < 1).any(axis=1))[0])
        raise ValueError(f"image {i} is empty: {shapes[i]}")
    check_device(images[0], "images")
    rows = np.arange(len(images)) if rows is None else np.asarray(rows, dtype=np.int64)
    if len(rows) != len(images):
        raise ValueError(f"{len(rows)} rows for {len(images)} images")
    if out is None:
        out = torch.empty((len(images), c, height, width), dtype=torch.uint8, device=device)
    if out.dim() != 4 or tuple(out.shape[1:]) != (c, height, width) or out.dtype != torch.uint8:
        raise ValueError(f"out must be (N, {c}, {height}, {width}) uint8; got {tuple(out.shape)} {out.dtype}")
    if out.device != device or not out.is_contiguous():
        raise ValueError(f"out must be contiguous on {device}")
    if ((rows < 0) | (rows >= out.shape[0])).any():
        raise ValueError(f"rows must be in 0..{out.shape[0] - 1}; got {rows.tolist()}")
    support = SUPPORT[interpolation]
    rh, rw, top, left, taps_y, taps_x = _geometry(sizes, height, width, resize, support)
    images, src, offsets = _sources(images)  # `images` held: a copy made there lives until the launch
    params = np.stack([offsets, sizes[:, 0], sizes[:, 1], rh, rw, top, left, rows], axis=1)
    table = torch.from_numpy(np.ascontiguousarray(params, dtype=np.int64))
    # From pinned memory the table's copy is queued on the stream; from pageable memory it would wait for the stream,
    # a forward in flight included (the engine prepares the next batch while one runs: service/engine/core.py).
    table = table.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else table.to(device)
    grid = (len(images), triton.cdiv(height, BLOCK_H) * triton.cdiv(width, BLOCK_W))
    grid_launch(_resize_crop_kernel, grid)(
        src, table, out, taps_y, taps_x,
        OH=height, OW=width, C=c, FLIP=bool(flip_channels and c == 3), BICUBIC=FILTERS[interpolation] == 1,
        SUPPORT=support, BLOCK_H=BLOCK_H, BLOCK_W=BLOCK_W,
    )  # fmt: skip
    return out
