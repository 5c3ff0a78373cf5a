"""Dynamic batching of inference requests: asyncio + numpy only, no HTTP, no torch.

Requests (arrays of shape ``(n, *feature_shape)``) are queued on the event loop. One collector
task takes the oldest request, keeps adding whole requests in FIFO order until the batch holds
``max_batch_size`` rows or ``max_delay_s`` has passed, and hands the batch to ONE worker thread,
which concatenates the parts and calls ``run_batch``. Each caller then gets back exactly its own
rows of the output.

Why one worker thread: the GPU executes one forward at a time anyway, and a single owner thread
keeps every kernel launch (warm-up included, see ``run_in_worker``) on one CUDA stream. Why at
most one batch in flight: requests that arrive while a forward runs simply queue, so the next
batch holds roughly ``arrival rate x forward time`` requests; batches grow with load by
themselves, with no tuning.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np

__all__ = [
    "BatchFailed",
    "BatchObserver",
    "Batcher",
    "BatcherError",
    "DeadlineExceeded",
    "Overloaded",
    "ShuttingDown",
]

log = logging.getLogger("fusedserve.batching")

T = TypeVar("T")

WORKER_THREAD_PREFIX = "fusedserve-forward"


class BatcherError(Exception):
    """Base of every error the batcher raises to a caller of ``submit``."""


class Overloaded(BatcherError):
    """The queue already held ``max_queue_requests`` requests; this one was never queued."""


class DeadlineExceeded(BatcherError):
    """The request's deadline passed before its batch ran; it never reached ``run_batch``."""


class BatchFailed(BatcherError):
    """The forward of this request's batch raised; ``__cause__`` is the original exception."""


class ShuttingDown(BatcherError):
    """``stop()`` was called while the request waited, or the request came after ``stop()``."""


class BatchObserver(Protocol):
    """Metrics hooks. All are called on the event loop thread and must be cheap.

    An observer that raises is logged and ignored: metrics never fail a request.
    """

    def queue_depth(self, requests: int) -> None:
        """Requests waiting in the queue, after every change to it."""

    def queue_wait(self, seconds: float) -> None:
        """Per request, when its batch is formed: enqueue -> batch start."""

    def batch(self, rows: int, requests: int) -> None:
        """Per batch handed to ``run_batch``."""

    def dropped(self, reason: str) -> None:
        """Per request dropped before its forward: ``"timeout"`` or ``"cancelled"``."""


