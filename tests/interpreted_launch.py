"""A stand-in for kernels.launch.DirectLaunch on the CPU, for the tests of the layers' fast paths.

A prepared layer passes its kernel's runtime arguments to DirectLaunch exactly as Triton's C launcher
takes them, pointers as ints (addresses). The stand-in runs the interpreted kernel with the same
arguments, each address turned back into the live tensor that starts there, so that a wrong argument
order or value in a fast path gives a wrong result here instead of only on a GPU.
"""

from __future__ import annotations

import gc

import torch


def tensor_at(address: int, dtype: torch.dtype) -> torch.Tensor:
    """A live tensor of `dtype` whose data starts at `address` (the interpreter needs tensors, not addresses).

    Searches every object the garbage collector tracks: slow (tens of ms), and only for tests."""
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads __class__, which some lazily loaded modules answer with a warning
        if issubclass(type(obj), torch.Tensor) and obj.dtype == dtype and obj.data_ptr() == address:
            return obj
    raise AssertionError(f"no live {dtype} tensor starts at address {address:#x}: a wrong pointer argument")


class InterpretedLaunch:
    """Called as DirectLaunch is, `launch(grid, *runtime_args)`; the first len(pointer_dtypes) arguments are
    addresses of tensors of those dtypes. Counts its calls."""

    def __init__(self, kernel, constexprs: dict, pointer_dtypes: tuple[torch.dtype, ...]):
        self.kernel, self.constexprs, self.pointer_dtypes, self.calls = kernel, constexprs, pointer_dtypes, 0
        self._seen: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def __call__(self, grid: int, *args):
        self.calls += 1
        n = len(self.pointer_dtypes)
        assert all(type(a) is int for a in args[:n]), "pointers must be passed as ints"
        tensors = [self._tensor(a, dt) for a, dt in zip(args[:n], self.pointer_dtypes, strict=True)]
        self.kernel[(grid,)](*tensors, *args[n:], **self.constexprs)

    def _tensor(self, address: int, dtype: torch.dtype) -> torch.Tensor:
        # Kept once found: the reference keeps its memory from being reused, so an address seen again is that
        # same tensor.
        key = (address, dtype)
        if key not in self._seen:
            self._seen[key] = tensor_at(address, dtype)
        return self._seen[key]
