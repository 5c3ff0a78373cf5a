"""Eager torch versions of every fused op, one torch kernel per step.

Used twice: by the tests, as the reference the fused kernels are checked against, and by the
unfused executor, as the baseline the service compares live. They run in the inputs' dtype, as a
user's eager model would (mm in fp16 rounds its output to fp16 before the bias add, where the fused
kernel keeps fp32 until the end), on any device.
"""

from __future__ import annotations

import torch

from .activations import DEFAULT_NEGATIVE_SLOPE, torch_activation


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    *,
    negative_slope: float = DEFAULT_NEGATIVE_SLOPE,
) -> torch.Tensor:
    """act(x @ weight.T + bias) as the 3 kernels of the published unfused baseline: mm, add, act."""
    y = torch.mm(x, weight.t())
    if bias is not None:
        y = y + bias
    return torch_activation(y, activation, negative_slope)


def activation(x: torch.Tensor, name: str, *, negative_slope: float = DEFAULT_NEGATIVE_SLOPE) -> torch.Tensor:
    """One eager activation kernel."""
    return torch_activation(x, name, negative_slope)
