"""Output sizes of torch's convolutions and pools along one axis, for the loader and the importers."""

from __future__ import annotations


def conv_out(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    """torch.nn.Conv2d's output size along one axis (may be < 1: the caller refuses that)."""
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def pool_out(size: int, kernel: int, stride: int, padding: int, ceil_mode: bool) -> int:
    """torch.nn.{Avg,Max}Pool2d's output size along one axis: with ceil_mode a last, partial window
    counts, unless it would start in the right padding."""
    span = size + 2 * padding - kernel
    out = (-(-span // stride) if ceil_mode else span // stride) + 1
    if ceil_mode and (out - 1) * stride >= size + padding:
        out -= 1
    return out
