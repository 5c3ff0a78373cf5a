"""Fused pooling: y = act(avg_pool2d(x)) or act(max_pool2d(x)) in one Triton kernel.

Eager torch runs this as two kernels, the pool and the activation: the pooled tensor is written by the
first and read back by the second. Here the activation is applied to the fp32 window result in registers,
so x is read once and y written once: for 2x2 windows over fp32 x of 4096x4096, 64 + 16 MB moved instead
of 64 + 16 + 16 + 16. The kernel is pure bandwidth: its speed is how close it reads x at the memory's rate.

Shapes: x (N, C, H, W) in any memory format (torch's contiguous NCHW or channels_last NHWC); y (N, C, OH, OW)
in the same memory format. torch's semantics for every argument: kernel_size, stride (None: kernel_size),
padding (at most half the window), ceil_mode (the last window may start in the right/bottom padding but
never past it) and count_include_pad (the divisor counts the padding inside the window, never the part of a
ceil_mode window that hangs past the padding). Max pooling propagates NaN, as torch's does.

Two kernels, one per layout, both taking any strides (so each is tested on both layouts):
- `_pool_rows_kernel` (NCHW): a program pools a (BLOCK_R output rows) x (BLOCK_OW output columns) tile;
  rows are flattened (n, c, oh). Where windows do not overlap along W (a power-of-two stride >= the window
  width: k2 s2, k8 s8, ...) each input row segment the tile needs is one contiguous load of BLOCK_OW * SW
  elements (16-byte vectors), reduced window by window after a reshape; otherwise each window column is its
  own strided load, and the overlap comes from L1.
- `_pool_channels_kernel` (NHWC): a program pools (BLOCK_P output positions) x (BLOCK_C channels), loading
  each window element for all channels at once: contiguous along C.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .activations import DEFAULT_NEGATIVE_SLOPE, apply_activation, check_activation, round_to_bf16
from .fp8 import E4M3, inverse, quantize_e4m3
from .interpreter import InterpreterSwitches
from .launch import grid_launch
from .pdl import gdc_launch_dependents, gdc_wait, use_pdl
from .runtime import bf16_on_interpreter, check_device, interpreting
from .tuning import LaunchConfig, scope_for, tune
from .tuning_background import on_new_picks

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KINDS = ("avg", "max")


@triton.jit
def _max_propagating_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


# Windows of at most this many elements are unrolled (tl.static_range): constant offsets, every load in flight
# at once. Larger ones (a global pool over 56x56: 3,136 taps) loop at run time: unrolled, one such kernel took
# minutes to compile, once per tuning candidate, and held a server's start past 300 s.
UNROLL_TAPS = tl.constexpr(64)


@triton.jit
def _rows_tap(out, row_ptrs, row_ok, w0, kw, W, stride_xw, IS_MAX: tl.constexpr, other: tl.constexpr):
    iw = w0 + kw
    ok = row_ok[:, None] & ((iw >= 0) & (iw < W))[None, :]
    v = tl.load(row_ptrs[:, None] + iw[None, :] * stride_xw, mask=ok, other=other).to(tl.float32)
    return _max_propagating_nan(out, v) if IS_MAX else out + v


@triton.jit
def _span_tap(acc, x_rows, rows, R, ih, H, iw, col_ok, stride_xh, stride_xw, IS_MAX: tl.constexpr, other: tl.constexpr):
    row_ok = (ih >= 0) & (ih < H) & (rows < R)
    ptrs = x_rows[:, None] + ih[:, None] * stride_xh + iw[None, :] * stride_xw
    v = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=other).to(tl.float32)
    return _max_propagating_nan(acc, v) if IS_MAX else acc + v


@triton.jit
def _channels_tap(
    out, x_pos, x_ch, pos_ok, ch_ok, ih, iw, H, W, stride_xh, stride_xw, IS_MAX: tl.constexpr, other: tl.constexpr
):
    ok = pos_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
    ptrs = (x_pos + ih * stride_xh + iw * stride_xw)[:, None] + x_ch[None, :]
    v = tl.load(ptrs, mask=ok[:, None] & ch_ok[None, :], other=other).to(tl.float32)
    return _max_propagating_nan(out, v) if IS_MAX else out + v


@triton.jit
def _window_divisor(start, size, K: tl.constexpr, P: tl.constexpr, COUNT_INCLUDE_PAD: tl.constexpr):
    """Elements of a window starting at `start` (may be negative) along one axis of length `size`, as torch's
    avg_pool2d counts them: the window clipped to the padded extent [-P, size + P), then, without
    count_include_pad, to the input [0, size)."""
    end = tl.minimum(start + K, size + P)
    if not COUNT_INCLUDE_PAD:
        start = tl.maximum(start, 0)
        end = tl.minimum(end, size)
    return tl.maximum(end - start, 1).to(tl.float32)  # >= 1 in every stored window; masked lanes: no 0 / 0


@triton.jit(do_not_specialize=["R"])  # R grows with the batch: one compiled kernel for every batch size
def _pool_rows_kernel(
    # pointers
    x_ptr, y_ptr,
    # sizes (R = N * C * OH output rows)
    R, C, H, W, OH, OW,
    # strides
    stride_xn, stride_xc, stride_xh, stride_xw,
    stride_yn, stride_yc, stride_yh, stride_yw,
    # epilogue parameters (y_inv_scale: 1 / the e4m3 output's scale, where Y_FP8)
    negative_slope, y_inv_scale,
    # meta-parameters
    IS_MAX: tl.constexpr,
    KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
    COUNT_INCLUDE_PAD: tl.constexpr,
    SPAN: tl.constexpr,  # windows do not overlap along W and SW is a power of two: one contiguous load per row
    ACTIVATION: tl.constexpr,
    ROUND_BF16: tl.constexpr,  # interpreter only: its fp32 -> bf16 cast truncates (activations.round_to_bf16)
    Y_FP8: tl.constexpr,  # y is e4m3: quantized with y_inv_scale (kernels/fp8.py), for a float8 layer to read
    ROUND_FP8: tl.constexpr,  # interpreter only: the e4m3 rounding done by hand (fp8.quantize_e4m3)
    PDL: tl.constexpr,  # launched as a programmatic dependent launch (pdl.py): the next layer may start early
    BLOCK_R: tl.constexpr, BLOCK_OW: tl.constexpr,
):  # fmt: skip
    if PDL:  # everything here reads x, which the previous kernel writes: wait first
        gdc_launch_dependents()
        gdc_wait()
    # A 1-D grid (R can pass the 65535 limit of grid axis 1): column blocks fastest, so neighbouring programs
    # read neighbouring segments of the same input rows.
    w_blocks = tl.cdiv(OW, BLOCK_OW)
    pid_r = tl.program_id(0) // w_blocks
    pid_w = tl.program_id(0) % w_blocks
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    plane = rows // OH
    oh = rows % OH
    x_rows = x_ptr + (plane // C) * stride_xn + (plane % C) * stride_xc  # (BLOCK_R,) plane bases
    h0 = oh * SH - PH
    ow = pid_w * BLOCK_OW + tl.arange(0, BLOCK_OW)
    other = float("-inf") if IS_MAX else 0.0

    if SPAN:
        # Input columns [pid_w * BLOCK_OW * SW - PW, + BLOCK_OW * SW): output column j // SW of the tile takes
        # element j when j % SW < KW. With PW = 0 and W a multiple of 16 the mask is constant over 16-element
        # runs, and the loads are 16-byte vectors.
        j = tl.arange(0, BLOCK_OW * SW)
        iw = pid_w * BLOCK_OW * SW - PW + j
        col_ok = (iw >= 0) & (iw < W)
        if KW < SW:
            col_ok = col_ok & ((j % SW) < KW)
        acc = tl.full((BLOCK_R, BLOCK_OW * SW), other, dtype=tl.float32)
        if KH <= UNROLL_TAPS:
            for kh in tl.static_range(KH):
                acc = _span_tap(acc, x_rows, rows, R, h0 + kh, H, iw, col_ok, stride_xh, stride_xw, IS_MAX, other)
        else:
            for kh in range(KH):
                acc = _span_tap(acc, x_rows, rows, R, h0 + kh, H, iw, col_ok, stride_xh, stride_xw, IS_MAX, other)
        windows = tl.reshape(acc, (BLOCK_R, BLOCK_OW, SW))
        out = tl.reduce(windows, 2, _max_propagating_nan) if IS_MAX else tl.sum(windows, axis=2)
    else:
        out = tl.full((BLOCK_R, BLOCK_OW), other, dtype=tl.float32)
        w0 = ow * SW - PW
        if KH * KW <= UNROLL_TAPS:
            for kh in tl.static_range(KH):
                ih = h0 + kh
                row_ok = (ih >= 0) & (ih < H) & (rows < R)
                for kw in tl.static_range(KW):
                    out = _rows_tap(out, x_rows + ih * stride_xh, row_ok, w0, kw, W, stride_xw, IS_MAX, other)
        else:
            for kh in range(KH):
                ih = h0 + kh
                row_ok = (ih >= 0) & (ih < H) & (rows < R)
                for kw in range(KW):
                    out = _rows_tap(out, x_rows + ih * stride_xh, row_ok, w0, kw, W, stride_xw, IS_MAX, other)

    if not IS_MAX:
        div_h = _window_divisor(h0, H, KH, PH, COUNT_INCLUDE_PAD)
        div_w = _window_divisor(ow * SW - PW, W, KW, PW, COUNT_INCLUDE_PAD)
        out = out / (div_h[:, None] * div_w[None, :])
    else:  # lanes past the edges hold -inf, which gelu & co. would turn into NaN: harmless (never stored), but noisy
        out = tl.where((rows < R)[:, None] & (ow < OW)[None, :], out, 0.0)
    out = apply_activation(out, ACTIVATION, negative_slope)
    if ROUND_BF16:
        out = round_to_bf16(out)
    y_rows = y_ptr + (plane // C) * stride_yn + (plane % C) * stride_yc + oh * stride_yh
    y_ptrs = y_rows[:, None] + ow[None, :] * stride_yw
    if Y_FP8:
        out = quantize_e4m3(out, y_inv_scale, ROUND_FP8)
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=(rows < R)[:, None] & (ow < OW)[None, :])


@triton.jit(do_not_specialize=["P"])
def _pool_channels_kernel(
    # pointers
    x_ptr, y_ptr,
    # sizes (P = N * OH * OW output positions)
    P, C, H, W, OH, OW,
    # strides
    stride_xn, stride_xc, stride_xh, stride_xw,
    stride_yn, stride_yc, stride_yh, stride_yw,
    # epilogue parameters
    negative_slope, y_inv_scale,
    # meta-parameters
    IS_MAX: tl.constexpr,
    KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr, PH: tl.constexpr, PW: tl.constexpr,
    COUNT_INCLUDE_PAD: tl.constexpr,
    ACTIVATION: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    Y_FP8: tl.constexpr,
    ROUND_FP8: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    c_blocks = tl.cdiv(C, BLOCK_C)
    pid_p = tl.program_id(0) // c_blocks
    pid_c = tl.program_id(0) % c_blocks
    pos = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    ch = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    n = pos // (OH * OW)
    oh = (pos // OW) % OH
    ow = pos % OW
    h0 = oh * SH - PH
    w0 = ow * SW - PW
    pos_ok = pos < P
    ch_ok = ch < C
    x_pos = x_ptr + n * stride_xn
    x_ch = ch * stride_xc
    other = float("-inf") if IS_MAX else 0.0
    out = tl.full((BLOCK_P, BLOCK_C), other, dtype=tl.float32)
    if KH * KW <= UNROLL_TAPS:
        for kh in tl.static_range(KH):
            for kw in tl.static_range(KW):
                out = _channels_tap(
                    out, x_pos, x_ch, pos_ok, ch_ok, h0 + kh, w0 + kw, H, W, stride_xh, stride_xw, IS_MAX, other
                )
    else:
        for kh in range(KH):
            for kw in range(KW):
                out = _channels_tap(
                    out, x_pos, x_ch, pos_ok, ch_ok, h0 + kh, w0 + kw, H, W, stride_xh, stride_xw, IS_MAX, other
                )
    if not IS_MAX:
        div = _window_divisor(h0, H, KH, PH, COUNT_INCLUDE_PAD) * _window_divisor(w0, W, KW, PW, COUNT_INCLUDE_PAD)
        out = out / div[:, None]
    else:
        out = tl.where(pos_ok[:, None] & ch_ok[None, :], out, 0.0)
    out = apply_activation(out, ACTIVATION, negative_slope)
    if ROUND_BF16:
        out = round_to_bf16(out)
    y_pos = y_ptr + n * stride_yn + oh * stride_yh + ow * stride_yw
    y_ptrs = y_pos[:, None] + (ch * stride_yc)[None, :]
    if Y_FP8:
        out = quantize_e4m3(out, y_inv_scale, ROUND_FP8)
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=pos_ok[:, None] & ch_ok[None, :])


# ---- the launcher ----


def pair(v, name: str) -> tuple[int, int]:
    """An int or a pair of ints, as torch's size arguments take them."""
    if isinstance(v, int):
        return (v, v)
    try:
        a, b = v
        return (int(a), int(b))
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an int or a pair of ints; got {v!r}") from None


