"""A deadline on every compile of this package's Triton kernels.

A kernel specialised into a huge program can compile for minutes: SqueezeNet's 13x13 global pool folded into a
conv's epilogue unrolled 169 K-loops, and its first forward was still compiling after 5 minutes on an H100, tuning
on or off, so the service never became ready. Normal compiles of this package's kernels take 0.2-5 s (16 at once on
a 16-core host, kernels/precompile.py). So each compile runs on a thread of its own and the caller waits at most
`deadline_s()` (FUSEDSERVE_COMPILE_DEADLINE_S, default DEFAULT_DEADLINE_S; 0 turns the deadline off); past it the
caller gets CompileDeadlineExceeded and the compile is recorded as late:

- the tuner drops that candidate like one that fails to compile (kernels/tuning.py), and raises
  CompileDeadlineExceeded when no candidate compiled in time;
- the service's executor runs a step whose kernel has no config that compiles in time as its unfused torch op
  (service/model/executors.py, `Executor.warm_forward`), and says so in /model, the log and a metric;
- a later compile of the same program fails at once instead of waiting again.

The late compile itself cannot be stopped (Triton's passes run in C++), so its thread runs on in the background as a
daemon; when it finishes, Triton's on-disk cache has the kernel and the next start compiles it at once.

The deadline wraps `triton.compiler.compile`, which a kernel looks up when it first runs on a device
(JITFunction.create_binder), so `install()` must run before any kernel of this package first runs (kernels/__init__).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

DEFAULT_DEADLINE_S = 30.0
ENV = "FUSEDSERVE_COMPILE_DEADLINE_S"


class CompileDeadlineExceeded(RuntimeError):
    """A Triton compile took longer than the deadline (or one of the same program did before)."""

    def __init__(self, kernel: str, seconds: float):
        super().__init__(f"compiling {kernel} took more than {seconds:g} s ({ENV}); left to finish in the background")
        self.kernel = kernel
        self.seconds = seconds


_deadline: list[float | None] = []  # set(): overrides the environment


def deadline_s() -> float | None:
    """Seconds a compile may take; None: no deadline."""
    if _deadline:
        return _deadline[0]
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return DEFAULT_DEADLINE_S
    try:
        value = float(raw)
    except ValueError:
        log.warning("%s=%r is not a number of seconds; taking %g", ENV, raw, DEFAULT_DEADLINE_S)
        return DEFAULT_DEADLINE_S
    return value if value > 0 else None


def set_deadline(seconds: float | None) -> None:
    """The deadline in seconds (0 or None: none), over the environment's (the service passes its setting)."""
    _deadline[:] = [seconds if seconds and seconds > 0 else None]


class _Late:
    """Programs whose compile missed the deadline, and the callbacks told of each."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.keys: set[str] = set()
        self.count = 0
        self.listeners: list[Callable[[str], None]] = []

    def add(self, key: str, kernel: str) -> None:
        with self.lock:
            self.keys.add(key)
            self.count += 1
            listeners = list(self.listeners)
        for listener in listeners:
            try:
                listener(kernel)
            except Exception:  # noqa: BLE001 - a metric's failure must not fail the compile's caller
                log.exception("compile deadline listener failed")


late = _Late()


def on_late(listener: Callable[[str], None]) -> None:
    """Call listener(kernel name) for each compile that misses its deadline (the service counts them)."""
    with late.lock:
        late.listeners.append(listener)


def late_count() -> int:
    """Compiles that missed their deadline in this process."""
    return late.count


def _name_and_key(src, options) -> tuple[str, str]:
    fn = getattr(src, "fn", None)
    name = getattr(fn, "__name__", None) or getattr(src, "name", None) or type(src).__name__
    try:
        key = f"{src.hash()}|{sorted((options or {}).items())!r}"
    except Exception:  # noqa: BLE001 - a source without a hash (an IR file): its text stands for it
        key = f"{name}|{src!r}|{options!r}"
    return name, key


def _ours(src) -> bool:
    """Whether `src` is one of this package's kernels: others' compiles in the same process (torch.compile's
    inductor, a benchmark's anchors) run as Triton runs them."""
    fn = getattr(src, "fn", None)  # a JITFunction: `module` (and `__module__`) name where it was defined
    module = getattr(fn, "module", None) or getattr(fn, "__module__", None) or ""
    return module == __package__ or module.startswith(f"{__package__}.")


def with_deadline(compile_fn: Callable) -> Callable:
    """compile_fn (triton.compiler.compile's signature) under the deadline."""
    if getattr(compile_fn, "__wrapped_by_deadline__", False):
        return compile_fn

    def compile(src, target=None, options=None, *args, **kwargs):
        limit = deadline_s()
        if limit is None or not _ours(src):
            return compile_fn(src, target, options, *args, **kwargs)
        name, key = _name_and_key(src, options)
        if key in late.keys:
            raise CompileDeadlineExceeded(name, limit)
        result: list = []
        done = threading.Event()

        def work() -> None:
            try:
                result.append((True, compile_fn(src, target, options, *args, **kwargs)))
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                result.append((False, e))
            finally:
                done.set()

        started = time.monotonic()
        threading.Thread(target=work, name=f"compile-{name}", daemon=True).start()
        if not done.wait(limit):
            late.add(key, name)
            log.warning("compiling %s: past the %g s deadline (%s); that config is dropped and the compile left "
                        "to finish in the background", name, limit, ENV)  # fmt: skip
            raise CompileDeadlineExceeded(name, limit)
        ok, value = result[0]
        if not ok:
            raise value
        log.debug("compiled %s in %.2f s", name, time.monotonic() - started)
        return value

    compile.__wrapped_by_deadline__ = True  # type: ignore[attr-defined]
    compile.__wrapped__ = compile_fn  # type: ignore[attr-defined]
    return compile


def install() -> None:
    """Put the deadline on triton.compiler.compile (once; kernels already bound to a device keep what they had)."""
    try:
        import triton.compiler as compiler
    except ImportError:  # no triton: nothing compiles
        return
    compiler.compile = with_deadline(compiler.compile)
