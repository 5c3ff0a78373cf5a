"""Background tuning: a server becomes ready on untimed picks, and times them later while it is idle.

Timing every candidate of every key at start-up does not fit a large model's start: ResNet-50 has ~50 keys per
batch bucket and 9 buckets up to 256, each key 11-28 candidates at ~1.5 s a key with Triton's cache warm. With
FUSEDSERVE_TUNING_BACKGROUND on (kernels/tuning.py, `background`), `tune` does not time a key missing from the
cache: `defer` returns an untimed pick at once and queues the key. The pick is the one cached for the same kernel
and shape at the nearest batch bucket, where one is among this key's candidates (neighbouring buckets mostly pick
alike), else the first candidate, as FUSEDSERVE_TUNING=false takes.

The server then calls `step` while no request waits: each call times one candidate of one queued key (a capture and
~30 ms of cold and hot timing, after its compile where it is not compiled yet, so a request that arrives waits for
one step at most), and the call that times a key's last candidate picks and caches it exactly as `tune` would, so
the next start finds it. A call that reaches a candidate not compiled yet first compiles it and the next ones
(BACKGROUND_CHUNK in all, at most precompile.threads()) side by side where that can help (kernels/precompile.py).
Where the pick differs from the untimed one, the launchers' memos are cleared (`on_new_picks`: they ask `tune`
again, and get the cached pick) and `step` names the batch buckets whose CUDA graphs hold the old one, for the
server to capture again between batches. The bucket of each key is the one the
server was warming or capturing when the key was deferred (`for_bucket`); `used` counts the buckets that traffic
runs, and the queue times those first.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import math
import re
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

from . import precompile, tuning
from .tuning import LaunchConfig, Times

log = logging.getLogger(__name__)

# Candidates a background step compiles side by side. A request that arrives meanwhile waits for the whole chunk:
# on an H100 with Triton's cache cold, a conv key of 27 candidates tuned in 11.9 s compiling one at a time and in
# 4.4 s on 16 threads (Triton's Python front end holds the GIL: far from 16x), so a chunk of 4 keeps a step's wait
# near a compile or two while a key takes 4x fewer compiling steps. Start-up tuning, where no request waits,
# compiles a key's candidates all at once.
BACKGROUND_CHUNK = 4

# The batch bucket in a tuning key: the launchers end their keys' bucket field with `|m<rows>` (GEMMs, convs: M
# rows of the implicit GEMM) or `|n<rows>` (pools), before any flags (`|tma`, `|residual`, `|pool=...`).
_BUCKET = re.compile(r"\|([mn])(\d+)(?=\||$)")


def split_bucket(key: str) -> tuple[str, int] | None:
    """(the key with its bucket replaced by a placeholder, the bucket), or None for a key without one."""
    found = list(_BUCKET.finditer(key))
    if len(found) != 1:
        return None
    m = found[0]
    return key[: m.start()] + f"|{m.group(1)}*" + key[m.end() :], int(m.group(2))


def nearest_pick(scope: str, key: str, candidates: list[LaunchConfig]) -> LaunchConfig | None:
    """The config cached for `scope` under the same key at the nearest other bucket (by factors of two; the smaller
    of two as near) that is among `candidates`, under the current timing policy; None where there is none."""
    mine = split_bucket(key)
    if mine is None:
        return None
    suffix = f"|timing={tuning.policy_label(tuning.timing_policy())}"
    offered = set(candidates)
    near = []
    for entry, config in tuning.cache().configs(scope).items():
        if not entry.endswith(suffix) or config not in offered:
            continue
        theirs = split_bucket(entry.removesuffix(suffix))
        if theirs is not None and theirs[0] == mine[0] and theirs[1] != mine[1] and theirs[1] > 0:
            near.append((abs(math.log2(theirs[1]) - math.log2(max(mine[1], 1))), theirs[1], config))
    return min(near, key=lambda t: t[:2])[2] if near else None


@dataclass(eq=False)
class Job:
    """One deferred key: its candidates, how to run one, and the timings taken so far."""

    scope: str
    key: str
    candidates: list[LaunchConfig]
    run: Callable[[LaunchConfig], None]  # the first deferring call's launch: it holds that call's tensors
    measure: Callable | None
    untimed: LaunchConfig  # what the launchers run until the key is timed
    order: int
    buckets: set[int] = field(default_factory=set)  # the graph buckets whose forwards run it
    timings: dict[LaunchConfig, Times] = field(default_factory=dict)
    next: int = 0  # the candidate to time next
    compiled_to: int = 0  # candidates before this one were precompiled (kernels/precompile.py)


class Finished(NamedTuple):
    """A key `step` finished: its pick, whether that differs from its untimed pick, and its graph buckets."""

    scope: str
    key: str
    pick: LaunchConfig
    changed: bool
    buckets: frozenset[int]


class Queue:
    """The keys deferred in this process, and the traffic of each batch bucket that orders them."""

    def __init__(self):
        self._lock = threading.Lock()  # a mode loaded on its own thread (service/engine/ab.py) may defer keys
        self.jobs: dict[tuple[str, str], Job] = {}
        self.settled: dict[tuple[str, str], LaunchConfig] = {}  # keys no candidate could be timed for: kept untimed
        self.hits: Counter[int] = Counter()
        self.done = 0  # keys timed by `step`
        self._order = itertools.count()
        self._bucket = threading.local()

    def defer(self, scope: str, key: str, candidates: list[LaunchConfig], run, measure) -> LaunchConfig:
        """The untimed pick of a key missing from the cache; the key is queued on its first call."""
        bucket = getattr(self._bucket, "value", None)
        with self._lock:
            job = self.jobs.get((scope, key))
            if job is None or job.candidates != candidates:
                settled = self.settled.get((scope, key))
                if settled is not None:
                    return settled
                untimed = nearest_pick(scope, key, candidates) or candidates[0]
                job = self.jobs[(scope, key)] = Job(scope, key, candidates, run, measure, untimed, next(self._order))
            if bucket is not None:
                job.buckets.add(bucket)
            return job.untimed

    @contextmanager
    def for_bucket(self, bucket: int) -> Iterator[None]:
        """Keys deferred inside belong to the graph of batch bucket `bucket` (this thread's calls only)."""
        before = getattr(self._bucket, "value", None)
        self._bucket.value = bucket
        try:
            yield
        finally:
            self._bucket.value = before

    def used(self, bucket: int) -> None:
        """A batch of bucket `bucket` ran: its keys are timed before those of buckets with less traffic."""
        self.hits[bucket] += 1

    def pending(self) -> int:
        return len(self.jobs)

    def pending_buckets(self) -> set[int]:
        """The graph buckets that still run an untimed pick."""
        with self._lock:
            return {b for job in self.jobs.values() for b in job.buckets}

    def _next_job(self) -> Job | None:
        """The key to time next: the most used bucket's first, then the order they were deferred in (warm-up
        defers the smallest bucket first)."""
        with self._lock:
            if not self.jobs:
                return None
            return min(self.jobs.values(), key=lambda j: (-max((self.hits[b] for b in j.buckets), default=0), j.order))

    def step(self) -> Finished | None:
        """Time one candidate of the next key (compiling it and the next ones first where they are not yet,
        `Job.compiled_to`); when that was its last, pick, cache and return it (else None)."""
        job = self._next_job()
        if job is None:
            return None
        label = f"{job.scope} {job.key}"
        if job.next < len(job.candidates):
            if job.next >= job.compiled_to:  # the next chunk, compiled side by side
                chunk = job.candidates[job.next : job.next + max(1, min(precompile.threads(), BACKGROUND_CHUNK))]
                precompile.precompile(chunk, job.run, label)
                job.compiled_to = job.next + len(chunk)
            config = job.candidates[job.next]
            job.next += 1
            times = tuning.time_one(config, job.run, job.measure, label)
            if isinstance(times, Times):
                job.timings[config] = times
            if job.next < len(job.candidates):
                return None
        with self._lock:
            del self.jobs[(job.scope, job.key)]
        if not job.timings:
            log.warning("tuning %s: no candidate could be timed; keeping the untimed %s", label, job.untimed.meta())
            self.settled[(job.scope, job.key)] = job.untimed
            return None
        best = tuning.store_pick(job.scope, job.key, job.candidates, job.timings, tuning.timing_policy(),
                                 " in the background")  # fmt: skip
        self.done += 1
        changed = best != job.untimed
        if changed:
            forget_picks()
        return Finished(job.scope, job.key, best, changed, frozenset(job.buckets))


_queue = Queue()


def queue() -> Queue:
    return _queue


def reset() -> Queue:
    """A new, empty queue (tests; a process that starts over)."""
    global _queue
    _queue = Queue()
    return _queue


def defer(scope: str, key: str, candidates: list[LaunchConfig], run, measure=None) -> LaunchConfig:
    return _queue.defer(scope, key, candidates, run, measure)


# ---- the launchers' memos ----

_clearers: list[Callable[[], Callable[[], None] | None]] = []


def on_new_picks(clear: Callable[[], None]) -> None:
    """Call `clear` whenever a background pick replaces an untimed one, so that a launcher's memo of picks asks
    `tune` again. A bound method is held weakly (a layer's memo goes with the layer); anything else for good."""
    if inspect.ismethod(clear):
        _clearers.append(weakref.WeakMethod(clear))
        if len(_clearers) % 1024 == 0:  # layers come and go (tests make thousands): drop the dead
            _clearers[:] = [ref for ref in _clearers if ref() is not None]
    else:
        _clearers.append(lambda: clear)


def forget_picks() -> None:
    """Clear every launcher memo registered with `on_new_picks`."""
    for ref in list(_clearers):
        clear = ref()
        if clear is not None:
            clear()
