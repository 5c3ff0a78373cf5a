"""Fused float8 linear layer: y = act(x @ W^T * s + b [+ residual]) with e4m3 operands, in one Triton kernel.

linear.py's GEMM with e4m3 x and W tiles into tl.dot (twice Hopper's fp16 multiply-add rate, half the bytes) and
an fp32 accumulator; the epilogue is fp8.fp8_epilogue: dequantize with s[n] = s_x * s_w[n], bias, residual,
activation, then e4m3 with the next layer's input scale or fp16 for an fp16 consumer. x may be fp16/fp32 (the
output of an fp16 step), quantized with its scale as each tile is loaded.

Shapes (nn.Linear's layout): x (M, K) contiguous, weight (N, K) e4m3 contiguous (K-major, as Hopper's fp8 MMA
takes it), scale and bias (N,) fp32, residual and y (M, N).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .activations import DEFAULT_NEGATIVE_SLOPE, check_activation
from .conv_fp8 import _gather
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
from .linear import m_bucket
from .pdl import gdc_launch_dependents, gdc_wait, use_pdl
from .runtime import check_device, interpreting
from .tiles import device_limits, grouped_tile
from .tuning import LaunchConfig, scope_for, tune
from .tuning_background import on_new_picks


@triton.jit(do_not_specialize=["M"])
def _linear_fp8_kernel(
    # pointers: x (e4m3, or fp16/fp32 with QUANT_X), w (e4m3), s (fp32: s_x * s_w[n]), b (fp32 bias), y, r (residual,
    # y's strides; unused without HAS_RESIDUAL)
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, r_ptr,
    # sizes
    M, N, K,
    # strides
    stride_xm, stride_xk,
    stride_wn, stride_wk,
    stride_ym, stride_yn,
    # scales: 1 / s_x (QUANT_X), the residual's s_r (R_FP8), 1 / s_y (Y_FP8); the leaky_relu slope
    x_inv_scale, r_scale, y_inv_scale, negative_slope,
    # meta-parameters
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ACTIVATION: tl.constexpr, PDL: tl.constexpr,
    QUANT_X: tl.constexpr, R_FP8: tl.constexpr, Y_FP8: tl.constexpr, ROUND_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    if PDL:
        gdc_launch_dependents()
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows and columns past the edge read the last one (clamped, linear.py): computed, never stored
    offs_m = tl.minimum(rows, M - 1)
    offs_n = tl.minimum(cols, N - 1)
    scale = tl.load(s_ptr + offs_n)
    bias = tl.load(b_ptr + offs_n).to(tl.float32) if HAS_BIAS else scale
    if PDL:
        gdc_wait()
    offs_k = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_tile = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn  # a (BLOCK_K, BLOCK_N) view of W^T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = _gather(x_tile + k * BLOCK_K * stride_xk, offs_k[None, :] < k_left, x_inv_scale, QUANT_X, ROUND_FP8)
        b = tl.load(w_tile + k * BLOCK_K * stride_wk, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc)

    y_offs = rows[:, None] * stride_ym + cols[None, :] * stride_yn
    y_mask = (rows[:, None] < M) & (cols[None, :] < N)
    r = tl.load(r_ptr + y_offs, mask=y_mask, other=0.0) if HAS_RESIDUAL else acc
    out = fp8_epilogue(acc, scale, bias, r, r_scale, negative_slope, y_inv_scale, HAS_BIAS, HAS_RESIDUAL, R_FP8,
                       ACTIVATION, Y_FP8, ROUND_FP8, y_ptr.dtype.element_ty)  # fmt: skip
    tl.store(y_ptr + y_offs, out, mask=y_mask)


# ---- the launcher ----


_configs: dict[tuple, LaunchConfig] = {}
on_new_picks(_configs.clear)


def fused_linear_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    *,
    negative_slope: float = DEFAULT_NEGATIVE_SLOPE,
    x_scale: float = 1.0,
    residual: torch.Tensor | None = None,
    residual_scale: float = 1.0,
    out_scale: float | None = None,
    out_dtype: torch.dtype = torch.float16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """act(x @ weight.T * scale[n] + bias [+ residual]) with e4m3 operands and an fp32 accumulator; returns y (M, N).

    x (M, K) contiguous: float8_e4m3fn, or float16/float32 quantized as it is read with `x_scale`; weight (N, K)
    float8_e4m3fn contiguous (fp8.quantize_weight); scale (N,) float32 (fp8.dequant_scale); bias (N,) float32 or None;
    residual (M, N) e4m3 (times residual_scale), fp16 or fp32, or None; out_scale: y = e4m3(v / out_scale), or None
    for y in out_dtype (float16 or float32)."""
    check_activation(activation)
    y_dtype = E4M3 if out_scale is not None else out_dtype
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x (M, K) and weight (N, K) must agree on K; got {tuple(x.shape)} and {tuple(weight.shape)}")
    if weight.dtype != E4M3:
        raise TypeError(f"weight has dtype {weight.dtype}; fused_linear_fp8 takes float8_e4m3fn")
    if x.dtype not in FP8_X_DTYPES or y_dtype not in FP8_OUT_DTYPES:
        raise TypeError(f"x {x.dtype} -> y {y_dtype}: fused_linear_fp8 reads e4m3/fp16/fp32 and writes e4m3/fp16/fp32")
    for t, name in ((x, "x"), (weight, "weight")):
        check_device(t, name)
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous; got strides {t.stride()}")
        if t.device != x.device:
            raise ValueError(f"x is on {x.device} but {name} is on {t.device}")
    M, K = x.shape
    N = weight.shape[0]
    check_scale_vector(scale, N, x.device)
    check_fp8_bias(bias, N, x.device)
    if out is None:
        out = torch.empty((M, N), device=x.device, dtype=y_dtype)
    elif tuple(out.shape) != (M, N) or out.dtype != y_dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous ({M}, {N}) {y_dtype} tensor; got {tuple(out.shape)} {out.dtype}")
    has_residual = residual is not None
    if has_residual:
        if tuple(residual.shape) != (M, N) or residual.dtype not in FP8_OUT_DTYPES:
            raise ValueError(
                f"residual must be ({M}, {N}) e4m3/fp16/fp32; got {tuple(residual.shape)} {residual.dtype}"
            )
        residual = residual.contiguous()
    if M == 0:
        return out
    flags = fp8_flags(x, y_dtype, residual)
    pdl = use_pdl(x.device)
    scales = (
        inverse(x_scale) if flags["QUANT_X"] else 1.0,
        float(residual_scale) if flags["R_FP8"] else 1.0,
        inverse(out_scale) if out_scale is not None else 1.0,
        float(negative_slope),
    )

    def run(config: LaunchConfig):
        meta = config.meta()
        tiles = triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])
        return grid_launch(_linear_fp8_kernel, (tiles,))(
            x, weight, scale, bias if bias is not None else scale, out, residual if has_residual else out,
            M, N, K,
            x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
            *scales,
            HAS_BIAS=bias is not None, HAS_RESIDUAL=has_residual, ACTIVATION=activation, PDL=pdl, **flags, **meta,
            **({"launch_pdl": True} if pdl else {}),
        )  # fmt: skip

    if interpreting():
        run(_interpreter_config(M, N, K))
        return out
    bucket = m_bucket(M)
    signature = (N, K, x.dtype, y_dtype, activation, bias is not None, bucket, has_residual and residual.dtype)
    config = _configs.get(signature)
    if config is None:
        key = f"N{N}|K{K}|x={x.dtype}|y={y_dtype}|{activation}|bias={bias is not None}|m{bucket}"
        if has_residual:
            key += f"|residual={residual.dtype}"
        scope = scope_for("linear_fp8", _linear_fp8_kernel)
        config = tune(scope, key, cuda_configs(bucket, N, K, device_limits(x.device)[0]), run)
        _configs[signature] = config
    run(config)
    return out


# ---- candidate configs (the tuner times them on CUDA) ----


def cuda_configs(bucket: int, N: int, K: int, sms: int = 132) -> list[LaunchConfig]:
    """Candidates for one (batch bucket, N, K): linear.py's tiles with K steps twice as deep in elements (the same
    bytes per step), never below 32 (Hopper's fp8 MMA takes K in steps of 32). Batches of up to 64 rows stream the
    weights: narrow 16- and 32-row tiles and deep K steps, so that every SM loads."""

    def cfg(bm, bn, bk, warps, stages):
        return LaunchConfig.of(warps, stages, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8)

    if bucket <= 64:
        out = [cfg(bm, bn, bk, 4, 4) for bm in (16, 32) for bn in (32, 64) for bk in (128, 256)]
        out += [cfg(64, 64, 128, 4, 4), cfg(64, 128, 128, 4, 4)]
    else:
        out = [
            cfg(128, 256, 128, 8, 3),
            cfg(128, 128, 128, 8, 3),
            cfg(128, 128, 128, 4, 4),
            cfg(64, 128, 128, 4, 4),
            cfg(64, 64, 128, 4, 4),
            cfg(64, 128, 64, 4, 6),
        ]
    # K shorter than a step: a step no deeper than K (rounded up to 32)
    kmax = max(32, triton.next_power_of_2(K))
    return list(dict.fromkeys(LaunchConfig.of(c.num_warps, c.num_stages, **{**dict(c.kwargs),
                                              "BLOCK_K": min(c["BLOCK_K"], kmax)}) for c in out))  # fmt: skip


# ---- under the interpreter ----


SMALL_INTERPRETER_TILE = (16, 32, 32)  # tests' tile: awkward shapes cross block edges in every dimension


@dataclass(frozen=True)
class InterpreterChoice:
    """What fused_linear_fp8 runs under the interpreter: by default the largest tile the problem fills."""

    tile: tuple[int, int, int] | None = None  # (BLOCK_M, BLOCK_N, BLOCK_K)


INTERPRETER = InterpreterSwitches(InterpreterChoice())


def _interpreter_config(M: int, N: int, K: int) -> LaunchConfig:
    def fit(n: int, lo: int, hi: int) -> int:
        return max(lo, min(hi, triton.next_power_of_2(n)))

    bm, bn, bk = INTERPRETER.choice.tile or (fit(M, 16, 64), fit(N, 16, 256), fit(K, 32, 128))
    return LaunchConfig.of(4, 1, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=4)
