"""Pick a launch config per (kernel, shape, batch bucket) once, and remember it on disk.

Triton's own autotuner keys on the call's arguments and keeps its results in memory (its optional
disk cache, `cache_results`, is not in every Triton we support and is keyed by hashes we cannot
read). A server needs more: the key is the batch *bucket* (powers of two), so a new
batch size never re-tunes; the results survive a restart, so a redeploy does not spend its warm-up
re-timing 10-20 configs per layer and bucket; and the file says what was chosen, for whom.

Each candidate is timed twice on one captured graph of a single call: cold (L2 cleared before each call,
kernels/cold_timing.py: the first batch after an idle spell) and hot (replayed back to back, the weights
left in L2 by the replay before, kernels/hot_timing.py: a loaded server). `pick` chooses from both
(FUSEDSERVE_TUNING_TIMING: `both`, the default; `cold` or `hot` alone).

The file is JSON: {"<gpu> | <triton version> | <kernel>": {"<key>|timing=<policy label>": {"kwargs": {...},
"num_warps": 4, "num_stages": 3, "cold_us": 4.1, "hot_us": 3.2, "offered": "<hash>"}}}. Entries are never
trusted across GPUs, Triton versions or timing policies, a kernel whose source changes, or that of any helper it
calls, gets a new name (`source_hash`), and a pick made from another list of candidates is made again
(`offered_hash`: a release that offers a new candidate has it timed, rather than keep a pick made without it). A
corrupt or unwritable file costs a re-tune and a warning, never a failed start.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from . import precompile
from .compile_deadline import CompileDeadlineExceeded
from .launch import precompiling
from .runtime import EnvChoice, EnvSwitch

log = logging.getLogger(__name__)


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


class Times(NamedTuple):
    """One candidate's device time per call, in us: cold (L2 cleared before the call) and hot (back to back)."""

    cold_us: float
    hot_us: float


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
    """A short hash of the kernels' source and of every @triton.jit function they call, however deep, and the
    global constants they read: Triton's JITFunction.cache_key, the walk Triton keys its own compile cache by.
    So an edited kernel, helper or constant never reuses old picks. Under the interpreter (no cache_key, and no
    tuning) the functions' own source."""
    h = hashlib.sha256()
    for fn in fns:
        h.update(str(getattr(fn, "cache_key", None) or getattr(fn, "src", repr(fn))).encode())
    return h.hexdigest()[:12]


def offered_hash(candidates: Iterable[LaunchConfig]) -> str:
    """A short hash of a list of candidates, in order."""
    return hashlib.sha256(json.dumps([c.to_json() for c in candidates], sort_keys=True).encode()).hexdigest()[:12]


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

    def get(self, scope: str, key: str, offered: str) -> LaunchConfig | None:
        """The config recorded for (scope, key); None where there is none, or it was picked from a list of
        candidates other than `offered` (an `offered_hash`)."""
        entry = self._data.get(scope, {}).get(key)
        if entry is None or entry.get("offered") != offered:
            return None
        try:
            return LaunchConfig.from_json(entry)
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    def configs(self, scope: str) -> dict[str, LaunchConfig]:
        """Every config recorded in `scope`, by entry key (whatever list of candidates it was picked from)."""
        out = {}
        for key, entry in list(self._data.get(scope, {}).items()):
            try:
                out[key] = LaunchConfig.from_json(entry)
            except (KeyError, TypeError, ValueError, AttributeError):
                continue
        return out

    def put(self, scope: str, key: str, config: LaunchConfig, times: Times, offered: str) -> None:
        """Record the chosen config with its cold and hot time (us), and the candidates it was picked from."""
        times_us = {"cold_us": round(times.cold_us, 3), "hot_us": round(times.hot_us, 3)}
        entry = {**config.to_json(), **times_us, "offered": offered}
        with self._lock:
            self._data.setdefault(scope, {})[key] = entry
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


POLICIES = ("both", "cold", "hot")
# `both` prefers a candidate near the best on each count (issue 19): cold within 2% of the best (the benchmark
# allows 3% over the cold-tuned run it replaced, and the tuner's cold times wander ~1% from one process to the
# next), hot within 10% (every process's pick within 10% of the best hot time).
COLD_SLACK = 1.02
HOT_SLACK = 1.10


def regret(times: Times, best: Times) -> Times:
    """times over the best of each timing: 1.0 is the best on that count."""
    return Times(_ratio(times.cold_us, best.cold_us), _ratio(times.hot_us, best.hot_us))


def _ratio(us: float, best: float) -> float:
    return us / best if best > 0 else (1.0 if us <= best else math.inf)


def best_times(timings: Mapping[LaunchConfig, tuple[float, float]]) -> Times:
    """The least cold and the least hot time over the candidates (usually of two different ones)."""
    return Times(min(c for c, _ in timings.values()), min(h for _, h in timings.values()))


