"""Fused layer norm over the channels of an image batch (ConvNeXt's LayerNorm2d), then an activation, in one kernel.

y[n, :, h, w] = act((x[n, :, h, w] - mean) * rstd * weight + bias): mean and biased variance over the C channels
of each pixel, rstd = 1 / sqrt(var + eps), all in fp32, one rounding to x's dtype. torchvision's LayerNorm2d runs
this as permute, layer_norm, permute (and a copy back to NCHW where the next op wants it), then the activation as
its own kernel; here x is read once and y written once: for ConvNeXt-T's first stage at 256 images (256 x 96 x 56 x
56, fp16) 154 MB in and 154 MB out, nothing else. The kernel is pure bandwidth.

Shapes: x (N, C, H, W) in NCHW or channels_last memory (any strides where h and w merge into one pixel index:
stride_h = W * stride_w), or (N, C) vectors (the classifier's LayerNorm before its Linear); weight and bias (C,)
in x's dtype or fp32 (either may be None: 1 and 0); y of x's shape in `memory_format` (None: x's).

One kernel for every layout: a program normalizes BLOCK_P pixels of one image with the whole channel row of each
in registers (BLOCK_C = next_pow2(C) >= C), so the mean and the variance come from the values held, in two passes
over registers: no E[x^2] - E[x]^2 cancellation (at a mean of 30 standard deviations one fp32 pass errs by 1e-4).
channels_last: each pixel's C values are contiguous (16-byte vector loads along C), and all pixels of the batch form
one row sequence (stride C), so the grid walks them as one (FLAT) image. NCHW: the channel stride is H * W; loads
are coalesced along the BLOCK_P pixels of a channel instead, one program per pixel block of one image. H * W is
compiled in (a layer's constant): where it is a multiple of 16 (56 x 56, 28 x 28) those loads are vectors too, and
NCHW takes 1.3-1.5x channels_last's time; at 14 x 14 and 7 x 7 they are not, and it takes 2-3x. channels_last is the
layout to serve ConvNeXt in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .activations import DEFAULT_NEGATIVE_SLOPE, apply_activation, check_activation, round_to_bf16
from .interpreter import InterpreterSwitches
from .launch import grid_launch
from .pdl import gdc_launch_dependents, gdc_wait, use_pdl
from .pool import channels_last
from .runtime import bf16_on_interpreter, check_device, interpreting
from .tuning import LaunchConfig, scope_for, tune
from .tuning_background import on_new_picks

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The whole channel row sits in registers: 8192 fp32 values over 8 warps is 32 a thread (plus weight and bias).
# ConvNeXt's widest is 768 (T/S), 1024 (B), 1536 (L), 2048 (XL).
MAX_C = 8192


@triton.jit(do_not_specialize=["P"])  # P grows with the batch: one compiled kernel for every batch size
def _layernorm_channels_kernel(
    # pointers
    x_ptr, w_ptr, b_ptr, y_ptr,
    # sizes: P pixels in all (FLAT) or images of HW pixels (a layer's constant: its divisibility by 16 lets NCHW's
    # loads along the pixels be vectors), of C channels
    P, HW, C,
    # strides (image, pixel, channel)
    stride_xn, stride_xp, stride_xc,
    stride_yn, stride_yp, stride_yc,
    # parameters
    eps, negative_slope,
    # meta-parameters
    FLAT: tl.constexpr,  # every pixel of the batch at one stride (channels_last, vectors): walked as one image
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    ROUND_BF16: tl.constexpr,  # interpreter only: its fp32 -> bf16 cast truncates (activations.round_to_bf16)
    PDL: tl.constexpr,  # launched as a programmatic dependent launch (pdl.py): the next layer may start early
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    # A 1-D grid, pixel blocks fastest: neighbouring programs read neighbouring pixels of one image.
    if FLAT:
        n = 0
        pix = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        pix_ok = pix < P
    else:
        p_blocks = tl.cdiv(HW, BLOCK_P)
        n = tl.program_id(0) // p_blocks
        pix = (tl.program_id(0) % p_blocks) * BLOCK_P + tl.arange(0, BLOCK_P)
        pix_ok = pix < HW
    ch = tl.arange(0, BLOCK_C)
    ch_ok = ch < C
    mask = pix_ok[:, None] & ch_ok[None, :]
    # weight and bias do not depend on the previous kernel: requested before the wait
    if HAS_WEIGHT:
        w = tl.load(w_ptr + ch, mask=ch_ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b = tl.load(b_ptr + ch, mask=ch_ok, other=0.0).to(tl.float32)
    if PDL:  # x is the previous kernel's output
        gdc_launch_dependents()
        gdc_wait()

    x_ptrs = x_ptr + n * stride_xn + pix[:, None] * stride_xp + ch[None, :] * stride_xc
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    # IEEE divisions (div_rn): Triton's fp32 `/` is div.full.f32, 2 ulp off, so seven equal channels of 5.0 had a mean
    # of 4.9999998 and y = bias + 1.2e-4 * weight where torch gives bias exactly (H200, eps 1e-5).
    mean = tl.div_rn(tl.sum(x, axis=1), C + 0.0)
    d = tl.where(mask, x - mean[:, None], 0.0)  # masked channels must not add (0 - mean)^2
    var = tl.div_rn(tl.sum(d * d, axis=1), C + 0.0)  # biased, as torch's layer_norm
    y = d * tl.rsqrt(var + eps)[:, None]
    if HAS_WEIGHT:
        y = y * w[None, :]
    if HAS_BIAS:
        y = y + b[None, :]
    y = apply_activation(y, ACTIVATION, negative_slope)
    if ROUND_BF16:
        y = round_to_bf16(y)
    y_ptrs = y_ptr + n * stride_yn + pix[:, None] * stride_yp + ch[None, :] * stride_yc
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask)


# ---- the launcher ----


def _pixel_strides(t: torch.Tensor) -> tuple[int, int] | None:
    """(image stride, pixel stride) of a 4-D (N, C, H, W) tensor whose h and w merge into one pixel index
    p = h * W + w at one stride; None where they do not (a crop of a wider plane, say)."""
    _, _, H, W = t.shape
    sn, _, sh, sw = t.stride()
    if H * W == 1:
        return sn, sn  # one pixel per image: the images are the pixels
    if W == 1:
        return sn, sh
    if H == 1 or sh == W * sw:
        return sn, sw
    return None


def _check_param(p: torch.Tensor | None, name: str, x: torch.Tensor) -> None:
    if p is None:
        return
    C = x.shape[1]
    if p.shape != (C,):
        raise ValueError(f"{name} must have shape ({C},) (one per channel); got {tuple(p.shape)}")
    if p.dtype not in (x.dtype, torch.float32):
        raise TypeError(f"{name} has dtype {p.dtype}; it must be x's ({x.dtype}) or float32")
    if p.device != x.device:
        raise ValueError(f"{name} is on {p.device}, x on {x.device}")


def _check(x, weight, bias, activation, memory_format) -> None:
    check_activation(activation)
    if x.dim() not in (2, 4):
        raise ValueError(f"x must be (N, C, H, W) or (N, C); got shape {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; fused_layernorm_channels supports float32, float16, bfloat16")
    check_device(x, "x")
    if x.shape[1] > MAX_C:
        raise ValueError(f"x has {x.shape[1]} channels; the kernel holds a pixel's channels in registers (<= {MAX_C})")
    _check_param(weight, "weight", x)
    _check_param(bias, "bias", x)
    if memory_format not in (None, torch.contiguous_format, torch.channels_last):
        raise ValueError(f"memory_format must be None, contiguous_format or channels_last; got {memory_format}")
    if x.dim() == 2 and memory_format == torch.channels_last:
        raise ValueError("memory_format=torch.channels_last needs a 4-D x; got (N, C) vectors")


def _max_offset(t: torch.Tensor) -> int:
    return sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True) if size > 0)


_configs: dict[tuple, LaunchConfig] = {}  # per call signature: the tuned config, without re-keying the tuner
on_new_picks(_configs.clear)  # a pick timed in the background replaces an untimed one: ask tune() again


def fused_layernorm_channels(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-6,
    activation: str = "none",
    *,
    negative_slope: float = DEFAULT_NEGATIVE_SLOPE,
    memory_format: torch.memory_format | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """act(layer_norm over dim 1 of x (N, C, H, W) or (N, C)) * weight + bias, with the mean and biased variance of
    each pixel's C channels (+ eps), in fp32; one kernel, one rounding to x's dtype. weight, bias: (C,) in x's dtype
    or fp32, or None. Returns y of x's shape and dtype in `memory_format` (torch.contiguous_format or
    torch.channels_last; None: x's), or writes `out` (x's shape and dtype, either memory format) and returns it.
    eps 1e-6 is ConvNeXt's (torch.nn.LayerNorm's default is 1e-5)."""
    _check(x, weight, bias, activation, memory_format)
    if x.dim() == 4:
        fmt = torch.channels_last if channels_last(x) else torch.contiguous_format
    else:
        fmt = torch.contiguous_format
    if out is None:
        out = torch.empty(x.shape, device=x.device, dtype=x.dtype, memory_format=memory_format or fmt)
    elif out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"out must be a {tuple(x.shape)} {x.dtype} tensor on {x.device}; got {tuple(out.shape)}")
    if out.numel() == 0:
        return out

    if x.dim() == 2:  # (N, C): N pixels of one image
        flat, P, HW = True, x.shape[0], 1
        xs = (0, x.stride(0), x.stride(1))
        ys = (0, out.stride(0), out.stride(1))
    else:
        N, C, H, W = x.shape
        if _pixel_strides(x) is None:  # h and w do not merge: one copy, into the layout of the output
            x = x.contiguous(memory_format=torch.channels_last if channels_last(out) else torch.contiguous_format)
        y_pix = _pixel_strides(out)
        if y_pix is None:
            raise ValueError(f"out's h and w must merge into one pixel index (stride_h = W * stride_w); "
                             f"got strides {out.stride()}")  # fmt: skip
        (xn, xp), (yn, yp) = _pixel_strides(x), y_pix
        P, HW = N * H * W, H * W
        flat = xn == HW * xp and yn == HW * yp  # every pixel of the batch at one stride (channels_last)
        xs = (xn, xp, x.stride(1))
        ys = (yn, yp, out.stride(1))
    if max(_max_offset(x), _max_offset(out)) >= 2**31:
        raise ValueError(f"x {tuple(x.shape)} spans 2**31 elements or more; the kernel indexes with int32")
    if weight is not None:
        weight = weight.contiguous()
    if bias is not None:
        bias = bias.contiguous()

    C = x.shape[1]
    fixed = dict(
        FLAT=flat,
        HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None,
        ACTIVATION=activation,
        ROUND_BF16=bf16_on_interpreter(x.dtype),
        PDL=use_pdl(x.device),
    )

    def run(config: LaunchConfig):
        meta = config.meta()
        grid = triton.cdiv(P, meta["BLOCK_P"]) if flat else (P // HW) * triton.cdiv(HW, meta["BLOCK_P"])
        return grid_launch(_layernorm_channels_kernel, (grid,))(
            x, weight if weight is not None else x, bias if bias is not None else x, out,
            P, HW, C,
            *xs, *ys,
            float(eps), float(negative_slope),
            **fixed, **meta, **({"launch_pdl": True} if fixed["PDL"] else {}),
        )  # fmt: skip

    walked = P if flat else HW  # pixels a program's block is cut from
    if interpreting():
        bp = INTERPRETER.choice.block_p
        config = _config(walked, C, 4096, 4) if bp is None else LaunchConfig.of(4, 1, BLOCK_P=bp, BLOCK_C=_block_c(C))
        run(config)
        return out
    # Tuned, not a fixed tile: the kernel moves 2 * N * C * H * W elements (154 MB each way for ConvNeXt-T's first
    # stage at 256 images, fp16) and should run at memory bandwidth, but which pixel block gets there depends on
    # the layout: a fixed 4096-element tile ran up to 1.2x the tuned pick's time on channels_last x and 1.4x on
    # NCHW (768 x 7 x 7, where each channel's contiguous run is only BLOCK_P pixels). Batches share a tuned config
    # by power-of-two bucket of pixels (of the whole batch), as the pools' do.
    bucket = 1 << max(P - 1, 0).bit_length()
    x_fmt, y_fmt = ("vec" if t.dim() == 2 else "nhwc" if channels_last(t) else "nchw" for t in (x, out))
    w_dtypes = tuple(None if p is None else p.dtype for p in (weight, bias))
    signature = (x.shape[1:], x_fmt, y_fmt, flat, x.dtype, w_dtypes, activation, bucket)
    config = _configs.get(signature)
    if config is None:
        key = (
            f"C{C}|{'x'.join(map(str, x.shape[2:])) or 'vec'}|{x.dtype}|w={w_dtypes[0]}|b={w_dtypes[1]}|{activation}"
            f"|x={x_fmt}|y={y_fmt}|{'flat' if flat else 'images'}|p{bucket}"
        )
        scope = scope_for("layernorm_channels", _layernorm_channels_kernel)
        config = tune(scope, key, cuda_configs(min(bucket, walked), C), run)
        _configs[signature] = config
    run(config)
    return out


# ---- candidate configs (the tuner times them on CUDA) ----


def _block_c(C: int) -> int:
    return triton.next_power_of_2(C)


def _config(pixels: int, C: int, elems: int, warps: int) -> LaunchConfig:
    """The whole channel row (BLOCK_C = next_pow2(C)) for as many of `pixels` as make about `elems` elements."""
    bc = _block_c(C)
    bp = max(1, min(triton.next_power_of_2(pixels), elems // bc))
    return LaunchConfig.of(warps, 1, BLOCK_P=bp, BLOCK_C=bc)


def cuda_configs(pixels: int, C: int) -> list[LaunchConfig]:
    """Candidates the tuner times: tiles of 2-8K elements, 4 or 8 warps, 8 to 64 fp32 values a thread (more
    spills with weight and bias beside them). A row kernel is a stream: bigger tiles put more bytes in flight per
    SM, smaller ones give small inputs (a 7x7 map at batch 1: 49 pixels) more programs. (16K-element tiles for NCHW,
    where a load's contiguous run is a channel's BLOCK_P pixels, were never the fastest at ConvNeXt-T's shapes.)"""
    out = []
    for elems in (2048, 4096, 8192):
        for warps in (4, 8):
            c = _config(pixels, C, elems, warps)
            per_thread = c["BLOCK_P"] * c["BLOCK_C"] // (32 * warps)
            if per_thread > 64 or (per_thread < 8 and warps > 4):
                continue
            if c not in out:
                out.append(c)
    return out  # never empty: 8192 elements over 8 warps is 32 a thread, and C <= MAX_C = 8192


# ---- under the interpreter: one config, from choices that tests change (interpreter.py) ----


SMALL_INTERPRETER_BLOCK_P = 4  # tests' tile: awkward pixel counts end mid-block


@dataclass(frozen=True)
class InterpreterChoice:
    """What fused_layernorm_channels runs under the interpreter. Its cost is per program, so by default one big
    tile of about 4096 elements."""

    block_p: int | None = None  # pixels a program (a power of two); None: about 4096 elements a program


INTERPRETER = InterpreterSwitches(InterpreterChoice())
