"""The engine's batch queue (service/engine/batching.py): whole requests, FIFO, dropped before the GPU when expired or
cancelled, bounded, and never held back when max_delay is 0."""

from __future__ import annotations

import numpy as np
import pytest

from service.engine.batching import BatchQueue, Pending

FEATURES = 4
NOW = 1000.0


def req(rid: int, n: int = 1, *, owner: bytes = b"a", at: float = NOW, timeout: float = 10.0) -> Pending:
    rows = np.random.default_rng(rid).standard_normal((n, FEATURES), dtype=np.float32)
    return Pending(owner, rid, rows, at, at + timeout)


def ids(batch: list[Pending]) -> list[int]:
    return [r.id for r in batch]


def test_takes_everything_queued_in_arrival_order_up_to_the_row_limit():
    q = BatchQueue(max_batch_size=8, max_queue_requests=100)
    for i, n in enumerate([3, 2, 2, 4, 1]):
        assert q.push(req(i, n))
    batch, expired = q.take(NOW)
    assert ids(batch) == [0, 1, 2] and not expired  # 3+2+2 = 7; the 4-row request does not fit
    assert len(q) == 2
    batch, _ = q.take(NOW)
    assert ids(batch) == [3, 4]
    assert q.take(NOW) == ([], []) and len(q) == 0


def test_a_request_is_never_split_and_a_full_batch_is_taken_alone():
    q = BatchQueue(max_batch_size=4, max_queue_requests=10)
    q.push(req(0, 4))
    q.push(req(1, 1))
    assert ids(q.take(NOW)[0]) == [0]
    assert ids(q.take(NOW)[0]) == [1]


def test_expired_requests_are_dropped_before_the_batch_and_reported():
    q = BatchQueue(max_batch_size=8, max_queue_requests=10)
    q.push(req(0, timeout=1.0))
    q.push(req(1, timeout=5.0))
    q.push(req(2, timeout=0.5))
    batch, expired = q.take(NOW + 2.0)
    assert ids(batch) == [1] and sorted(ids(expired)) == [0, 2]
    assert len(q) == 0


def test_cancelled_requests_leave_the_queue_and_free_their_slot():
    q = BatchQueue(max_batch_size=8, max_queue_requests=2)
    q.push(req(0, owner=b"a"))
    q.push(req(0, owner=b"b"))  # the same id from another front end is another request
    assert not q.push(req(1)), "the queue holds max_queue_requests"
    assert q.cancel(b"a", 0) and not q.cancel(b"a", 0) and not q.cancel(b"c", 7)
    assert len(q) == 1
    assert q.push(req(2, owner=b"a"))
    batch, _ = q.take(NOW)
    assert [(r.owner, r.id) for r in batch] == [(b"b", 0), (b"a", 2)]


def test_drop_owner_cancels_only_that_front_end():
    q = BatchQueue(max_batch_size=8, max_queue_requests=10)
    for i in range(3):
        q.push(req(i, owner=b"gone"))
        q.push(req(i, owner=b"here"))
    assert q.drop_owner(b"gone") == 3
    assert [r.owner for r in q.take(NOW)[0]] == [b"here"] * 3


def test_a_full_queue_refuses_without_queueing():
    q = BatchQueue(max_batch_size=8, max_queue_requests=3)
    assert all(q.push(req(i)) for i in range(3))
    assert not q.push(req(3))
    assert ids(q.take(NOW)[0]) == [0, 1, 2]


def test_rows_outside_one_batch_are_a_caller_error():
    q = BatchQueue(max_batch_size=4, max_queue_requests=3)
    with pytest.raises(ValueError, match="1..4 rows"):
        q.push(req(0, 5))


def test_no_delay_means_an_idle_engine_takes_a_partial_batch_at_once():
    q = BatchQueue(max_batch_size=8, max_queue_requests=10, max_delay_s=0.0)
    q.push(req(0))
    assert q.hold_for(NOW) == 0.0


def test_max_delay_holds_a_partial_batch_from_the_oldest_arrival_only():
    q = BatchQueue(max_batch_size=8, max_queue_requests=10, max_delay_s=0.02)
    assert q.hold_for(NOW) == 0.0  # empty: nothing to hold
    q.push(req(0, at=NOW))
    assert q.hold_for(NOW + 0.005) == pytest.approx(0.015)
    # A request that already waited longer than max_delay (behind a forward) is not held again.
    assert q.hold_for(NOW + 0.05) == 0.0
    q.push(req(1, 7, at=NOW + 0.001))
    assert q.hold_for(NOW + 0.005) == 0.0, "a full batch is never held"


def test_a_cancelled_head_does_not_hold_the_batch():
    q = BatchQueue(max_batch_size=8, max_queue_requests=10, max_delay_s=0.02)
    q.push(req(0, at=NOW - 1.0))
    q.push(req(1, at=NOW))
    q.cancel(b"a", 0)
    assert q.hold_for(NOW) == pytest.approx(0.02)


def test_drain_returns_every_live_request():
    q = BatchQueue(max_batch_size=8, max_queue_requests=10)
    for i in range(4):
        q.push(req(i))
    q.cancel(b"a", 1)
    assert ids(q.drain()) == [0, 2, 3] and len(q) == 0
