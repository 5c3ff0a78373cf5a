"""GPU faults at the forward: which kind an exception is, and a hook that injects them for tests.

Three kinds, handled by service/engine/core.py:
- OOM: the allocator could not get memory for this batch (torch.OutOfMemoryError, or a CUDA "out of
  memory" error). The context is intact: the cache is released and the batch is retried in halves, down to
  single requests; a request that still does not fit alone gets 503.
- STICKY: the CUDA context is poisoned (an illegal address, a launch failure, a device-side assert, an ECC
  error): every later call on it fails too, and only a new process recovers. The engine answers what it
  holds with 503, marks itself broken (/health/live turns 503) and exits non-zero for a restart.
- OTHER: anything else fails its batch alone (500), as before.

An error whose message names none of these, raised on a CUDA device, is STICKY when a follow-up
`torch.cuda.synchronize()` fails too: that is the definition of a sticky error.

Faults cannot be produced on demand (and not at all without a GPU), so tests inject them at the runner
boundary, the call the engine makes: `FS_INJECT_FAULT` (not a FUSEDSERVE_ setting, so no configuration of a
real deployment reaches it) wraps the runner in `FaultyRunner`.
"""

from __future__ import annotations

import contextlib
import os

OOM, STICKY, OTHER = "oom", "sticky", "other"
KINDS = (OOM, STICKY)  # the kinds counted in fusedserve_gpu_faults_total

# Substrings (lower case) of CUDA errors that leave the context unusable: cudaErrorIllegalAddress,
# cudaErrorLaunchFailure, cudaErrorMisalignedAddress, cudaErrorIllegalInstruction, cudaErrorAssert,
# cudaErrorHardwareStackError, cudaErrorECCUncorrectable, cudaErrorLaunchTimeout.
STICKY_MARKERS = (
    "illegal memory access",
    "unspecified launch failure",
    "misaligned address",
    "illegal instruction",
    "device-side assert",
    "hardware stack error",
    "uncorrectable ecc error",
    "launch timed out",
)

INJECT_ENV = "FS_INJECT_FAULT"


class DeviceBroken(Exception):
    """The engine's device hit a sticky error: the process must exit to be restarted."""


def classify(err: BaseException, device_type: str) -> str:
    import torch

    msg = str(err).lower()
    if isinstance(err, torch.OutOfMemoryError) or "out of memory" in msg:
        return OOM
    if any(m in msg for m in STICKY_MARKERS):
        return STICKY
    if device_type == "cuda" and isinstance(err, RuntimeError):  # torch.AcceleratorError is a RuntimeError
        try:
            torch.cuda.synchronize()
        except Exception:
            return STICKY
    return OTHER


def release_memory(device_type: str) -> None:
    """After an OOM: give the caching allocator's unused blocks back, so the smaller retry can get them."""
    if device_type == "cuda":
        import torch

        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()


class FaultyRunner:
    """A runner that fails like a GPU would, for tests. Spec (FS_INJECT_FAULT):
    `oom_above=N`: a forward of more than N rows raises torch.OutOfMemoryError;
    `sticky_at=K`: the K-th forward (from 1) and every later one raise CUDA's illegal-address error;
    `fail_above=N`: a forward of more than N rows raises an error of neither kind (its batch fails with 500 and the
    engine keeps serving)."""

    def __init__(self, runner, spec: str):
        name, _, value = spec.partition("=")
        if name not in ("oom_above", "sticky_at", "fail_above") or not value.isdigit():
            raise ValueError(f"{INJECT_ENV}={spec!r}: expected oom_above=N, sticky_at=K or fail_above=N")
        self._runner = runner
        self._kind = name
        self._n = int(value)
        self._forwards = 0

    def __getattr__(self, name: str):
        return getattr(self._runner, name)

    def launch(self, parts, observe: bool = True):
        import torch

        self._forwards += 1
        rows = sum(p.shape[0] for p in parts)
        if self._kind == "oom_above" and rows > self._n:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {rows} rows (injected: {INJECT_ENV})")
        if self._kind == "fail_above" and rows > self._n:
            raise ValueError(f"injected failure of a forward of {rows} rows ({INJECT_ENV})")
        if self._kind == "sticky_at" and self._forwards >= self._n:
            raise RuntimeError(
                "CUDA error: an illegal memory access was encountered "
                f"(injected: {INJECT_ENV}, forward {self._forwards})"
            )
        return self._runner.launch(parts, observe)


def maybe_inject(runner):
    """`runner`, wrapped in a FaultyRunner when FS_INJECT_FAULT is set (tests only)."""
    spec = os.environ.get(INJECT_ENV)
    return FaultyRunner(runner, spec) if spec else runner
