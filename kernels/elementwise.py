"""A standalone activation kernel, for an activation that follows no linear layer (the model's first
op, or a second activation in a row) and so cannot ride in a GEMM epilogue.

Shapes: x of any shape, contiguous; y has x's shape and dtype. Computed in fp32, rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .activations import DEFAULT_NEGATIVE_SLOPE, apply_activation, check_activation, round_to_bf16
from .launch import grid_launch
from .linear import SUPPORTED_DTYPES
from .runtime import bf16_on_interpreter, check_device

BLOCK = 1024  # 4 warps x 32 lanes x 8 elements: 16-byte fp16 / 32-byte fp32 accesses per lane


@triton.jit
def _activation_kernel(
    # pointers
    x_ptr, y_ptr,
    # sizes
    n_elements,
    # epilogue parameters
    negative_slope,
    # meta-parameters
    ACTIVATION: tl.constexpr,
    ROUND_BF16: tl.constexpr,  # interpreter only: its fp32 -> bf16 cast truncates (activations.round_to_bf16)
    BLOCK: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    y = apply_activation(x, ACTIVATION, negative_slope)
    if ROUND_BF16:
        y = round_to_bf16(y)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def fused_activation(
    x: torch.Tensor,
    activation: str,
    *,
    negative_slope: float = DEFAULT_NEGATIVE_SLOPE,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """activation(x) elementwise in one kernel; returns a tensor of x's shape and dtype."""
    check_activation(activation)
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; fused_activation supports float32, float16, bfloat16")
    if not x.is_contiguous():
        raise ValueError(f"x must be contiguous (call .contiguous()); got strides {x.stride()}")
    if x.numel() >= 2**31:
        raise ValueError(f"x has {x.numel()} elements; the kernel indexes with int32 (< 2**31)")
    check_device(x, "x")
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {tuple(x.shape)} {x.dtype} tensor on {x.device}")
    n = x.numel()
    if n:
        grid_launch(_activation_kernel, (triton.cdiv(n, BLOCK),))(
            x,
            out,
            n,
            float(negative_slope),
            ACTIVATION=activation,
            ROUND_BF16=bf16_on_interpreter(x.dtype),
            BLOCK=BLOCK,
        )
    return out