# eq=False: entries are found in the deque by identity (deque.remove on cancellation); the
# generated __eq__ would compare the numpy arrays and raise "truth value is ambiguous".
@dataclass(slots=True, eq=False)
class _Request:
    rows: np.ndarray
    future: asyncio.Future[np.ndarray]
    enqueued_at: float  # time.monotonic()
    deadline: float | None  # absolute time.monotonic(), None = no deadline
    in_queue: bool = field(default=True)  # False once the collector (or stop/cancel) took it out

    def expired(self, now: float) -> bool:
        return self.deadline is not None and self.deadline <= now


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Batcher:
    """Merges concurrent ``submit`` calls into batches for ``run_batch``; see the module docstring.

    ``run_batch(batch)`` gets an array of shape ``(rows, *feature_shape)`` (rows <= max_batch_size)
    and must return an array whose first dimension is ``rows``. It runs on the worker thread. When
    the batch holds a single request, ``batch`` may be that caller's own array (no copy), so
    ``run_batch`` must not modify its input in place.
    """

    def __init__(
        self,
        run_batch: Callable[[np.ndarray], np.ndarray],
        *,
        max_batch_size: int,
        max_delay_s: float,
        max_queue_requests: int,
        observer: BatchObserver | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_delay_s < 0:
            raise ValueError(f"max_delay_s must be >= 0, got {max_delay_s}")
        if max_queue_requests < 1:
            raise ValueError(f"max_queue_requests must be >= 1, got {max_queue_requests}")
        self._run_batch = run_batch
        self._max_rows = max_batch_size
        self._max_delay = max_delay_s
        self._max_queue = max_queue_requests
        self._observer = observer

        self._queue: collections.deque[_Request] = collections.deque()
        # Requests taken out of the queue for the batch being formed, then the batch in flight.
        # Kept on self so that an unexpected error in the collector can still fail them instead
        # of leaving their callers waiting forever.
        self._forming: list[_Request] = []
        self._waiter: asyncio.Future[None] | None = None  # collector sleeps on it; submit wakes it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._collector: asyncio.Task[None] | None = None
        self._stopping = False
        self._stop_task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Create the worker thread and the collector task on the running loop."""
        if self._loop is not None or self._stopping:
            raise RuntimeError("Batcher.start() may be called once, before stop()")
        self._loop = asyncio.get_running_loop()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=WORKER_THREAD_PREFIX)
        self._collector = self._loop.create_task(self._collect(), name="fusedserve-batcher")
        self._collector.add_done_callback(self._collector_done)

    async def stop(self) -> None:
        """Stop collecting, fail queued requests with ShuttingDown, let the batch in flight
        finish (its callers get their results), then shut the worker thread down.

        Idempotent; safe to call concurrently. Cancelling a caller of stop() does not abort
        the shutdown (it is shielded). Waits as long as the forward in flight takes.
        """
        if self._stop_task is None:
            self._stop_task = asyncio.get_running_loop().create_task(self._shutdown())
        await asyncio.shield(self._stop_task)

    async def _shutdown(self) -> None:
        self._stopping = True
        self._fail_queued(lambda: ShuttingDown("batcher stopped while the request was queued"))
        self._wake()
        if self._collector is not None:
            # The collector finishes the forward in flight and delivers its results; a batch
            # still being formed is failed with ShuttingDown.
            await asyncio.shield(self._collector)
        if self._pool is not None:
            # run_in_worker() jobs may still be queued on the thread. The pool is FIFO with one
            # worker, so once this no-op has run everything before it has too, and the join in
            # shutdown() below only waits for an idle thread to exit (microseconds), not for
            # GPU work, so it does not stall the event loop.
            try:
                await self._loop.run_in_executor(self._pool, lambda: None)
            finally:
                self._pool.shutdown(wait=True)

    def _collector_done(self, task: asyncio.Task[None]) -> None:
        # The collector only returns after stop(). If it ends any other way that is a bug; make
        # sure nobody waits forever on it and that later submits fail fast.
        if self._stopping and (task.cancelled() or task.exception() is None):
            return
        if task.cancelled():  # e.g. the loop was closed without stop()
            log.warning("batch collector task was cancelled without stop(); batcher now refuses requests")
        else:
            log.error("batch collector task died; batcher is now refusing requests", exc_info=task.exception())
        self._stopping = True
        self._fail_queued(lambda: ShuttingDown("batch collector exited unexpectedly"))

    # ------------------------------------------------------------------ public API

    @property
    def queue_depth(self) -> int:
        """Requests waiting in the queue (not counting the batch being formed or in flight)."""
        return len(self._queue)

    async def submit(self, rows: np.ndarray, deadline: float | None = None) -> np.ndarray:
        """Queue ``rows`` (shape ``(n, *feature_shape)``, 1 <= n <= max_batch_size) and return the
        ``n`` output rows that ``run_batch`` produced for them.

        ``deadline`` is an absolute ``time.monotonic()`` time. Raises Overloaded (at once, never
        queued), DeadlineExceeded, BatchFailed or ShuttingDown; ValueError for a bad ``n``.
        """
        if self._stopping:
            raise ShuttingDown("batcher is stopped")
        loop = self._loop
        if loop is None:
            raise RuntimeError("Batcher.start() has not been called")
        if asyncio.get_running_loop() is not loop:
            raise RuntimeError("Batcher.submit() called from a different event loop than start()")
        n = rows.shape[0] if rows.ndim else 0
        if not 1 <= n <= self._max_rows:
            raise ValueError(f"a request must have 1..{self._max_rows} rows (max_batch_size), got {n}")
        now = time.monotonic()
        if deadline is not None and deadline <= now:
            self._observe("dropped", "timeout")
            raise DeadlineExceeded(f"deadline passed {now - deadline:.3f} s before the request was queued")
        if len(self._queue) >= self._max_queue:
            raise Overloaded(f"queue full: {len(self._queue)} requests waiting (max_queue_requests)")

        req = _Request(rows, loop.create_future(), now, deadline)
        self._queue.append(req)
        self._observe("queue_depth", len(self._queue))
        self._wake()
        try:
            return await req.future
        except asyncio.CancelledError:
            # Task.cancel() has already cancelled req.future. If the request is still queued,
            # take it out now so it stops holding a max_queue_requests slot. If the collector
            # already took it, the collector skips it (and reports the drop) before the forward;
            # if its batch is running, the batch finishes and this result is discarded.
            if req.in_queue:
                req.in_queue = False
                self._queue.remove(req)  # O(queue length), bounded by max_queue_requests
                self._observe("dropped", "cancelled")
                self._observe("queue_depth", len(self._queue))
            elif req.future.done() and not req.future.cancelled():
                # Result/exception was set, but this task was cancelled before it resumed:
                # mark it retrieved so asyncio doesn't log "exception was never retrieved".
                req.future.exception()
            raise

    async def run_in_worker(self, fn: Callable[[], T]) -> T:
        """Run ``fn()`` on the forward thread (e.g. warm-up), so one thread owns the GPU stream.

        It queues behind (and blocks) forwards like any batch.
        """
        if self._stopping:
            raise ShuttingDown("batcher is stopped")
        if self._loop is None or self._pool is None:
            raise RuntimeError("Batcher.start() has not been called")
        return await self._loop.run_in_executor(self._pool, fn)

    # ------------------------------------------------------------------ collector

    def _wake(self) -> None:
        if self._waiter is not None:
            _resolve(self._waiter)

    async def _wait_for_work(self, timeout: float | None) -> None:
        """Sleep until submit()/stop() wakes us, or ``timeout`` seconds pass. No polling.

        A Future plus call_later rather than asyncio.wait_for(event.wait()): wait_for would
        create a task per wake-up, and under load the collector wakes once per request.
        """
        assert self._loop is not None
        waiter = self._loop.create_future()
        self._waiter = waiter
        timer = None if timeout is None else self._loop.call_later(timeout, _resolve, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    async def _collect(self) -> None:
        while not self._stopping:
            try:
                await self._collect_one_batch()
            except asyncio.CancelledError:
                self._fail_forming(lambda: ShuttingDown("batch collector cancelled"))
                raise
            except Exception as err:
                # Never let the collector die: a dead collector means every caller hangs.
                log.exception("batch collector error; failing the affected batch and continuing")
                self._fail_forming(
                    lambda err=err: _chain(BatchFailed(f"internal batching error: {type(err).__name__}: {err}"), err)
                )
                await asyncio.sleep(0)  # let other tasks run if this error repeats
        self._fail_forming(lambda: ShuttingDown("batcher stopped before the request's batch ran"))

    async def _collect_one_batch(self) -> None:
        forming: list[_Request] = []
        self._forming = forming
        rows = 0
        close_at = 0.0
        while True:
            if self._stopping:
                return  # _collect fails what we took with ShuttingDown
            now = time.monotonic()
            taken = False
            queue = self._queue
            while queue:
                req = queue[0]
                if req.future.done():  # cancelled; submit() hasn't run its except block yet
                    queue.popleft()
                    req.in_queue = False
                    taken = True
                    self._observe("dropped", "cancelled")
                    continue
                if req.expired(now):
                    queue.popleft()
                    req.in_queue = False
                    taken = True
                    self._drop_timeout(req, now)
                    continue
                n = req.rows.shape[0]
                if rows + n > self._max_rows:
                    break  # whole requests only: it goes first in the next batch
                queue.popleft()
                req.in_queue = False
                taken = True
                if not forming:
                    # The delay counts from the first request's ENQUEUE time, not from when the
                    # collector took it. Idle, the two are the same. Under load they are not: a
                    # request that already waited a whole forward (say 5 ms) would otherwise
                    # wait another max_delay_s with the GPU idle, e.g. 5 ms forward + 5 ms delay
                    # = 50 % GPU utilisation at best; this way the next forward starts at once.
                    close_at = req.enqueued_at + self._max_delay
                forming.append(req)
                rows += n
            if taken:
                self._observe("queue_depth", len(queue))
            if rows >= self._max_rows or queue:
                break  # full, or the next request does not fit: waiting longer cannot help
            if not forming:
                await self._wait_for_work(None)
                continue
            remaining = close_at - time.monotonic()
            if remaining <= 0:
                break
            await self._wait_for_work(remaining)
        await self._run(forming)

    async def _run(self, forming: list[_Request]) -> None:
        assert self._loop is not None
        now = time.monotonic()
        live: list[_Request] = []
        for req in forming:
            if req.future.done():  # caller cancelled while the batch was being formed
                self._observe("dropped", "cancelled")
            elif req.expired(now):  # expired during the max_delay_s wait
                self._drop_timeout(req, now)
            else:
                live.append(req)
        self._forming = live
        if not live:
            return
        parts = [req.rows for req in live]
        counts = [p.shape[0] for p in parts]
        rows = sum(counts)
        for req in live:
            self._observe("queue_wait", now - req.enqueued_at)
        self._observe("batch", rows, len(live))

        try:
            out = await self._loop.run_in_executor(self._pool, self._forward, parts, rows)
        except Exception as err:
            log.error("forward failed on a batch of %d rows (%d requests)", rows, len(live), exc_info=err)
            msg = f"forward failed on a batch of {rows} rows ({len(live)} requests): {type(err).__name__}: {err}"
            for req in live:
                if not req.future.done():
                    # One exception object per caller: a shared instance would accumulate every
                    # caller's traceback frames as each task re-raises it.
                    req.future.set_exception(_chain(BatchFailed(msg), err))
            self._forming = []
            return

        start = 0
        for req, n in zip(live, counts, strict=True):
            if not req.future.done():  # done = caller cancelled mid-forward: result discarded
                req.future.set_result(out[start : start + n])  # a view into the batch output
            start += n
        self._forming = []

    def _forward(self, parts: list[np.ndarray], rows: int) -> np.ndarray:
        """Runs on the worker thread: the concatenation copy stays off the event loop too."""
        batch = np.ascontiguousarray(parts[0]) if len(parts) == 1 else np.concatenate(parts, axis=0)
        out = self._run_batch(batch)
        shape = getattr(out, "shape", None)
        if shape is None or len(shape) == 0 or shape[0] != rows:
            got = f"shape {tuple(shape)}" if shape is not None else f"a {type(out).__name__}"
            raise ValueError(
                f"run_batch returned {got} for a batch of {rows} rows (the output's first dimension must be {rows})"
            )
        return out

    # ------------------------------------------------------------------ helpers

    def _drop_timeout(self, req: _Request, now: float) -> None:
        assert req.deadline is not None
        req.future.set_exception(
            DeadlineExceeded(
                f"deadline passed {now - req.deadline:.3f} s before the request's batch ran "
                f"(queued {now - req.enqueued_at:.3f} s)"
            )
        )
        self._observe("dropped", "timeout")

    def _fail_queued(self, make_exc: Callable[[], BaseException]) -> None:
        if not self._queue:
            return
        while self._queue:
            req = self._queue.popleft()
            req.in_queue = False
            if not req.future.done():
                req.future.set_exception(make_exc())
        self._observe("queue_depth", 0)

    def _fail_forming(self, make_exc: Callable[[], BaseException]) -> None:
        forming, self._forming = self._forming, []
        for req in forming:
            if not req.future.done():
                req.future.set_exception(make_exc())

    def _observe(self, hook: str, *args: Any) -> None:
        observer = self._observer
        if observer is None:
            return
        try:
            getattr(observer, hook)(*args)
        except Exception:
            log.exception("BatchObserver.%s%r raised; ignored", hook, args)


def _chain(exc: BaseException, cause: BaseException) -> BaseException:
    """``raise exc from cause`` for an exception that is stored on a future, not raised here."""
    exc.__cause__ = cause
    return exc
