"""What the float8 kernels share (conv_fp8.py, linear_fp8.py): e4m3 rounding, quantizing an fp32 tile, the
dequantizing epilogue, and the host-side quantization of weights and activations.

Format: torch.float8_e4m3fn (Triton's tl.float8e4nv), 1 sign, 4 exponent, 3 mantissa bits, no infinities, largest
finite value 448, smallest normal 2**-6, subnormals in steps of 2**-9. A tensor t is stored as q = e4m3(t / s) with
a scale s: per output channel for weights (s[o] = max |W[o]| / 448), one per tensor for activations (s = the
calibrated max |x| / 448). Dequantized, t ~ q * s; a value is off by at most half an e4m3 step, 2**-4 of itself
(6.25%) for normals.

A GEMM of two e4m3 operands multiplies exactly in fp32 (3 + 3 mantissa bits: the product has 8) and accumulates in
fp32; the epilogue turns the accumulator into the layer's output with one multiply per column, acc * (s_x * s_w[o]),
then adds the bias and the residual, applies the activation, and either rounds to fp16 (the consumer is an fp16 step)
or quantizes for the next fp8 layer, q = e4m3(clamp(v * (1 / s_y), -448, 448)), its input scale s_y.

Interpreter (triton 3.9): tl.dot on float8e4nv operands is exact (every one of the 256 codes times the identity gives
itself back), and so is the fp32 -> e4m3 cast of a value that e4m3 holds; but the cast of any other value is wrong
(its rounding carry never reaches the exponent: 1.99 -> 1.0, 31.6 -> 16; 470 -> NaN). So under the interpreter the
quantizer rounds to e4m3 by hand first (ROUND_FP8, `round_to_e4m3`), and the cast is then exact; compiled kernels
cast with the hardware's round-to-nearest-even (cvt.rn.satfinite.e4m3x2.f32 on sm_89+).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .activations import apply_activation
from .runtime import interpreting

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # largest finite e4m3fn value
FP8_OUT_DTYPES = (E4M3, torch.float16, torch.float32)  # what an fp8 layer writes
FP8_X_DTYPES = (E4M3, torch.float16, torch.float32)  # what it reads: e4m3, or fp16/fp32 quantized as it is read


def fp8_capable(device: torch.device | str | None = None) -> bool:
    """Whether compiled fp8 dots run on `device`: CUDA compute capability 8.9+ (Ada, Hopper). Under the interpreter
    True (numpy runs them)."""
    if interpreting():
        return True
    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


@triton.jit
def round_to_e4m3(x):
    """fp32 x (|x| <= 448) rounded to the nearest e4m3 value (ties to even), returned as fp32 holding that value, so
    that the interpreter's cast to float8e4nv is exact (module docstring). Normals (|x| >= 2**-6): add 0x7FFFF plus
    the lowest kept bit to the bit pattern and clear the 20 dropped bits (3 mantissa bits kept; a carry runs into the
    exponent, as rounding 1.96 up to 2.0 must). Subnormals (steps of 2**-9): (|x| + 2**14) - 2**14 in fp32, whose
    ulp at 2**14 is 2**-9, rounds to that step, ties to even."""
    a = tl.abs(x)
    bits = a.to(tl.uint32, bitcast=True)
    bits = (bits + (0x7FFFF + ((bits >> 20) & 1))) & 0xFFF00000
    normal = bits.to(tl.float32, bitcast=True)
    subnormal = (a + 16384.0) - 16384.0
    r = tl.where(a < 0.015625, subnormal, normal)
    return tl.where(x < 0, -r, r)


@triton.jit
def quantize_e4m3(v, inv_scale, ROUND_FP8: tl.constexpr):
    """An fp32 tile as e4m3: v * inv_scale, saturated to +-448 (torch's cast would give NaN past 464), rounded to
    nearest even. NaN stays NaN."""
    q = v * inv_scale
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    if ROUND_FP8:
        q = round_to_e4m3(q)
    return q.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def fp8_epilogue(acc, scale, bias, r, r_scale, negative_slope, y_inv_scale, HAS_BIAS: tl.constexpr,
                 HAS_RESIDUAL: tl.constexpr, R_FP8: tl.constexpr, ACTIVATION: tl.constexpr, Y_FP8: tl.constexpr,
                 ROUND_FP8: tl.constexpr, OUT_DTYPE: tl.constexpr):  # fmt: skip
    """The (BLOCK_M, BLOCK_N) fp32 accumulator of e4m3 products as the layer's output tile: dequantized (times
    `scale`, (BLOCK_N,) s_x * s_w[o]), plus the bias (BLOCK_N,) and the residual tile `r` (times r_scale where it is
    e4m3), activated, then quantized with y_inv_scale (Y_FP8) or cast to OUT_DTYPE."""
    acc = acc * scale[None, :]
    if HAS_BIAS:
        acc = acc + bias[None, :]
    if HAS_RESIDUAL:
        acc = acc + r.to(tl.float32) * r_scale if R_FP8 else acc + r.to(tl.float32)
    acc = apply_activation(acc, ACTIVATION, negative_slope)
    if Y_FP8:
        return quantize_e4m3(acc, y_inv_scale, ROUND_FP8)
    return acc.to(OUT_DTYPE)


# ---- host side ----


def scale_of(absmax: float) -> float:
    """The per-tensor scale of an activation whose calibrated max |x| is `absmax`: absmax / 448 (1 for an all-zero
    tensor, so that nothing divides by 0)."""
    absmax = float(absmax)
    return absmax / E4M3_MAX if absmax > 0 else 1.0


def inverse(scale: float) -> float:
    """1 / scale as the kernels multiply by it: computed in float64, rounded once to fp32 (the reference does the
    same, so both quantize with the same multiplier)."""
    return float(torch.tensor(1.0 / float(scale), dtype=torch.float32))


def quantize(t: torch.Tensor, scale: float) -> torch.Tensor:
    """t as e4m3 with one scale: clamp(t * fp32(1 / scale), -448, 448) rounded to nearest even, in fp32."""
    return (t.float() * inverse(scale)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, fp32 scale per output channel (dim 0)) with scale[o] = max |W[o]| / 448 (1 for an all-zero row),
    computed in float64 from the weight as given (the fused executor's folded batch norm is float64)."""
    w = weight.double()
    absmax = w.abs().reshape(w.shape[0], -1).amax(dim=1)
    scale = torch.where(absmax > 0, absmax / E4M3_MAX, torch.ones_like(absmax))
    q = (w / scale.reshape(-1, *([1] * (w.dim() - 1)))).clamp(-E4M3_MAX, E4M3_MAX).float().to(E4M3)
    return q, scale.float()


