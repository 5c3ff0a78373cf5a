"""Programmatic dependent launch (PDL, sm_90+): a layer's kernel starts while the previous one is finishing.

A forward is one kernel per layer, each reading the previous layer's output. Without PDL the next kernel
is launched only when the previous one has fully drained, and its programs then start from nothing: the
first weight tile of every program comes from HBM after the gap. Launched with `launch_pdl=True`, a GEMM
kernel's programs may start as soon as every program of the previous kernel has called
`gdc_launch_dependents()` (ours do so first thing). Each then does the work that does not depend on the
previous layer (the GEMV kernel loads its first weight tile; the GEMV and MMA kernels request their bias)
and calls `gdc_wait()`, which returns once
the previous kernel has completed and its writes are visible, before it reads x or writes anything.

The wide MLP at batch 1 (three GEMV launches in one CUDA graph, cold) takes 26.6 us with PDL against
30.8 without (docs/performance.md, "Layers start early"). Also captured into CUDA graphs: stream capture
turns the launch attribute into a programmatic edge.

Every kernel launched this way must call gdc_wait() before touching anything another kernel writes; a
kernel launched without PDL, or a predecessor that never calls gdc_launch_dependents, just waits as usual.
"""

from __future__ import annotations

import torch
import triton

from .runtime import EnvSwitch, interpreting

try:  # triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    AVAILABLE = True
except ImportError:  # pragma: no cover - older triton: PDL stays off, and these are never traced
    AVAILABLE = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


__all__ = ["AVAILABLE", "enabled", "gdc_launch_dependents", "gdc_wait", "set_enabled", "switch", "use_pdl"]

# Whether PDL is wanted at all: FUSEDSERVE_PDL (default true), or set_enabled (the service's setting).
switch = EnvSwitch("FUSEDSERVE_PDL")
enabled = switch
set_enabled = switch.set
_capable: dict[int, bool] = {}


def use_pdl(device: torch.device) -> bool:
    """Whether kernels launched on `device` use PDL: wanted, compiled (not interpreted), Triton has it and
    the GPU is sm_90 or newer (griddepcontrol is a Hopper instruction)."""
    if not (AVAILABLE and enabled()) or interpreting() or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capable:
        _capable[index] = torch.cuda.get_device_capability(index) >= (9, 0)
    return _capable[index]
