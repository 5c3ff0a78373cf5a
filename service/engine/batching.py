"""The engine's batch queue: whole requests, first come first served; numpy only, no HTTP, no asyncio, no torch.

Requests from every front end join one queue per engine. The engine takes the next batch the moment it
is free (`take`): every queued request in arrival order while the rows fit `max_batch_size`; requests
whose deadline passed or whose client went away are dropped there, before the GPU. So a request that
finds the engine idle runs at once, and requests that arrive while a forward runs gather into the next
batch: under load a batch holds about `arrival rate x forward time` requests, with no timer to tune
(Triton's dynamic batcher with `max_queue_delay_microseconds: 0` behaves the same way).

`max_delay_s` > 0 lets an idle engine hold a partial batch for company: `hold_for` says how much longer,
counted from the oldest request's arrival, so a request that already waited behind a forward is never
held again.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np

__all__ = ["BatchQueue", "Pending"]


# eq=False: entries are compared by identity (the generated __eq__ would compare numpy arrays).
@dataclass(slots=True, eq=False)
class Pending:
    """One queued request: who sent it (a front end's link identity) and its id there, its rows, its times."""

    owner: object  # the front end's connection, as the engine names it
    id: int
    rows: np.ndarray  # (n, *input_shape) float32; an image request: (n, 0) until its images are decoded
    enqueued_at: float  # time.monotonic(), the same clock in every process of the host
    deadline: float  # absolute time.monotonic()
    cancelled: bool = False
    # An image request (wire.SUBMIT_IMAGES): per image (wire kind, bytes, height, width), decoded when its batch runs
    images: list | None = None


class BatchQueue:
    def __init__(self, *, max_batch_size: int, max_queue_requests: int, max_delay_s: float = 0.0):
        if max_batch_size < 1 or max_queue_requests < 1 or max_delay_s < 0:
            raise ValueError(
                f"need max_batch_size >= 1, max_queue_requests >= 1, max_delay_s >= 0; got "
                f"{max_batch_size}, {max_queue_requests}, {max_delay_s}"
            )
        self.max_batch_size = max_batch_size
        self.max_queue_requests = max_queue_requests
        self.max_delay_s = max_delay_s
        self._queue: collections.deque[Pending] = collections.deque()
        self._by_key: dict[tuple[object, int], Pending] = {}  # live (not cancelled) entries, for cancel()
        self._rows = 0  # rows of live entries

    def __len__(self) -> int:
        """Live requests waiting (cancelled ones still in the deque are not counted)."""
        return len(self._by_key)

    def push(self, req: Pending) -> bool:
        """Queue `req`; False (and nothing queued) when `max_queue_requests` are already waiting."""
        n = req.rows.shape[0]
        if not 1 <= n <= self.max_batch_size:
            raise ValueError(f"a request must have 1..{self.max_batch_size} rows (max_batch_size), got {n}")
        if len(self._by_key) >= self.max_queue_requests:
            return False
        self._queue.append(req)
        self._by_key[(req.owner, req.id)] = req
        self._rows += n
        return True

    def cancel(self, owner: object, req_id: int) -> bool:
        """Drop a queued request whose client left; False when it is not queued (already taken, or unknown)."""
        req = self._by_key.pop((owner, req_id), None)
        if req is None:
            return False
        req.cancelled = True  # skipped, and removed from the deque, when take() reaches it
        self._rows -= req.rows.shape[0]
        return True

    def drop_owner(self, owner: object) -> int:
        """Cancel every request of one front end (it went away); returns how many."""
        keys = [k for k in self._by_key if k[0] == owner]
        for k in keys:
            self.cancel(*k)
        return len(keys)

    def peek(self) -> Pending | None:
        """The request the next take() would start with (the oldest live one), left queued; None when empty."""
        self._skip_cancelled()
        return self._queue[0] if self._queue else None

    def hold_for(self, now: float) -> float:
        """Seconds an idle engine may still wait before taking a partial batch (0: take it now)."""
        if self.max_delay_s <= 0 or self._rows >= self.max_batch_size:
            return 0.0
        self._skip_cancelled()
        if not self._queue:
            return 0.0
        return max(0.0, self._queue[0].enqueued_at + self.max_delay_s - now)

    def take(self, now: float) -> tuple[list[Pending], list[Pending]]:
        """The next batch (whole requests, FIFO, at most max_batch_size rows) and the requests dropped on the way
        because their deadline passed."""
        batch: list[Pending] = []
        expired: list[Pending] = []
        rows = 0
        queue = self._queue
        while queue:
            req = queue[0]
            if req.cancelled:
                queue.popleft()
                continue
            n = req.rows.shape[0]
            if req.deadline <= now:
                queue.popleft()
                self._forget(req, n)
                expired.append(req)
                continue
            if rows + n > self.max_batch_size:
                break  # whole requests only: it leads the next batch
            queue.popleft()
            self._forget(req, n)
            batch.append(req)
            rows += n
        return batch, expired

    def drain(self) -> list[Pending]:
        """Every live request, taken out (for a shutdown that cannot serve them)."""
        out = [r for r in self._queue if not r.cancelled]
        self._queue.clear()
        self._by_key.clear()
        self._rows = 0
        return out

    def _forget(self, req: Pending, n: int) -> None:
        del self._by_key[(req.owner, req.id)]
        self._rows -= n

    def _skip_cancelled(self) -> None:
        while self._queue and self._queue[0].cancelled:
            self._queue.popleft()