def pool_output_size(size: int, k: int, s: int, p: int, ceil_mode: bool) -> int:
    """torch's pooling_output_shape: windows that start inside the input or the left padding; with ceil_mode
    a partial last window, unless it would start in the right padding."""
    out = (size + 2 * p - k + ((s - 1) if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    return out


def _check(x: torch.Tensor, kind: str, k, s, p, activation: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown pooling kind {kind!r}; expected 'avg' or 'max'")
    check_activation(activation)
    if x.dim() != 4:
        raise ValueError(f"x must be 4-D (N, C, H, W); got shape {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; fused_pool2d supports float32, float16, bfloat16")
    if x.numel() >= 2**31:
        raise ValueError(f"x has {x.numel()} elements; the kernel indexes with int32 (< 2**31)")
    check_device(x, "x")
    if min(k) < 1 or min(s) < 1 or min(p) < 0:
        raise ValueError(f"kernel_size and stride must be >= 1 and padding >= 0; got {k}, {s}, {p}")
    if p[0] > k[0] // 2 or p[1] > k[1] // 2:
        raise ValueError(f"padding {p} must be at most half of kernel_size {k}, as torch requires")


def channels_last(t: torch.Tensor) -> bool:
    """t is laid out NHWC. Where both layouts hold (one channel, or 1x1 planes), as torch decides: NHWC when
    the channel stride is the unit one (what .to(memory_format=torch.channels_last) gives one channel)."""
    if not t.is_contiguous(memory_format=torch.channels_last):
        return False
    return not t.is_contiguous() or (t.shape[1] == 1 and t.stride(1) == 1 and t.shape[2] * t.shape[3] > 1)


def _memory_format(x: torch.Tensor) -> torch.memory_format:
    return torch.channels_last if channels_last(x) else torch.contiguous_format


_configs: dict[tuple, LaunchConfig] = {}  # per call signature: the tuned config, without re-keying the tuner
on_new_picks(_configs.clear)  # a pick timed in the background replaces an untimed one: ask tune() again


def fused_pool2d(
    x: torch.Tensor,
    kind: str,
    kernel_size,
    stride=None,
    padding=(0, 0),
    *,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    activation: str = "none",
    negative_slope: float = DEFAULT_NEGATIVE_SLOPE,
    memory_format: torch.memory_format | None = None,
    out: torch.Tensor | None = None,
    out_scale: float | None = None,
) -> torch.Tensor:
    """act(avg_pool2d or max_pool2d (kind "avg" | "max") of x (N, C, H, W)), with torch's semantics for every
    argument; one kernel, fp32 inside, one rounding to x's dtype. Returns y (N, C, OH, OW) in
    `memory_format` (torch.contiguous_format or torch.channels_last; None: x's). count_include_pad matters for
    "avg" only. `out_scale`: y is e4m3 instead, quantized with that scale (kernels/fp8.py's `quantize`), for a
    float8 layer to read (a max of quantized values is the quantized max: the same bytes as quantizing after)."""
    k = pair(kernel_size, "kernel_size")
    s = k if stride is None else pair(stride, "stride")
    p = pair(padding, "padding")
    _check(x, kind, k, s, p, activation)
    N, C, H, W = x.shape
    OH = pool_output_size(H, k[0], s[0], p[0], ceil_mode)
    OW = pool_output_size(W, k[1], s[1], p[1], ceil_mode)
    if OH < 1 or OW < 1:
        raise ValueError(f"output of {kind} pooling {tuple(x.shape)} with kernel {k}, stride {s}, padding {p} is empty")
    fmt = _memory_format(x)
    y_dtype = E4M3 if out_scale is not None else x.dtype
    if out is None:
        out = torch.empty((N, C, OH, OW), device=x.device, dtype=y_dtype, memory_format=memory_format or fmt)
    elif out.shape != (N, C, OH, OW) or out.dtype != y_dtype or out.device != x.device:
        raise ValueError(f"out must be a ({N}, {C}, {OH}, {OW}) {y_dtype} tensor on {x.device}; got "
                         f"{tuple(out.shape)} {out.dtype}")  # fmt: skip
    if out.numel() == 0:
        return out

    layout = "channels" if fmt == torch.channels_last else "rows"
    if interpreting() and INTERPRETER.choice.layout is not None:
        layout = INTERPRETER.choice.layout
    # Non-overlapping windows along W with a power-of-two stride: one contiguous load per input row segment.
    span = k[1] <= s[1] and s[1] & (s[1] - 1) == 0 and s[1] <= 64
    fixed = dict(
        IS_MAX=kind == "max",
        KH=k[0], KW=k[1], SH=s[0], SW=s[1], PH=p[0], PW=p[1],
        COUNT_INCLUDE_PAD=bool(count_include_pad),
        ACTIVATION=activation,
        ROUND_BF16=bf16_on_interpreter(x.dtype) and out_scale is None,
        Y_FP8=out_scale is not None,
        ROUND_FP8=out_scale is not None and interpreting(),
        PDL=use_pdl(x.device),
    )  # fmt: skip
    y_inv_scale = inverse(out_scale) if out_scale is not None else 1.0
    if layout == "rows":
        fixed["SPAN"] = span
        count, inner, kernel = N * C * OH, OW, _pool_rows_kernel
        names = ("BLOCK_R", "BLOCK_OW")
    else:
        count, inner, kernel = N * OH * OW, C, _pool_channels_kernel
        names = ("BLOCK_P", "BLOCK_C")

    def run(config: LaunchConfig):
        meta = config.meta()
        grid = triton.cdiv(count, meta[names[0]]) * triton.cdiv(inner, meta[names[1]])
        return grid_launch(kernel, (grid,))(
            x, out,
            count, C, H, W, OH, OW,
            *x.stride(), *out.stride(),
            float(negative_slope), y_inv_scale,
            **fixed, **meta, **({"launch_pdl": True} if fixed["PDL"] else {}),
        )  # fmt: skip

    if interpreting():
        if INTERPRETER.choice.tile is not None:
            config = LaunchConfig.of(4, 1, **dict(zip(names, INTERPRETER.choice.tile, strict=True)))
        elif layout == "rows":
            config = _rows_config(count, OW, s[1], span, 4096, 4)
        else:
            config = _channels_config(count, C, 4096, 4)
        run(config)
        return out
    # Batches share a tuned config by power-of-two bucket of rows (or positions), as the GEMMs' do.
    bucket = 1 << max(count - 1, 0).bit_length()
    y_nchw = out.is_contiguous()
    signature = (layout, x.shape[1:], x.stride()[1:], y_nchw, x.dtype, y_dtype, kind, k, s, p, ceil_mode,
                 count_include_pad, activation, bucket)  # fmt: skip
    config = _configs.get(signature)
    if config is None:
        key = (
            f"{layout}|C{C}|H{H}|W{W}|{x.dtype}|{kind}|k{k}|s{s}|p{p}|ceil={ceil_mode}"
            f"|cip={count_include_pad}|{activation}|y={'nchw' if y_nchw else 'nhwc'}|n{bucket}"
        )
        if out_scale is not None:
            key += "|y=e4m3"
        scope = scope_for("pool", kernel)  # with every helper it calls (tuning.source_hash)
        config = tune(scope, key, cuda_configs(layout, bucket, inner, s[1], span), run)
        _configs[signature] = config
    run(config)
    return out


# ---- candidate configs (the tuner times them on CUDA) ----


def _rows_config(rows: int, OW: int, SW: int, span: bool, elems: int, warps: int) -> LaunchConfig:
    """A tile of about `elems` input elements per window row: as wide as the output rows (up to 1024
    input columns), then as many rows as fill it."""
    per_col = SW if span else 1
    bw = min(triton.next_power_of_2(OW), max(1, 1024 // per_col))
    br = max(1, min(triton.next_power_of_2(rows), elems // (bw * per_col)))
    return LaunchConfig.of(warps, 1, BLOCK_R=br, BLOCK_OW=bw)


def _channels_config(positions: int, C: int, elems: int, warps: int) -> LaunchConfig:
    bc = min(triton.next_power_of_2(C), 256)
    bp = max(1, min(triton.next_power_of_2(positions), elems // bc))
    return LaunchConfig.of(warps, 1, BLOCK_P=bp, BLOCK_C=bc)


def cuda_configs(layout: str, rows_or_positions: int, inner: int, SW: int, span: bool) -> list[LaunchConfig]:
    """Candidates the tuner times: 1-8K input elements per window row per program, 4 or 8 warps. Pooling is
    a stream: bigger tiles put more bytes in flight per SM; smaller ones more programs for small inputs. Without
    the contiguous span (overlapping windows), at most 32 outputs per thread."""
    out = []
    for elems in (1024, 2048, 4096, 8192):
        for warps in (4, 8):
            if not span and elems > 32 * 32 * warps:  # a load per window element: 64 per thread spilled (sm_90)
                continue
            if layout == "rows":
                c = _rows_config(rows_or_positions, inner, SW, span, elems, warps)
            else:
                c = _channels_config(rows_or_positions, inner, elems, warps)
            if c not in out:
                out.append(c)
    return out


# ---- under the interpreter: one config, from choices that tests change (interpreter.py) ----


SMALL_INTERPRETER_TILE = (2, 4)  # tests' tile: awkward shapes cross tile edges in both dimensions


@dataclass(frozen=True)
class InterpreterChoice:
    """What fused_pool2d runs under the interpreter. Its cost is per program, so by default one big tile."""

    tile: tuple[int, int] | None = None  # (BLOCK_R or BLOCK_P, BLOCK_OW or BLOCK_C); None: about 4096 elements
    layout: str | None = None  # the kernel: "rows" or "channels"; None: by x's memory format


INTERPRETER = InterpreterSwitches(InterpreterChoice())
