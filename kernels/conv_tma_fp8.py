"""Float8 conv2d + scale + bias [+ residual] + activation as conv_tma.py's implicit GEMM fed by TMA: e4m3 x and
weight boxes, an fp32 accumulator, conv_fp8.py's epilogue (fp8.fp8_epilogue).

conv_fp8.py's kernel gathers its x tiles with per-element pointers and masks, as conv.py does; ResNet-50's float16 convs
run conv_tma.py's TMA boxes instead, and in float8 the gathers ran it level with float16 at 256 images on an H200 (7,792
µs against 7,823; 0.76x at batch 1: docs/performance.md, "Float8"), so twice the MMA rate went unused. Here the main
loop is conv_tma's (`_k_loop`: one TMA copy of x's shifted box and one of the weight's tile per tap and K step, the
padding zero-filled by the copy), with K steps of 64 or 128 e4m3 channels (the same 64 or 128 bytes as fp16's 32 or 64).
With it the float8 ResNet-50 runs 1.44x float16 at 256 images and 1.49x at batch 1 on an H200 (docs/performance.md,
"Float8"). The epilogue dequantizes with s_x * s_w[o] per column, adds the bias and the residual (read with pointers at
y's offsets: e4m3 with its scale, or fp16/fp32), activates, and stores e4m3 quantized with the next layer's scale or
fp16: by TMA where y is NHWC with 16-byte rows, else with pointers.

Runs where conv_tma.eligible says (x e4m3 channels_last with C a multiple of 16, the weight channels_last; strided, H
and W multiples of the stride and C of a K step, 32 channels at least: an fp8 tl.dot takes K >= 32). fp16 or fp32 x
(QUANT_X, quantized as gathered) stays with conv_fp8's gathers: a TMA copy moves bytes as they are. No pool (fp8 convs
never pool). fused_conv2d_fp8 offers this kernel's configs to the tuner beside its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .conv_tma import _box_offsets, _box_origin, _k_loop, box_shape, descriptors, k_steps
from .conv_tma import eligible as tma_eligible
from .fp8 import E4M3, fp8_epilogue
from .launch import grid_launch
from .pdl import gdc_launch_dependents, gdc_wait
from .tuning import LaunchConfig


@triton.jit(do_not_specialize=["NB"])
def _conv2d_tma_fp8_kernel(
    x_desc,  # e4m3 x as (NB, H, W, C), boxes [IMG, BH, BW, BLOCK_K]; strided, (NB, H / SH, SH, W / SW, SW * C)
    w_desc,  # the e4m3 weight as (OC, KH * KW * C), boxes [BLOCK_N, BLOCK_K]
    s_ptr,  # fp32 (OC,): s_x * s_w[o]
    b_ptr,  # fp32 (OC,) bias (HAS_BIAS)
    y,  # Y_NHWC: a descriptor of y as (NB, OH, OW, OC), boxes [IMG, BH, BW, BLOCK_N]; else y's pointer
    r_ptr,  # the residual, with y's strides (HAS_RESIDUAL)
    NB,  # the batch: the only run-time size
    stride_yn, stride_yc, stride_yh, stride_yw,
    r_scale, y_inv_scale, negative_slope,  # the residual's s_r (R_FP8), 1 / s_y (Y_FP8), leaky_relu's slope
    C: tl.constexpr, H: tl.constexpr, W: tl.constexpr, OC: tl.constexpr, OH: tl.constexpr, OW: tl.constexpr,
    KH: tl.constexpr, KW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
    SH: tl.constexpr, SW: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ACTIVATION: tl.constexpr,
    R_FP8: tl.constexpr, Y_FP8: tl.constexpr, ROUND_FP8: tl.constexpr,  # as conv_fp8's kernel (fp8.fp8_flags)
    PDL: tl.constexpr,
    Y_NHWC: tl.constexpr,  # y channels_last and contiguous: stored by TMA; else with pointers
    IMG: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr,  # the output box: BLOCK_M = IMG * BH * BW pixels
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    BLOCK_M: tl.constexpr = IMG * BH * BW
    n0, oh0, ow0, o0 = _box_origin(NB, OH, OW, OC, IMG, BH, BW, BLOCK_N)
    cols = o0 + tl.arange(0, BLOCK_N)
    offs_n = tl.minimum(cols, OC - 1)  # columns past the edge compute on the last one, never stored
    # The scales and the bias: no earlier kernel writes them, so before the PDL wait
    scale = tl.load(s_ptr + offs_n)
    bias = tl.load(b_ptr + offs_n) if HAS_BIAS else scale
    if PDL:  # wait for the previous layer before the first copy of x
        gdc_wait()
    acc = _k_loop(x_desc, w_desc, n0, oh0, ow0, o0, C, KH, KW, PH, PW, DH, DW, SH, SW, BLOCK_M, BLOCK_N, BLOCK_K,
                  False, None)  # fmt: skip
    if PDL:  # as conv_tma's kernel: the next layer once every program is here
        gdc_launch_dependents()
    rows, inside = _box_offsets(n0, oh0, ow0, NB, OH, OW, IMG, BH, BW, stride_yn, stride_yh, stride_yw)
    y_ok = inside[:, None] & (cols < OC)[None, :]
    r = tl.load(r_ptr + rows[:, None] + (cols * stride_yc)[None, :], mask=y_ok, other=0.0) if HAS_RESIDUAL else acc
    if Y_NHWC:
        out = fp8_epilogue(acc, scale, bias, r, r_scale, negative_slope, y_inv_scale, HAS_BIAS, HAS_RESIDUAL, R_FP8,
                           ACTIVATION, Y_FP8, ROUND_FP8, y.dtype)  # fmt: skip
        y.store([n0, oh0, ow0, o0], out.reshape(IMG, BH, BW, BLOCK_N))
    else:
        out = fp8_epilogue(acc, scale, bias, r, r_scale, negative_slope, y_inv_scale, HAS_BIAS, HAS_RESIDUAL, R_FP8,
                           ACTIVATION, Y_FP8, ROUND_FP8, y.dtype.element_ty)  # fmt: skip
        tl.store(y + rows[:, None] + (cols * stride_yc)[None, :], out, mask=y_ok)


def launch(x, weight, scale, bias, out, residual, scales: tuple, flags: dict, geometry: dict, activation: str,
           pdl: bool, config: LaunchConfig):  # fmt: skip
    """One launch: x (N, C, H, W) e4m3 and weight (OC, C, KH, KW) e4m3, both channels_last (conv_tma.eligible);
    scales: (r_scale, y_inv_scale, negative_slope); flags: fp8.fp8_flags' R_FP8, Y_FP8, ROUND_FP8 (no QUANT_X);
    geometry: C, H, W, KH, KW, SH, SW, PH, PW, DH, DW, OH, OW; residual: None, or with out's strides."""
    meta = {k: v for k, v in config.meta().items() if k != "TMA"}
    x_desc, w_desc, y, store_nhwc, programs = descriptors(x, weight, out, geometry, meta)
    return grid_launch(_conv2d_tma_fp8_kernel, (programs,))(
        x_desc, w_desc, scale, bias if bias is not None else scale, y, residual if residual is not None else out,
        x.shape[0], *out.stride(), *scales,
        **geometry, OC=weight.shape[0], HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        ACTIVATION=activation, R_FP8=flags["R_FP8"], Y_FP8=flags["Y_FP8"], ROUND_FP8=flags["ROUND_FP8"], PDL=pdl,
        Y_NHWC=store_nhwc, **meta, **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip


def interpreter_config(OC: int, C: int, OH: int, OW: int, strided: bool, block_m: int = 64) -> LaunchConfig:
    """The one config run under the interpreter: a `block_m`-pixel box (boxes cross image edges), all of OC up to
    128 channels, the widest K step conv_tma.k_steps allows."""
    bk = max(k_steps(C, 1, strided))
    img, bh, bw = box_shape(block_m, OH, OW)
    return LaunchConfig.of(4, 1, IMG=img, BH=bh, BW=bw, BLOCK_N=max(16, min(128, triton.next_power_of_2(OC))),
                           BLOCK_K=bk, TMA=1)  # fmt: skip


def eligible(x: torch.Tensor, weight: torch.Tensor, stride, out: torch.Tensor) -> bool:
    """conv_tma.eligible for an e4m3 x (1-byte channels: C a multiple of 16; strided, of 32)."""
    return x.dtype == E4M3 and weight.dtype == E4M3 and tma_eligible(x, weight, stride, None, out)
