"""The engine decodes the next batch of JPEG requests while the current batch's forward runs (engine/core.py,
_take_ahead): nvJPEG's decode waits on the host for the GPU's hardware decoder while the forward runs on the SMs, so
the two overlap instead of following each other.

A real Engine with a stub runner (a launch that returns before its outputs are collected, as a graph replay does) and
a stub decoder, both writing to one log: the order of decodes, launches and collects, every request answered once
with its own rows, a batch of tensors never taken early, and requests taken ahead dropped with their front end.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from service.config import Settings
from service.engine.batching import Pending
from service.engine.core import Engine
from service.link import stream as link
from service.link import wire

SHAPE = (2, 3)


class Log(list):
    pass


class StubRunner:
    """A forward that answers each row with its sum, launched (queued) apart from its collect, as a graph replay."""

    wire_dtype = np.dtype(np.float32)

    def __init__(self, log: Log):
        self.log = log

    def launch(self, parts):
        rows = np.concatenate([np.asarray(p, np.float32).reshape(len(p), -1) for p in parts])
        self.log.append(("launch", [int(v) for v in rows[:, 0]]))
        return rows.sum(axis=1, keepdims=True)  # an ndarray: no `done`, as an InFlight of a replay

    def collect(self, out):
        self.log.append(("collect",))
        return out


class StubDecoder:
    """Each image request's rows: its one image's first byte, repeated over the model's input."""

    def __init__(self, log: Log):
        self.log = log

    def __call__(self, requests):
        firsts = [images[0][1][0] for images in requests]
        self.log.append(("decode", firsts))
        return [np.full((1, *SHAPE), first, np.float32) for first in firsts]


class NoMetrics:
    def __getattr__(self, name):
        return lambda *a, **k: None


@pytest.fixture
def engine(tmp_path):
    listener = link.new_socket()
    listener.bind(str(tmp_path / "engine.sock"))
    listener.listen(8)
    log = Log()
    eng = Engine(StubRunner(log), listener, Settings(max_batch_size=2), SHAPE, NoMetrics())
    eng.jpeg = StubDecoder(log)
    answers = []
    eng._reply = lambda owner, rid, status, rows, payload, mode=wire.NO_MODE: answers.append(
        (owner, rid, status, None if status != wire.OK else float(np.asarray(payload)[0, 0]))
    )
    eng.log, eng.answers = log, answers
    yield eng
    listener.close()


def image_request(owner: int, rid: int, first: int) -> Pending:
    return Pending(
        owner, rid, np.empty((1, 0), np.uint8), 0.0, 1e12, images=[(wire.ENCODED_JPEG, bytes([first]), 1, 1)]
    )


def tensor_request(owner: int, rid: int, first: int) -> Pending:
    return Pending(owner, rid, np.full((1, *SHAPE), first, np.float32), 0.0, 1e12)


def test_the_next_batch_of_jpegs_is_decoded_while_the_current_one_runs(engine):
    for rid, first in enumerate((1, 2, 3, 4, 5)):
        assert engine.queue.push(image_request(7, rid, first))
    engine._run_batch()
    # batch [1, 2] decoded and launched; [3, 4] decoded before [1, 2] was collected; 5 still queued
    assert engine.log == [("decode", [1, 2]), ("launch", [1, 2]), ("decode", [3, 4]), ("collect",)]
    assert engine._ahead is not None and len(engine.queue) == 1
    engine._run_batch()  # the batch taken ahead runs, and 5 is decoded meanwhile
    assert engine.log[4:] == [("launch", [3, 4]), ("decode", [5]), ("collect",)]
    engine._run_batch()
    assert engine.log[7:] == [("launch", [5]), ("collect",)] and engine._ahead is None
    # every request answered once, OK, with the sum of its own rows (6 values of its first byte)
    assert sorted(engine.answers) == [(7, rid, wire.OK, 6.0 * first) for rid, first in enumerate((1, 2, 3, 4, 5))]


def test_a_queue_led_by_tensors_is_not_taken_early(engine):
    engine.queue.push(image_request(7, 0, 1))
    engine.queue.push(tensor_request(7, 1, 9))
    engine.queue.push(tensor_request(7, 2, 8))
    engine._run_batch()  # [image 1, tensor 9]; then the queue starts with a tensor request: nothing taken ahead
    assert engine.log == [("decode", [1]), ("launch", [1, 9]), ("collect",)]
    assert engine._ahead is None and len(engine.queue) == 1


def test_requests_taken_ahead_go_with_their_front_end(engine):
    class Sock:
        def close(self):
            pass

    conn = SimpleNamespace(owner=3, arena=None, sock=Sock())  # what _drop reads of a front end's connection
    for rid, (owner, first) in enumerate([(3, 1), (3, 2), (3, 3), (4, 4)]):
        engine.queue.push(image_request(owner, rid, first))
    engine._run_batch()
    assert [r.id for r in engine._ahead[0]] == [2, 3]
    engine._conns[3] = conn
    engine.selector.unregister = lambda sock: None  # it was never registered: no socket behind it
    engine._drop(conn)
    assert [r.id for r in engine._ahead[0]] == [3]  # owner 4's request stays
    engine._run_batch()
    assert engine.log[-2:] == [("launch", [4]), ("collect",)]
    assert [a[1] for a in engine.answers] == [0, 1, 3]  # request 2 dropped unanswered with its front end


def test_a_batch_whose_images_cannot_be_prepared_fails_alone(engine):
    """A decoder that breaks its contract (rows for fewer requests than it was given) is the engine's bug: the batch's
    requests are answered FAILED, in the engine's step or taken ahead during a forward (which is still collected and
    answered), and the engine serves the next batch."""
    for rid, first in enumerate((1, 2, 3, 4, 5, 6, 7)):
        engine.queue.push(image_request(7, rid, first))
    good = engine.jpeg
    bad = {(1, 2), (5, 6)}  # [1, 2] fails in the engine's step, [5, 6] when taken ahead during [3, 4]'s forward

    def decoder(requests):
        rows = good(requests)
        return rows[:-1] if tuple(images[0][1][0] for images in requests) in bad else rows

    engine.jpeg = decoder
    engine._run_batch()  # [1, 2] failed: nothing launched, nothing taken ahead
    assert engine.log == [("decode", [1, 2])] and engine._ahead is None
    engine._run_batch()  # [3, 4] runs; [5, 6] is taken ahead and fails; [3, 4] is collected all the same
    assert engine.log[1:] == [("decode", [3, 4]), ("launch", [3, 4]), ("decode", [5, 6]), ("collect",)]
    assert engine._ahead is None
    engine._run_batch()  # 7
    statuses = {rid: status for _, rid, status, _ in engine.answers}
    assert statuses == {0: wire.FAILED, 1: wire.FAILED, 2: wire.OK, 3: wire.OK, 4: wire.FAILED, 5: wire.FAILED,
                        6: wire.OK}  # fmt: skip
