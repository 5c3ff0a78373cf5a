"""Capture one call into a CUDA graph, the way torch.cuda.graphs documents it: warm-up calls on a side
stream first, so that first-call work (Triton compiles, autotuning, cuBLAS handles, workspace
allocations) happens outside the capture, where it would fail or be recorded.

Used by the tuner (each candidate is timed as a replay), the service's GraphedExecutor (one graph per
batch bucket) and the benchmark (every provider's "graph" cell).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def capture(
    fn: Callable[[], T], *, warmups: int, device: torch.device | None = None, pool=None
) -> tuple[torch.cuda.CUDAGraph, T]:
    """fn called `warmups` times on a side stream, then once under capture; returns the graph and what
    that captured call returned (its static output). `pool`: a graph memory pool to share."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out
