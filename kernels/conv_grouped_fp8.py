"""Fused float8 grouped and depthwise 2-D convolution: y = act(conv2d(x, W, groups=G) * s + b [+ residual]) with e4m3
operands and an fp32 accumulator, in one Triton kernel.

Why: MobileNetV2 and EfficientNet-B0 are memory-bound at batch 256, and their largest tensors, the 6x-expanded ones
of each inverted-residual block, are what the depthwise convs read and write (MobileNetV2's on 96 channels at 112x112
reads 617 MB at batch 256 in fp16). With conv_fp8.py's groups=1 convs in e4m3 and these in fp16, every expanded
tensor would cross the float8/float16 boundary twice at 2 bytes a value; here they read and write 1.

The contract is conv_fp8.fused_conv2d_fp8's, for groups > 1: x e4m3 (quantized with x_scale), or fp16/fp32 quantized
with x_scale as it is loaded (QUANT_X: conv_fp8._gather); the weight e4m3 (OC, C / G, KH, KW), quantized per output
channel; `scale` the per-channel dequantizing multiplier s_x * s_w[o]; the epilogue fp8.fp8_epilogue's (dequantize,
bias, residual, activation, then e4m3 with out_scale or out_dtype). The groups and the two paths are
conv_grouped.py's:

Groups: x (N, C, H, W) and weight (OC, CG, KH, KW) with C = G * CG and OCG = OC / G. Output channel o reads the CG
input channels (o // OCG) * CG + [0, CG); depthwise is CG = 1 (OCG > 1: a channel multiplier). One kernel,
`_conv2d_grouped_fp8_kernel`, with conv_grouped.py's two paths behind a constexpr (one signature, one epilogue):
- DIRECT (depthwise): a direct convolution (`_depthwise`), BLOCK_M output pixels x BLOCK_N channels a program, fp32
  FMAs over the KH x KW taps (a depthwise 3x3 is 9 multiply-adds an output: nothing for a tensor core). Each product
  of two e4m3 values is exact in fp32 (3 + 3 mantissa bits). Channels_last x: a tap is one load of up to 16 e4m3
  channels a thread, and of their weights (laid out with the output channels contiguous: prepare_weight); NCHW x:
  the tile is laid out pixels-first, as conv_grouped's.
- the grouped GEMM (CG > 1, `_grouped_gemm`): conv_grouped's implicit GEMM with block-diagonal weight tiles (a tile
  holds GPT = BLOCK_N // OCG whole groups when a group is narrower than it), e4m3 x and W tiles into tl.dot (Hopper's
  fp8 MMA) with K steps of 32 or more, its least K.

The layer's shape is compile-time and the batch run-time: one compiled kernel per layer and config serves every batch.
y comes back channels_last unless asked otherwise (conv_fp8's rule: activations stay NHWC between fp8 layers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .activations import DEFAULT_NEGATIVE_SLOPE, check_activation
from .conv import _y_tile, conv_geometry, m_bucket, output_tensor
from .conv_fp8 import SMALL_INTERPRETER_TILE, _gather
from .conv_grouped import UNROLL, InterpreterChoice, _fit, default_path
from .conv_grouped import direct_configs as fp16_direct_configs
from .conv_grouped import gemm_configs as fp16_gemm_configs
from .fp8 import (
    E4M3,
    FP8_OUT_DTYPES,
    FP8_X_DTYPES,
    check_fp8_bias,
    check_scale_vector,
    fp8_epilogue,
    fp8_flags,
    inverse,
)
from .interpreter import InterpreterSwitches
from .launch import grid_launch
from .pdl import gdc_launch_dependents, gdc_wait, use_pdl
from .pool import channels_last as _channels_last
from .runtime import check_device, interpreting
from .tiles import channels_last_alignment, known_multiple, known_strides, pow2_alignment, residual_like
from .tuning import LaunchConfig, scope_for, tune
from .tuning_background import on_new_picks

FP8_DOT_MIN_K = 32  # an fp8 tl.dot takes K in steps of 32 (Hopper's wgmma, Ada's mma.sync m16n8k32)


@triton.jit
def _window_row(acc, x_tile, w_o, p_ok, o_ok, h0, w0, kh, x_inv_scale, stride_xh, stride_xw, stride_wh, stride_ww,
                H: tl.constexpr, W: tl.constexpr, KW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
                QUANT_X: tl.constexpr, ROUND_FP8: tl.constexpr):  # fmt: skip
    """acc plus the products of window row kh: its KW taps unrolled (their loads in flight at once), x at the window
    corner's pointers x_tile as e4m3 (0 outside the image), times each channel's e4m3 weight at w_o (0 past OC), in
    fp32."""
    ih = h0 + kh * DH
    row_ok = p_ok & (ih >= 0) & (ih < H)
    x_row = x_tile + (kh * DH) * stride_xh
    w_row = w_o + kh * stride_wh
    for kw in tl.static_range(KW):
        iw = w0 + kw * DW
        ok = (row_ok & (iw >= 0) & (iw < W)) & o_ok
        a = _gather(x_row + (kw * DW) * stride_xw, ok, x_inv_scale, QUANT_X, ROUND_FP8)
        acc += a.to(tl.float32) * tl.load(w_row + kw * stride_ww, mask=o_ok, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _depthwise(x_ptr, w_ptr, rows, o, NB, x_inv_scale, stride_xn, stride_xc, stride_xh, stride_xw, stride_wo,
               stride_wh, stride_ww, OC: tl.constexpr, OCG: tl.constexpr, H: tl.constexpr, W: tl.constexpr,
               OH: tl.constexpr, OW: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr,
               SW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
               QUANT_X: tl.constexpr, ROUND_FP8: tl.constexpr, CHANNELS_LAST: tl.constexpr):  # fmt: skip
    """The direct convolution of output pixels `rows` and channels `o` (1-D), one input channel each: the
    (len(rows), len(o)) fp32 sums of the KH x KW taps. Each product of two e4m3 values is exact in fp32."""
    # Pixels as (BLOCK_M, 1) and channels as (1, BLOCK_N) (channels along a warp: NHWC x), or (1, BLOCK_M) and
    # (BLOCK_N, 1) (pixels along a warp: NCHW x, where a warp's load then reads along a row of pixels, not 32 planes).
    if CHANNELS_LAST:
        pos = rows[:, None]
        o = o[None, :]
    else:
        pos = rows[None, :]
        o = o[:, None]
    n = pos // (OH * OW)
    p_ok = n < NB  # pos < NB * OH * OW
    o_ok = o < OC
    # Each output channel's input channel: the channel itself without a multiplier, unclamped, so that NHWC x is read
    # in 16-byte vectors along o (masked past OC).
    x_ch = (o if OCG == 1 else tl.minimum(o, OC - 1) // OCG) * stride_xc
    w_o = w_ptr + o * stride_wo  # unclamped too: the weight's channels are contiguous (prepare_weight)
    h0 = ((pos // OW) % OH) * SH - PH  # top-left corner of each output pixel's window, in padded coordinates
    w0 = (pos % OW) * SW - PW
    x_tile = x_ptr + n * stride_xn + h0 * stride_xh + w0 * stride_xw + x_ch
    acc = tl.zeros(x_tile.shape, dtype=tl.float32)
    # Every tap unrolled where they are few (a depthwise 3x3's 9: constant offsets, the loads in flight at once), else
    # the window rows at run time, each row's taps unrolled (conv_grouped.py: a 7x7 unrolled whole spilled).
    if KH * KW <= UNROLL:
        for kh in tl.static_range(KH):
            acc = _window_row(acc, x_tile, w_o, p_ok, o_ok, h0, w0, kh, x_inv_scale, stride_xh, stride_xw, stride_wh,
                              stride_ww, H, W, KW, DH, DW, QUANT_X, ROUND_FP8)  # fmt: skip
    else:
        for kh in range(KH):
            acc = _window_row(acc, x_tile, w_o, p_ok, o_ok, h0, w0, kh, x_inv_scale, stride_xh, stride_xw, stride_wh,
                              stride_ww, H, W, KW, DH, DW, QUANT_X, ROUND_FP8)  # fmt: skip
    # (pixels, channels) for the epilogue: a transpose of registers relabels the layout, it moves nothing
    return acc if CHANNELS_LAST else tl.trans(acc)


@triton.jit
def _grouped_gemm(x_ptr, w_ptr, rows, g0, rel, o_safe, NB, x_inv_scale, stride_xn, stride_xc, stride_xh, stride_xw,
                  stride_wo, stride_wc, stride_wh, stride_ww, G: tl.constexpr, CG: tl.constexpr, OCG: tl.constexpr,
                  GPT: tl.constexpr, H: tl.constexpr, W: tl.constexpr, OH: tl.constexpr, OW: tl.constexpr,
                  KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr,
                  PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr, QUANT_X: tl.constexpr,
                  ROUND_FP8: tl.constexpr, CHANNELS_LAST: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """conv_grouped's implicit GEMM on e4m3 tiles: the (len(rows), len(rel)) fp32 sums for output pixels `rows` and
    the tile's columns rel (channel g0 * OCG + rel), GPT whole groups from group g0 (or part of one, GPT 1). Per tap,
    K is the CG * GPT input channels of the tile's groups, BLOCK_K at a time; the weight tile is block-diagonal."""
    KT: tl.constexpr = GPT * CG
    n = rows // (OH * OW)
    m_ok = n < NB  # rows < M, constant over each image's OH * OW rows
    h0 = ((rows // OW) % OH) * SH - PH
    w0 = (rows % OW) * SW - PW
    offs_k = tl.arange(0, BLOCK_K)
    # Pointer tiles built once; each step adds one scalar offset (conv.py: recomputed per step they spilled).
    x_corner = x_ptr + n * stride_xn + h0 * stride_xh + w0 * stride_xw + (g0 * CG) * stride_xc
    if CHANNELS_LAST:
        a_tile = x_corner[:, None] + (offs_k * stride_xc)[None, :]
    else:  # (BLOCK_K, BLOCK_M): a warp's threads along pixels, 1-2 cache lines a load instead of 32 planes
        a_tile = x_corner[None, :] + (offs_k * stride_xc)[:, None]
    # Column j's weights start at input channel CG * (its group - g0) of the tap's K: W[o_j, k - CG * group(j)].
    col_group = rel // OCG
    b_tile = (w_ptr + o_safe * stride_wo - (col_group * CG) * stride_wc)[None, :] + (offs_k * stride_wc)[:, None]
    k_limit = tl.minimum(KT, (G - g0) * CG)  # the last tile's groups may run past G
    acc = tl.zeros((rows.shape[0], rel.shape[0]), dtype=tl.float32)
    k_steps: tl.constexpr = (KT + BLOCK_K - 1) // BLOCK_K
    for step in range(KH * KW * k_steps):  # one flat loop over (tap, channel block): one software pipeline
        tap = step // k_steps
        k0 = (step % k_steps) * BLOCK_K
        ih = h0 + (tap // KW) * DH
        iw = w0 + (tap % KW) * DW
        in_image = m_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        k_ok = offs_k < k_limit - k0  # `arange < scalar`: constant over runs, so loads stay vectorised
        x_step = k0 * stride_xc + ((tap // KW) * DH) * stride_xh + ((tap % KW) * DW) * stride_xw
        if CHANNELS_LAST:
            a = _gather(a_tile + x_step, in_image[:, None] & k_ok[None, :], x_inv_scale, QUANT_X, ROUND_FP8)
        else:
            a = tl.trans(_gather(a_tile + x_step, k_ok[:, None] & in_image[None, :], x_inv_scale, QUANT_X, ROUND_FP8))
        if GPT == 1:
            b_ok = (offs_k < CG - k0)[:, None]
        else:  # block-diagonal: input channel k of the tile's K meets only the columns of its own group
            b_ok = (((k0 + offs_k) // CG)[:, None] == col_group[None, :]) & k_ok[:, None]
        w_step = k0 * stride_wc + (tap // KW) * stride_wh + (tap % KW) * stride_ww
        acc = tl.dot(a, tl.load(b_tile + w_step, mask=b_ok, other=0.0), acc)
    return acc


@triton.jit(do_not_specialize=["NB"])
def _conv2d_grouped_fp8_kernel(
    # pointers: x (e4m3, or fp16/fp32 with QUANT_X), w (e4m3), s (fp32 s_x * s_w[o]), b (fp32 bias), y (e4m3, fp16 or
    # fp32), r (the residual, with y's strides; unused without HAS_RESIDUAL)
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, r_ptr,
    # sizes (the batch NB is the only run-time one; M = NB * OH * OW output pixels)
    NB,
    # strides
    stride_xn, stride_xc, stride_xh, stride_xw,
    stride_wo, stride_wc, stride_wh, stride_ww,
    stride_yn, stride_yc, stride_yh, stride_yw,
    # scales: 1 / s_x (QUANT_X), the residual's s_r (R_FP8), 1 / s_y (Y_FP8); the epilogue's leaky_relu slope
    x_inv_scale, r_scale, y_inv_scale, negative_slope,
    # the layer's shape (G groups of CG input and OCG output channels)
    G: tl.constexpr, CG: tl.constexpr, OCG: tl.constexpr,
    H: tl.constexpr, W: tl.constexpr, OH: tl.constexpr, OW: tl.constexpr,
    KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
    PH: tl.constexpr, PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
    # meta-parameters (PDL: pdl.py; QUANT_X, R_FP8, Y_FP8, ROUND_FP8: fp8.fp8_flags)
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ACTIVATION: tl.constexpr,
    PDL: tl.constexpr, QUANT_X: tl.constexpr, R_FP8: tl.constexpr, Y_FP8: tl.constexpr, ROUND_FP8: tl.constexpr,
    DIRECT: tl.constexpr,  # the direct convolution (depthwise, CG 1), else the grouped GEMM
    CHANNELS_LAST: tl.constexpr,  # x is NHWC: channels along a warp; else pixels along it
    Y_PLANES: tl.constexpr,  # y is contiguous NCHW
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  # output pixels and channels a program
    BLOCK_K: tl.constexpr = FP8_DOT_MIN_K,  # the GEMM's K step
    # what x's and y's pixel strides and the weight's are multiples of (tiles.channels_last_alignment; DIRECT: the
    # weight's tap strides, tiles.pow2_alignment)
    X_ALIGN: tl.constexpr = 1, W_ALIGN: tl.constexpr = 1, Y_ALIGN: tl.constexpr = 1,
):  # fmt: skip
    stride_xn, stride_xh, stride_xw = known_strides(stride_xn, stride_xh, stride_xw, X_ALIGN)  # conv.py: why
    if DIRECT:  # the weight's output channels contiguous (prepare_weight): its tap strides multiples of W_ALIGN
        stride_wh, stride_ww = known_multiple(stride_wh, W_ALIGN), known_multiple(stride_ww, W_ALIGN)
    else:
        stride_wo, stride_wh, stride_ww = known_strides(stride_wo, stride_wh, stride_ww, W_ALIGN)
    stride_yn, stride_yh, stride_yw = known_strides(stride_yn, stride_yh, stride_yw, Y_ALIGN)
    OC: tl.constexpr = G * OCG
    if PDL:  # the next layer may start; this one waits for the previous layer (below) before reading x
        gdc_launch_dependents()
    # Column tiles fastest: neighbouring programs read the same pixels' neighbouring channels (NHWC: the same lines).
    if DIRECT:
        col_tiles = tl.cdiv(OC, BLOCK_N)
        o = (tl.program_id(0) % col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = o < OC
    else:
        # GPT whole groups a tile when a group is narrower than it, else BLOCK_N channels of one group, SUBS such
        # tiles a group (conv_grouped.py)
        GPT: tl.constexpr = BLOCK_N // OCG if OCG < BLOCK_N else 1
        SUBS: tl.constexpr = 1 if OCG < BLOCK_N else (OCG + BLOCK_N - 1) // BLOCK_N
        col_tiles = ((G + GPT - 1) // GPT) * SUBS
        g0 = ((tl.program_id(0) % col_tiles) // SUBS) * GPT  # the tile's first group
        rel = ((tl.program_id(0) % col_tiles) % SUBS) * BLOCK_N + tl.arange(0, BLOCK_N)  # from g0's first channel
        o = g0 * OCG + rel
        col_ok = (rel < GPT * OCG) & (o < OC)
    rows = (tl.program_id(0) // col_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    # Scales and bias: no earlier kernel writes them, so before the PDL wait; at unclamped channels (16-byte loads),
    # 0 past the edge
    scale = tl.load(s_ptr + o, mask=col_ok, other=0.0)
    bias = tl.load(b_ptr + o, mask=col_ok, other=0.0) if HAS_BIAS else scale
    if PDL:
        gdc_wait()
    if DIRECT:
        acc = _depthwise(x_ptr, w_ptr, rows, o, NB, x_inv_scale, stride_xn, stride_xc, stride_xh, stride_xw,
                         stride_wo, stride_wh, stride_ww, OC, OCG, H, W, OH, OW, KH, KW, SH, SW, PH, PW, DH, DW,
                         QUANT_X, ROUND_FP8, CHANNELS_LAST)  # fmt: skip
    else:
        o_safe = tl.minimum(o, OC - 1)  # columns past the edge compute on the last channel, never stored
        acc = _grouped_gemm(x_ptr, w_ptr, rows, g0, rel, o_safe, NB, x_inv_scale, stride_xn, stride_xc, stride_xh,
                            stride_xw, stride_wo, stride_wc, stride_wh, stride_ww, G, CG, OCG, GPT, H, W, OH, OW, KH,
                            KW, SH, SW, PH, PW, DH, DW, QUANT_X, ROUND_FP8, CHANNELS_LAST, BLOCK_K)  # fmt: skip

    n = rows // (OH * OW)
    out_h = (rows // OW) % OH
    out_w = rows % OW
    y_ok = (n < NB)[:, None] & col_ok[None, :]
    if HAS_RESIDUAL:
        r_tile = _y_tile(r_ptr, n, rows, out_h, out_w, o, stride_yn, stride_yc, stride_yh, stride_yw, OH, OW, Y_PLANES)
        r = tl.load(r_tile, mask=y_ok, other=0.0)
    else:
        r = acc
    out = fp8_epilogue(acc, scale, bias, r, r_scale, negative_slope, y_inv_scale, HAS_BIAS, HAS_RESIDUAL, R_FP8,
                       ACTIVATION, Y_FP8, ROUND_FP8, y_ptr.dtype.element_ty)  # fmt: skip
    y_tile = _y_tile(y_ptr, n, rows, out_h, out_w, o, stride_yn, stride_yc, stride_yh, stride_yw, OH, OW, Y_PLANES)
    tl.store(y_tile, out, mask=y_ok)


# ---- the launcher ----


def _check(x, weight, scale, bias, activation, groups, residual, y_dtype) -> None:
    check_activation(activation)
    if x.dim() != 4 or weight.dim() != 4:
        raise ValueError(f"x and weight must be 4-D; got {tuple(x.shape)} and {tuple(weight.shape)}")
    for t, name in ((x, "x"), (weight, "weight")):
        check_device(t, name)
        if t.numel() >= 2**31:
            raise ValueError(f"{name} has {t.numel()} elements; the kernel indexes with int32 (< 2**31)")
    if weight.device != x.device:
        raise ValueError(f"x is on {x.device} but weight is on {weight.device}")
    if min(weight.shape) < 1:
        raise ValueError(f"weight must have every dimension >= 1; got shape {tuple(weight.shape)}")
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups must be an int >= 1; got {groups!r}")
    C, OC = x.shape[1], weight.shape[0]
    if C % groups or OC % groups:
        raise ValueError(f"groups={groups} must divide x's C={C} and weight's OC={OC}")
    if weight.shape[1] != C // groups:
        raise ValueError(f"weight (OC, C / groups, KH, KW) has {weight.shape[1]} input channels a group; x's C={C} in "
                         f"{groups} groups needs {C // groups}")  # fmt: skip
    # dtypes: fp8.py's, what an fp8 layer reads and writes (y's: out_dtype, or e4m3 with an out_scale)
    checked = [(x.dtype, "x", FP8_X_DTYPES), (weight.dtype, "weight", (E4M3,)), (y_dtype, "out_dtype", FP8_OUT_DTYPES)]
    if residual is not None:
        checked.append((residual.dtype, "residual", FP8_OUT_DTYPES))
    for dtype, name, allowed in checked:
        if dtype not in allowed:
            want = ", ".join(str(d).removeprefix("torch.") for d in allowed)
            raise TypeError(f"{name} is {dtype}; fused_conv2d_grouped_fp8 takes {want}")
    check_scale_vector(scale, OC, x.device)
    check_fp8_bias(bias, OC, x.device)


def prepare_weight(weight: torch.Tensor) -> torch.Tensor:
    """The e4m3 weight (OC, C / groups, KH, KW) in the layout the kernel reads best, for a layer to keep (the launcher
    copies any other into it at each call). Depthwise (one input channel a group): the output channels contiguous,
    (KH, KW, OC) in memory, so that a thread's 16 channels of a tap are one 16-byte load (in torch's layout a thread
    read them a byte at a time: 144 one-byte loads beside x's 9 vector loads, 64x32 outputs of a 3x3 on 4 warps, sm_90
    PTX). Wider groups: channels_last, a group's channels contiguous, K-major as the fp8 MMA reads its operands."""
    if weight.shape[1] != 1:
        return weight.contiguous(memory_format=torch.channels_last)
    if weight.permute(2, 3, 1, 0).is_contiguous():
        return weight
    return weight.permute(2, 3, 1, 0).contiguous().permute(3, 2, 0, 1)


_configs: dict[tuple, LaunchConfig] = {}  # per (layer signature, M bucket): the tuned config
on_new_picks(_configs.clear)  # a pick timed in the background replaces an untimed one: ask tune() again


def fused_conv2d_grouped_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    *,
    stride=(1, 1),
    padding=(0, 0),
    dilation=(1, 1),
    groups: int,
    negative_slope: float = DEFAULT_NEGATIVE_SLOPE,
    x_scale: float = 1.0,
    residual: torch.Tensor | None = None,
    residual_scale: float = 1.0,
    out_scale: float | None = None,
    out_dtype: torch.dtype = torch.float16,
    memory_format: torch.memory_format | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """act(conv2d(x, weight, groups=groups) * scale[o] + bias [+ residual]) with e4m3 operands and an fp32
    accumulator: conv_fp8.fused_conv2d_fp8's contract for grouped and depthwise convs.

    x (N, C, H, W), any strides (channels_last best): float8_e4m3fn, or float16/float32 quantized as it is read with
    `x_scale` (e4m3(x / x_scale)); weight (OC, C / groups, KH, KW) float8_e4m3fn (fp8.quantize_weight: per output
    channel); scale (OC,) float32, the dequantizing multiplier s_x * s_w[o] (fp8.dequant_scale); bias (OC,) float32
    or None. Depthwise (C / groups == 1, OC any multiple of C) runs the direct convolution, wider groups the GEMM.
    stride, padding, dilation: ints or pairs, as torch takes them.
    residual: None, or a tensor of the output's shape, float8_e4m3fn (read times `residual_scale`), fp16 or fp32,
    added before the activation.
    out_scale: the output's quantization scale (the next fp8 layer's input scale): y = e4m3(v / out_scale); None:
    y in out_dtype (float16 or float32).
    memory_format: of the returned tensor; None: channels_last. out: None, or the (N, OC, OH, OW) tensor to write.
    """
    y_dtype = E4M3 if out_scale is not None else out_dtype
    _check(x, weight, scale, bias, activation, groups, residual, y_dtype)
    s, p, d, OH, OW = conv_geometry(x, weight, stride, padding, dilation)
    N, C, H, W = x.shape
    OC, CG, KH, KW = weight.shape
    G, OCG = groups, OC // groups
    out = output_tensor(out, (N, OC, OH, OW), y_dtype, x.device, memory_format or torch.channels_last)
    has_residual = residual is not None
    if has_residual:
        residual = residual_like(residual, out, any_dtype=True)  # at y's offsets; not out's own memory
    M = N * OH * OW
    if M == 0:
        return out
    weight = prepare_weight(weight)  # a no-op for a prepared layer
    channels_last = _channels_last(x)
    y_planes = out.stride()[1:] == (OH * OW, OW, 1)
    flags = fp8_flags(x, y_dtype, residual)
    pdl = use_pdl(x.device)
    geometry = dict(H=H, W=W, OH=OH, OW=OW, KH=KH, KW=KW, SH=s[0], SW=s[1], PH=p[0], PW=p[1], DH=d[0], DW=d[1])
    args = (x, weight, scale, bias if bias is not None else scale, out, residual if has_residual else out, N,
            *x.stride(), *weight.stride(), *out.stride(), inverse(x_scale) if flags["QUANT_X"] else 1.0,
            float(residual_scale) if flags["R_FP8"] else 1.0, inverse(out_scale) if out_scale is not None else 1.0,
            float(negative_slope))  # fmt: skip
    common = dict(**geometry, HAS_BIAS=bias is not None, HAS_RESIDUAL=has_residual, ACTIVATION=activation, PDL=pdl,
                  **flags, Y_PLANES=y_planes, X_ALIGN=channels_last_alignment(x), Y_ALIGN=channels_last_alignment(out),
                  G=G, CG=CG, OCG=OCG,
                  CHANNELS_LAST=channels_last, **({"launch_pdl": True} if pdl else {}))  # fmt: skip

    def run(config: LaunchConfig):
        meta = config.meta()
        bm, bn = meta["BLOCK_M"], meta["BLOCK_N"]
        if meta["DIRECT"]:
            col_tiles = triton.cdiv(OC, bn)
            w_align = pow2_alignment(*weight.stride()[2:])
        else:
            col_tiles = triton.cdiv(G, bn // OCG) if bn > OCG else G * triton.cdiv(OCG, bn)
            w_align = channels_last_alignment(weight)
        return grid_launch(_conv2d_grouped_fp8_kernel, (triton.cdiv(M, bm) * col_tiles,))(
            *args, **common, W_ALIGN=w_align, **meta
        )

    if interpreting():
        run(_interpreter_config(M, OC, CG, OCG))
        return out
    bucket = m_bucket(M)
    signature = (tuple(weight.shape), weight.stride(), x.shape[1:], x.stride()[1:], x.dtype, G, s, p, d, activation,
                 bias is not None, y_dtype, y_planes, bucket, has_residual and residual.dtype)  # fmt: skip
    config = _configs.get(signature)
    if config is None:
        key = (
            f"OC{OC}|C{C}|G{G}|H{H}|W{W}|k{KH}x{KW}|s{s}|p{p}|d{d}|x={x.dtype}|y={y_dtype}|{activation}"
            f"|bias={bias is not None}|{'nhwc' if channels_last else 'nchw'}|y={'nchw' if y_planes else 'nhwc'}"
            f"|m{bucket}"
        )
        if has_residual:  # one more read in the epilogue: timed apart
            key += f"|residual={residual.dtype}"
        scope = scope_for("conv2d_grouped_fp8", _conv2d_grouped_fp8_kernel)
        config = tune(scope, key, cuda_configs(bucket, OC, CG, OCG, channels_last), run)
        _configs[signature] = config
    run(config)
    return out


# ---- candidate configs (the tuner times them on CUDA) ----


def direct_configs(bucket: int, OC: int, channels_last: bool) -> list[LaunchConfig]:
    """conv_grouped's direct-kernel tiles (the same outputs a program and warps: 8-32 fp32 accumulators a thread), as
    (BLOCK_M pixels, BLOCK_N channels). Channels_last, twice the channels a program and half the pixels: a 16-byte
    vector holds 16 e4m3 channels against 8 fp16 ones, so 32-128 channels a pixel load the 32-128 bytes that fp16's
    16-64 do. NCHW: pixels along the warp, as they are."""
    out = []
    for config in fp16_direct_configs(bucket, OC, channels_last):
        bp, bc = config["BLOCK_P"], config["BLOCK_C"]
        if channels_last:
            bp, bc = max(16, bp * bc // _fit(OC, 16, 2 * bc)), _fit(OC, 16, 2 * bc)
        config = LaunchConfig.of(config.num_warps, 1, DIRECT=1, BLOCK_M=bp, BLOCK_N=bc)
        if config not in out:
            out.append(config)
    return out


def gemm_configs(bucket: int, CG: int, OCG: int) -> list[LaunchConfig]:
    """conv_grouped's grouped-GEMM tiles (BLOCK_M, BLOCK_N, warps, stages), with K steps twice as deep in elements
    (the same bytes a step), never below 32 (FP8_DOT_MIN_K) nor past the tile's K per tap rounded up to a power of two:
    groups of 2 in a 16-wide tile still fill half a 32-deep step."""
    out = []
    for config in fp16_gemm_configs(bucket, CG, OCG):
        bn = config["BLOCK_N"]
        kt = (bn // OCG if bn > OCG else 1) * CG
        bk = max(FP8_DOT_MIN_K, min(2 * config["BLOCK_K"], triton.next_power_of_2(kt)))
        config = LaunchConfig.of(config.num_warps, config.num_stages, DIRECT=0, BLOCK_M=config["BLOCK_M"],
                                 BLOCK_N=bn, BLOCK_K=bk)  # fmt: skip
        if config not in out:
            out.append(config)
    return out


def cuda_configs(bucket: int, OC: int, CG: int, OCG: int, channels_last: bool) -> list[LaunchConfig]:
    """Candidates the tuner times for one layer and M bucket: depthwise (CG 1) the direct kernel, wider groups the
    GEMM (conv_grouped.cuda_configs: why)."""
    if CG == 1:
        return direct_configs(bucket, OC, channels_last)
    return gemm_configs(bucket, CG, OCG)


# ---- under the interpreter: one config, from choices that tests change (interpreter.py) ----


SMALL_DIRECT_TILE = (32, 8)  # tests' tiles: awkward shapes cross every block edge
SMALL_GEMM_TILE = SMALL_INTERPRETER_TILE  # conv_fp8's (16, 16, 32): BLOCK_K at the fp8 dot's least

# conv_grouped's choices (path, direct_tile, gemm_tile): by default the largest tile the problem fills, the direct
# kernel for depthwise and the GEMM for wider groups
INTERPRETER = InterpreterSwitches(InterpreterChoice())


def _interpreter_config(M: int, OC: int, CG: int, OCG: int) -> LaunchConfig:
    choice = INTERPRETER.choice
    path = choice.path or default_path(CG)
    if path == "direct" and CG == 1:
        bm, bn = choice.direct_tile or (_fit(M, 16, 256), _fit(OC, 1, 64))
        return LaunchConfig.of(4, 1, DIRECT=1, BLOCK_M=bm, BLOCK_N=bn)
    if path != "gemm":
        raise ValueError(f"interpreter path must be 'direct' (depthwise only) or 'gemm'; got {path!r} for CG={CG}")
    bm, bn, bk = choice.gemm_tile or (_fit(M, 16, 64), _fit(OCG, 16, 64), 0)
    kt = (bn // OCG if bn > OCG else 1) * CG
    return LaunchConfig.of(4, 1, DIRECT=0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk or _fit(kt, FP8_DOT_MIN_K, 128))
