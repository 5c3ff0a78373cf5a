"""Fused float8 2-D convolution: y = act(conv2d(x, W) * s + b [+ residual]) with e4m3 operands, as an implicit GEMM.

The GEMM is conv.py's (M = N * OH * OW output pixels, OC columns, K = C * KH * KW), with e4m3 x and W tiles into
tl.dot and an fp32 accumulator. Hopper's e4m3 tensor cores do twice the multiply-adds per second of its fp16 ones,
and each layer reads and writes 1 byte per activation instead of 2. The epilogue (fp8.fp8_epilogue) dequantizes the
accumulator with one multiply per column (s[o] = s_x * s_w[o]: the input's per-tensor and the weight's per-channel
scale), adds the fp32 bias and the residual (e4m3 with its own scale, or fp16/fp32), applies the activation, and
writes either e4m3 quantized with the next layer's input scale (activations stay 1 byte between fp8 layers) or fp16
where the consumer is an fp16 step.

x may also be fp16 or fp32 (the output of an fp16 step: the stem conv, a pool): each gathered element is then
quantized with x's scale as it is loaded (QUANT_X), so the boundary costs no kernel of its own.

Layouts: x in any strides, channels_last best (a gathered K step is BLOCK_K contiguous channels, and Hopper's fp8
MMA takes its operands K-major from shared memory); the weight is made channels_last by the launcher for the same
reason. y comes back channels_last unless asked otherwise. groups=1, any stride, padding and dilation; no pool (a
pooled conv stays fp16 in a model: planner.group_conv_pools folds pools into fp16 convs only).

Two K loops, as conv.py's: FLAT_K over all C * KH * KW in (kh, kw, c) order, for few channels (C < 32); taps, one
(kh, kw) tap and BLOCK_K channels per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import conv_tma, conv_tma_fp8
from .activations import DEFAULT_NEGATIVE_SLOPE, check_activation
from .conv import _y_tile, conv_geometry, m_bucket, output_tensor
from .fp8 import (
    E4M3,
    FP8_OUT_DTYPES,
    FP8_X_DTYPES,
    check_fp8_bias,
    check_scale_vector,
    fp8_epilogue,
    fp8_flags,
    inverse,
    quantize_e4m3,
)
from .interpreter import InterpreterSwitches
from .launch import grid_launch
from .pdl import gdc_launch_dependents, gdc_wait, use_pdl
from .pool import channels_last as _channels_last
from .runtime import check_device, interpreting
from .tiles import (
    channels_last_alignment,
    device_limits,
    grouped_tile,
    known_multiple,
    known_strides,
    pow2_alignment,
    residual_like,
)
from .tuning import LaunchConfig, scope_for, tune
from .tuning_background import on_new_picks


@triton.jit
def _gather(ptrs, ok, x_inv_scale, QUANT_X: tl.constexpr, ROUND_FP8: tl.constexpr):
    """A gathered tile of x as e4m3: loaded as it is, or (QUANT_X: x is fp16/fp32) quantized with 1 / s_x as it is
    loaded. 0 where not `ok` (the padding, rows past M, channels past C): e4m3 0 either way."""
    a = tl.load(ptrs, mask=ok, other=0.0)
    if QUANT_X:
        a = quantize_e4m3(a.to(tl.float32), x_inv_scale, ROUND_FP8)
    return a


@triton.jit
def _gather_gated(ptrs, ok, g_ptrs, x_inv_scale, ROUND_FP8: tl.constexpr):
    """A gathered tile of an fp16/fp32 x times its squeeze-excitation gate (g[n, c], one value per image and channel),
    quantized with 1 / s_xg as it is loaded: x * g is never written, and is quantized once, with the scale calibrated
    for it (calibrate.gated_name). 0 where not `ok`."""
    a = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptrs, mask=ok, other=0.0).to(tl.float32)
    return quantize_e4m3(a * g, x_inv_scale, ROUND_FP8)


@triton.jit(do_not_specialize=["NB"])
def _conv2d_fp8_kernel(
    # pointers: x (e4m3, or fp16/fp32 with QUANT_X), w (e4m3), s (fp32 per output channel: s_x * s_w[o]), b (fp32
    # bias), y (e4m3, fp16 or fp32), r (the residual, with y's strides; unused without HAS_RESIDUAL), g (the gate,
    # (N, C); unused without HAS_GATE)
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, r_ptr, g_ptr,
    # sizes (the batch NB is the only run-time one; M = NB * OH * OW)
    NB, OC,
    # strides
    stride_xn, stride_xc, stride_xh, stride_xw,
    stride_wo, stride_wc, stride_wh, stride_ww,
    stride_yn, stride_yc, stride_yh, stride_yw,
    stride_gn, stride_gc,
    # scales: 1 / s_x (QUANT_X; with HAS_GATE, of x * gate), the residual's s_r (R_FP8), 1 / s_y (Y_FP8); the
    # epilogue's leaky_relu slope
    x_inv_scale, r_scale, y_inv_scale, negative_slope,
    # the layer's shape
    C: tl.constexpr, H: tl.constexpr, W: tl.constexpr, OH: tl.constexpr, OW: tl.constexpr,
    KH: tl.constexpr, KW: tl.constexpr, SH: tl.constexpr, SW: tl.constexpr,
    PH: tl.constexpr, PW: tl.constexpr, DH: tl.constexpr, DW: tl.constexpr,
    # meta-parameters
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ACTIVATION: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent launch (pdl.py)
    QUANT_X: tl.constexpr,  # x is fp16/fp32: quantized with x_inv_scale as gathered
    HAS_GATE: tl.constexpr,  # x times the gate g[n, c] as gathered, then quantized (QUANT_X is set with it)
    R_FP8: tl.constexpr,  # the residual is e4m3 (times r_scale), else read as it is
    Y_FP8: tl.constexpr,  # y is e4m3, quantized with y_inv_scale
    ROUND_FP8: tl.constexpr,  # round to e4m3 by hand before each cast (interpreter workaround, fp8.py)
    Y_PLANES: tl.constexpr,  # y is contiguous NCHW
    FLAT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    # what x's, the weight's and y's (and the residual's) pixel strides are multiples of (tiles.channels_last_alignment)
    X_ALIGN: tl.constexpr = 1, W_ALIGN: tl.constexpr = 1, Y_ALIGN: tl.constexpr = 1,
    OC_ALIGN: tl.constexpr = 1,  # what OC is a multiple of (tiles.pow2_alignment)
):  # fmt: skip
    # Said where Triton cannot see it (it specializes multiples of 16 only): 24 e4m3 channels in channels_last
    # (MobileNetV2's 24 -> 144 1x1 convs) are 8-byte strides, so a pixel's channels are gathered in 8-byte vectors,
    # not one byte at a time (sm_90 PTX of the 56x56 layer's pick: 64 ld.global.b8 a K step before these hints).
    stride_xn, stride_xh, stride_xw = known_strides(stride_xn, stride_xh, stride_xw, X_ALIGN)
    stride_wo, stride_wh, stride_ww = known_strides(stride_wo, stride_wh, stride_ww, W_ALIGN)
    stride_yn, stride_yh, stride_yw = known_strides(stride_yn, stride_yh, stride_yw, Y_ALIGN)
    # and of OC, whose mask then holds over runs of OC_ALIGN channels: 24 e4m3 output channels (MobileNetV2's
    # 144 -> 24) are stored in 8-byte vectors, not a byte at a time (128 st.global.b8 a tile before)
    OC = known_multiple(OC, OC_ALIGN)
    if PDL:  # the next layer may start; this one waits for the previous layer (below) before reading x
        gdc_launch_dependents()
    M = NB * (OH * OW)
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(OC, BLOCK_N), GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n = rows // (OH * OW)
    out_h = (rows // OW) % OH
    out_w = rows % OW
    m_ok = n < NB
    offs_n = tl.minimum(cols, OC - 1)  # columns past the edge compute on the last one, never stored
    w_cols = w_ptr + offs_n * stride_wo
    # Weights and their scales: no earlier kernel writes them, so before the PDL wait
    scale = tl.load(s_ptr + offs_n)
    bias = tl.load(b_ptr + offs_n).to(tl.float32) if HAS_BIAS else scale
    if PDL:
        gdc_wait()
    offs_k = tl.arange(0, BLOCK_K)
    h0 = out_h * SH - PH
    w0 = out_w * SW - PW
    x_corner = x_ptr + n * stride_xn + h0 * stride_xh + w0 * stride_xw
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FLAT_K:
        K = C * KH * KW
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            k_ok = offs_k < K - k0
            c = k % C  # (kh, kw, c) order: channels_last x gives runs of C contiguous channels
            kh = k // (KW * C)
            kw = (k // C) % KW
            ih = h0[:, None] + (kh * DH)[None, :]
            iw = w0[:, None] + (kw * DW)[None, :]
            a_ok = (m_ok[:, None] & k_ok[None, :]) & ((ih >= 0) & (ih < H) & (iw >= 0) & (iw < W))
            x_k = c * stride_xc + (kh * DH) * stride_xh + (kw * DW) * stride_xw
            if HAS_GATE:
                g_k = g_ptr + n[:, None] * stride_gn + (c * stride_gc)[None, :]
                a = _gather_gated(x_corner[:, None] + x_k[None, :], a_ok, g_k, x_inv_scale, ROUND_FP8)
            else:
                a = _gather(x_corner[:, None] + x_k[None, :], a_ok, x_inv_scale, QUANT_X, ROUND_FP8)
            w_k = c * stride_wc + kh * stride_wh + kw * stride_ww
            b = tl.load(w_cols[None, :] + w_k[:, None], mask=k_ok[:, None], other=0.0)
            acc = tl.dot(a, b, acc)
    else:
        c_steps = (C + BLOCK_K - 1) // BLOCK_K  # constexpr
        a_tile = x_corner[:, None] + (offs_k * stride_xc)[None, :]
        b_tile = w_cols[None, :] + (offs_k * stride_wc)[:, None]
        for step in range(0, KH * KW * c_steps):
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
            if HAS_GATE:
                g_k = g_ptr + n[:, None] * stride_gn + ((c0 + offs_k) * stride_gc)[None, :]
                a = _gather_gated(a_tile + x_step, a_ok, g_k, x_inv_scale, ROUND_FP8)
            else:
                a = _gather(a_tile + x_step, a_ok, x_inv_scale, QUANT_X, ROUND_FP8)
            b = tl.load(b_tile + (c0 * stride_wc + kh * stride_wh + kw * stride_ww), mask=c_ok[:, None], other=0.0)
            acc = tl.dot(a, b, acc)

    y_ok = m_ok[:, None] & (cols < OC)[None, :]
    if HAS_RESIDUAL:
        r_tile = _y_tile(r_ptr, n, rows, out_h, out_w, cols, stride_yn, stride_yc, stride_yh, stride_yw, OH, OW,
                         Y_PLANES)  # fmt: skip
        r = tl.load(r_tile, mask=y_ok, other=0.0)
    else:
        r = acc
    out = fp8_epilogue(acc, scale, bias, r, r_scale, negative_slope, y_inv_scale, HAS_BIAS, HAS_RESIDUAL, R_FP8,
                       ACTIVATION, Y_FP8, ROUND_FP8, y_ptr.dtype.element_ty)  # fmt: skip
    y_ptrs = _y_tile(y_ptr, n, rows, out_h, out_w, cols, stride_yn, stride_yc, stride_yh, stride_yw, OH, OW, Y_PLANES)
    tl.store(y_ptrs, out, mask=y_ok)


# ---- the launcher ----


def _check(x, weight, scale, bias, activation, residual, out_dtype) -> None:
    check_activation(activation)
    if x.dim() != 4 or weight.dim() != 4:
        raise ValueError(f"x and weight must be 4-D; got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"x has C={x.shape[1]} channels but weight (OC, C, KH, KW) has C={weight.shape[1]} (groups=1)")
    if min(weight.shape) < 1:
        raise ValueError(f"weight must have every dimension >= 1; got shape {tuple(weight.shape)}")
    if weight.dtype != E4M3:
        raise TypeError(f"weight has dtype {weight.dtype}; fused_conv2d_fp8 takes float8_e4m3fn (fp8.quantize_weight)")
    if x.dtype not in FP8_X_DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; fused_conv2d_fp8 takes float8_e4m3fn, float16 or float32")
    if out_dtype not in FP8_OUT_DTYPES:
        raise TypeError(f"out_dtype {out_dtype}: fused_conv2d_fp8 writes float8_e4m3fn, float16 or float32")
    for t, name in ((x, "x"), (weight, "weight")):
        check_device(t, name)
        if t.numel() >= 2**31:
            raise ValueError(f"{name} has {t.numel()} elements; the kernel indexes with int32 (< 2**31)")
        if t.device != x.device:
            raise ValueError(f"x is on {x.device} but {name} is on {t.device}")
    check_scale_vector(scale, weight.shape[0], x.device)
    check_fp8_bias(bias, weight.shape[0], x.device)
    if residual is not None and residual.dtype not in FP8_OUT_DTYPES:
        raise TypeError(f"residual has dtype {residual.dtype}; want float8_e4m3fn (with residual_scale), fp16 or fp32")


def _gate_2d(gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The gate as the kernel reads it, (N, C) with its own strides; a clear error for a wrong shape, device or x."""
    N, C = x.shape[:2]
    if x.dtype == E4M3:
        raise TypeError("a gate needs x in float16 or float32 (x * gate is quantized as it is read); x is e4m3")
    if gate.dim() == 4 and tuple(gate.shape[2:]) == (1, 1):
        gate = gate[:, :, 0, 0]
    if tuple(gate.shape) != (N, C):
        raise ValueError(f"gate must be (N, C) = ({N}, {C}) or (N, C, 1, 1); got {tuple(gate.shape)}")
    if not gate.is_floating_point() or gate.dtype == E4M3:
        raise TypeError(f"gate has dtype {gate.dtype}; want float16, bfloat16 or float32")
    if gate.device != x.device:
        raise ValueError(f"x is on {x.device} but gate is on {gate.device}")
    return gate


