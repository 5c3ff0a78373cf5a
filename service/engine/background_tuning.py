"""Background tuning in the engine: the keys start-up left untimed (kernels/tuning_background.py) are timed while no
request waits, one candidate per call of `run_one`, and the CUDA graphs of the buckets whose picks changed are
captured again between batches."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kernels import tuning_background

log = logging.getLogger(__name__)

# A graph is captured again once every key of its bucket is timed, or this long after its first new pick, whichever
# comes first: a capture runs the bucket's forward 3 times (2 warm-ups and the capture, more with timed graphs), so
# not once per key (~50 keys a bucket for ResNet-50), yet traffic in that bucket gets the new picks within seconds.
RECAPTURE_AFTER_S = 10.0


class BackgroundTuning:
    """Times one queued tuning key's candidate per idle slice and swaps the new picks in, for one engine."""

    def __init__(self, runners: Callable[[], dict], metrics, publish: Callable[[int, int], None] | None = None):
        self.runners = runners  # {mode: ModelRunner}, as the engine holds them now (a reload may add one)
        self.metrics = metrics
        self.publish = publish  # (pending keys, keys done): for GET /model (service/link/tuning_progress.py)
        self.stale: dict[int, float] = {}  # bucket -> time.monotonic() of its first pick newer than its graph
        self._reported = -1  # the pending count last reported
        self.report()

    @property
    def pending(self) -> bool:
        """Whether anything is left: a key to time, or a graph to capture again."""
        return bool(tuning_background.queue().pending() or self.stale)

    def _graphs(self) -> list:
        """The fused runners' graphs: the unfused mode's kernels are torch's, never tuned here."""
        return [r.graphs for mode, r in self.runners().items() if mode == "fused" and r.graphs is not None]

    def used(self, rows: int) -> None:
        """A batch of `rows` ran: its bucket's keys go first."""
        for graphs in self._graphs():
            if rows <= graphs.max_batch_size:
                tuning_background.queue().used(graphs.bucket_for(rows))

    def run_one(self, now: float | None = None) -> None:
        """One slice: capture one stale graph again where one is due, else time one candidate."""
        now = time.monotonic() if now is None else now
        queue = tuning_background.queue()
        if self.stale:
            waiting = queue.pending_buckets()
            due = [b for b, since in self.stale.items() if b not in waiting or now - since >= RECAPTURE_AFTER_S]
            if due:
                bucket = min(due)
                del self.stale[bucket]
                t = time.perf_counter()
                captured = sum(graphs.recapture(bucket) for graphs in self._graphs())
                log.info("bucket %d captured again with its new kernel picks in %.1f ms", bucket,
                         (time.perf_counter() - t) * 1e3)  # fmt: skip
                self.metrics.tuning(queue.pending(), recaptured=captured)
                return
        finished = queue.step()
        if finished is not None:
            if finished.changed:
                for bucket in finished.buckets:
                    self.stale.setdefault(bucket, now)
            self.report(finished.changed)
        elif queue.pending() != self._reported:  # a key left untimed for good (no candidate could be timed)
            self.report()

    def report(self, tuned: bool | None = None) -> None:
        queue = tuning_background.queue()
        self._reported = queue.pending()
        self.metrics.tuning(self._reported, tuned)
        if self.publish is not None:
            self.publish(self._reported, queue.done)
