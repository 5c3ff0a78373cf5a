"""Fused grouped and depthwise 2-D convolution: y = act(conv2d(x, W, groups=G) + b [+ residual]) in one Triton kernel.

Eager torch runs this as cuDNN's grouped conv, then the residual add and the activation, each one more kernel that
writes and reads back the (N, OC, OH, OW) result. Here bias, residual and activation are applied to the fp32
accumulator in registers and y is written once, in its final dtype, as conv.py does for groups=1.

Groups: x (N, C, H, W) and weight (OC, CG, KH, KW) with C = G * CG and OC = G * OCG. Output channel o belongs to
group o // OCG and reads the CG input channels (o // OCG) * CG + [0, CG). Depthwise is CG = 1 (OCG = 1, or a channel
multiplier OCG > 1: output o reads input channel o // OCG).

Two kernels:
- `_conv2d_direct_kernel` (depthwise): a direct convolution. A program computes BLOCK_P output pixels x BLOCK_C
  output channels, looping over the KH x KW taps (and each group's CG channels) with fp32 FMAs: a depthwise 3x3 does
  9 multiply-adds an output, no reduction a tensor core could take. With channels_last x each pixel's channels are
  contiguous, so a tap is one 16-byte-vector load of the tile; with NCHW x the tile is laid out pixels-first (a
  warp's threads along a row of pixels, not across planes). It computes wider groups right too, but 16x slower than
  the GEMM below on ResNeXt's groups of 4 (the tuner never offers it there; tests force it).
- `_conv2d_grouped_kernel` (CG > 1): an implicit GEMM per tile, as conv.py's. A tile holds BLOCK_N output channels
  of whole groups: GPT = BLOCK_N // OCG groups when a group is narrower than the tile (ResNeXt 32x4d: 4 channels
  a group, 4 or 8 groups a 16- or 32-wide tile), else BLOCK_N channels of one group. Per tap, K is the GPT * CG input
  channels of the tile's groups (contiguous in channels_last x), BLOCK_K at a time, and the weight tile is
  block-diagonal: the element for input channel k and output column j is W[o_j, k - CG * group(j)] where k is in
  column j's group, else 0. So 4-channel groups run on the tensor cores at 1/GPT of their rate (GPT times the
  multiply-adds) instead of on the CUDA cores, with vector loads of x; groups of 16, 32 or 64 channels waste nothing.

The layer's shape is compile-time and the batch run-time, as in conv.py: one compiled kernel per layer and config
serves every batch size. Layouts: x in NCHW or channels_last memory (any strides, in fact); y in `memory_format`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .activations import DEFAULT_NEGATIVE_SLOPE, apply_activation, check_activation, round_to_bf16
from .conv import conv_geometry, m_bucket, output_tensor
from .interpreter import InterpreterSwitches
from .launch import grid_launch
from .pdl import gdc_launch_dependents, gdc_wait
from .pool import channels_last as _channels_last
from .runtime import check_device, interpreting
from .tiles import channels_last_alignment, gemm_flags, known_strides, launch_options, residual_like
from .tuning import LaunchConfig, scope_for, tune
from .tuning_background import on_new_picks

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The direct kernel unrolls at most this many (tap, channel) steps (tl.static_range): a whole depthwise 3x3 window,
# or one row of a 5x5 or 7x7 (the rows then loop at run time); past that, run-time loops.
UNROLL = tl.constexpr(16)


@triton.jit
def _pixel_offsets(n, pos, oh, ow, stride_n, stride_h, stride_w, OH: tl.constexpr, OW: tl.constexpr,
                   PLANES: tl.constexpr):  # fmt: skip
    """Offsets of output pixels (image n, row oh, column ow; pos = the flat pixel index) in y or the residual. PLANES:
    y is contiguous NCHW, where a pixel's offset in its plane is pos % (OH * OW), which Triton sees as runs of
    contiguous pixels when the plane is a multiple of the tile (56 x 56 = 49 x 64), so the store goes out in vectors."""
    if PLANES:
        return n * stride_n + pos % (OH * OW)
    else:
        return n * stride_n + oh * stride_h + ow * stride_w


@triton.jit
def _direct_row(acc, x_pix, x_ch, w_o, p_ok, o_ok, h0, w0, kh, stride_xc, stride_xh, stride_xw,
                stride_wc, stride_wh, stride_ww, H: tl.constexpr, W: tl.constexpr, KW: tl.constexpr,
                DH: tl.constexpr, DW: tl.constexpr, CG: tl.constexpr, UNROLLED: tl.constexpr):  # fmt: skip
    """acc plus the products of window row kh: its KW taps times the CG input channels of each output channel's
    group (x at pixel pointers x_pix + channel offsets x_ch, 0 outside the image; W at w_o). UNROLLED: the
    (tap, channel) steps unrolled, else run-time loops (the same body)."""
    ih = h0 + kh * DH
    row_ok = p_ok & (ih >= 0) & (ih < H)
    x_row = x_pix + (kh * DH) * stride_xh + x_ch
    w_row = w_o + kh * stride_wh
    if UNROLLED:
        for kw in tl.static_range(KW):
            iw = w0 + kw * DW
            ok = (row_ok & (iw >= 0) & (iw < W)) & o_ok
            for c in tl.static_range(CG):
                xv = tl.load(x_row + ((kw * DW) * stride_xw + c * stride_xc), mask=ok, other=0.0)
                acc += xv.to(tl.float32) * tl.load(w_row + (kw * stride_ww + c * stride_wc)).to(tl.float32)
    else:
        for kw in range(KW):
            iw = w0 + kw * DW
            ok = (row_ok & (iw >= 0) & (iw < W)) & o_ok
            for c in range(CG):
                xv = tl.load(x_row + ((kw * DW) * stride_xw + c * stride_xc), mask=ok, other=0.0)
                acc += xv.to(tl.float32) * tl.load(w_row + (kw * stride_ww + c * stride_wc)).to(tl.float32)
    return acc


@triton.jit(do_not_specialize=["NB"])
def _conv2d_direct_kernel(
    # pointers (r_ptr: the residual, with y's strides; unused without HAS_RESIDUAL)
    x_ptr, w_ptr, b_ptr, y_ptr, r_ptr,
    # sizes (the batch NB is the only run-time one)
    NB,
    # strides
    stride_xn, stride_xc, stride_xh, stride_xw,
    stride_wo, stride_wc, stride_wh, stride_ww,
    stride_yn, stride_yc, stride_yh, stride_yw,
    # epilogue parameters
    negative_slope,
    # the layer's shape (OC output channels in groups of OCG, each reading CG input channels)
    OC: tl.constexpr, CG: tl.constexpr, OCG: tl.constexpr,
    H: tl.constexpr, W: tl.constexpr, OH: tl.constexpr, OW: tl.constexpr,
    KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
    PH: tl.constexpr, PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
    # meta-parameters
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,  # added before the activation
    ACTIVATION: tl.constexpr,
    ROUND_BF16: tl.constexpr,  # round to bf16 by hand before the store (interpreter workaround)
    PDL: tl.constexpr,  # launched as a programmatic dependent launch (pdl.py)
    PC: tl.constexpr,  # the tile is (BLOCK_P, BLOCK_C), channels fastest (NHWC x); else (BLOCK_C, BLOCK_P)
    Y_PLANES: tl.constexpr,  # y is contiguous NCHW: each (n, o) plane one run of OH * OW elements
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
    # what x's, the weight's and y's pixel strides are multiples of (tiles.channels_last_alignment)
    X_ALIGN: tl.constexpr = 1, W_ALIGN: tl.constexpr = 1, Y_ALIGN: tl.constexpr = 1,
):  # fmt: skip
    stride_xn, stride_xh, stride_xw = known_strides(stride_xn, stride_xh, stride_xw, X_ALIGN)  # conv.py: why
    stride_wo, stride_wh, stride_ww = known_strides(stride_wo, stride_wh, stride_ww, W_ALIGN)
    stride_yn, stride_yh, stride_yw = known_strides(stride_yn, stride_yh, stride_yw, Y_ALIGN)
    if PDL:  # the next layer may start; this one waits for the previous layer (below) before reading x
        gdc_launch_dependents()
    # Channel blocks fastest: neighbouring programs read the same pixels' neighbouring channels (NHWC: the same lines).
    c_blocks = tl.cdiv(OC, BLOCK_C)
    pid_p = tl.program_id(0) // c_blocks
    pid_c = tl.program_id(0) % c_blocks
    pos = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    o = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    # Pixel quantities as (BLOCK_P, 1) and channel ones as (1, BLOCK_C) (PC: channels along a warp, NHWC), or
    # (1, BLOCK_P) and (BLOCK_C, 1) (pixels along a warp: NCHW, where a warp's load then reads along a row of pixels,
    # not 32 planes); every sum of the two is the program's tile.
    if PC:
        pos = pos[:, None]
        o = o[None, :]
    else:
        pos = pos[None, :]
        o = o[:, None]
    n = pos // (OH * OW)
    oh = (pos // OW) % OH
    ow = pos % OW
    p_ok = n < NB  # pos < NB * OH * OW, constant over each image's pixels
    o_ok = o < OC
    o_safe = tl.minimum(o, OC - 1)  # channels past the edge compute on the last one, never stored
    # Each output channel's group's first input channel; depthwise: the output channel itself, unclamped so that NHWC
    # x is read in 16-byte vectors along o.
    x_ch = (o if CG == 1 and OCG == 1 else (o_safe // OCG) * CG) * stride_xc
    w_o = w_ptr + o_safe * stride_wo
    if HAS_BIAS:
        bias = tl.load(b_ptr + o_safe).to(tl.float32)  # a weight: no earlier kernel writes it, so before the wait
    if PDL:
        gdc_wait()
    h0 = oh * SH - PH  # top-left corner of each output pixel's window, in padded coordinates
    w0 = ow * SW - PW
    x_pix = x_ptr + n * stride_xn + h0 * stride_xh + w0 * stride_xw
    acc = tl.zeros((BLOCK_P, BLOCK_C) if PC else (BLOCK_C, BLOCK_P), dtype=tl.float32)
    # Unrolled where the steps are few (constant offsets, the loads in flight at once: the 9 taps of a depthwise 3x3),
    # else one window row at a time: all 49 taps of a 7x7 unrolled, the loads issued ahead spilled 3.5 KB a thread.
    if KH * KW * CG <= UNROLL:
        for kh in tl.static_range(KH):
            acc = _direct_row(acc, x_pix, x_ch, w_o, p_ok, o_ok, h0, w0, kh, stride_xc, stride_xh, stride_xw,
                              stride_wc, stride_wh, stride_ww, H, W, KW, DH, DW, CG, True)  # fmt: skip
    else:
        for kh in range(KH):
            acc = _direct_row(acc, x_pix, x_ch, w_o, p_ok, o_ok, h0, w0, kh, stride_xc, stride_xh, stride_xw,
                              stride_wc, stride_wh, stride_ww, H, W, KW, DH, DW, CG, KW * CG <= UNROLL)  # fmt: skip

    # Epilogue on the fp32 accumulator: bias, residual, activation, one rounding to y's dtype.
    if HAS_BIAS:
        acc += bias
    y_ok = p_ok & o_ok
    if HAS_RESIDUAL:
        r_pix = _pixel_offsets(n, pos, oh, ow, stride_yn, stride_yh, stride_yw, OH, OW, Y_PLANES)
        acc += tl.load(r_ptr + r_pix + o * stride_yc, mask=y_ok, other=0.0).to(tl.float32)
    acc = apply_activation(acc, ACTIVATION, negative_slope)
    if ROUND_BF16:
        acc = round_to_bf16(acc)
    y_pix = _pixel_offsets(n, pos, oh, ow, stride_yn, stride_yh, stride_yw, OH, OW, Y_PLANES)
    tl.store(y_ptr + y_pix + o * stride_yc, acc.to(y_ptr.dtype.element_ty), mask=y_ok)


@triton.jit(do_not_specialize=["NB"])
def _conv2d_grouped_kernel(
    # pointers (r_ptr: the residual, with y's strides; unused without HAS_RESIDUAL)
    x_ptr, w_ptr, b_ptr, y_ptr, r_ptr,
    # sizes (the batch NB is the only run-time one; the GEMM's M = NB * OH * OW)
    NB,
    # strides
    stride_xn, stride_xc, stride_xh, stride_xw,
    stride_wo, stride_wc, stride_wh, stride_ww,
    stride_yn, stride_yc, stride_yh, stride_yw,
    # epilogue parameters
    negative_slope,
    # the layer's shape (G groups of CG input and OCG output channels)
    G: tl.constexpr, CG: tl.constexpr, OCG: tl.constexpr,
    H: tl.constexpr, W: tl.constexpr, OH: tl.constexpr, OW: tl.constexpr,
    KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
    PH: tl.constexpr, PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
    # meta-parameters
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,  # added before the activation
    ACTIVATION: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,  # "ieee" or "tf32"; only fp32 operands care
    UPCAST_DOT: tl.constexpr,  # bf16 operands multiplied as fp32 (interpreter workaround, tiles.gemm_flags)
    ROUND_BF16: tl.constexpr,  # round to bf16 by hand before the store (interpreter workaround)
    PDL: tl.constexpr,  # launched as a programmatic dependent launch (pdl.py)
    CHANNELS_LAST: tl.constexpr,  # x is NHWC: gathered as (BLOCK_M, BLOCK_K), channels contiguous; else transposed
    Y_PLANES: tl.constexpr,  # y is contiguous NCHW: each (n, o) plane one run of OH * OW elements
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    # what x's, the weight's and y's pixel strides are multiples of (tiles.channels_last_alignment)
    X_ALIGN: tl.constexpr = 1, W_ALIGN: tl.constexpr = 1, Y_ALIGN: tl.constexpr = 1,
):  # fmt: skip
    # Said where Triton cannot see it: RegNetY's 104 channels in groups of 8 are 8-element strides, so the tile's
    # channel runs load as 16-byte vectors, not 2-byte ones (conv.py's kernel does the same).
    stride_xn, stride_xh, stride_xw = known_strides(stride_xn, stride_xh, stride_xw, X_ALIGN)
    stride_wo, stride_wh, stride_ww = known_strides(stride_wo, stride_wh, stride_ww, W_ALIGN)
    stride_yn, stride_yh, stride_yw = known_strides(stride_yn, stride_yh, stride_yw, Y_ALIGN)
    # A tile's columns: GPT whole groups when a group is narrower than the tile, else BLOCK_N channels of one group
    # (SUBS such tiles a group). KT: the input channels of the tile's groups, the K of one tap.
    GPT: tl.constexpr = BLOCK_N // OCG if OCG < BLOCK_N else 1
    SUBS: tl.constexpr = 1 if OCG < BLOCK_N else (OCG + BLOCK_N - 1) // BLOCK_N
    KT: tl.constexpr = GPT * CG
    C: tl.constexpr = G * CG
    OC: tl.constexpr = G * OCG
    if PDL:
        gdc_launch_dependents()
    # Column tiles fastest: with NHWC x the tiles of one row block read the same pixels' neighbouring channels.
    n_tiles = ((G + GPT - 1) // GPT) * SUBS
    pid_m = tl.program_id(0) // n_tiles
    pid_n = tl.program_id(0) % n_tiles
    g0 = (pid_n // SUBS) * GPT  # the tile's first group
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rel = (pid_n % SUBS) * BLOCK_N + tl.arange(0, BLOCK_N)  # output channel within the tile's first group's start
    o = g0 * OCG + rel
    col_ok = (rel < GPT * OCG) & (o < OC)
    o_safe = tl.minimum(o, OC - 1)  # columns past the edge compute on the last channel, never stored
    n = rows // (OH * OW)
    out_h = (rows // OW) % OH
    out_w = rows % OW
    m_ok = n < NB  # rows < M, constant over each image's OH * OW rows (vector stores)
    offs_k = tl.arange(0, BLOCK_K)
    if HAS_BIAS:
        bias = tl.load(b_ptr + o_safe).to(tl.float32)  # a weight: before the PDL wait
    if PDL:
        gdc_wait()
    h0 = out_h * SH - PH
    w0 = out_w * SW - PW
    # Pointer tiles built once; each step adds one scalar offset (conv.py: recomputed per step they spilled).
    x_corner = x_ptr + n * stride_xn + h0 * stride_xh + w0 * stride_xw + (g0 * CG) * stride_xc
    if CHANNELS_LAST:
        a_tile = x_corner[:, None] + (offs_k * stride_xc)[None, :]
    else:  # (BLOCK_K, BLOCK_M): a warp's threads along pixels, 1-2 cache lines a load instead of 32 planes
        a_tile = x_corner[None, :] + (offs_k * stride_xc)[:, None]
    # Column j's weights start at input channel CG * (its group - g0) of the tap's K: W[o, k - CG * group(j)].
    col_group = rel // OCG  # 0 .. GPT - 1 where col_ok
    b_tile = (w_ptr + o_safe * stride_wo - (col_group * CG) * stride_wc)[None, :] + (offs_k * stride_wc)[:, None]
    k_limit = tl.minimum(KT, C - g0 * CG)  # the last tile's groups may run past G
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # One flat loop over (tap, channel block) steps, so that Triton's software pipeline sees one loop.
    k_steps: tl.constexpr = (KT + BLOCK_K - 1) // BLOCK_K
    for step in range(KH * KW * k_steps):
        tap = step // k_steps
        k0 = (step % k_steps) * BLOCK_K
        kh = tap // KW
        kw = tap % KW
        ih = h0 + kh * DH
        iw = w0 + kw * DW
        row_ok = m_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        k_ok = offs_k < k_limit - k0  # `arange < scalar`: constant over runs, so loads stay vectorised
        x_step = k0 * stride_xc + (kh * DH) * stride_xh + (kw * DW) * stride_xw
        if CHANNELS_LAST:
            a = tl.load(a_tile + x_step, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        else:
            a = tl.trans(tl.load(a_tile + x_step, mask=k_ok[:, None] & row_ok[None, :], other=0.0))
        if GPT == 1:
            b_ok = (offs_k < CG - k0)[:, None]
        else:  # block-diagonal: input channel k of the tile's K meets only the columns of its own group
            b_ok = (((k0 + offs_k) // CG)[:, None] == col_group[None, :]) & k_ok[:, None]
        b = tl.load(b_tile + (k0 * stride_wc + kh * stride_wh + kw * stride_ww), mask=b_ok, other=0.0)
        if UPCAST_DOT:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)

    # Epilogue on the fp32 accumulator: bias, residual, activation, one rounding to y's dtype.
    if HAS_BIAS:
        acc += bias[None, :]
    y_ok = m_ok[:, None] & col_ok[None, :]
    if HAS_RESIDUAL:
        r_pix = _pixel_offsets(n, rows, out_h, out_w, stride_yn, stride_yh, stride_yw, OH, OW, Y_PLANES)
        acc += tl.load(r_ptr + r_pix[:, None] + (o * stride_yc)[None, :], mask=y_ok, other=0.0).to(tl.float32)
    acc = apply_activation(acc, ACTIVATION, negative_slope)
    if ROUND_BF16:
        acc = round_to_bf16(acc)
    y_pix = _pixel_offsets(n, rows, out_h, out_w, stride_yn, stride_yh, stride_yw, OH, OW, Y_PLANES)
    tl.store(y_ptr + y_pix[:, None] + (o * stride_yc)[None, :], acc.to(y_ptr.dtype.element_ty), mask=y_ok)


# ---- the launcher ----


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str, groups) -> None:
    check_activation(activation)
    if x.dim() != 4:
        raise ValueError(f"x must be 4-D (N, C, H, W); got shape {tuple(x.shape)}")
    if weight.dim() != 4:
        raise ValueError(f"weight must be 4-D (OC, C / groups, KH, KW); got shape {tuple(weight.shape)}")
    if min(weight.shape) < 1:
        raise ValueError(f"weight must have every dimension >= 1; got shape {tuple(weight.shape)}")
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups must be an int >= 1; got {groups!r}")
    C, OC = x.shape[1], weight.shape[0]
    if C % groups or OC % groups:
        raise ValueError(f"groups={groups} must divide x's C={C} and weight's OC={OC}")
    if weight.shape[1] != C // groups:
        raise ValueError(
            f"weight (OC, C / groups, KH, KW) has {weight.shape[1]} input channels a group; x's C={C} in "
            f"{groups} groups needs {C // groups}"
        )
    for t, name in ((x, "x"), (weight, "weight")):
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; fused_conv2d_grouped supports float32, float16, bfloat16")
        if t.numel() >= 2**31:
            raise ValueError(f"{name} has {t.numel()} elements; the kernels index with int32 (< 2**31)")
        check_device(t, name)
    if weight.dtype != x.dtype:
        raise TypeError(f"x has dtype {x.dtype} but weight has {weight.dtype}; cast them to one dtype")
    if weight.device != x.device:
        raise ValueError(f"x is on {x.device} but weight is on {weight.device}")
    if bias is not None:
        if tuple(bias.shape) != (OC,):
            raise ValueError(f"bias must have shape ({OC},) to match weight; got {tuple(bias.shape)}")
        if bias.dtype != weight.dtype or bias.device != x.device:
            raise TypeError(f"bias has dtype {bias.dtype} on {bias.device}; want {weight.dtype} on {x.device}")


def default_path(CG: int) -> str:
    """The kernel a layer runs where nothing is timed (the interpreter; the tuner's first candidate): "direct" for
    depthwise (one input channel a group: nothing to reduce but the taps), "gemm" for wider groups."""
    return "direct" if CG == 1 else "gemm"


_configs: dict[tuple, LaunchConfig] = {}  # per (layer signature, M bucket): the tuned config
on_new_picks(_configs.clear)  # a pick timed in the background replaces an untimed one: ask tune() again


def fused_conv2d_grouped(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    *,
    stride=(1, 1),
    padding=(0, 0),
    dilation=(1, 1),
    groups: int,
    negative_slope: float = DEFAULT_NEGATIVE_SLOPE,
    residual: torch.Tensor | None = None,
    memory_format: torch.memory_format | None = None,
    out: torch.Tensor | None = None,
    allow_tf32: bool | None = None,
) -> torch.Tensor:
    """act(conv2d(x, weight, bias, groups=groups) [+ residual]); x (N, C, H, W) in NCHW or channels_last memory,
    weight (OC, C / groups, KH, KW); returns (N, OC, OH, OW) in x's dtype. Accumulates in fp32. Depthwise (C / groups
    == 1, OC a multiple of C) runs the direct kernel, wider groups the grouped implicit GEMM.

    stride, padding, dilation: ints or pairs, as torch takes them (padding as numbers: 'same' is (K - 1) // 2 for an
    odd window at stride 1).

    memory_format: of the returned tensor (when `out` is None), torch.contiguous_format or torch.channels_last; None:
    torch's rule, channels_last when x or the weight is. The fused executor hands convs channels_last x and asks for
    channels_last y: the layout where a pixel's channels are contiguous.

    residual: None, or a tensor of the output's shape and dtype, added before the activation and read once in the
    epilogue (tiles.residual_like: one in another layout than the output's is copied into it first).

    out: None, or the (N, OC, OH, OW) tensor to write (any layout). allow_tf32: for float32 in the GEMM kernel,
    multiply in TF32 or full fp32; None follows `torch.backends.cudnn.allow_tf32`, as cuDNN's conv would. The direct
    kernel always multiplies in fp32.
    """
    _check(x, weight, bias, activation, groups)
    dtype = x.dtype
    s, p, d, OH, OW = conv_geometry(x, weight, stride, padding, dilation)
    N, C, H, W = x.shape
    OC, CG, KH, KW = weight.shape
    G, OCG = groups, OC // groups
    channels_last = _channels_last(x)
    fmt = torch.channels_last if channels_last or _channels_last(weight) else torch.contiguous_format
    out = output_tensor(out, (N, OC, OH, OW), dtype, x.device, memory_format or fmt)
    has_residual = residual is not None
    if has_residual:
        residual = residual_like(residual, out)  # in out's strides, so that the kernels read it at y's offsets
    M = N * OH * OW
    if M == 0:
        return out
    if allow_tf32 is None:
        allow_tf32 = torch.backends.cudnn.allow_tf32
    fixed = gemm_flags(bias is not None, activation, dtype, allow_tf32, x.device)
    y_planes = out.stride()[1:] == (OH * OW, OW, 1)
    geometry = dict(H=H, W=W, OH=OH, OW=OW, KH=KH, KW=KW, SH=s[0], SW=s[1], PH=p[0], PW=p[1], DH=d[0], DW=d[1])
    args = (x, weight, bias if bias is not None else weight, out, residual if has_residual else out, N,
            *x.stride(), *weight.stride(), *out.stride(), float(negative_slope))  # fmt: skip
    align = dict(X_ALIGN=channels_last_alignment(x), W_ALIGN=channels_last_alignment(weight),
                 Y_ALIGN=channels_last_alignment(out))  # fmt: skip

    def run(config: LaunchConfig):
        meta = config.meta()
        if meta.pop("DIRECT"):
            grid = triton.cdiv(M, meta["BLOCK_P"]) * triton.cdiv(OC, meta["BLOCK_C"])
            epilogue = {k: fixed[k] for k in ("HAS_BIAS", "ACTIVATION", "ROUND_BF16", "PDL")}
            return grid_launch(_conv2d_direct_kernel, (grid,))(
                *args, OC=OC, CG=CG, OCG=OCG, **geometry, HAS_RESIDUAL=has_residual, **epilogue,
                PC=meta.pop("PC"), Y_PLANES=y_planes, **meta, **align, **launch_options(fixed),
            )  # fmt: skip
        bn = meta["BLOCK_N"]
        n_tiles = triton.cdiv(G, bn // OCG) if bn > OCG else G * triton.cdiv(OCG, bn)
        grid = triton.cdiv(M, meta["BLOCK_M"]) * n_tiles
        return grid_launch(_conv2d_grouped_kernel, (grid,))(
            *args, G=G, CG=CG, OCG=OCG, **geometry, HAS_RESIDUAL=has_residual, **fixed,
            CHANNELS_LAST=channels_last, Y_PLANES=y_planes, **meta, **align, **launch_options(fixed),
        )  # fmt: skip

    if interpreting():
        run(_interpreter_config(M, OC, CG, OCG, channels_last))
        return out
    bucket = m_bucket(M)
    signature = (tuple(weight.shape), weight.stride(), x.shape[1:], x.stride()[1:], dtype, G, s, p, d, activation,
                 bias is not None, fixed["INPUT_PRECISION"], channels_last, y_planes, bucket, has_residual)  # fmt: skip
    config = _configs.get(signature)
    if config is None:
        key = (
            f"OC{OC}|C{C}|G{G}|H{H}|W{W}|k{KH}x{KW}|s{s}|p{p}|d{d}|{dtype}|{activation}|bias={bias is not None}"
            f"|{fixed['INPUT_PRECISION']}|{'nhwc' if channels_last else 'nchw'}|y={'nchw' if y_planes else 'nhwc'}"
            f"|m{bucket}"
        )
        if has_residual:  # one more read in the epilogue: timed apart
            key += "|residual"
        scope = scope_for("conv2d_grouped", _conv2d_direct_kernel, _conv2d_grouped_kernel)
        fma = dtype == torch.float32 and fixed["INPUT_PRECISION"] == "ieee"
        config = tune(scope, key, cuda_configs(bucket, OC, CG, OCG, channels_last, fma), run)
        _configs[signature] = config
    run(config)
    return out


# ---- candidate configs (the tuner times them on CUDA) ----


def _fit(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(n)))


def direct_configs(bucket: int, OC: int, channels_last: bool) -> list[LaunchConfig]:
    """The direct kernel's candidates: 1-4K outputs a program (8-32 fp32 accumulators a thread), 4 or 8 warps. NHWC:
    channels along the warp, 16-64 of them (32-128 bytes of fp16 a pixel); NCHW: pixels along it, and 8-16 channels
    (planes) a program."""
    widths = sorted({_fit(OC, 16, w) for w in (16, 32, 64)}) if channels_last else sorted({_fit(OC, 1, 8), 16})
    # NCHW tiles of 2-4K outputs on 4 warps spilled 248 bytes a thread (3x3, fp16, sm_90): 8 warps there
    sizes = ((1024, 4), (2048, 4), (4096, 4), (4096, 8)) if channels_last else ((1024, 4), (2048, 8), (4096, 8))
    out = []
    for elems, warps in sizes:
        for bc in widths:
            bp = max(16, min(_fit(bucket, 16, 1024), elems // bc))
            config = LaunchConfig.of(warps, 1, DIRECT=1, PC=int(channels_last), BLOCK_P=bp, BLOCK_C=bc)
            if config not in out:
                out.append(config)
    return out


def gemm_configs(bucket: int, CG: int, OCG: int, fma: bool = False) -> list[LaunchConfig]:
    """The grouped implicit GEMM's candidates. BLOCK_N: the group's width (16 at least, tl.dot's least); groups
    narrower than 16 also get 32-wide tiles (twice the groups a tile: twice the block-diagonal waste, half the
    programs, each with twice the K a step). BLOCK_K: the tile's K per tap, at most 64 (32 on the CUDA cores, `fma`)."""
    out = []
    widths = {_fit(OCG, 16, 128), _fit(OCG, 16, 64)} | ({32} if OCG < 16 else set())
    for bn in sorted(widths):
        kt = (bn // OCG if bn > OCG else 1) * CG
        for bk in sorted({_fit(kt, 16, 32 if fma else 64), _fit(kt, 16, 16 if fma else 32)}):
            for bm, warps, stages in ((64, 4, 3), (128, 4, 3), (128, 8, 3), (64, 4, 4)):
                if bm > 64 and bucket <= 64:
                    continue
                config = LaunchConfig.of(warps, stages, DIRECT=0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
                if config not in out:
                    out.append(config)
    return out


def cuda_configs(bucket: int, OC: int, CG: int, OCG: int, channels_last: bool, fma: bool = False) -> list[LaunchConfig]:
    """Candidates the tuner times for one layer and M bucket, the untimed pick first: depthwise (CG 1) the direct
    kernel (a GEMM tile would be 1/16 useful at best), wider groups the GEMM. (The direct kernel computes groups of 4
    right, but 16x slower than the GEMM: ResNeXt's 128-channel 3x3 in groups of 32 at 56x56, fp16.)"""
    if CG == 1:
        return direct_configs(bucket, OC, channels_last)
    return gemm_configs(bucket, CG, OCG, fma)


# ---- under the interpreter: one config, from choices that tests change (interpreter.py) ----


SMALL_DIRECT_TILE = (32, 8)  # tests' tiles: awkward shapes cross every block edge
SMALL_GEMM_TILE = (16, 16, 16)


@dataclass(frozen=True)
class InterpreterChoice:
    """What fused_conv2d_grouped runs under the interpreter. Its cost is per program and per step, so by default the
    largest tile the problem fills."""

    path: str | None = None  # "direct" or "gemm"; None: default_path (direct for depthwise, else the GEMM)
    direct_tile: tuple[int, int] | None = None  # (BLOCK_P, BLOCK_C)
    gemm_tile: tuple[int, int, int] | None = None  # (BLOCK_M, BLOCK_N, BLOCK_K)


INTERPRETER = InterpreterSwitches(InterpreterChoice())


def _interpreter_config(M: int, OC: int, CG: int, OCG: int, channels_last: bool) -> LaunchConfig:
    choice = INTERPRETER.choice
    path = choice.path or default_path(CG)
    if path == "direct":
        bp, bc = choice.direct_tile or (_fit(M, 16, 256), _fit(OC, 1, 64))
        return LaunchConfig.of(4, 1, DIRECT=1, PC=int(channels_last), BLOCK_P=bp, BLOCK_C=bc)
    if path != "gemm":
        raise ValueError(f"interpreter path must be 'direct' or 'gemm'; got {path!r}")
    bm, bn, bk = choice.gemm_tile or (_fit(M, 16, 64), _fit(OCG, 16, 64), 0)
    if not bk:
        bk = _fit((bn // OCG if bn > OCG else 1) * CG, 16, 64)
    return LaunchConfig.of(4, 1, DIRECT=0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
