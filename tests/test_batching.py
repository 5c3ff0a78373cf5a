"""Tests for service.batching: real asyncio concurrency and a real worker thread, bounded in time.

Batch composition is made deterministic with a gate: a request holding the BLOCK value makes
run_batch wait on a threading.Event, so everything submitted meanwhile queues up, and the test
knows exactly what the next batches will hold when it opens the gate.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Awaitable, Callable

import numpy as np
import pytest

from service.batching import (
    Batcher,
    BatcherError,
    BatchFailed,
    DeadlineExceeded,
    Overloaded,
    ShuttingDown,
)

pytestmark = pytest.mark.timeout(30)

BLOCK = -1000.0  # a row holding this makes run_batch wait for Forward.release
MARKER = -7.0  # rows that must never reach run_batch, or that make it fail
SLOW = 99.0  # test 8: a forward that waits for the event loop to tick
FEATURES = 4


def rows(n: int, value: float = 1.0) -> np.ndarray:
    return np.full((n, FEATURES), value, dtype=np.float32)


def double(x: np.ndarray) -> np.ndarray:
    return x * 2


class Forward:
    """A run_batch that records what it saw, and can be held closed by a gate."""

    def __init__(self, fn: Callable[[np.ndarray], np.ndarray] = double, sleep_s: float = 0.0) -> None:
        self.fn = fn
        self.sleep_s = sleep_s
        self.batches: list[np.ndarray] = []
        self.threads: list[threading.Thread] = []
        self.blocked = threading.Event()  # set when a gated batch is waiting in run_batch
        self.release = threading.Event()

    def __call__(self, batch: np.ndarray) -> np.ndarray:
        self.batches.append(batch.copy())
        self.threads.append(threading.current_thread())
        if (batch == BLOCK).any():
            self.blocked.set()
            if not self.release.wait(10):
                raise TimeoutError("test never opened the gate")
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return self.fn(batch)

    @property
    def sizes(self) -> list[int]:
        return [b.shape[0] for b in self.batches]

    def saw(self, value: float) -> bool:
        return any((b == value).any() for b in self.batches)

    async def wait_blocked(self) -> None:
        assert await asyncio.to_thread(self.blocked.wait, 5), "gated batch never reached run_batch"


class Recorder:
    """A BatchObserver that records every call."""

    def __init__(self) -> None:
        self.depths: list[int] = []
        self.waits: list[float] = []
        self.batches: list[tuple[int, int]] = []
        self.drops: list[str] = []

    def queue_depth(self, requests: int) -> None:
        self.depths.append(requests)

    def queue_wait(self, seconds: float) -> None:
        self.waits.append(seconds)

    def batch(self, rows: int, requests: int) -> None:
        self.batches.append((rows, requests))

    def dropped(self, reason: str) -> None:
        self.drops.append(reason)


async def until(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    """Yield to the loop until pred() holds (a precondition, not an assertion on timing)."""
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "condition not reached in time"
        await asyncio.sleep(0.001)


def run_with(
    body: Callable[[Batcher, Forward, Recorder], Awaitable[None]],
    forward: Forward | None = None,
    *,
    max_batch_size: int = 8,
    max_delay_s: float = 0.002,
    max_queue_requests: int = 1000,
) -> tuple[Forward, Recorder]:
    """Start a batcher, run body, always open the gate and stop the batcher afterwards."""
    fwd = forward or Forward()
    obs = Recorder()

    async def main() -> None:
        b = Batcher(
            fwd,
            max_batch_size=max_batch_size,
            max_delay_s=max_delay_s,
            max_queue_requests=max_queue_requests,
            observer=obs,
        )
        await b.start()
        try:
            await body(b, fwd, obs)
        finally:
            fwd.release.set()
            await asyncio.wait_for(b.stop(), 10)

    asyncio.run(main())
    return fwd, obs


# 1 ---------------------------------------------------------------------------------------------


def test_concurrent_requests_are_merged_into_batches() -> None:
    rng = random.Random(1)
    sizes = [rng.randint(1, 3) for _ in range(64)]

    async def body(b: Batcher, fwd: Forward, obs: Recorder) -> None:
        outs = await asyncio.gather(*(b.submit(rows(n, i)) for i, n in enumerate(sizes)))
        assert [o.shape[0] for o in outs] == sizes

    fwd, obs = run_with(body, Forward(sleep_s=0.005), max_batch_size=16)
    assert max(req for _, req in obs.batches) > 1, obs.batches
    assert all(n <= 16 for n in fwd.sizes), fwd.sizes
    assert sum(fwd.sizes) == sum(sizes)
    assert len(fwd.batches) < len(sizes)


# 2 ---------------------------------------------------------------------------------------------


def rowwise(x: np.ndarray) -> np.ndarray:
    """Row-wise, and different for every row we send, so any swap/shift of rows is detected."""
    return x * 2 + x.sum(axis=(1, 2), keepdims=True)


def test_each_caller_gets_exactly_its_own_rows_in_order() -> None:
    rng = np.random.default_rng(2)
    reqs = [rng.standard_normal((int(rng.integers(1, 9)), 3, 5)).astype(np.float64) for _ in range(300)]
    jitter = random.Random(2)

    async def one(b: Batcher, x: np.ndarray) -> np.ndarray:
        await asyncio.sleep(jitter.random() * 0.01)  # vary the arrival pattern, hence the batches
        return await b.submit(x)

    async def body(b: Batcher, fwd: Forward, obs: Recorder) -> None:
        outs = await asyncio.gather(*(one(b, x) for x in reqs))
        for x, out in zip(reqs, outs, strict=True):
            assert np.array_equal(out, rowwise(x))

    fwd, obs = run_with(body, Forward(rowwise, sleep_s=0.001), max_batch_size=16)
    assert max(req for _, req in obs.batches) > 1  # the mixing actually happened
    assert sum(fwd.sizes) == sum(x.shape[0] for x in reqs)


# 3 ---------------------------------------------------------------------------------------------


def test_batches_hold_whole_requests_in_fifo_order_up_to_max_batch_size() -> None:
    sizes = [3, 3, 2, 4, 1]

    async def body(b: Batcher, fwd: Forward, obs: Recorder) -> None:
        gate = asyncio.ensure_future(b.submit(rows(5, BLOCK)))
        await fwd.wait_blocked()
        tasks = [asyncio.ensure_future(b.submit(rows(n, i))) for i, n in enumerate(sizes)]
        await until(lambda: b.queue_depth == len(sizes))
        fwd.release.set()
        outs = await asyncio.gather(*tasks)
        for i, (n, out) in enumerate(zip(sizes, outs, strict=True)):
            assert np.array_equal(out, double(rows(n, i)))
        await gate

    fwd, obs = run_with(body, max_batch_size=5, max_delay_s=0.01)
    # 3+3 > 5, so the 2nd request waits and goes first in the next batch; never split, FIFO.
    assert fwd.sizes == [5, 3, 5, 5]
    assert [list(np.unique(b[:, 0])) for b in fwd.batches[1:]] == [[0], [1, 2], [3, 4]]
    assert [r for _, r in obs.batches] == [1, 1, 2, 2]


def test_lone_request_runs_after_max_delay() -> None:
    async def body(b: Batcher, fwd: Forward, obs: Recorder) -> None:
        t0 = time.monotonic()
        out = await b.submit(rows(1))
        elapsed = time.monotonic() - t0
        assert np.array_equal(out, double(rows(1)))
        assert 0.045 <= elapsed < 1.0, elapsed  # waited for company, but not forever

    run_with(body, max_batch_size=8, max_delay_s=0.05)


def test_full_batch_runs_without_waiting_for_max_delay() -> None:
    async def body(b: Batcher, fwd: Forward, obs: Recorder) -> None:
        t0 = time.monotonic()
        await b.submit(rows(4))  # one request that fills the batch
        await asyncio.gather(b.submit(rows(1)), b.submit(rows(3)))  # two that fill it together
        assert time.monotonic() - t0 < 1.0  # max_delay_s is 5 s

    fwd, _ = run_with(body, max_batch_size=4, max_delay_s=5.0)
    assert fwd.sizes == [4, 4]


def test_delay_counts_from_enqueue_so_a_backlog_runs_at_once() -> None:
    # A request that already waited max_delay_s behind a slow forward is not held back again.
    async def body(b: Batcher, fwd: Forward, obs: Recorder) -> None:
        gate = asyncio.ensure_future(b.submit(rows(8, BLOCK)))
        await fwd.wait_blocked()
        t_enq = time.monotonic()
        waiting = asyncio.ensure_future(b.submit(rows(1)))
        await until(lambda: time.monotonic() > t_enq + 0.3)  # longer than max_delay_s
        t_open = time.monotonic()
        fwd.release.set()
        await gate
        await waiting
        assert time.monotonic() - t_open < 0.2  # not another 0.3 s

    run_with(body, max_batch_size=8, max_delay_s=0.3)


def test_request_larger_than_max_batch_size_is_rejected() -> None:
    async def body(b: Batcher, fwd: Forward, obs: Recorder) -> None:
        with pytest.raises(ValueError, match="1..4 rows"):
            await b.submit(rows(5))
        with pytest.raises(ValueError):
            await b.submit(np.zeros((0, FEATURES), np.float32))
        assert b.queue_depth == 0

    fwd, _ = run_with(body, max_batch_size=4)
    assert fwd.batches == []


# 4 ---------------------------------------------------------------------------------------------


def fail_on_marker(x: np.ndarray) -> np.ndarray:
    if (x == MARKER).any():
        raise RuntimeError("bad marker row")
    return x * 2


def test_forward_failure_fails_only_that_batch() -> None:
    async def body(b: Batcher, fwd: Forward, obs: Recorder) -> None:
        gate = asyncio.ensure_future(b.submit(rows(4, BLOCK)))
        await fwd.wait_blocked()
        # Queue [good 2 + bad 2] = batch of 4, then [other 4] = next batch.
        good = asyncio.ensure_future(b.submit(rows(2, 1.0)))
        bad = asyncio.ensure_future(b.submit(rows(2, MARKER)))
        other = asyncio.ensure_future(b.submit(rows(4, 3.0)))
        await until(lambda: b.queue_depth == 3)
        fwd.release.set()
        res = await asyncio.gather(good, bad, other, return_exceptions=True)
        await gate

        assert isinstance(res[0], BatchFailed) and isinstance(res[1], BatchFailed)
        for err in res[:2]:
            assert "RuntimeError" in str(err) and "bad marker row" in str(err)
            assert isinstance(err.__cause__, RuntimeError)
        assert res[0] is not res[1]  # one exception object per caller
        assert np.array_equal(res[2], rows(4, 6.0))
        assert np.array_equal(await b.submit(rows(1, 5.0)), rows(1, 10.0))  # collector still alive

    fwd, obs = run_with(body, Forward(fail_on_marker), max_batch_size=4)
    assert fwd.sizes == [4, 4, 4, 1]


# 5 ---------------------------------------------------------------------------------------------


def test_full_queue_raises_overloaded_immediately() -> None:
    async def body(b: Batcher, fwd: Forward, obs: Recorder) -> None:
        gate = asyncio.ensure_future(b.submit(rows(4, BLOCK)))
        await fwd.wait_blocked()
        queued = [asyncio.ensure_future(b.submit(rows(1, v))) for v in (1.0, 2.0)]
        await until(lambda: b.queue_depth == 2)
        t0 = time.monotonic()
        with pytest.raises(Overloaded):
            # wait_for: a hang would show up as TimeoutError, not pass
            await asyncio.wait_for(b.submit(rows(1, MARKER)), 1.0)
        assert time.monotonic() - t0 < 0.5
        assert b.queue_depth == 2
        fwd.release.set()
        await gate
        outs = await asyncio.gather(*queued)
        assert [o[0, 0] for o in outs] == [2.0, 4.0]

    fwd, _ = run_with(body, max_batch_size=4, max_queue_requests=2)
    assert not fwd.saw(MARKER)


# 6 ---------------------------------------------------------------------------------------------


def test_expired_deadline_is_dropped_before_the_forward() -> None:
    async def body(b: Batcher, fwd: Forward, obs: Recorder) -> None:
        # Already past at submit.
        with pytest.raises(DeadlineExceeded):
            await b.submit(rows(1, MARKER), deadline=time.monotonic() - 0.001)
        assert obs.drops == ["timeout"]

        # Expires while it waits behind a long forward.
        gate = asyncio.ensure_future(b.submit(rows(4, BLOCK)))
        await fwd.wait_blocked()
        deadline = time.monotonic() + 0.05
        late = asyncio.ensure_future(b.submit(rows(3, MARKER), deadline=deadline))
        ok = asyncio.ensure_future(b.submit(rows(1, 1.0), deadline=time.monotonic() + 60))
        ok2 = asyncio.ensure_future(b.submit(rows(2, 2.0)))
        await until(lambda: time.monotonic() > deadline)
        fwd.release.set()
        await gate
        with pytest.raises(DeadlineExceeded):
            await late
        assert np.array_equal(await ok, rows(1, 2.0))
        assert np.array_equal(await ok2, rows(2, 4.0))

    fwd, obs = run_with(body, max_batch_size=4)
    assert not fwd.saw(MARKER)
    assert fwd.sizes == [4, 3]  # the expired request took no room: ok and ok2 share a batch
    assert obs.drops == ["timeout", "timeout"]


def test_deadline_expiring_while_the_batch_is_formed() -> None:
    # Taken while still valid, expires during the max_delay_s wait: dropped at dispatch.
    async def body(b: Batcher, fwd: Forward, obs: Recorder) -> None:
        late = asyncio.ensure_future(b.submit(rows(1, MARKER), deadline=time.monotonic() + 0.02))
        await until(lambda: b.queue_depth == 0 and len(obs.depths) >= 2)  # collector took it
        ok = asyncio.ensure_future(b.submit(rows(1, 1.0)))
        with pytest.raises(DeadlineExceeded):
            await late
        assert np.array_equal(await ok, rows(1, 2.0))

    fwd, obs = run_with(body, max_batch_size=4, max_delay_s=0.1)
    assert not fwd.saw(MARKER)
    assert fwd.sizes == [1]
    assert obs.drops == ["timeout"]


# 7 ---------------------------------------------------------------------------------------------


def test_cancelled_waiting_request_never_reaches_the_forward() -> None:
    async def body(b: Batcher, fwd: Forward, obs: Recorder) -> None:
        gate = asyncio.ensure_future(b.submit(rows(4, BLOCK)))
        await fwd.wait_blocked()
        doomed = asyncio.ensure_future(b.submit(rows(1, MARKER)))
        other = asyncio.ensure_future(b.submit(rows(1, 1.0)))
        await until(lambda: b.queue_depth == 2)
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        assert b.queue_depth == 1  # its queue slot is freed at once
        assert obs.drops == ["cancelled"]
        fwd.release.set()
        await gate
        assert np.array_equal(await other, rows(1, 2.0))

    fwd, obs = run_with(body, max_batch_size=4)
    assert not fwd.saw(MARKER)
    assert fwd.sizes == [4, 1]


def test_cancelled_while_its_batch_is_being_formed() -> None:
    async def body(b: Batcher, fwd: Forward, obs: Recorder) -> None:
        doomed = asyncio.ensure_future(b.submit(rows(1, MARKER)))
        await until(lambda: b.queue_depth == 0 and len(obs.depths) >= 2)  # collector took it
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        # This joins the batch still being formed; the batch runs with it alone.
        assert np.array_equal(await b.submit(rows(1, 1.0)), rows(1, 2.0))

    fwd, obs = run_with(body, max_batch_size=4, max_delay_s=0.2)
    assert not fwd.saw(MARKER)
    assert fwd.sizes == [1]
    assert obs.drops == ["cancelled"]


def test_cancelling_a_running_request_does_not_affect_its_batch_mates() -> None:
    async def body(b: Batcher, fwd: Forward, obs: Recorder) -> None:
        mine = asyncio.ensure_future(b.submit(rows(2, BLOCK)))
        mate = asyncio.ensure_future(b.submit(rows(2, 1.0)))
        await fwd.wait_blocked()  # both are in the running batch
        mine.cancel()
        with pytest.raises(asyncio.CancelledError):
            await mine
        fwd.release.set()
        assert np.array_equal(await mate, rows(2, 2.0))
        assert np.array_equal(await b.submit(rows(1, 3.0)), rows(1, 6.0))

    fwd, obs = run_with(body, max_batch_size=4)
    assert fwd.sizes == [4, 1]
    assert obs.drops == []  # it was not dropped: its batch ran


# 8 ---------------------------------------------------------------------------------------------


def test_forward_runs_on_one_worker_thread_and_the_loop_stays_responsive() -> None:
    ticks = 0
    ticked = threading.Event()

    def slow(x: np.ndarray) -> np.ndarray:
        # The first batch blocks until the event loop has ticked 10 times (10 x 10 ms): were the
        # forward running on the loop, the ticker could not run and this would time out.
        if (x == SLOW).any() and not ticked.wait(5):
            raise AssertionError("event loop did not tick while the forward ran")
        return x * 2

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1
            if ticks >= 10:
                ticked.set()

    async def body(b: Batcher, fwd: Forward, obs: Recorder) -> None:
        t = asyncio.ensure_future(ticker())
        try:
            assert np.array_equal(await b.submit(rows(2, SLOW)), rows(2, 2 * SLOW))
            await b.submit(rows(1, 1.0))
            await b.submit(rows(1, 2.0))
            warm = await b.run_in_worker(threading.current_thread)
        finally:
            t.cancel()
        assert ticks >= 10
        assert all(th is warm for th in fwd.threads)

    fwd, _ = run_with(body, Forward(slow), max_batch_size=4)
    assert len(fwd.threads) == 3
    assert fwd.threads[0].name.startswith("fusedserve-forward")
    assert fwd.threads[0] is not threading.main_thread()
    assert len(set(fwd.threads)) == 1
    assert not fwd.threads[0].is_alive()  # stop() shut the worker thread down


# 9 ---------------------------------------------------------------------------------------------


def test_stop_fails_queued_requests_and_finishes_the_batch_in_flight() -> None:
    async def body(b: Batcher, fwd: Forward, obs: Recorder) -> None:
        running = asyncio.ensure_future(b.submit(rows(4, BLOCK)))
        await fwd.wait_blocked()
        queued = [asyncio.ensure_future(b.submit(rows(1, MARKER))) for _ in range(2)]
        await until(lambda: b.queue_depth == 2)
        stopping = asyncio.ensure_future(b.stop())
        for q in queued:
            with pytest.raises(ShuttingDown):
                await q
        assert not stopping.done()  # still waiting for the forward in flight
        fwd.release.set()
        assert np.array_equal(await running, rows(4, 2 * BLOCK))  # in-flight batch completes
        await asyncio.wait_for(stopping, 5)
        with pytest.raises(ShuttingDown):
            await b.submit(rows(1))
        with pytest.raises(ShuttingDown):
            await b.run_in_worker(lambda: None)
        await b.stop()  # idempotent

    fwd, obs = run_with(body, max_batch_size=4)
    assert not fwd.saw(MARKER)
    assert not fwd.threads[0].is_alive()


def test_stop_fails_the_batch_being_formed() -> None:
    async def body(b: Batcher, fwd: Forward, obs: Recorder) -> None:
        forming = asyncio.ensure_future(b.submit(rows(1, MARKER)))
        await until(lambda: b.queue_depth == 0 and len(obs.depths) >= 2)  # taken, delay 5 s
        await asyncio.wait_for(b.stop(), 2)
        with pytest.raises(ShuttingDown):
            await forming

    fwd, _ = run_with(body, max_batch_size=4, max_delay_s=5.0)
    assert fwd.batches == []


# 10 --------------------------------------------------------------------------------------------


def test_observer_sees_sane_values() -> None:
    sizes = [1 + i % 3 for i in range(40)]

    async def body(b: Batcher, fwd: Forward, obs: Recorder) -> None:
        await asyncio.gather(*(b.submit(rows(n)) for n in sizes))

    fwd, obs = run_with(body, Forward(sleep_s=0.002), max_batch_size=8, max_queue_requests=40)
    assert sum(r for r, _ in obs.batches) == sum(sizes) == sum(fwd.sizes)
    assert sum(q for _, q in obs.batches) == len(sizes)
    assert all(1 <= r <= 8 and 1 <= q <= r for r, q in obs.batches)
    assert len(obs.waits) == len(sizes)
    assert all(0 <= w < 5 for w in obs.waits)
    assert len(obs.depths) >= len(sizes)  # at least one per enqueue
    assert all(0 <= d <= 40 for d in obs.depths)
    assert max(obs.depths) > 1 and obs.depths[-1] == 0
    assert obs.drops == []


def test_a_raising_observer_breaks_nothing() -> None:
    class Broken(Recorder):
        def batch(self, rows: int, requests: int) -> None:
            raise RuntimeError("metrics backend down")

    async def main() -> None:
        b = Batcher(double, max_batch_size=4, max_delay_s=0.001, max_queue_requests=10, observer=Broken())
        await b.start()
        try:
            outs = await asyncio.gather(*(b.submit(rows(1, i)) for i in range(6)))
            assert [o[0, 0] for o in outs] == [2.0 * i for i in range(6)]
        finally:
            await b.stop()

    asyncio.run(main())


# 11 --------------------------------------------------------------------------------------------


def test_wrong_output_row_count_fails_only_that_batch() -> None:
    def drop_a_row(x: np.ndarray) -> np.ndarray:
        return x[:-1] * 2 if (x == MARKER).any() else x * 2

    async def body(b: Batcher, fwd: Forward, obs: Recorder) -> None:
        gate = asyncio.ensure_future(b.submit(rows(4, BLOCK)))
        await fwd.wait_blocked()
        bad = [asyncio.ensure_future(b.submit(rows(2, v))) for v in (MARKER, 1.0)]
        good = asyncio.ensure_future(b.submit(rows(3, 2.0)))
        await until(lambda: b.queue_depth == 3)
        fwd.release.set()
        await gate
        for t in bad:
            with pytest.raises(BatchFailed, match=r"shape \(3, 4\) for a batch of 4 rows"):
                await t
        assert np.array_equal(await good, rows(3, 4.0))

    fwd, _ = run_with(body, Forward(drop_a_row), max_batch_size=4)
    assert fwd.sizes == [4, 4, 3]


def test_non_array_output_is_a_batch_failure() -> None:
    async def body(b: Batcher, fwd: Forward, obs: Recorder) -> None:
        with pytest.raises(BatchFailed, match="NoneType") as info:
            await b.submit(rows(1))
        assert isinstance(info.value, BatcherError)
        assert isinstance(info.value.__cause__, ValueError)

    run_with(body, Forward(lambda x: None))


def test_submit_before_start_is_an_error() -> None:
    async def main() -> None:
        b = Batcher(double, max_batch_size=4, max_delay_s=0.001, max_queue_requests=10)
        with pytest.raises(RuntimeError, match="start"):
            await b.submit(rows(1))

    asyncio.run(main())
