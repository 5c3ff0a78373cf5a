"""Launch an already-compiled Triton kernel straight through its C launcher.

`kernel[grid](...)` goes through JITFunction.run on every call: bind the arguments, compute the
specialization key (alignment, divisibility and value of every argument), look the kernel up, build
launch metadata. That Python is 30-60 us per launch on the H200's host (bench/results), more than the
kernels themselves at serving sizes and 3-5x what eager torch spends per op. A prepared layer knows
its compiled kernel after the first launch, so later launches call the compiled kernel's launcher
directly: a stream lookup and one C call.

Sound only while the specialization would not change: the callers reuse a kernel only for calls
whose tensors are contiguous and 16-byte aligned, as at the first launch (their weights, sizes and
strides are fixed per layer; the batch size is never specialized: do_not_specialize). Launch hooks
(profilers such as proton) do not see these launches. Needs triton >= 3.3, whose launcher takes every
argument, constexprs included; older versions take the slow path.
"""

from __future__ import annotations

import triton
from triton.runtime import driver

DIRECT_LAUNCH = tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 3)


class DirectLaunch:
    """A compiled kernel plus its constexpr arguments, ready to launch on a 1-D grid."""

    def __init__(self, compiled, constexpr_values: tuple):
        if hasattr(compiled, "result"):  # an async-compile future (newer triton)
            compiled = compiled.result()
        compiled._init_handles()
        self._run = compiled.run
        self._function = compiled.function
        self._metadata = compiled.packed_metadata
        self._tail = constexpr_values
        self._device = driver.active.get_current_device
        self._stream = driver.active.get_current_stream

    def __call__(self, grid: int, *args) -> None:
        self._run(grid, 1, 1, self._stream(self._device()), self._function, self._metadata, None, None, None,
                  *args, *self._tail)  # fmt: skip


def constexpr_tail(kernel, values: dict) -> tuple:
    """The values of a compiled (not interpreted) kernel's constexpr parameters, in signature order: what
    the C launcher takes after the runtime arguments."""
    return tuple(values[p.name] for p in kernel.params if p.is_constexpr)


def aligned(*tensors) -> bool:
    """Contiguous and 16-byte aligned, as at the first launch: the specialization a direct launch assumes."""
    return all(t.data_ptr() % 16 == 0 and t.is_contiguous() for t in tensors)


def plain_rows(x, dtype, device, features: int) -> bool:
    """x is a contiguous (rows, features) tensor of `dtype` on `device`: what a launch recorded for a batch
    size assumes (a fast path; anything else takes the checked path, which names what is wrong)."""
    return x.dtype is dtype and x.dim() == 2 and x.shape[1] == features and x.is_contiguous() and x.device == device
