"""Fused 2-D convolution: y = act(conv2d(x, W) + b [+ residual]) in one Triton kernel, as an implicit GEMM.

Eager torch runs this as cuDNN's conv (bias added inside, or as one more kernel) then the activation: the
(N, OC, OH, OW) result is written, read back and written again. Here bias and activation are applied to the
fp32 accumulator tile in registers, and y is written once, in its final dtype. A ResNet block's skip connection,
relu(bn(conv(x)) + identity) with the BatchNorm folded into W and b, adds one read of the residual in the same
epilogue, where eager torch runs one more add kernel (a write and two reads of y's size).

Implicit GEMM: the convolution is the matrix product Y[m, o] = sum_k A[m, k] * W[o, k] with
    m = (n, oh, ow)        M = N * OH * OW   (one row per output pixel)
    o                      OC output channels (GEMM N)
    k = (c, kh, kw)        K = C * KH * KW   (one column per weight element)
    A[m, k] = x[n, c, oh * SH - PH + kh * DH, ow * SW - PW + kw * DW], 0 where that falls in the padding.
A is never materialised (im2col would write and read K/C times x): each (BLOCK_M, BLOCK_K) tile of it is
gathered from x straight into the tl.dot operand.

Two ways through K (a meta-parameter the tuner picks between):
- FLAT_K: k runs over all C * KH * KW in BLOCK_K steps, each element decomposed into (c, kh, kw). For few
  channels (the digits CNN's first layer: K = 1 * 3 * 3 = 9, one 16-wide step instead of 9).
- taps: one (kh, kw) tap at a time, BLOCK_K channels per step, so the row addresses and their padding masks
  are computed once per step, and with channels_last x the BLOCK_K channels are contiguous (16-byte loads).

Input normalization (a model's first conv, whose input is the image as the client sent it): with
`input_norm=(scale, shift)` each gathered element of A is x * scale[c] + shift[c] in fp32 where it lies inside the
image and exactly 0 in the padding (torch's conv2d((x - mean) / std, padding=p): the padding comes after the
normalization), then rounded to the weights' dtype for tl.dot. x may then be uint8 (a pixel as sent: a quarter of
fp32's bytes from the client to the GPU) or any float dtype; y takes the weights' dtype.

A per-image per-channel gate of x (a squeeze-and-excitation block's x * s, s of shape (N, C), read by its 1x1
projection conv): with `x_scale=s` each gathered element of A is x[n, c, ...] * s[n, c] in fp32, rounded once to x's
dtype, 0 in the padding. Eager torch writes x * s as its own tensor and the conv reads it back: here x is read once
and the product never goes to memory (2 * N * C * H * W elements fewer moved per SE block).

Layouts: x in torch's contiguous NCHW or channels_last (NHWC) memory format, any strides in fact; y comes
back in x's memory format. With channels_last both the gathers (along C) and the store (along OC) are
contiguous: a model should convert its input to channels_last once and stay there (the weights may stay
NCHW; they are small and sit in L2).

The layer's shape (C, H, W, OH, OW, window, stride, padding, dilation) is compile-time: a model fixes it per
layer, and constant divisors make the (n, oh, ow) decomposition a multiply and shift. Only the batch is a
run-time size, not specialised, so every batch size shares one compiled kernel per tuned config.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import conv_tma
from .activations import DEFAULT_NEGATIVE_SLOPE, apply_activation, check_activation, round_to_bf16
from .fp8 import E4M3, inverse, quantize_e4m3
from .interpreter import InterpreterSwitches
from .launch import grid_launch
from .pdl import gdc_launch_dependents, gdc_wait
from .pool import _max_propagating_nan, _pool_channels_kernel, _pool_rows_kernel, fused_pool2d, pair
from .pool import channels_last as _channels_last
from .runtime import check_device, interpreting
from .tiles import (
    SplitKWorkspace,
    channels_last_alignment,
    device_limits,
    gemm_flags,
    grouped_tile,
    known_multiple,
    known_strides,
    launch_options,
    pow2_alignment,
    residual_like,
    split_k_sum,
)
from .tuning import LaunchConfig, scope_for, tune
from .tuning_background import on_new_picks

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
NORM_X_DTYPES = (torch.uint8, *SUPPORTED_DTYPES)  # x's dtypes with input_norm (pixels as sent)
X_SCALE_DTYPES = (*SUPPORTED_DTYPES, torch.float64)  # x_scale's dtypes (read in fp32)
POOL_KERNELS = (_pool_rows_kernel, _pool_channels_kernel)  # in the tuning scope: APART candidates run them
# The most pool window elements the conv kernel folds itself: it unrolls its whole K loop once per window element
# (tl.static_range), so a 3x3 window compiles 9 loops, while a global pool of 13x13 (SqueezeNet's classifier conv)
# compiled 169 and never finished. Larger windows run the conv, then fused_pool2d (one more kernel).
MAX_POOL_WINDOW = 9


@triton.jit
def _split_range(steps: tl.constexpr, pid_k, SPLIT_K: tl.constexpr):
    """[first, end) of the K steps program pid_k of SPLIT_K sums: all of them, as constants, when K is not split."""
    if SPLIT_K == 1:
        return 0, steps
    per_split: tl.constexpr = (steps + SPLIT_K - 1) // SPLIT_K
    return pid_k * per_split, tl.minimum(pid_k * per_split + per_split, steps)


@triton.jit
def _y_tile(base, n, rows, out_h, out_w, cols, stride_yn, stride_yc, stride_yh, stride_yw, OH: tl.constexpr,
            OW: tl.constexpr, Y_PLANES: tl.constexpr):  # fmt: skip
    """Pointers from `base` to the (BLOCK_M, BLOCK_N) tile of y at output pixels `rows` (image n, row out_h, column
    out_w) and channels `cols`: into y, or into the residual, which has y's strides."""
    if Y_PLANES:
        # Contiguous NCHW y: a pixel's offset in its plane is rows % (OH * OW), which Triton sees as runs of
        # contiguous rows (OH * OW a constexpr), so the store goes out in vectors along M.
        y_rows = base + n * stride_yn + rows % (OH * OW)
    else:
        y_rows = base + n * stride_yn + out_h * stride_yh + out_w * stride_yw
    return y_rows[:, None] + (cols * stride_yc)[None, :]  # unclamped cols: contiguous along O for NHWC y


@triton.jit
def _normalized(a, a_ok, scale_ptr, shift_ptr, c, c_ok, DTYPE: tl.constexpr, ROUND_BF16: tl.constexpr,
                K_AXIS: tl.constexpr = 1, ACTIVATION: tl.constexpr = "none", SLOPE: tl.constexpr = 0.01):  # fmt: skip
    """A gathered (BLOCK_M, BLOCK_K) tile of x at channels `c` (valid where `c_ok`) as the conv's operand (K_AXIS 0:
    the (BLOCK_K, BLOCK_M) tile): ACTIVATION(x * scale[c] + shift[c]) in fp32 where `a_ok` (inside the image), 0 in
    the padding (torch pads the activated tensor: relu(bn(x)) then conv2d(padding=p)), rounded once to DTYPE.
    ROUND_BF16: to nearest by hand (the interpreter's cast truncates, and 147 truncations of the stem's K, all toward
    zero, moved outputs by 2e-2)."""
    scale = tl.load(scale_ptr + c, mask=c_ok, other=0.0)
    shift = tl.load(shift_ptr + c, mask=c_ok, other=0.0)
    if K_AXIS == 1:
        value = a.to(tl.float32) * scale[None, :] + shift[None, :]
    else:
        value = a.to(tl.float32) * scale[:, None] + shift[:, None]
    value = tl.where(a_ok, apply_activation(value, ACTIVATION, SLOPE), 0.0)
    if ROUND_BF16:
        value = round_to_bf16(value)
    return value.to(DTYPE)


@triton.jit
def _gated_two_images(a, gate_first, gate_second, second, c, c_ok, DTYPE: tl.constexpr, ROUND_BF16: tl.constexpr):
    """_gated for a (BLOCK_M, BLOCK_K) tile whose rows belong to at most two images (BLOCK_M <= OH * OW): two
    (BLOCK_K,) loads of the gate, `gate_first` and `gate_second` pointing at the two images' rows and `second`
    (BLOCK_M,) marking the rows of the second, instead of a gather per element. RegNetY-400MF's SE-gated 1x1 convs at
    28x28 ran 149-170 us at 256 images with the gather (H200), as slow as torch's three kernels; a 1x1 conv of that
    size moves 126 MB (30 us at the copy rate). x is 0 where not a_ok (the load's `other`): so is the product."""
    g1 = tl.load(gate_first + c, mask=c_ok, other=0.0).to(tl.float32)
    g2 = tl.load(gate_second + c, mask=c_ok, other=0.0).to(tl.float32)
    value = a.to(tl.float32) * tl.where(second[:, None], g2[None, :], g1[None, :])
    if ROUND_BF16:
        value = round_to_bf16(value)
    return value.to(DTYPE)


