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

# Names accepted everywhere (kernels, reference, model config). "gelu" is the erf form, "gelu_tanh"
# the tanh approximation (torch's approximate="tanh"); "relu6" is min(max(x, 0), 6) (ONNX's Clip(0, 6)),
# "hardswish" x * relu6(x + 3) / 6 (MobileNetV3's, torch's F.hardswish).
ACTIVATIONS = ("none", "relu", "leaky_relu", "gelu", "gelu_tanh", "sigmoid", "silu", "tanh", "relu6", "hardswish")
DEFAULT_NEGATIVE_SLOPE = 0.01  # torch.nn.LeakyReLU's default


def check_activation(name: str) -> None:
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; expected one of {', '.join(ACTIVATIONS)}")


@triton.jit
def _tanh(x):
    # Triton has no tanh that also runs under the interpreter (libdevice does not), so build it from
    # exp: tanh|x| = (1 - t) / (1 + t), t = exp(-2|x|) <= 1, which never overflows. For |x| < 0.25 that
    # subtraction loses digits (relative error ~1e-4 at |x| = 1e-3), so use the odd Taylor series
    # there: its first omitted term, 62x^9/2835, is below 4e-7 relative at |x| = 0.25.
    a = tl.abs(x)
    t = tl.exp(-2.0 * a)
    big = (1.0 - t) / (1.0 + t)
    x2 = a * a
    small = a * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    r = tl.where(a < 0.25, small, big)
    return tl.where(x < 0, -r, r)


@triton.jit
def _erfc_nonnegative(z):
    # erfc(z) for z >= 0 (Numerical Recipes' erfcc, fractional error < 1.2e-7 for every z >= 0).
    t = 1.0 / (1.0 + 0.5 * z)
    p = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (
        0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))))  # fmt: skip
    return t * tl.exp(-z * z + p)


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
        c = _erfc_nonnegative(tl.abs(x) * 0.7071067811865476)  # 1/sqrt(2)
        x = x * tl.where(x < 0, 0.5 * c, 1.0 - 0.5 * c)
    elif ACTIVATION == "gelu_tanh":
        # 0.5 * (1 + tanh(z)) == sigmoid(2z); the sigmoid form has no 1 + tanh cancellation for x < 0.
        x = x * tl.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))  # 2 * sqrt(2/pi)
    elif ACTIVATION == "sigmoid":
        x = tl.sigmoid(x)
    elif ACTIVATION == "silu":
        x = x * tl.sigmoid(x)
    elif ACTIVATION == "tanh":
        x = _tanh(x)
    elif ACTIVATION == "relu6":
        x = _relu6(x)
    elif ACTIVATION == "hardswish":
        x = x * _relu6(x + 3.0) * (1.0 / 6.0)  # -inf gives NaN (-inf * 0), as torch's does
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
    return torch.tanh(x)