def pick(timings: Mapping[LaunchConfig, tuple[float, float]], policy: str = "both") -> LaunchConfig:
    """The candidate `policy` chooses from each one's (cold us, hot us).

    cold, hot: the fastest by that timing; the other timing breaks a tie. both: of the candidates within
    COLD_SLACK of the best cold time and HOT_SLACK of the best hot time, the fastest hot (a loaded server runs
    hot); when none is within both, the least max(cold / best cold, hot / best hot), the candidate closest to
    the best on its worse count, the lower sum of the two ratios breaking a tie. Either way neither a loaded
    server (hot) nor the first batch after an idle spell (cold) pays much for the other. Of two candidates at
    1.00x cold and 1.07x hot and at 1.06x cold and 1.00x hot (the wide MLP's middle layer at batch 16;
    docs/performance.md, "What the tuner times"), `both` takes the first, `hot` the second. Equal scores go
    to the earlier candidate.
    """
    if policy not in POLICIES:
        raise ValueError(f"timing policy must be one of {', '.join(POLICIES)}; got {policy!r}")
    if not timings:
        raise ValueError("no timed candidate to pick from")
    best = best_times(timings)
    regrets = {config: regret(Times(*times), best) for config, times in timings.items()}
    if policy == "cold":
        return min(regrets, key=lambda c: (regrets[c].cold_us, regrets[c].hot_us))
    if policy == "hot":
        return min(regrets, key=lambda c: (regrets[c].hot_us, regrets[c].cold_us))
    near = [c for c, r in regrets.items() if r.cold_us <= COLD_SLACK and r.hot_us <= HOT_SLACK]
    if near:
        return min(near, key=lambda c: (regrets[c].hot_us, regrets[c].cold_us))
    return min(regrets, key=lambda c: (max(regrets[c]), sum(regrets[c])))


def policy_label(policy: str) -> str:
    """The policy as the tuning cache's keys name it: `both` with its bounds ('both:cold1.02,hot1.10'), so that a
    pick made under other bounds, or before `both` had them, is timed again instead of reused."""
    return f"both:cold{COLD_SLACK:.2f},hot{HOT_SLACK:.2f}" if policy == "both" else policy


def time_candidates(
    candidates: Iterable[LaunchConfig],
    run: Callable[[LaunchConfig], None],
    measure: Callable[[Callable[[], None]], tuple[float, float]] | None = None,
    label: str = "",
) -> dict[LaunchConfig, Times]:
    """{candidate: its (cold us, hot us) by `measure`}, in candidate order (default `_graph_times`).

    The candidates are compiled side by side first, where that can help (kernels/precompile.py), then timed one
    after another. A candidate that fails to compile or launch (too much shared memory, say), or whose timing is not
    a number, is left out (`time_one`); if all are, the last error is raised, since no config can run this shape.
    """
    candidates = list(candidates)
    precompile.precompile(candidates, run, label)
    timings: dict[LaunchConfig, Times] = {}
    last_error: Exception | None = None
    for config in candidates:
        times = time_one(config, run, measure, label)
        if isinstance(times, Times):
            timings[config] = times
        # A compile past its deadline is the error to report when none runs: the caller may fall back on it.
        elif times is not None and not isinstance(last_error, CompileDeadlineExceeded):
            last_error = times
    if not timings:
        raise RuntimeError(f"no launch config runs {label}") from last_error
    return timings


def time_one(
    config: LaunchConfig,
    run: Callable[[LaunchConfig], None],
    measure: Callable[[Callable[[], None]], tuple[float, float]] | None = None,
    label: str = "",
) -> Times | Exception | None:
    """One candidate's (cold us, hot us) by `measure` (default `_graph_times`); the error where it fails to compile
    or launch, None where its timing is not a number."""
    measure = measure or _graph_times
    try:
        with precompiling(False):  # launches, even for a tune inside a candidate's precompile (conv's pool apart)
            cold, hot = measure(lambda: run(config))
    except Exception as e:  # noqa: BLE001 - triton raises several types (OutOfResources, CompilationError)
        log.debug("tuning %s: %s skipped (%s)", label, config, e)
        return e
    if not (math.isfinite(cold) and math.isfinite(hot)):
        log.debug("tuning %s: %s skipped (cold %s us, hot %s us)", label, config, cold, hot)
        return None
    return Times(float(cold), float(hot))


def tune(
    scope: str,
    key: str,
    candidates: Iterable[LaunchConfig],
    run: Callable[[LaunchConfig], None],
    measure: Callable[[Callable[[], None]], tuple[float, float]] | None = None,
) -> LaunchConfig:
    """The cached config for (scope, key) under the timing policy, or the candidate `pick` chooses from each
    one's (cold us, hot us) by `measure` (see `time_candidates`), then cached with both times.

    The policy (`policy_label`) is part of the entry's key and the candidates' `offered_hash` is stored with
    it: a pick made for another policy, or from another list, is never reused. With background tuning on
    (kernels/tuning_background.py), or once this process has spent its timing budget (`timing_budget`), a key
    missing from the cache is not timed here: it gets an untimed pick at once and is queued, to be timed while
    the server is idle.
    """
    candidates = list(candidates)
    policy = timing_policy()
    entry = f"{key}|timing={policy_label(policy)}"
    offered = offered_hash(candidates)
    store = cache()
    hit = store.get(scope, entry, offered)
    if hit is not None:
        return hit
    if not enabled():
        return candidates[0]
    if background() or timing_budget.spent():
        from . import tuning_background

        return tuning_background.defer(scope, key, candidates, run, measure)
    started = time.perf_counter()
    timings = time_candidates(candidates, run, measure, f"{scope} {key}")
    timing_budget.charge(time.perf_counter() - started)
    return store_pick(scope, key, candidates, timings, policy)