@triton.jit
def _gated(a, a_ok, gate_rows, c, DTYPE: tl.constexpr, ROUND_BF16: tl.constexpr, K_AXIS: tl.constexpr = 1):
    """A gathered (BLOCK_M, BLOCK_K) tile of x at channels `c` (K_AXIS 0: the (BLOCK_K, BLOCK_M) tile) times its
    gate: x * gate[n, c] in fp32, `gate_rows` (BLOCK_M,) pointing at the gate's row of each tile row's image n, 0
    where not `a_ok` (the padding: the gate scales real pixels only), rounded once to DTYPE (ROUND_BF16: _normalized).
    The gate is (N, C), 1.2 MB at most in fp32 for 256 images of 1152 channels: these gathers hit L1/L2."""
    if K_AXIS == 1:
        gate = tl.load(gate_rows[:, None] + c[None, :], mask=a_ok, other=0.0)
    else:
        gate = tl.load(gate_rows[None, :] + c[:, None], mask=a_ok, other=0.0)
    value = a.to(tl.float32) * gate.to(tl.float32)  # a is 0 where not a_ok, and so is the gate: exactly 0 there
    if ROUND_BF16:
        value = round_to_bf16(value)
    return value.to(DTYPE)


@triton.jit(do_not_specialize=["NB"])
def _conv2d_kernel(
    # pointers (r_ptr: the residual, with y's strides; unused without HAS_RESIDUAL)
    x_ptr, w_ptr, b_ptr, y_ptr, r_ptr,
    ws_ptr, cnt_ptr,  # split-K partial tiles and per-tile arrival counters (tiles.split_k_sum); unused at SPLIT_K 1
    # fp32 per-channel scale and shift of x (HAS_INPUT_NORM); or x's (NB, C) contiguous gate, any float dtype, and
    # None (HAS_X_SCALE, below); else any two pointers, never read
    xs_ptr, xb_ptr,
    # sizes (the batch NB is the only run-time one; the GEMM's M = NB * OH * OW)
    NB, OC,
    # strides
    stride_xn, stride_xc, stride_xh, stride_xw,
    stride_wo, stride_wc, stride_wh, stride_ww,
    stride_yn, stride_yc, stride_yh, stride_yw,
    # epilogue parameters
    negative_slope,
    # the layer's shape
    C: tl.constexpr, H: tl.constexpr, W: tl.constexpr, OH: tl.constexpr, OW: tl.constexpr,
    KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
    PH: tl.constexpr, PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
    # pooling of the activated conv output: POOL "none" | "max" | "avg" over PKH x PKW windows at stride
    # (PSH, PSW), floor mode, no padding; OH, OW are then the pooled output's size
    POOL: tl.constexpr, PKH: tl.constexpr, PKW: tl.constexpr, PSH: tl.constexpr, PSW: tl.constexpr,
    # meta-parameters
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,  # added before the activation; only with POOL "none"
    ACTIVATION: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,  # "ieee" or "tf32"; only fp32 operands care
    UPCAST_DOT: tl.constexpr,  # bf16 operands multiplied as fp32 (interpreter workaround, tiles.gemm_flags)
    ROUND_BF16: tl.constexpr,  # round to bf16 by hand before the store (interpreter workaround)
    PDL: tl.constexpr,  # launched as a programmatic dependent launch (pdl.py)
    CHANNELS_LAST: tl.constexpr,  # FLAT_K order: (kh, kw, c) for NHWC x (c contiguous), else (c, kh, kw)
    Y_PLANES: tl.constexpr,  # y is contiguous NCHW: each (n, o) plane one run of OH * OW elements
    FLAT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,  # programs per output tile, each over 1/SPLIT_K of the K steps; only with POOL "none"
    HAS_INPUT_NORM: tl.constexpr = False,  # A = x * scale[c] + shift[c] inside the image, 0 in the padding
    # what x's, the weight's and y's (and the residual's) pixel strides are multiples of (tiles.channels_last_alignment)
    X_ALIGN: tl.constexpr = 1, W_ALIGN: tl.constexpr = 1, Y_ALIGN: tl.constexpr = 1,
    # HAS_INPUT_NORM's activation of x * scale[c] + shift[c] (a pre-activation BatchNorm + ReLU), before the padding's 0
    INPUT_ACTIVATION: tl.constexpr = "none", INPUT_SLOPE: tl.constexpr = 0.01,
    # 1 or 2: y is a buffer of 2 * OC channels whose channels 2o + (INTERLEAVE - 1) are this conv's output channel o
    # and the others (2o + 2 - INTERLEAVE) r_ptr's channel o (a tensor of OC channels at y's pixel strides, channel
    # stride 1), stored together: a ShuffleNet unit's channel shuffle of concat(x1, branch) in whole rows
    INTERLEAVE: tl.constexpr = 0,
    # the partner's pixel stride where it is a tensor of its own (dense channels_last: OC); 0: y's pixel strides
    P_PIXEL: tl.constexpr = 0,
    # y is e4m3 for float8 readers (fused_conv2d's out_scale), quantized with Y_INV_SCALE, 1 / its scale. A constant,
    # not a parameter: one conv of a model takes it (the float16 stem before float8 layers), so it costs one compile
    # and every other launch keeps its signature. ROUND_FP8: the interpreter's e4m3 rounding by hand (fp8.py).
    Y_FP8: tl.constexpr = False, Y_INV_SCALE: tl.constexpr = 1.0, ROUND_FP8: tl.constexpr = False,
    OC_ALIGN: tl.constexpr = 1,  # what OC is a multiple of (tiles.pow2_alignment)
):  # fmt: skip
    tl.static_assert(POOL == "none" or not HAS_RESIDUAL, "a residual is added to the conv's output, never pooled")
    # Said where Triton cannot see it (it specializes multiples of 16 only): 104 channels (RegNetY) in channels_last
    # are 8-element strides, so a channel run's loads and stores are 16-byte vectors, not 2-byte ones.
    stride_xn, stride_xh, stride_xw = known_strides(stride_xn, stride_xh, stride_xw, X_ALIGN)
    stride_wo, stride_wh, stride_ww = known_strides(stride_wo, stride_wh, stride_ww, W_ALIGN)
    stride_yn, stride_yh, stride_yw = known_strides(stride_yn, stride_yh, stride_yw, Y_ALIGN)
    # and of OC, whose mask then holds over runs of OC_ALIGN channels: 24 output channels (MobileNetV2's 144 -> 24,
    # EfficientNet's) are stored and their residual read in 16-byte vectors, not 2 bytes at a time (sm_90 PTX)
    OC = known_multiple(OC, OC_ALIGN)
    # A = x * gate[n, c] (fused_conv2d's x_scale): flagged by a None shift pointer, which Triton makes a compile-time
    # constant, rather than a parameter of its own, so the kernel's signature (and every other launch's code) is as
    # before this flag.
    HAS_X_SCALE: tl.constexpr = xb_ptr is None
    tl.static_assert(not (HAS_X_SCALE and HAS_INPUT_NORM), "x is normalized or gated, never both")
    if PDL:  # the next layer may start; this one waits for the previous layer (below) before reading x
        gdc_launch_dependents()
    M = NB * (OH * OW)
    tile = tl.program_id(0) // SPLIT_K
    pid_k = tl.program_id(0) % SPLIT_K
    pid_m, pid_n = grouped_tile(tile, tl.cdiv(M, BLOCK_M), tl.cdiv(OC, BLOCK_N), GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Output pixel of each row. From the unclamped rows (masked below where >= M): with OW a constexpr power of
    # two, Triton then sees runs of OW contiguous pixels, so NCHW gathers and stores go along M, coalesced.
    n = rows // (OH * OW)
    out_h = (rows // OW) % OH
    out_w = rows % OW
    m_ok = n < NB  # rows < M, written so that it is constant over each image's OH * OW rows (vector stores)
    offs_n = tl.minimum(cols, OC - 1)  # columns past the edge compute on the last one, never stored
    w_cols = w_ptr + offs_n * stride_wo
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n)  # a weight: no earlier kernel writes it, so before the PDL wait
    if PDL:
        gdc_wait()
    offs_k = tl.arange(0, BLOCK_K)
    if HAS_X_SCALE:
        gate_rows = xs_ptr + n * C  # (BLOCK_M,) each row's image's gates; rows past M are masked at every load
        # A tile no taller than an image spans at most two: the channels-contiguous K loop loads their two gate rows
        # (_gated_two_images); the other loops, and taller tiles (7x7 maps at 64+ rows), gather per element.
        n_first = (pid_m * BLOCK_M) // (OH * OW)
        gate_first = xs_ptr + n_first * C
        gate_second = xs_ptr + tl.minimum(n_first + 1, NB - 1) * C  # past the batch: its rows are masked (x is 0)
        second = n != n_first
    if POOL == "max":
        result = tl.full((BLOCK_M, BLOCK_N), float("-inf"), dtype=tl.float32)
    else:
        result = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Without pooling one pass. With it, one pass per window element: each conv output in the tile's pooling
    # windows is computed (once, for non-overlapping windows), activated and folded into the pooled result in
    # registers, so the conv output never goes to memory (conv + act + pool: 3 kernels -> 1).
    for win in tl.static_range(PKH * PKW):
        oh = out_h * PSH + win // PKW  # (BLOCK_M,) the conv output pixel
        ow = out_w * PSW + win % PKW
        h0 = oh * SH - PH  # top-left corner of each output pixel's window, in padded coordinates
        w0 = ow * SW - PW
        # Where each window's corner would be (it may lie in the padding: every load below is masked there). The
        # (BLOCK_M, BLOCK_K) pointer tiles are built once, and each K step adds one scalar (linear.py): recomputed
        # per step, their 64-bit adds, kept alive for the pipeline's stages, spilled registers (sm_90, 128x128).
        x_corner = x_ptr + n * stride_xn + h0 * stride_xh + w0 * stride_xw
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if FLAT_K:
            K = C * KH * KW  # constexpr: the product of constexprs
            k_steps = (K + BLOCK_K - 1) // BLOCK_K
            first, end = _split_range(k_steps, pid_k, SPLIT_K)
            # k0 steps by BLOCK_K, as unsplit it always did: a loop over step numbers (k0 = step * BLOCK_K) spilled
            # 16 bytes (fp32 on the CUDA cores, 16 -> 32 channels, 64x32x16)
            for k0 in range(first * BLOCK_K, end * BLOCK_K, BLOCK_K):
                k = k0 + offs_k
                k_ok = offs_k < K - k0
                if CHANNELS_LAST:
                    c = k % C
                    kh = k // (KW * C)
                    kw = (k // C) % KW
                    ih = h0[:, None] + (kh * DH)[None, :]
                    iw = w0[:, None] + (kw * DW)[None, :]
                    a_ok = (m_ok[:, None] & k_ok[None, :]) & ((ih >= 0) & (ih < H) & (iw >= 0) & (iw < W))
                    x_k = c * stride_xc + (kh * DH) * stride_xh + (kw * DW) * stride_xw
                    a = tl.load(x_corner[:, None] + x_k[None, :], mask=a_ok, other=0.0)
                    if HAS_INPUT_NORM:
                        a = _normalized(a, a_ok, xs_ptr, xb_ptr, c, k_ok, w_ptr.dtype.element_ty, ROUND_BF16, 1,
                                        INPUT_ACTIVATION, INPUT_SLOPE)  # fmt: skip
                    if HAS_X_SCALE:
                        a = _gated(a, a_ok, gate_rows, c, w_ptr.dtype.element_ty, ROUND_BF16)
                else:
                    # NCHW x: along K an element's neighbours lie KW apart at best (runs of 7 for the stem), along M
                    # SW apart (the next output pixel). Gathered as a (BLOCK_K, BLOCK_M) tile, whose default layout
                    # lays a warp's threads along M: one load instruction reads 32 pixels of one image row, 1-2
                    # cache lines, where threads along K touched up to 32 (the ResNet stem at 256 images of
                    # 224x224: 1,571 us, 36% of ResNet-18's forward, H200). Transposed for the dot.
                    c = k // (KH * KW)
                    kh = (k // KW) % KH
                    kw = k % KW
                    ih = (kh * DH)[:, None] + h0[None, :]
                    iw = (kw * DW)[:, None] + w0[None, :]
                    a_ok = (k_ok[:, None] & m_ok[None, :]) & ((ih >= 0) & (ih < H) & (iw >= 0) & (iw < W))
                    x_k = c * stride_xc + (kh * DH) * stride_xh + (kw * DW) * stride_xw
                    a = tl.load(x_corner[None, :] + x_k[:, None], mask=a_ok, other=0.0)
                    if HAS_INPUT_NORM:
                        a = _normalized(a, a_ok, xs_ptr, xb_ptr, c, k_ok, w_ptr.dtype.element_ty, ROUND_BF16, 0,
                                        INPUT_ACTIVATION, INPUT_SLOPE)  # fmt: skip
                    if HAS_X_SCALE:
                        a = _gated(a, a_ok, gate_rows, c, w_ptr.dtype.element_ty, ROUND_BF16, 0)
                    a = tl.trans(a)
                w_k = c * stride_wc + kh * stride_wh + kw * stride_ww
                b = tl.load(w_cols[None, :] + w_k[:, None], mask=k_ok[:, None], other=0.0)
                if UPCAST_DOT:
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        else:
            # One flat loop over (tap, channel block) steps, so that Triton's software pipeline sees one loop.
            c_steps = (C + BLOCK_K - 1) // BLOCK_K  # constexpr
            a_tile = x_corner[:, None] + (offs_k * stride_xc)[None, :]
            b_tile = w_cols[None, :] + (offs_k * stride_wc)[:, None]
            first, end = _split_range(KH * KW * c_steps, pid_k, SPLIT_K)
            for step in range(first, end):
                tap = step // c_steps
                c0 = (step % c_steps) * BLOCK_K
                kh = tap // KW
                kw = tap % KW
                ih = h0 + kh * DH
                iw = w0 + kw * DW
                row_ok = m_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
                c_ok = offs_k < C - c0  # `arange < scalar`: constant over runs, so loads stay vectorised
                x_step = c0 * stride_xc + (kh * DH) * stride_xh + (kw * DW) * stride_xw
                a_ok = row_ok[:, None] & c_ok[None, :]
                a = tl.load(a_tile + x_step, mask=a_ok, other=0.0)
                if HAS_INPUT_NORM:
                    a = _normalized(a, a_ok, xs_ptr, xb_ptr, c0 + offs_k, c_ok, w_ptr.dtype.element_ty, ROUND_BF16,
                                    1, INPUT_ACTIVATION, INPUT_SLOPE)  # fmt: skip
                if HAS_X_SCALE:
                    if BLOCK_M <= OH * OW:
                        a = _gated_two_images(a, gate_first, gate_second, second, c0 + offs_k, c_ok,
                                              w_ptr.dtype.element_ty, ROUND_BF16)  # fmt: skip
                    else:
                        a = _gated(a, a_ok, gate_rows, c0 + offs_k, w_ptr.dtype.element_ty, ROUND_BF16)
                b = tl.load(b_tile + (c0 * stride_wc + kh * stride_wh + kw * stride_ww), mask=c_ok[:, None], other=0.0)
                if UPCAST_DOT:
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        if SPLIT_K > 1:  # the tile's last program to arrive gets the full sum and stores; the others store nothing
            acc, last = split_k_sum(acc, ws_ptr, cnt_ptr, tile, pid_k, SPLIT_K, BLOCK_M, BLOCK_N)
        # Epilogue on the fp32 accumulator: bias, residual, activation, then the pooling fold.
        if HAS_BIAS:
            acc = acc + bias.to(tl.float32)[None, :]
        if HAS_RESIDUAL:  # no pool: one window, whose pixels are the stored ones; read by the storing program only
            r_ok = m_ok[:, None] & (cols < OC)[None, :]
            if SPLIT_K > 1:
                r_ok = r_ok & last
            r_tile = _y_tile(r_ptr, n, rows, out_h, out_w, cols, stride_yn, stride_yc, stride_yh, stride_yw, OH, OW,
                             Y_PLANES)  # fmt: skip
            acc = acc + tl.load(r_tile, mask=r_ok, other=0.0).to(tl.float32)
        acc = apply_activation(acc, ACTIVATION, negative_slope)
        if POOL == "max":
            result = _max_propagating_nan(result, acc)
        elif POOL == "avg":
            result = result + acc
        else:
            result = acc
    if POOL == "avg":
        result = result / (PKH * PKW)  # floor mode, no padding: every window is whole

    # One rounding to the output dtype. e4m3: to the compute dtype first, as the tensor it replaces was, then
    # quantized, so the float8 readers read the values they quantized as they gathered that tensor before.
    if Y_FP8:
        result = round_to_bf16(result) if ROUND_BF16 else result.to(w_ptr.dtype.element_ty).to(tl.float32)
        result = quantize_e4m3(result, Y_INV_SCALE, ROUND_FP8)
    elif ROUND_BF16:
        result = round_to_bf16(result)
    y_ok = m_ok[:, None] & (cols < OC)[None, :]
    if SPLIT_K > 1:
        y_ok = y_ok & last
    if INTERLEAVE == 0:
        y_ptrs = _y_tile(y_ptr, n, rows, out_h, out_w, cols, stride_yn, stride_yc, stride_yh, stride_yw, OH, OW,
                         Y_PLANES)  # fmt: skip
        tl.store(y_ptrs, result.to(y_ptr.dtype.element_ty), mask=y_ok)
    else:
        # Every other channel stored alone goes out in 2-byte pieces, half of each sector: 6.7x the dense store's
        # time (H200, 58 channels at 28x28, 256 images: 188 against 28 us). With the other half's channels loaded
        # beside it, the tile's rows are whole runs of 2 * BLOCK_N channels, stored as the dense ones are.
        tl.static_assert(POOL == "none" and not HAS_RESIDUAL, "an interleaved output is neither pooled nor added to")
        if P_PIXEL == 0:  # a channel run of a buffer with y's pixel strides (a split's half)
            p_ptrs = _y_tile(r_ptr, n, rows, out_h, out_w, cols, stride_yn, 1, stride_yh, stride_yw, OH, OW, False)
        else:  # dense channels_last (another conv's output)
            p_ptrs = _y_tile(r_ptr, n, rows, out_h, out_w, cols, OH * OW * P_PIXEL, 1, OW * P_PIXEL, P_PIXEL, OH, OW,
                             False)  # fmt: skip
        other = tl.load(p_ptrs, mask=y_ok, other=0.0).to(y_ptr.dtype.element_ty)
        own = result.to(y_ptr.dtype.element_ty)
        pair = tl.join(own, other) if INTERLEAVE == 1 else tl.join(other, own)  # (BLOCK_M, BLOCK_N, 2)
        pair = tl.reshape(pair, (BLOCK_M, 2 * BLOCK_N))
        cols2 = pid_n * (2 * BLOCK_N) + tl.arange(0, 2 * BLOCK_N)
        y2_ptrs = _y_tile(y_ptr, n, rows, out_h, out_w, cols2, stride_yn, 1, stride_yh, stride_yw, OH, OW, False)
        y2_ok = m_ok[:, None] & (cols2 < 2 * OC)[None, :]
        if SPLIT_K > 1:  # last: the (BLOCK_M, BLOCK_N) tile's mask, widened as the pair is
            y2_ok = y2_ok & tl.reshape(tl.join(last, last), (BLOCK_M, 2 * BLOCK_N))
        tl.store(y2_ptrs, pair, mask=y2_ok)


# ---- the launcher ----


def conv_output_size(size: int, k: int, s: int, p: int, d: int) -> int:
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def conv_geometry(x: torch.Tensor, weight: torch.Tensor, stride, padding, dilation) -> tuple:
    """(stride, padding, dilation as pairs, OH, OW) of a conv of x (N, C, H, W) by weight (OC, CG, KH, KW); a clear
    ValueError for a stride or dilation below 1, a negative padding, or an empty output."""
    s, p, d = pair(stride, "stride"), pair(padding, "padding"), pair(dilation, "dilation")
    if min(s) < 1 or min(d) < 1 or min(p) < 0:
        raise ValueError(f"stride and dilation must be >= 1 and padding >= 0; got {s}, {d}, {p}")
    (H, W), (KH, KW) = x.shape[2:], weight.shape[2:]
    OH, OW = conv_output_size(H, KH, s[0], p[0], d[0]), conv_output_size(W, KW, s[1], p[1], d[1])
    if OH < 1 or OW < 1:
        raise ValueError(
            f"conv output is empty: input {H}x{W}, kernel {KH}x{KW}, stride {s}, padding {p}, dilation {d}"
        )
    return s, p, d, OH, OW


def output_tensor(out: torch.Tensor | None, shape: tuple, dtype, device, memory_format) -> torch.Tensor:
    """`out` checked against the output's shape, dtype and device, or a new one in `memory_format`; the kernels index
    with int32, so at most 2**31 - 1 elements."""
    if out is None:
        out = torch.empty(shape, device=device, dtype=dtype, memory_format=memory_format)
    elif tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device:
        want = f"({', '.join(map(str, shape))}) {dtype} tensor on {device}"
        raise ValueError(f"out must be a {want}; got {tuple(out.shape)} {out.dtype} on {out.device}")
    if out.numel() >= 2**31:
        raise ValueError(f"the output has {out.numel()} elements; the kernels index with int32 (< 2**31)")
    return out


def channel_slice_of_nhwc(t: torch.Tensor) -> bool:
    """t (N, C, H, W) has unit channel stride and pixels at least C apart: a run of a channels_last tensor's channels
    (a concat's buffer[:, a:b], which its producers write in place), gathered as channels_last x is (C contiguous)."""
    C = t.shape[1]
    return C > 1 and t.stride(1) == 1 and min(t.stride(0), t.stride(2), t.stride(3)) >= C


def m_bucket(m: int) -> int:
    """Batches share tuned configs by power-of-two bucket of M = N * OH * OW (1 .. 2**20)."""
    return min(1 << max(m - 1, 0).bit_length(), 1 << 20)


def _check(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str, input_norm: tuple | None = None
) -> None:
    check_activation(activation)
    if x.dim() != 4:
        raise ValueError(f"x must be 4-D (N, C, H, W); got shape {tuple(x.shape)}")
    if weight.dim() != 4:
        raise ValueError(f"weight must be 4-D (OC, C, KH, KW); got shape {tuple(weight.shape)}")
    if min(weight.shape) < 1:
        raise ValueError(f"weight must have every dimension >= 1; got shape {tuple(weight.shape)}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"x has C={x.shape[1]} channels but weight (OC, C, KH, KW) has C={weight.shape[1]} (groups=1 only)"
        )
    for t, name in ((x, "x"), (weight, "weight")):
        if t.dtype not in SUPPORTED_DTYPES and not (t is x and input_norm is not None and t.dtype in NORM_X_DTYPES):
            also = " (and uint8 x with input_norm)" if t is x else ""
            raise TypeError(f"{name} has dtype {t.dtype}; fused_conv2d supports float32, float16, bfloat16{also}")
        if t.numel() >= 2**31:
            raise ValueError(f"{name} has {t.numel()} elements; the kernel indexes with int32 (< 2**31)")
        check_device(t, name)
    if input_norm is not None:
        _check_input_norm(input_norm, x)
    elif weight.dtype != x.dtype:
        raise TypeError(f"x has dtype {x.dtype} but weight has {weight.dtype}; cast them to one dtype")
    if weight.device != x.device:
        raise ValueError(f"x is on {x.device} but weight is on {weight.device}")
    if bias is not None:
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must have shape ({weight.shape[0]},) to match weight; got {tuple(bias.shape)}")
        if bias.dtype != weight.dtype or bias.device != x.device:
            raise TypeError(f"bias has dtype {bias.dtype} on {bias.device}; want {weight.dtype} on {x.device}")


def _check_input_norm(input_norm: tuple, x: torch.Tensor) -> None:
    if not isinstance(input_norm, (tuple, list)) or len(input_norm) != 2:
        raise ValueError(f"input_norm must be (scale, shift), two fp32 tensors of x's channels; got {input_norm!r}")
    for t, name in zip(input_norm, ("scale", "shift"), strict=True):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != (x.shape[1],):
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else repr(t)
            raise ValueError(f"input_norm's {name} must be a float32 tensor of shape ({x.shape[1]},); got {got}")
        if t.device != x.device or not t.is_contiguous():
            raise ValueError(f"input_norm's {name} must be contiguous on {x.device}; got one on {t.device}")


def _check_x_scale(x_scale, x: torch.Tensor, input_norm: tuple | None) -> torch.Tensor:
    """x_scale as the kernel reads it: the contiguous (N, C) view of an (N, C) or (N, C, 1, 1) tensor."""
    N, C = x.shape[:2]
    if input_norm is not None:
        raise ValueError("x_scale and input_norm cannot both be given: a normalized input is a model's, never gated")
    if not isinstance(x_scale, torch.Tensor) or tuple(x_scale.shape) not in ((N, C), (N, C, 1, 1)):
        got = tuple(x_scale.shape) if isinstance(x_scale, torch.Tensor) else repr(x_scale)
        want = f"({N}, {C}) or ({N}, {C}, 1, 1), one gate per image and channel of x"
        raise ValueError(f"x_scale must have shape {want}; got {got}")
    if x_scale.dtype not in X_SCALE_DTYPES:
        raise TypeError(f"x_scale has dtype {x_scale.dtype}; want a float dtype (float32, float16, bfloat16, float64)")
    if x_scale.device != x.device or not x_scale.is_contiguous():
        raise ValueError(f"x_scale must be contiguous on {x.device}; got one on {x_scale.device}")
    return x_scale.view(N, C)


def input_norm_of(mean, std, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, shift) = (1 / std, -mean / std) per channel, computed in float64 and stored as float32: the
    `input_norm` that makes the conv see (x - mean) / std."""
    mean = torch.as_tensor(mean, dtype=torch.float64)
    std = torch.as_tensor(std, dtype=torch.float64)
    scale, shift = 1.0 / std, -mean / std
    return scale.to(device=device, dtype=torch.float32), shift.to(device=device, dtype=torch.float32)


_configs: dict[tuple, LaunchConfig] = {}  # per (layer signature, M bucket): the tuned config
on_new_picks(_configs.clear)  # a pick timed in the background replaces an untimed one: ask tune() again
_zero_bias: dict[tuple, torch.Tensor] = {}  # per (OC, dtype, device): the bias of a layer without one
# Split-K partials and counters, one workspace per device for every conv layer: launches on one stream never
# overlap in it (under PDL a layer touches it only after gdc_wait, once the layer before has finished).
_workspaces: dict[torch.device, SplitKWorkspace] = {}


def _zeros_for(weight: torch.Tensor) -> torch.Tensor:
    """A zero bias for a CUDA layer without one: compiled, the kernel's HAS_BIAS=False variant gives wrong outputs
    with NHWC input and FLAT_K=0 (triton 3.6; tests/test_kernels_conv.py, test_gpu_shapes_layouts_and_no_bias;
    docs/performance.md). Loading OC zeros costs a program one small read."""
    key = (weight.shape[0], weight.dtype, weight.device)
    zeros = _zero_bias.get(key)
    if zeros is None:
        zeros = _zero_bias[key] = torch.zeros(weight.shape[0], dtype=weight.dtype, device=weight.device)
    return zeros


def fused_conv2d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    stride=(1, 1),
    padding=(0, 0),
    dilation=(1, 1),
    activation: str = "none",
    negative_slope: float = DEFAULT_NEGATIVE_SLOPE,
    allow_tf32: bool | None = None,
    pool: tuple | None = None,
    memory_format: torch.memory_format | None = None,
    out: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    input_norm: tuple[torch.Tensor, torch.Tensor] | None = None,
    x_scale: torch.Tensor | None = None,
    input_activation: str = "none",
    input_negative_slope: float = DEFAULT_NEGATIVE_SLOPE,
    interleave: torch.Tensor | None = None,
    interleave_index: int = 0,
    out_scale: float | None = None,
    _pair: tuple[torch.Tensor, int, int] | None = None,
) -> torch.Tensor:
    """act(conv2d(x, weight, bias) [+ residual]); x (N, C, H, W) contiguous NCHW (or channels_last), weight
    (OC, C, KH, KW); returns (N, OC, OH, OW) in x's dtype, channels_last if x or weight is (as torch does), else
    NCHW; groups=1. Accumulates in fp32.

    allow_tf32: for float32, multiply in TF32 or full fp32; None follows `torch.backends.cudnn.allow_tf32`
    (torch's default: True), what cuDNN's conv would do with the same tensors.

    pool: ("max" | "avg", kernel_size) or ("max" | "avg", kernel_size, stride) (ints or pairs; stride None or
    left out: kernel_size) pools the activated conv output in the same kernel, as max_pool2d / avg_pool2d with
    padding 0 and ceil_mode False would: returns (N, OC, POH, POW), the conv output never written. Windows of more
    than MAX_POOL_WINDOW elements run the conv, then fused_pool2d. (Padded or ceil_mode pooling: call fused_pool2d
    after an unpooled fused_conv2d.)

    memory_format: of the returned tensor (when `out` is None), torch.contiguous_format or torch.channels_last;
    None: torch's rule above. A CNN reads NCHW and writes channels_last, keeps channels_last between its convs
    and pools (2x faster at 256 images of 64 -> 64 channels at 32x32; docs/performance.md, "CNNs"), and writes
    NCHW again before its flatten.

    residual: None, or a tensor of the output's shape (N, OC, OH, OW) and dtype, added before the activation (a
    ResNet block's relu(conv(x) + identity), its BatchNorm folded into weight and bias) and read once in the
    epilogue. Read at the output's offsets: one in another layout than the output's (NCHW for an NHWC output, or
    the reverse) is copied into it first, one more kernel. Not with `pool` (ValueError), nor in `out`'s memory.

    input_norm: None, or (scale, shift), float32 tensors of shape (C,) on x's device (`input_norm_of(mean, std)`):
    the conv reads x * scale[c] + shift[c] inside the image and 0 in the padding, i.e. conv2d((x - mean) / std)
    with the padding after the normalization. x may then be uint8 or any float dtype, and y (and the bias and the
    residual) take the weight's dtype. Never the TMA kernel (it copies x's boxes as they are).

    input_activation, input_negative_slope: with input_norm, an activation of the normalized x (any of
    kernels.activations; the slope for leaky_relu): the conv reads act(x * scale[c] + shift[c]) inside the image and 0
    in the padding, i.e. conv2d(relu(batch_norm(x)), padding=p) for a pre-activation BatchNorm + ReLU folded into
    (scale, shift) (DenseNet's BN-ReLU-conv: the activated tensor is never written).

    x_scale: None, or a gate per image and channel of x, shape (N, C) or (N, C, 1, 1), contiguous, on x's device, any
    float dtype (read in fp32): the conv reads x[n, c] * x_scale[n, c], i.e. act(conv2d(x * x_scale[:, :, None, None],
    weight, bias) [+ residual]) with the product rounded once to x's dtype and the padding 0, as a squeeze-and-
    excitation block's projection runs it, without writing and reading x * s. With a residual, a pool, any layout;
    not with input_norm (ValueError); never the TMA kernel.

    interleave, interleave_index: with `out` the channels k::2 (k = interleave_index, 0 or 1) of a channels_last buffer
    of 2 * OC channels, a tensor of out's shape and dtype whose channels go to the buffer's other ones, (1 - k)::2: a
    channel shuffle (groups 2) of a concat of the two, as ShuffleNet's units end. Where `interleave` has the buffer's
    pixel strides and unit channel stride (a split's first half: a channel run of the last unit's buffer) or is dense
    channels_last (the other branch's output), the kernel loads it in its epilogue and stores both in whole rows (one
    kernel, no strided copy); otherwise the conv writes `out` and `interleave` is copied beside it. Not with a pool or
    a residual (ValueError). Returns `out`.

    out_scale: y in e4m3 instead, for float8 layers to read (service/model/float8.Fp8Output: the float16 stem before
    MobileNetV2's first depthwise conv, which otherwise read 2 bytes a value and quantized each at each of its 9 taps):
    the result rounded to the compute dtype, then quantized with that scale (kernels/fp8.quantize). Not with a pool, a
    residual or interleave (ValueError); never the TMA kernel.
    """
    if out_scale is not None and (pool is not None or residual is not None or interleave is not None or _pair):
        raise ValueError("out_scale (an e4m3 output) is not fused with a pool, a residual or interleave")
    if interleave is not None and _pair is None:
        return _interleaved(x, weight, bias, interleave, interleave_index, out, residual, pool, stride=stride,
                            padding=padding, dilation=dilation, activation=activation, negative_slope=negative_slope,
                            allow_tf32=allow_tf32, input_norm=input_norm, x_scale=x_scale,
                            input_activation=input_activation, input_negative_slope=input_negative_slope)  # fmt: skip
    _check(x, weight, bias, activation, input_norm)
    check_activation(input_activation)
    if input_activation != "none" and input_norm is None:
        raise ValueError(f"input_activation {input_activation!r} applies to the normalized x: give input_norm too")
    dtype = weight.dtype  # the compute dtype: x's, or with input_norm the weight's (x may be uint8)
    y_dtype = E4M3 if out_scale is not None else dtype
    has_norm = input_norm is not None
    has_xscale = x_scale is not None
    if has_xscale:
        x_scale = _check_x_scale(x_scale, x, input_norm)
    s, p, d, OH, OW = conv_geometry(x, weight, stride, padding, dilation)
    N, C, H, W = x.shape
    OC, _, KH, KW = weight.shape
    POOL, PKH, PKW, PSH, PSW = "none", 1, 1, 1, 1
    if pool is not None:
        if not isinstance(pool, (tuple, list)) or len(pool) not in (2, 3) or pool[0] not in ("max", "avg"):
            raise ValueError(f"pool must be ('max' | 'avg', kernel_size[, stride]); got {pool!r}")
        (PKH, PKW) = pair(pool[1], "pool kernel_size")
        (PSH, PSW) = (PKH, PKW) if len(pool) == 2 or pool[2] is None else pair(pool[2], "pool stride")
        if min(PKH, PKW, PSH, PSW) < 1:
            raise ValueError(f"pool kernel_size and stride must be >= 1; got {pool!r}")
        POOL = pool[0]
        if OH < PKH or OW < PKW:
            raise ValueError(f"pooling {pool!r} leaves no output from the conv's {OH}x{OW}")
        OH, OW = (OH - PKH) // PSH + 1, (OW - PKW) // PSW + 1
    if residual is not None and POOL != "none":
        raise ValueError("a residual cannot be fused with a pool: add it in an unpooled fused_conv2d, then pool")
    if PKH * PKW > MAX_POOL_WINDOW:  # too many K loops to unroll: the conv, then the pool in its own kernel
        y = fused_conv2d(x, weight, bias, stride=s, padding=p, dilation=d, activation=activation,
                         negative_slope=negative_slope, allow_tf32=allow_tf32, memory_format=memory_format,
                         input_norm=input_norm, x_scale=x_scale, input_activation=input_activation,
                         input_negative_slope=input_negative_slope)  # fmt: skip
        return fused_pool2d(y, POOL, (PKH, PKW), (PSH, PSW), out=out)
    # torch's rule for the output's memory format: channels_last when x or the weight is. (An (N, 1, H, W)
    # input is both; a channels_last weight then asks for NHWC outputs.)
    channels_last = _channels_last(x) or channel_slice_of_nhwc(x)
    fmt = torch.channels_last if channels_last or _channels_last(weight) else torch.contiguous_format
    # _pair (partner, k, its pixel stride or 0: out's), from _interleaved: `out` is the whole buffer of 2 * OC
    # channels, written channels k::2 from the conv and the others from partner (the INTERLEAVE epilogue)
    partner, k, p_pixel = _pair if _pair is not None else (None, 0, 0)
    width = 2 * OC if partner is not None else OC  # out's channels: interleaved, the whole buffer's
    if out is None:
        out = torch.empty((N, OC, OH, OW), device=x.device, dtype=y_dtype, memory_format=memory_format or fmt)
    elif out.shape != (N, width, OH, OW) or out.dtype != y_dtype or out.device != x.device:
        want = f"({N}, {width}, {OH}, {OW}) {y_dtype} tensor on {x.device}"
        raise ValueError(f"out must be a {want}; got {tuple(out.shape)} {out.dtype} on {out.device}")
    has_residual = residual is not None
    if has_residual:
        residual = residual_like(residual, out)  # in out's strides, so that the kernels read it at y's offsets
    M = N * OH * OW
    y_planes = out.stride()[1:] == (OH * OW, OW, 1) and partner is None
    if M == 0:
        return out
    CH, CW = conv_output_size(H, KH, s[0], p[0], d[0]), conv_output_size(W, KW, s[1], p[1], d[1])  # unpooled
    if allow_tf32 is None:
        allow_tf32 = torch.backends.cudnn.allow_tf32
    if bias is None and not interpreting():
        bias = _zeros_for(weight)  # see _zeros_for: never the HAS_BIAS=False variant on a GPU
    fixed = gemm_flags(bias is not None, activation, dtype, allow_tf32, x.device)
    geometry = dict(C=C, H=H, W=W, KH=KH, KW=KW, SH=s[0], SW=s[1], PH=p[0], PW=p[1], DH=d[0], DW=d[1])
    K = C * KH * KW
    # xs_ptr, xb_ptr: the scale and shift; or the gate and None (the kernel's HAS_X_SCALE); else never read
    norm = tuple(input_norm) if has_norm else (x_scale, None) if has_xscale else (weight, weight)
    # left out at "none", so that every launch without it compiles the kernel it did before these constexprs
    input_act = {}
    if input_activation != "none":
        input_act = dict(INPUT_ACTIVATION=input_activation, INPUT_SLOPE=float(input_negative_slope))
    # left out without a partner, as input_act is
    interleave = {} if partner is None else dict(INTERLEAVE=1 + k, P_PIXEL=p_pixel)
    # and without an e4m3 output
    fp8_out = {} if out_scale is None else dict(Y_FP8=True, Y_INV_SCALE=inverse(out_scale), ROUND_FP8=interpreting())
    # and where Triton knows OC's alignment itself (a multiple of 16), or there is none
    oc_align = {"OC_ALIGN": pow2_alignment(OC)} if 1 < pow2_alignment(OC) < 16 else {}
    workspace = _workspaces.get(x.device)
    if workspace is None:
        workspace = _workspaces[x.device] = SplitKWorkspace(x.device)

    def launch(y: torch.Tensor, meta: dict, pooled: bool):
        oh, ow = (OH, OW) if pooled else (CH, CW)
        window = (
            dict(POOL=POOL, PKH=PKH, PKW=PKW, PSH=PSH, PSW=PSW)
            if pooled
            else dict(POOL="none", PKH=1, PKW=1, PSH=1, PSW=1)
        )
        if pooled and POOL != "none" and meta["SPLIT_K"] > 1:
            raise ValueError(f"a pooled conv cannot split K (config {meta})")  # partials would be pre-pool
        tiles = triton.cdiv(N * oh * ow, meta["BLOCK_M"]) * triton.cdiv(OC, meta["BLOCK_N"])
        ws, cnt = workspace.get(tiles, meta["BLOCK_M"] * meta["BLOCK_N"], meta["SPLIT_K"])
        return grid_launch(_conv2d_kernel, (tiles * meta["SPLIT_K"],))(
            x, weight, bias if bias is not None else weight, y, residual if has_residual else partner if partner
            is not None else y, ws, cnt, *norm,
            N, OC,
            *x.stride(), *weight.stride(), *y.stride(),
            float(negative_slope),
            **geometry, OH=oh, OW=ow, **window, HAS_RESIDUAL=has_residual, **fixed, CHANNELS_LAST=channels_last,
            Y_PLANES=y.stride()[1:] == (oh * ow, ow, 1), HAS_INPUT_NORM=has_norm, **meta, **launch_options(fixed),
            X_ALIGN=channels_last_alignment(x), W_ALIGN=channels_last_alignment(weight),
            Y_ALIGN=channels_last_alignment(y), **input_act, **interleave, **fp8_out, **oc_align,
        )  # fmt: skip

    # The TMA kernel (conv_tma.py) where it can run: x and weight channels_last, 16-byte rows, strides that divide
    # the image; with a residual too (read with pointers at y's offsets, so any layout of y).
    tma_pool = None if POOL == "none" else (POOL, (PKH, PKW), (PSH, PSW))
    tma = (not has_norm and not has_xscale and partner is None and out_scale is None
           and conv_tma.eligible(x, weight, s, tma_pool, out))  # fmt: skip
    tma_geometry = dict(geometry, OH=CH, OW=CW)

    def run(config: LaunchConfig):
        if conv_tma.is_tma(config):
            window = (POOL, PKH, PKW)
            return conv_tma.launch(x, weight, bias, out, float(negative_slope), tma_geometry, window, fixed, config,
                                   residual)  # fmt: skip
        meta = config.meta()
        if not meta.pop("APART", 0):
            return launch(out, meta, POOL != "none")
        # The pool apart: the conv (+ bias + act) to its full-size output, then one fused_pool2d kernel.
        conv_out = torch.empty((N, OC, CH, CW), device=x.device, dtype=dtype, memory_format=fmt)
        launch(conv_out, meta, False)
        return fused_pool2d(conv_out, POOL, (PKH, PKW), (PSH, PSW), out=out)

    if interpreting():
        if INTERPRETER.choice.tma and tma:
            run(_interpreter_tma_config(OC, C, CH, CW, (PKH, PKW), s != (1, 1)))
        else:
            run(_interpreter_config(M, OC, C, K, POOL != "none"))
        return out
    bucket = m_bucket(M)
    signature = (tuple(weight.shape), weight.stride(), x.shape[1:], x.stride()[1:], x.dtype, s, p, d, activation,
                 bias is not None, fixed["INPUT_PRECISION"], channels_last, y_planes, bucket, POOL, PKH, PKW, PSH, PSW,
                 tma, has_residual, dtype, has_norm, has_xscale, input_activation, input_negative_slope,
                 None if partner is None else (k, p_pixel), fp8_out.get("Y_INV_SCALE"))  # fmt: skip
    config = _configs.get(signature)
    if config is None:
        key = (
            f"OC{OC}|C{C}|H{H}|W{W}|k{KH}x{KW}|s{s}|p{p}|d{d}|{dtype}|{activation}|bias={bias is not None}"
            f"|{fixed['INPUT_PRECISION']}|{'nhwc' if channels_last else 'nchw'}|y={'nchw' if y_planes else 'nhwc'}"
            f"|m{bucket}"
        )
        if tma:  # x and the weight channels_last, aligned: TMA candidates too
            key += "|tma"
        if has_residual:  # one more read in the epilogue: timed apart
            key += "|residual"
        if has_norm:  # another kernel variant (HAS_INPUT_NORM), gathering x in its own dtype (uint8: 1 byte)
            key += f"|norm|x={x.dtype}"
            if input_activation != "none":  # the prologue's activation (a pre-activation BatchNorm's ReLU)
                key += f"|{input_activation}"
        if has_xscale:  # another kernel variant (HAS_X_SCALE): one more gather per K step
            key += "|xscale"
        if partner is not None:  # another epilogue (INTERLEAVE): one more read, twice the store
            key += "|interleave" if p_pixel == 0 else "|interleave-dense"
        if out_scale is not None:  # another epilogue (Y_FP8): a byte a value stored (any scale: the same picks)
            key += "|y=e4m3"
        if POOL != "none":
            key += f"|pool={POOL}{PKH}x{PKW}s{PSH}x{PSW}"
        # the kernels any candidate runs, with every helper they call (tuning.source_hash)
        scope = scope_for("conv2d", _conv2d_kernel, *POOL_KERNELS, conv_tma._conv2d_tma_kernel)
        fma = dtype == torch.float32 and fixed["INPUT_PRECISION"] == "ieee"
        sms = device_limits(x.device)[0]
        candidates = cuda_configs(bucket, OC, C, K, fma, POOL != "none", sms, weight.element_size(), has_norm,
                                  has_xscale)  # fmt: skip
        if POOL != "none" and triton.cdiv(bucket, 64) * triton.cdiv(OC, _fit(OC, 16, 128)) < sms:
            # Pooled, the kernel runs PKH * PKW K loops per tile over a quarter of the tiles (2x2): where that
            # leaves SMs idle, the conv apart at full size (split-K allowed) and then the pool may win.
            unpooled = cuda_configs(m_bucket(N * CH * CW), OC, C, K, fma, False, sms, weight.element_size(), has_norm,
                                    has_xscale)  # fmt: skip
            candidates += [LaunchConfig(c.kwargs + (("APART", 1),), c.num_warps, c.num_stages) for c in unpooled]
            # The pool's own tuning runs here, once, not inside the tuner's CUDA-graph capture of a candidate.
            fused_pool2d(torch.empty((N, OC, CH, CW), device=x.device, dtype=dtype, memory_format=fmt),
                         POOL, (PKH, PKW), (PSH, PSW))  # fmt: skip
        if partner is not None:
            candidates = interleave_candidates(candidates, weight.element_size())
        if tma:  # (PKH, PKW) is (1, 1) without a pool
            candidates += conv_tma.cuda_configs(m_bucket(N * CH * CW), OC, C, CH, CW, (PKH, PKW), weight.element_size(),
                                                strided=s != (1, 1))  # fmt: skip
        config = tune(scope, key, candidates, run)
        _configs[signature] = config
    run(config)
    return out


def interleaved_buffer(out: torch.Tensor, k: int) -> torch.Tensor | None:
    """The buffer whose channels k::2 `out` is (channel stride 2, channels_last pixel strides), as one tensor of
    2 * OC channels, or None where `out` is not such a view."""
    N, OC, OH, OW = out.shape
    sn, sc, sh, sw = out.stride()
    if sc != 2 or sw != 2 * OC or sh != OW * sw or (N > 1 and sn != OH * sh) or out.storage_offset() < k:
        return None
    return out.as_strided((N, 2 * OC, OH, OW), (sn, 1, sh, sw), out.storage_offset() - k)


def other_half(out: torch.Tensor, k: int) -> torch.Tensor:
    """Channels (1 - k)::2 of the buffer whose channels k::2 `out` is: the partner's, a view of the same shape."""
    return out.as_strided(out.shape, out.stride(), out.storage_offset() + 1 - 2 * k)


def _interleaved(x, weight, bias, partner, k, out, residual, pool, **kw) -> torch.Tensor:
    if k not in (0, 1):
        raise ValueError(f"interleave_index must be 0 or 1; got {k!r}")
    if out is None or residual is not None or pool is not None:
        raise ValueError("interleave needs out= (channels k::2 of a buffer) and neither a residual nor a pool")
    if partner.shape != out.shape or partner.dtype != out.dtype or partner.device != out.device:
        raise ValueError(f"interleave must be a {tuple(out.shape)} {out.dtype} tensor on {out.device}; got "
                         f"{tuple(partner.shape)} {partner.dtype} on {partner.device}")  # fmt: skip
    whole = interleaved_buffer(out, k)
    N, OC, OH, OW = out.shape
    # (an image stride matters only past one image)
    ps = partner.stride() if N > 1 else (None, *partner.stride()[1:])
    if whole is not None and ps == (whole.stride(0) if N > 1 else None, 1, *whole.stride()[2:]):
        pixel = 0  # a channel run of a buffer with the output's pixel strides: read at y's offsets
    elif whole is not None and ps == (OH * OW * OC if N > 1 else None, 1, OW * OC, OC):
        pixel = OC  # dense channels_last
    else:  # the conv into its channels, then the other half copied
        fused_conv2d(x, weight, bias, out=out, **kw)
        other_half(out, k).copy_(partner)
        return out
    fused_conv2d(x, weight, bias, out=whole, _pair=(partner, k, pixel), **kw)
    return out


# ---- candidate configs (the tuner times them on CUDA) ----


def interleave_candidates(configs: list[LaunchConfig], element_size: int) -> list[LaunchConfig]:
    """Of a layer's candidates, those the INTERLEAVE epilogue (the tile and its partner joined into rows twice as
    wide) runs without spilling: in fp32, at most 16 accumulators a thread (64x64 over 8 warps, 64x32 over 4;
    compiled for sm_90 at ShuffleNetV2's shapes, 64x64 over 4 warps spilled 24 bytes under Triton 3.6 and 128x64 over
    4 32 bytes under 3.9); fp16 and bf16, every one. Where none is that small (232 channels), the candidates cut to
    64x64 tiles over 8 warps."""
    if element_size < 4:
        return configs
    small = [c for c in configs if c["BLOCK_M"] * c["BLOCK_N"] <= 16 * 32 * c.num_warps]
    if small:
        return small
    cut = []
    for c in configs:
        tile = dict(c.kwargs) | {"BLOCK_M": min(c["BLOCK_M"], 64), "BLOCK_N": min(c["BLOCK_N"], 64)}
        cut.append(LaunchConfig(tuple(sorted(tile.items())), 8, c.num_stages))
    return list(dict.fromkeys(cut))


def _fit(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(n)))  # tl.dot needs every block dim >= 16


def cuda_configs(
    bucket: int,
    OC: int,
    C: int,
    K: int,
    fma: bool = False,
    pooled: bool = False,
    sms: int = 132,
    element_size: int = 2,
    norm: bool = False,
    gated: bool = False,
) -> list[LaunchConfig]:
    """Candidates the tuner times for one layer and M bucket. The GEMM is tall and thin (M up to millions,
    OC 16-128, K = C * KH * KW 9-1152): BLOCK_N covers all of OC when it can, BLOCK_K no wider than K (few
    channels) or C, and few channels get only FLAT_K (a tap at a time would leave most of each K step empty).

    Compiled for sm_90 here (Triton 3.9, fp16, 3x3 over 64 channels to 128): a 128x128 tile on 4 warps spilled
    (16-1064 bytes of stack per thread: a 128-register accumulator plus the pipeline's gathered tiles), on 8
    warps it did not, nor did 64x128 on 4; so 128-row tiles run on 8 warps where BLOCK_N is 128. `fma`: fp32
    multiplied in full precision, which Triton does on the CUDA cores: there BLOCK_K 64 spilled 1.6-9.5 KB per
    thread, so it stops at 32. `pooled`: a pool fused after the conv keeps a second accumulator and one K loop
    per window element; 128-row tiles on 4 warps spilled there (40 bytes, tf32, 16 -> 32 channels).

    Small M (the wider CNN at batch 1: 1024 pixels at 32x32, 64 at 8x8) fills few of the `sms` with tiles, each
    walking all of K: there unpooled calls also get split-K variants (SPLIT_K programs per tile, 2+ K steps
    each, the partials summed by the tile's last program: tiles.split_k_sum), so more SMs gather at once."""
    bn = _fit(OC, 16, 128)
    width = K if C < 16 else C
    ks = sorted({_fit(width, 16, 32 if fma else 64), _fit(width, 16, 16 if fma else 32)})
    flats = (1,) if C < 16 else (0, 1)
    taps = K // C

    def split_for(bm: int, bn: int, bk: int, flat: int) -> int:
        if pooled:
            return 1
        tiles = triton.cdiv(bucket, bm) * triton.cdiv(OC, bn)
        steps = triton.cdiv(K, bk) if flat else taps * triton.cdiv(C, bk)
        split = 1
        while tiles * split * 2 <= sms and steps >= 4 * split and split < 16:  # >= 2 K steps per program
            split *= 2
        return split

    def cfg(warps, stages, bm, bn, bk, flat, split=1):
        return LaunchConfig.of(warps, stages, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, FLAT_K=flat, SPLIT_K=split)

    # `norm` (input_norm: the gathered tile normalized in fp32 before the dot). Compiled for the 7x7/2 stem at 224x224
    # (uint8 NCHW x) on Triton 3.6, every tile, depth and warp count: on 4 warps 64x64 spilled 104-352 bytes (fp16,
    # bf16) and 64x32 96-200 (fp32), 128-row tiles 8-1120; on 8 warps none spilled at 64 rows and 3 stages, nor at 128
    # rows and 2 stages in fp16/bf16 (3 stages: 16 bytes at BLOCK_K 64), while fp32 (on the CUDA cores) spilled at
    # 128 rows but for BLOCK_K 16 at 3 stages. Since NCHW x is gathered as a (BLOCK_K, BLOCK_M) tile, 128 rows at
    # BLOCK_K 64 spill 24 bytes in fp16/bf16 too (Triton 3.6; 3.9 does not): 128-row tiles stop at BLOCK_K 32.
    if norm:
        tiles = [(64, 8, 3), (128, 8, 3 if fma else 2)]
    else:
        tiles = [(64, 4, 4), (128, 8, 3)] + ([(128, 4, 3)] if bn <= 64 and not pooled else [])
    out = []
    for flat in flats:
        for bk in ks:
            for bm, warps, stages in tiles:
                if (bm > 64 and bucket <= 64) or (norm and bm > 64 and bk > (16 if fma else 32)):
                    continue
                # `gated` (x_scale: each gathered tile times its (n, c) gates in fp32): 128x32x64 on 4 warps spilled
                # 248 bytes (fp16, taps, NCHW x: EfficientNet-B0's 144 -> 24 at 56x56, sm_90; ungated, 112); on 8 not
                if gated and (bm, warps, bk) == (128, 4, 64):
                    continue
                # 64x128x64 on 4 warps spilled (224 bytes, fp16, taps, NCHW x: 128 -> 128 at 8x8); on 8 it did not
                out.append(cfg(8 if (bm, bn, bk) == (64, 128, 64) else warps, stages, bm, bn, bk, flat))
    # No 128-channel K steps for wide fp16 layers (a quarter as many as 32-channel ones, docs/performance.md, "CNNs"):
    # 64x128x128 on 8 warps spills 152 bytes per thread at 2 or 3 stages since the epilogue can read a residual
    # (Triton 3.6, sm_90; fp32 spilled before). Offer it again once the epilogue's registers are cut.
    if triton.cdiv(bucket, 64) * triton.cdiv(OC, bn) < sms:
        split = split_for(64, bn, ks[0], flats[-1])
        if split > 1:
            out.append(cfg(4, 4, 64, bn, ks[0], flats[-1], split))
        # Fewer 64-row tiles than the GPU has SMs: 32-row tiles, and narrower ones along O, so that more SMs
        # gather at once, and each of them split along K where that still leaves SMs idle.
        for bn_small in sorted({bn, min(bn, 64)}):
            for bk in ks:
                # 32x128x64 on 4 warps spilled 80 bytes (fp16, NCHW x: 128 -> 128 at 8x8, Triton 3.6); on 8 it did not
                out.append(cfg(8 if (bn_small, bk) == (128, 64) else 4, 3, 32, bn_small, bk, flats[-1]))
            # split at the narrower K step only: 32x128x64 split 8 spilled (48 bytes, fp32 as TF32)
            split = split_for(32, bn_small, ks[0], flats[-1])
            if split > 1:
                out.append(cfg(4, 3, 32, bn_small, ks[0], flats[-1], split))
    return out


# ---- under the interpreter: one config, from choices that tests change (interpreter.py) ----


SMALL_INTERPRETER_TILE = (16, 16, 16)  # tests' tile: awkward shapes cross every block edge


@dataclass(frozen=True)
class InterpreterChoice:
    """What fused_conv2d runs under the interpreter. Its cost is per program and per K step, so by default the
    largest tile the problem fills."""

    tile: tuple[int, int, int] | None = None  # (BLOCK_M, BLOCK_N, BLOCK_K); with `tma`, BLOCK_M is the box's pixels
    flat_k: bool | None = None  # the K loop: FLAT_K or one tap at a time; None: FLAT_K below 16 channels
    split_k: int = 1  # > 1: unpooled calls split K so that the reduction runs (pooled ones never split)
    pool_apart: bool = False  # pooled calls run the conv, then fused_pool2d (the tuner's APART candidates)
    tma: bool = False  # calls conv_tma can run (conv_tma.eligible) run it


INTERPRETER = InterpreterSwitches(InterpreterChoice())


def _interpreter_config(M: int, OC: int, C: int, K: int, pooled: bool) -> LaunchConfig:
    choice = INTERPRETER.choice
    bm, bn, bk = choice.tile or (_fit(M, 16, 64), _fit(OC, 16, 128), _fit(K, 16, 64))
    flat = choice.flat_k if choice.flat_k is not None else (C < 16)
    apart = {"APART": 1} if pooled and choice.pool_apart else {}
    split = 1 if pooled and not apart else choice.split_k
    return LaunchConfig.of(
        4, 1, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=4, FLAT_K=int(flat), SPLIT_K=split, **apart
    )


def _interpreter_tma_config(OC: int, C: int, OH: int, OW: int, pool: tuple[int, int], strided: bool) -> LaunchConfig:
    bm, bn, bk = INTERPRETER.choice.tile or (64, _fit(OC, 16, 128), _fit(C, 16, 64))
    if strided:  # a K step that divides C (conv_tma.k_steps)
        bk = max(k for k in (16, 32, 64) if k <= bk and C % k == 0)
    img, bh, bw = conv_tma.box_shape(bm, OH, OW, pool)
    return LaunchConfig.of(4, 1, IMG=img, BH=bh, BW=bw, BLOCK_N=bn, BLOCK_K=bk, TMA=1)
