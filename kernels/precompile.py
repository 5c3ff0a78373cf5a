"""Compile a key's candidate configs side by side before the tuner times them one by one.

Timing a candidate starts with its first launch, and on a host whose Triton cache is cold that launch compiles it:
most of a key's tuning time, one candidate after another on one thread. Triton >= 3.4's `AsyncCompileMode` hands
the compiles that `kernel.warmup` asks for to an executor instead, and puts each compiled kernel in the kernel's
cache when the mode's `with` block ends. Triton's C++ passes release the GIL and ptxas is a subprocess, so a pool of
threads compiles in parallel. `precompile` runs each candidate's launch once inside that mode with
launch.precompiling() on, so that launch.grid_launch compiles it without launching it; the timing that follows
finds every candidate compiled.

It compiles only where that can help: compiled kernels (not the interpreter), CUDA present, a Triton with
AsyncCompileMode, more than one candidate, and more than one thread (FUSEDSERVE_COMPILE_THREADS; `threads`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch
import triton

from .launch import precompiling, precompiling_now
from .runtime import EnvCount, interpreting

if TYPE_CHECKING:
    from .tuning import LaunchConfig

log = logging.getLogger(__name__)

MAX_DEFAULT_THREADS = 16


def default_threads() -> int:
    """The CPUs this process may run on, at most MAX_DEFAULT_THREADS."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS)
        cpus = os.cpu_count() or 1
    return min(MAX_DEFAULT_THREADS, cpus)


# Threads that compile a key's candidates (0 or 1: none, each candidate compiles when it is first timed).
threads = EnvCount("FUSEDSERVE_COMPILE_THREADS", default_threads)
set_threads = threads.set


def can_help(count: int) -> bool:
    """Whether compiling `count` candidates side by side can save time here."""
    return (
        count > 1
        and threads() > 1
        and not interpreting()
        and not precompiling_now()  # a tune inside a candidate's launch: its own candidates compile as it times them
        and hasattr(triton, "AsyncCompileMode")
        and torch.cuda.is_available()
    )


def precompile(candidates: Sequence[LaunchConfig], run: Callable[[LaunchConfig], object], label: str = "") -> None:
    """Compile every candidate's kernels, `threads()` at a time, by calling `run(config)` (the tuner's launch of one
    candidate) for each with launches turned into compiles; where that cannot help (`can_help`), nothing. A candidate
    whose launch or compile fails is left uncompiled: its timing compiles it again and skips it. Never raises."""
    try:
        candidates = list(candidates)
        if not can_help(len(candidates)):
            return
        started = time.perf_counter()
        workers = min(threads(), len(candidates))
        # The mode's exit (before the pool's) waits for every compile and puts each kernel in its kernel's cache,
        # failed ones left out.
        pool = ThreadPoolExecutor(workers, thread_name_prefix="fusedserve-compile")
        with pool, triton.AsyncCompileMode(pool, ignore_errors=True), precompiling():
            for config in candidates:
                try:
                    run(config)
                except Exception as e:  # noqa: BLE001 - as time_one: the timing skips it with its error
                    log.debug("precompiling %s: %s left to its timing (%s)", label, config, e)
        log.debug("precompiled %d candidates of %s in %.2f s on %d threads", len(candidates), label,
                  time.perf_counter() - started, workers)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - the timing compiles whatever is missing
        log.debug("precompiling %s failed (%s); each candidate compiles when it is timed", label, e)