_configs: dict[tuple, LaunchConfig] = {}  # per (layer signature, M bucket): the tuned config
on_new_picks(_configs.clear)


def fused_conv2d_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    stride=(1, 1),
    padding=(0, 0),
    dilation=(1, 1),
    activation: str = "none",
    negative_slope: float = DEFAULT_NEGATIVE_SLOPE,
    x_scale: float = 1.0,
    residual: torch.Tensor | None = None,
    residual_scale: float = 1.0,
    out_scale: float | None = None,
    out_dtype: torch.dtype = torch.float16,
    memory_format: torch.memory_format | None = None,
    out: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """act(conv2d(x, weight) * scale[o] + bias [+ residual]) with e4m3 operands and an fp32 accumulator; groups=1.

    x (N, C, H, W): float8_e4m3fn, or float16/float32 quantized as it is read with `x_scale` (e4m3(x / x_scale));
    weight (OC, C, KH, KW) float8_e4m3fn (fp8.quantize_weight: per output channel); scale (OC,) float32, the
    dequantizing multiplier s_x * s_w[o] (fp8.dequant_scale); bias (OC,) float32 or None.
    residual: None, or a tensor of the output's shape, float8_e4m3fn (read times `residual_scale`), fp16 or fp32,
    added before the activation.
    out_scale: the output's quantization scale (the next fp8 layer's input scale): y = e4m3(v / out_scale); None:
    y in out_dtype (float16 or float32).
    memory_format: of the returned tensor; None: channels_last.
    gate: None, or the squeeze-excitation gate of an fp16/fp32 x, one value per image and channel ((N, C) or
    (N, C, 1, 1), any float dtype): the conv reads e4m3(x * gate / x_scale), x_scale being that product's scale.
    """
    y_dtype = E4M3 if out_scale is not None else out_dtype
    _check(x, weight, scale, bias, activation, residual, y_dtype)
    if gate is not None:
        gate = _gate_2d(gate, x)
    s, p, d, OH, OW = conv_geometry(x, weight, stride, padding, dilation)
    N, C, H, W = x.shape
    OC, _, KH, KW = weight.shape
    out = output_tensor(out, (N, OC, OH, OW), y_dtype, x.device, memory_format or torch.channels_last)
    has_residual = residual is not None
    if has_residual:
        residual = residual_like(residual, out, any_dtype=True)  # at y's offsets; not out's own memory
    M = N * OH * OW
    if M == 0:
        return out
    # Hopper's fp8 MMA reads both operands K-major: the weight's channels contiguous (a no-op for a prepared layer)
    if not weight.is_contiguous(memory_format=torch.channels_last) or weight.shape[1] == 1:
        weight = weight.contiguous(memory_format=torch.channels_last)
    channels_last = _channels_last(x)
    y_planes = out.stride()[1:] == (OH * OW, OW, 1)
    flags = fp8_flags(x, y_dtype, residual)
    has_gate = gate is not None
    geometry = dict(C=C, H=H, W=W, OH=OH, OW=OW, KH=KH, KW=KW, SH=s[0], SW=s[1], PH=p[0], PW=p[1], DH=d[0], DW=d[1])
    pdl = use_pdl(x.device)
    scales = (
        inverse(x_scale) if flags["QUANT_X"] else 1.0,
        float(residual_scale) if flags["R_FP8"] else 1.0,
        inverse(out_scale) if out_scale is not None else 1.0,
        float(negative_slope),
    )

    # conv_tma_fp8's TMA boxes where they can run: e4m3 x and the weight channels_last, 16-byte rows, strides that
    # divide the image (an fp16/fp32 x, quantized as it is gathered, stays with the gathers: `eligible` says so)
    tma = not has_gate and conv_tma_fp8.eligible(x, weight, s, out)

    # OC's alignment where Triton does not know it itself (a multiple of 16) and there is one
    oc_align = {"OC_ALIGN": pow2_alignment(OC)} if 1 < pow2_alignment(OC) < 16 else {}

    def run(config: LaunchConfig):
        if conv_tma.is_tma(config):
            return conv_tma_fp8.launch(x, weight, scale, bias, out, residual if has_residual else None, scales[1:],
                                       flags, geometry, activation, pdl, config)  # fmt: skip
        meta = config.meta()
        tiles = triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(OC, meta["BLOCK_N"])
        return grid_launch(_conv2d_fp8_kernel, (tiles,))(
            x, weight, scale, bias if bias is not None else scale, out, residual if has_residual else out,
            gate if has_gate else scale,
            N, OC,
            *x.stride(), *weight.stride(), *out.stride(), *(gate.stride() if has_gate else (0, 0)),
            *scales,
            **geometry, HAS_BIAS=bias is not None, HAS_RESIDUAL=has_residual, ACTIVATION=activation, PDL=pdl,
            **flags, HAS_GATE=has_gate, Y_PLANES=y_planes, **meta, **({"launch_pdl": True} if pdl else {}),
            X_ALIGN=channels_last_alignment(x), W_ALIGN=channels_last_alignment(weight),
            Y_ALIGN=channels_last_alignment(out), **oc_align,
        )  # fmt: skip

    K = C * KH * KW
    if interpreting():
        if INTERPRETER.choice.tma and tma:
            run(conv_tma_fp8.interpreter_config(OC, C, OH, OW, s != (1, 1), INTERPRETER.choice.tma_pixels))
        else:
            run(_interpreter_config(M, OC, C, K))
        return out
    bucket = m_bucket(M)
    signature = (tuple(weight.shape), weight.stride(), x.shape[1:], x.stride()[1:], x.dtype, s, p, d, activation,
                 bias is not None, y_dtype, y_planes, bucket, has_residual and residual.dtype, tma,
                 has_gate)  # fmt: skip
    config = _configs.get(signature)
    if config is None:
        key = (
            f"OC{OC}|C{C}|H{H}|W{W}|k{KH}x{KW}|s{s}|p{p}|d{d}|x={x.dtype}|y={y_dtype}|{activation}"
            f"|bias={bias is not None}|{'nhwc' if channels_last else 'nchw'}|y={'nchw' if y_planes else 'nhwc'}"
            f"|m{bucket}"
        )
        if has_residual:
            key += f"|residual={residual.dtype}"
        if has_gate:
            key += "|gate"
        candidates = cuda_configs(bucket, OC, C, K, device_limits(x.device)[0])
        if tma:  # x and the weight channels_last, aligned: TMA candidates too
            key += "|tma"
            candidates += conv_tma.cuda_configs(bucket, OC, C, OH, OW, (1, 1), 1, strided=s != (1, 1),
                                                out_size=out.element_size())  # fmt: skip
        scope = scope_for("conv2d_fp8", _conv2d_fp8_kernel, conv_tma_fp8._conv2d_tma_fp8_kernel)
        config = tune(scope, key, candidates, run)
        _configs[signature] = config
    run(config)
    return out


