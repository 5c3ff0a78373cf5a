"""Pick the fastest launch config per (kernel, shape, batch bucket) once, and remember it on disk.

Triton's own autotuner keys on the call's arguments and keeps its results in memory (its optional
disk cache, `cache_results`, is not in every Triton we support and is keyed by hashes we cannot
read). A server needs more: the key is the batch *bucket* (powers of two), so a new
batch size never re-tunes; the results survive a restart, so a redeploy does not spend its warm-up
re-timing 10-20 configs per layer and bucket; and the file says what was chosen, for whom.

The file is JSON: {"<gpu> | <triton version> | <kernel>": {"<key>": {"kwargs": {...}, "num_warps": 4,
"num_stages": 3, "us": 4.1}}}. Entries are never trusted across GPUs or Triton versions, and a kernel
whose source changes gets a new name (`source_hash`). A corrupt or unwritable file costs a re-tune
and a warning, never a failed start.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from .runtime import EnvSwitch

log = logging.getLogger("fusedserve.tuning")


@dataclass(frozen=True)
class LaunchConfig:
    """Meta-parameters plus Triton's two launch options; what a tuned entry stores."""

    kwargs: tuple[tuple[str, int], ...]
    num_warps: int = 4
    num_stages: int = 3

    @staticmethod
    def of(num_warps: int = 4, num_stages: int = 3, **kwargs: int) -> LaunchConfig:
        return LaunchConfig(tuple(sorted(kwargs.items())), num_warps, num_stages)

    def meta(self) -> dict[str, int]:
        """Keyword arguments for `kernel[grid](..., **meta)`."""
        return {**dict(self.kwargs), "num_warps": self.num_warps, "num_stages": self.num_stages}

    def __getitem__(self, name: str) -> int:
        return dict(self.kwargs)[name]

    def to_json(self) -> dict:
        return {"kwargs": dict(self.kwargs), "num_warps": self.num_warps, "num_stages": self.num_stages}

    @staticmethod
    def from_json(d: dict) -> LaunchConfig:
        return LaunchConfig.of(int(d["num_warps"]), int(d["num_stages"]), **{k: int(v) for k, v in d["kwargs"].items()})


def default_cache_path() -> Path:
    """$FUSEDSERVE_TUNING_CACHE, else $XDG_CACHE_HOME/fusedserve/tuning.json (~/.cache by default)."""
    explicit = os.environ.get("FUSEDSERVE_TUNING_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fusedserve" / "tuning.json"


@functools.cache  # a hash of the kernel source per call would cost ~20 us
def scope_for(kernel: str, *fns) -> str:
    """The cache scope of one kernel on this GPU and Triton: '<gpu> | triton <v> | <kernel>@<source hash>'."""
    import torch
    import triton

    return f"{torch.cuda.get_device_name()} | triton {triton.__version__} | {kernel}@{source_hash(*fns)}"


def source_hash(*fns) -> str:
    """A short hash of the kernels' source (JITFunction.src), so an edited kernel never reuses old picks."""
    h = hashlib.sha256()
    for fn in fns:
        h.update(getattr(fn, "src", repr(fn)).encode())
    return h.hexdigest()[:12]


class TuningCache:
    """Tuned configs in memory, backed by one JSON file shared by every kernel of the process."""

    def __init__(self, path: Path | None):
        self.path = path  # None: memory only
        self._lock = threading.Lock()
        self._data: dict[str, dict[str, dict]] = self._read()

    def _read(self) -> dict:
        if self.path is None or not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict):
                raise ValueError("top level is not an object")
            return data
        except (OSError, ValueError) as e:
            log.warning("tuning cache %s unreadable (%s); re-tuning as needed and rewriting it", self.path, e)
            return {}

    def get(self, scope: str, key: str) -> LaunchConfig | None:
        entry = self._data.get(scope, {}).get(key)
        if entry is None:
            return None
        try:
            return LaunchConfig.from_json(entry)
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    def put(self, scope: str, key: str, config: LaunchConfig, us: float) -> None:
        with self._lock:
            self._data.setdefault(scope, {})[key] = {**config.to_json(), "us": round(us, 3)}
            self._write()

    def _write(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Write then rename: a reader (another replica sharing the volume) never sees half a file.
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tuning-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump(self._data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("cannot write tuning cache %s (%s); tuned configs stay in memory only", self.path, e)


_cache: list[TuningCache] = []


def cache() -> TuningCache:
    """The process's cache, opened on first use at `default_cache_path()`."""
    if not _cache:
        _cache.append(TuningCache(default_cache_path()))
    return _cache[0]


def use_cache(path: Path | None) -> TuningCache:
    """Point the process at another cache file (None: memory only); the service calls this from its settings."""
    _cache[:] = [TuningCache(path)]
    return _cache[0]


def tune(
    scope: str,
    key: str,
    candidates: Iterable[LaunchConfig],
    run: Callable[[LaunchConfig], None],
    bench: Callable[[Callable[[], None]], float] | None = None,
) -> LaunchConfig:
    """The cached config for (scope, key), or the fastest candidate by `bench` (device us), then cached.

    A candidate that fails to compile or launch (too much shared memory, say) is skipped; if all fail
    the last error is raised, since no config can run this shape.
    """
    store = cache()
    hit = store.get(scope, key)
    if hit is not None:
        return hit
    if not enabled():
        return next(iter(candidates))
    bench = bench or _cold_graph_us
    best, best_us, last_error = None, float("inf"), None
    for config in candidates:
        try:
            us = bench(lambda config=config: run(config))
        except Exception as e:  # noqa: BLE001 - triton raises several types (OutOfResources, CompilationError)
            last_error = e
            log.debug("tuning %s %s: %s skipped (%s)", scope, key, config, e)
            continue
        if us < best_us:
            best, best_us = config, us
    if best is None:
        raise RuntimeError(f"no launch config runs {scope} {key}") from last_error
    store.put(scope, key, best, best_us)
    log.info("tuned %s %s: %s (%.1f us)", scope, key, best.meta(), best_us)
    return best


def _cold_graph_us(fn: Callable[[], None]) -> float:
    """Device time of one call with L2 cleared before it (median, us): the way bench.kernels measures.

    The call is captured once into a CUDA graph and the replay timed by cold_timing.cold_us, which reads
    a 256 MB buffer before every rep. Not launches from Python: that times the launcher (a 10 us kernel
    reads 10-40 us, depending on Triton's Python), and the tuner would pick noise. Not back to back
    (do_bench_cudagraph): that keeps every weight in L2 and picks for that case only (a 4096x4096 M=1 fp16
    pick runs 12.3 us hot but 18.9 us cold on an H200), while the weights of a layer that streams MBs of
    them are not in L2 when a request arrives.
    """
    from .cold_timing import cold_us
    from .graph_capture import capture

    graph, _ = capture(fn, warmups=2)  # the first compiles the candidate
    return cold_us(graph.replay, warmup_ms=5, rep_ms=20)


# Whether to time candidates. FUSEDSERVE_TUNING=false takes each kernel's first candidate untimed: quick
# starts, and test runs that check every candidate explicitly instead.
switch = EnvSwitch("FUSEDSERVE_TUNING")
enabled = switch
set_enabled = switch.set