def dequant_scale(x_scale: float, w_scale: torch.Tensor) -> torch.Tensor:
    """The epilogue's per-column multiplier s_x * s_w[o], in fp32 (computed in float64)."""
    return (w_scale.double() * float(x_scale)).float()


def check_scale_vector(scale: torch.Tensor, n: int, device: torch.device) -> None:
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or tuple(scale.shape) != (n,):
        got = f"{scale.dtype} {tuple(scale.shape)}" if isinstance(scale, torch.Tensor) else repr(scale)
        raise ValueError(f"scale must be a float32 tensor of shape ({n},) (s_x * s_w per output channel); got {got}")
    if scale.device != device or not scale.is_contiguous():
        raise ValueError(f"scale must be contiguous on {device}; got one on {scale.device}")


def check_fp8_bias(bias: torch.Tensor | None, n: int, device: torch.device) -> None:
    if bias is None:
        return
    if tuple(bias.shape) != (n,) or bias.dtype != torch.float32 or bias.device != device or not bias.is_contiguous():
        raise ValueError(
            f"bias must be a contiguous float32 tensor of shape ({n},) on {device}; got {bias.dtype} "
            f"{tuple(bias.shape)} on {bias.device}"
        )


def fp8_flags(x: torch.Tensor, out_dtype: torch.dtype, residual: torch.Tensor | None) -> dict:
    """QUANT_X, Y_FP8, R_FP8 and ROUND_FP8 as the fp8 kernels take them (the output's other dtypes the kernels read
    from y's pointer)."""
    return dict(
        QUANT_X=x.dtype != E4M3,
        Y_FP8=out_dtype == E4M3,
        R_FP8=residual is not None and residual.dtype == E4M3,
        ROUND_FP8=interpreting(),
    )