# ---- candidate configs (the tuner times them on CUDA) ----


def _fit(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(n)))


def cuda_configs(bucket: int, OC: int, C: int, K: int, sms: int = 132) -> list[LaunchConfig]:
    """Candidates for one layer and M bucket. conv.py's tiles with K steps twice as deep in elements (the same bytes
    per step: 64 and 128 e4m3 channels against fp16's 32 and 64), never below 32 (Hopper's fp8 MMA takes K in steps of
    32); FLAT_K only below 32 channels. Small M (batch 1 of a late stage: 49 pixels) also gets 32-row tiles and
    narrower column blocks, so that more SMs gather at once."""
    bn = _fit(OC, 32, 128)
    width = K if C < 32 else C
    ks = sorted({_fit(width, 32, 128), _fit(width, 32, 64)})
    flat = 1 if C < 32 else 0

    def cfg(warps, stages, bm, bn, bk):
        return LaunchConfig.of(warps, stages, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, FLAT_K=flat)

    out = []
    for bk in ks:
        out += [cfg(4, 4, 64, bn, bk), cfg(8, 3, 128, bn, bk)]
        if bucket > 64:
            out.append(cfg(4, 3, 128, bn, bk))
        if OC >= 256 and bucket > 64:
            out.append(cfg(8, 3, 128, 256, bk))
    if triton.cdiv(bucket, 64) * triton.cdiv(OC, bn) < sms:
        for bn_small in sorted({bn, min(bn, 64)}):
            for bk in ks:
                out.append(cfg(4, 3, 32, bn_small, bk))
    return out


# ---- under the interpreter: one config, from choices that tests change (interpreter.py) ----


SMALL_INTERPRETER_TILE = (16, 16, 32)  # tests' tile: awkward shapes cross every block edge


@dataclass(frozen=True)
class InterpreterChoice:
    """What fused_conv2d_fp8 runs under the interpreter: by default the largest tile the problem fills."""

    tile: tuple[int, int, int] | None = None  # (BLOCK_M, BLOCK_N, BLOCK_K)
    flat_k: bool | None = None  # None: FLAT_K below 32 channels
    tma: bool = False  # calls conv_tma_fp8 can run (its `eligible`) run it
    tma_pixels: int = 64  # its output box's pixels (tests: 32, so that boxes cross image edges)


INTERPRETER = InterpreterSwitches(InterpreterChoice())


def _interpreter_config(M: int, OC: int, C: int, K: int) -> LaunchConfig:
    choice = INTERPRETER.choice
    bm, bn, bk = choice.tile or (_fit(M, 16, 64), _fit(OC, 16, 128), _fit(K if C < 32 else C, 32, 128))
    flat = choice.flat_k if choice.flat_k is not None else (C < 32)
    return LaunchConfig.of(4, 1, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=4, FLAT_K=int(flat))
