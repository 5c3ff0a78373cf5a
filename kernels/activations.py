"""The activation table: one Triton device function covering every activation, and its torch twin.

The fused kernels take the activation as a `tl.constexpr` string, so each (kernel, activation)
pair compiles to straight-line code with no branch at run time. `torch_activation` is the
reference the tests and the unfused executor use; both sides must list the same names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .runtime import interpreting

# Names accepted everywhere (kernels, reference, model config). "gelu" is the erf form, "gelu_tanh"
# the tanh approximation (torch's approximate="tanh"); "relu6" is min(max(x, 0), 6) (ONNX's Clip(0, 6)),
# "hardswish" x * relu6(x + 3) / 6 (MobileNetV3's, torch's F.hardswish).
ACTIVATIONS = (
    "none", "relu", "leaky_relu", "gelu", "gelu_tanh", "sigmoid", "silu", "tanh", "relu6", "hardswish", "hardsigmoid",
)  # fmt: skip
DEFAULT_NEGATIVE_SLOPE = 0.01  # torch.nn.LeakyReLU's default


def check_activation(name: str) -> None:
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; expected one of {', '.join(ACTIVATIONS)}")


LOG2E = tl.constexpr(1.4426950408889634)

# Compiled, 2**x and 1/x go to the special-function unit as one bare instruction each (PTX ex2.approx.ftz,
# rcp.approx.ftz: relative errors 2**-22 and 1 ulp; subnormals flushed to zero). Triton's tl.exp2 and `/` add
# fix-ups for subnormal inputs, 2 compares and 2-3 multiplies around each: with them the erf GELU epilogue of a
# 128x128 fp16 tile is 32 instructions an element against 20, and 4096x768 -> 3072 takes 59.3 us against 48.8
# (39.0 with no activation; H100, bench/results/h100/probe_gemm_epilogue_h100.txt).
# The interpreter has no PTX: there they are numpy's exp2 and division.
_BARE_MUFU = tl.constexpr(not interpreting())


@triton.jit
def _approx(x, OP: tl.constexpr):
    """2**x (OP "ex2") or 1/x (OP "rcp") of an fp32 tile."""
    if _BARE_MUFU:
        return tl.inline_asm_elementwise(OP + ".approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)  # fmt: skip
    elif OP == "ex2":
        return tl.exp2(x)
    else:
        return 1.0 / x


@triton.jit
def _sigmoid(x):
    # 1 / (1 + 2**(-x log2 e)): +-inf and NaN as torch answers them (2**inf = inf, 1/inf = 0)
    return _approx(1.0 + _approx(x * -LOG2E, "ex2"), "rcp")


@triton.jit
def _tanh(x):
    # Triton has no tanh that also runs under the interpreter (libdevice does not), so build it from
    # exp: tanh|x| = (1 - t) / (1 + t), t = exp(-2|x|) <= 1, which never overflows. For |x| < 0.25 that
    # subtraction loses digits (relative error ~1e-4 at |x| = 1e-3), so use the odd Taylor series
    # there: its first omitted term, 62x^9/2835, is below 4e-7 relative at |x| = 0.25.
    a = tl.abs(x)
    t = _approx(a * (-2.0 * LOG2E), "ex2")
    big = (1.0 - t) * _approx(1.0 + t, "rcp")
    x2 = a * a
    small = a * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    r = tl.where(a < 0.25, small, big)
    return tl.where(x < 0, -r, r)


@triton.jit
def _phi_tail(x):
    """erfc(|x| / sqrt 2) for any x: Numerical Recipes' erfcc, fractional error < 1.2e-7 for every argument,
    as t * 2**(log2 e * (p(t) - z^2)), t = 1 / (1 + z / 2), with log2 e folded into p's coefficients and z^2 =
    x^2 / 2: 9 FMAs, 2 special-function ops and 5 more instructions an element, compiled."""
    t = _approx(1.0 + tl.abs(x) * (0.5 * 0.7071067811865476), "rcp")
    p = LOG2E * -1.26551223 + t * (LOG2E * 1.00002368 + t * (LOG2E * 0.37409196 + t * (LOG2E * 0.09678418 + t * (
        LOG2E * -0.18628806 + t * (LOG2E * 0.27886807 + t * (LOG2E * -1.13520398 + t * (LOG2E * 1.48851587 + t * (
            LOG2E * -0.82215223 + t * (LOG2E * 0.17087277)))))))))  # fmt: skip
    return t * _approx(p + (x * x) * (-0.5 * LOG2E), "ex2")


@triton.jit
def _relu6(x):
    # NaN stays NaN through both bounds, as in torch's relu6 (a plain max and min would answer 0 or 6)
    x = tl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL)
    return tl.minimum(x, 6.0, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def round_to_bf16(x):
    """Round fp32 x to the nearest bf16 value (ties to even), returned as fp32 holding that value.

    Needed only under Triton's interpreter, whose fp32 -> bf16 cast truncates (triton 3.9: cast_impl
    passes no rounding mode), erring by up to 1 ulp (7.8e-3) toward zero; compiled kernels round to
    nearest in the cast itself. Adding 0x7FFF plus the lowest kept bit, then clearing the 16 dropped
    bits, is round-to-nearest-even on the bit pattern; the later cast is then exact. Finite x only.
    """
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def apply_activation(x, ACTIVATION: tl.constexpr, negative_slope):
    """x: an fp32 tile; returns ACTIVATION(x) in fp32. `negative_slope` is used by leaky_relu only."""
    if ACTIVATION == "relu":
        # NaN stays NaN, as in torch.relu: a plain max answers 0 and hides a bad input
        x = tl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL)
    elif ACTIVATION == "leaky_relu":
        x = tl.where(x >= 0, x, x * negative_slope)
    elif ACTIVATION == "gelu":
        # x * Phi(x) with Phi from erfc, not 0.5 * (1 + erf(x / sqrt(2))): for x < 0 that sum cancels
        # (torch's fp32 gelu: 8.8e-4 relative error at x in [-4, -2], 100% below -4, where it returns
        # 0); through erfc the worst relative error is 1.4e-6 there and 1.7e-5 out at x = -12.
        h = 0.5 * _phi_tail(x)  # Phi(-|x|)
        x = x * tl.where(x < 0, h, 1.0 - h)
    elif ACTIVATION == "gelu_tanh":
        # 0.5 * (1 + tanh(z)) == sigmoid(2z); the sigmoid form has no 1 + tanh cancellation for x < 0.
        x = x * _sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))  # 2 * sqrt(2/pi)
    elif ACTIVATION == "sigmoid":
        x = _sigmoid(x)
    elif ACTIVATION == "silu":
        x = x * _sigmoid(x)
    elif ACTIVATION == "tanh":
        x = _tanh(x)
    elif ACTIVATION == "relu6":
        x = _relu6(x)
    elif ACTIVATION == "hardswish":
        x = x * _relu6(x + 3.0) * (1.0 / 6.0)  # -inf gives NaN (-inf * 0), as torch's does
    elif ACTIVATION == "hardsigmoid":  # MobileNetV3's squeeze-and-excitation gate, in its second 1x1 conv
        x = _relu6(x + 3.0) * (1.0 / 6.0)
    return x


def torch_activation(x: torch.Tensor, name: str, negative_slope: float = DEFAULT_NEGATIVE_SLOPE) -> torch.Tensor:
    """The same activation as one eager torch op (one kernel), in x's dtype."""
    check_activation(name)
    if name == "none":
        return x
    if name == "relu":
        return torch.relu(x)
    if name == "leaky_relu":
        return F.leaky_relu(x, negative_slope)
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "sigmoid":
        return torch.sigmoid(x)
    if name == "silu":
        return F.silu(x)
    if name == "relu6":
        return F.relu6(x)
    if name == "hardswish":
        return F.hardswish(x)
    if name == "hardsigmoid":
        return F.hardsigmoid(x)
    return torch.tanh(x)
