"""Launch an already-compiled Triton kernel straight through its C launcher.

`kernel[grid](...)` goes through JITFunction.run on every call: bind the arguments, compute the
specialization key (alignment, divisibility and value of every argument), look the kernel up, build
launch metadata. That Python is 30-60 us per launch, more than the kernels themselves at serving sizes
and 3-5x what eager torch spends per op. A prepared layer knows its compiled kernel after the first
launch, so later launches call the compiled kernel's launcher directly: a stream lookup and one C call,
4.3 us on the same host (64x256x128 fp16; bench/probes/host_launch.py times each part below,
docs/performance.md, "Launches from Python"):
- pointer arguments are passed as ints (tensor.data_ptr()): for a tensor, Triton's launcher calls data_ptr()
  and then cuPointerGetAttribute, a driver call that checks the address is device memory, per pointer; an
  int it takes as the address. The callers have checked device and alignment already. (0.9 us, 6 pointers)
- the stream is the current stream of the device the kernel was loaded on, looked up by that device's
  index, not by asking torch which device is current (a Python call) every launch. (0.45 us)
- where Triton's launcher object only adds constant flags and empty scratch buffers before calling its
  C function (triton 3.6's CudaLauncher.__call__, for a kernel that needs no scratch), that C function is
  called directly; anything else (other launcher signatures, kernels with scratch) goes through the object.
  (0.9 us: the object builds two closures per call)

Sound only while the specialization would not change: the callers reuse a kernel only for calls
whose tensors are contiguous and 16-byte aligned, as at the first launch (their weights, sizes and
strides are fixed per layer; the batch size is never specialized: do_not_specialize). Launch hooks
(profilers such as proton) do not see these launches. Needs triton >= 3.3, whose launcher takes every
argument, constexprs included; older versions take the slow path. The callers keep the tensors whose
addresses they pass alive until the launch is enqueued (torch's stream order does the rest, as for any op).

Every Triton launch of this package goes through `grid_launch(kernel, grid)(...)`, so that the tuner can compile a
key's candidates without launching them (kernels/precompile.py, `precompiling`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import triton
from triton.runtime import driver

DIRECT_LAUNCH = tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 3)

# Set by `precompiling`: this thread's (this context's) launches compile their kernel and launch nothing.
_precompiling: ContextVar[bool] = ContextVar("fusedserve_precompiling", default=False)


def grid_launch(kernel, grid: tuple):
    """`kernel[grid]`, to be called with the kernel's arguments; inside `precompiling`, a call with the same
    arguments that compiles the kernel without launching it (`kernel.warmup`; under triton.AsyncCompileMode it
    hands the compile to the mode's executor and returns a FutureKernel, else the compiled kernel; None where a
    cache hook took the compile)."""
    if _precompiling.get():
        return functools.partial(kernel.warmup, grid=grid)
    return kernel[grid]


@contextmanager
def precompiling(on: bool = True) -> Iterator[None]:
    """Inside, `grid_launch` only compiles (on=True), or launches again (on=False: the tuner's timing, should a
    tune run inside a candidate's launch), in this thread only; the previous state comes back when the block ends."""
    token = _precompiling.set(on)
    try:
        yield
    finally:
        _precompiling.reset(token)


def precompiling_now() -> bool:
    """Whether `grid_launch` only compiles here: a launch's return value is then no launched kernel."""
    return _precompiling.get()


# The parameters of a launcher object's __call__ whose body is known: triton 3.6's CudaLauncher, which passes
# (gridX, gridY, gridZ, stream, function, cooperative flag, PDL flag, global scratch, profile scratch, *args)
# on to its C `launch`, the scratch buffers None for a kernel whose scratch sizes are 0.
_KNOWN_LAUNCHER_CALL = ("self", "gridX", "gridY", "gridZ", "stream", "function", "args")


def c_launch_of(run):
    """The C launch function behind Triton launcher object `run`, when calling it directly is the same as
    calling `run`: a launcher whose __call__ has the known signature, for a kernel with no scratch. Else None."""
    launch = getattr(run, "launch", None)
    if not callable(launch) or getattr(run, "global_scratch_size", None) != 0:
        return None
    if getattr(run, "profile_scratch_size", None) != 0:
        return None
    try:
        params = tuple(inspect.signature(type(run).__call__).parameters)
    except (TypeError, ValueError):
        return None
    return launch if params == _KNOWN_LAUNCHER_CALL else None


class DirectLaunch:
    """A compiled kernel plus its constexpr arguments, ready to launch on a 1-D grid.

    Call it as `launch(grid, *runtime_args)` with pointer arguments as ints (tensor.data_ptr()); tensors work
    too, at the cost of a driver call each. Build it right after the kernel's first launch, while the device
    it ran on is current: later launches go to that device's current stream.
    """

    def __init__(self, compiled, constexpr_values: tuple):
        if hasattr(compiled, "result"):  # an async-compile future (newer triton)
            compiled = compiled.result()
        compiled._init_handles()
        run = compiled.run
        self._run = run
        self._function = compiled.function
        self._metadata = compiled.packed_metadata
        self._tail = constexpr_values
        self._device_index = driver.active.get_current_device()
        self._stream = driver.active.get_current_stream
        c_launch = c_launch_of(run)
        self.calls_c_launcher = c_launch is not None
        if c_launch is not None:
            self._call = c_launch
            self._head = (self._function, run.launch_cooperative_grid, run.launch_pdl, None, None, self._metadata,
                          None, None, None)  # fmt: skip
        else:  # the launcher object: (function, metadata, launch metadata, enter hook, exit hook, *args)
            self._call = run
            self._head = (self._function, self._metadata, None, None, None)

    def __call__(self, grid: int, *args) -> None:
        self._call(grid, 1, 1, self._stream(self._device_index), *self._head, *args, *self._tail)


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