def store_pick(
    scope: str, key: str, candidates: list[LaunchConfig], timings: Mapping[LaunchConfig, Times], policy: str, how=""
) -> LaunchConfig:
    """The candidate `policy` picks from `timings`, recorded in the cache under (scope, key) and logged (`how`: how
    it was timed, for the log line)."""
    best = pick(timings, policy)
    times = timings[best]
    picks_timed.add()
    cache().put(scope, f"{key}|timing={policy_label(policy)}", best, times, offered_hash(candidates))
    cold, hot = regret(times, best_times(timings))
    log.info(
        "tuned%s %s %s: %s (cold %.1f us, hot %.1f us: %.2fx and %.2fx the best of %d candidates; timing %s)",
        how, scope, key, best.meta(), times.cold_us, times.hot_us, cold, hot, len(timings), policy,
    )  # fmt: skip
    return best


class _Count:
    """A count shared by threads (the start-up's progress reads it from its ticker)."""

    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def add(self) -> None:
        with self._lock:
            self.value += 1


# Keys this process has timed and picked a config for (start-up progress: service/engine/startup.py).
picks_timed = _Count()


def _graph_times(fn: Callable[[], None]) -> Times:
    """Device time of one call (us), cold and hot, both on one CUDA graph of that call.

    Cold: L2 cleared before each replay (cold_timing.cold_us, which reads a 256 MB buffer first; median),
    as the weights of a layer that streams MBs of them are when a request arrives after a pause (a
    4096x4096 M=1 fp16 pick runs 12.3 us hot but 18.9 us cold). Hot: replays back to back
    (hot_timing.hot_us, median us per replay over windows of >= 1 ms), as a loaded server runs one batch
    after the last, weights warm in L2, and the next call's programs meeting the last one's (the whole-MLP
    kernel's arrival counter, PDL's early starts). Not launches from Python: that times the launcher (a 10
    us kernel reads 10-40 us, depending on Triton's Python), and the tuner would pick noise.
    """
    from .cold_timing import cold_us
    from .graph_capture import capture
    from .hot_timing import hot_us

    graph, _ = capture(fn, warmups=2)  # the first compiles the candidate, where time_candidates' precompile did not
    cold = cold_us(graph.replay, warmup_ms=5, rep_ms=20)
    hot = hot_us(graph.replay)
    if hot["hot_host_bound"]:
        log.debug("hot timing may have measured the host's launches (%.2f us a replay)", hot["hot_us"])
    return Times(cold, hot["hot_us"])


# Whether to time candidates. FUSEDSERVE_TUNING=false takes each kernel's first candidate untimed: quick
# starts, and test runs that check every candidate explicitly instead.
switch = EnvSwitch("FUSEDSERVE_TUNING")
enabled = switch
set_enabled = switch.set

# Whether a key missing from the cache is timed later, while the server is idle, rather than at once
# (kernels/tuning_background.py): FUSEDSERVE_TUNING_BACKGROUND, off unless set (the service passes its setting).
background = EnvSwitch("FUSEDSERVE_TUNING_BACKGROUND", default=False)
set_background = background.set


class TimingBudget:
    """Seconds of candidate timing `tune` may spend in this process before it defers the keys still missing from the
    cache, as background tuning does (kernels/tuning_background.py). None: no limit (what a benchmark or a library
    caller gets). The service sets FUSEDSERVE_TUNING_STARTUP_S: timing every key of every bucket held a ResNet-50's
    start for minutes (bucket 1 alone took 217 s with empty caches on an H100), so past the budget it becomes ready
    on untimed picks and times the rest while idle. The key being timed when the budget runs out is finished."""

    def __init__(self) -> None:
        self.seconds: float | None = None
        self.used = 0.0

    def set(self, seconds: float | None) -> None:
        """A new budget, with nothing spent yet."""
        self.seconds = seconds
        self.used = 0.0

    def charge(self, seconds: float) -> None:
        self.used += seconds

    def spent(self) -> bool:
        return self.seconds is not None and self.used >= self.seconds


timing_budget = TimingBudget()


# Which timing picks a candidate (`pick`): FUSEDSERVE_TUNING_TIMING (both, cold or hot; default both), unless
# set_timing_policy said otherwise (the service passes its setting).
timing_policy = EnvChoice("FUSEDSERVE_TUNING_TIMING", POLICIES, "both")
set_timing_policy = timing_policy.set
