"""The link between front ends and engines, in one process: a real Engine and EngineClient on a Unix socket.

- link.Reader gives back exactly the messages sent, in order, however the stream is cut into chunks;
- an engine says its wire dtype first (HELLO); a front end that has heard it sends rows in that dtype, one that
  has not sends float32, the engine takes both, and the outputs come back widened to float32, with the mode that
  computed them;
- a front end that hears something other than a HELLO treats the engine as gone;
- a front end sends what one loop turn takes in as one message, and every FLUSH_EVERY requests before the turn ends;
- rows travel in the front end's shared arena: its ring never hands out overlapping slots, a slot comes back when
  the engine answers (a cancelled request's too), and a request that finds the arena full goes inline.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.config import Settings
from service.engine.core import Engine
from service.frontend import engine_client
from service.frontend.engine_client import EngineClient, EngineGone
from service.link import stream as link
from service.link import wire
from service.link.arena import ALIGN, Arena

SHAPE = (2, 3)  # the stub model's input shape: 6 features
OUT = 4


# ---------------------------------------------------------------------------- Reader


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=8),
    cuts=st.lists(st.integers(0, 30000), max_size=12),
)
def test_reader_returns_each_message_whole_however_the_stream_is_cut(sizes, cuts):
    rng = np.random.default_rng(len(sizes))
    messages = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    stream = b"".join(link.frame(m) for m in messages)
    points = sorted({0, len(stream), *(c % (len(stream) + 1) for c in cuts)})
    reader = link.Reader()
    got = []
    for a, b in zip(points, points[1:], strict=False):
        got += [bytes(m) for m in reader.feed(stream[a:b])]
    assert got == messages


def test_reader_views_outlive_the_next_chunk():
    """Messages are views of the chunks they came in: a later feed must not change an earlier message."""
    reader = link.Reader()
    one, two = b"a" * 100, b"b" * 100
    stream = link.frame(one) + link.frame(two)
    first = reader.feed(stream[:150])  # one whole message and the start of the next
    assert [bytes(m) for m in first] == [one]
    second = reader.feed(stream[150:])
    assert [bytes(m) for m in first] == [one] and [bytes(m) for m in second] == [two]


# ---------------------------------------------------------------------------- engine <-> front end


class StubRunner:
    """Answers each row with its first OUT values times 2, in the wire dtype; remembers the dtypes it was given."""

    def __init__(self, wire_dtype):
        self.wire_dtype = np.dtype(wire_dtype)
        self.seen: list[str] = []

    def launch(self, parts):
        self.seen += [p.dtype.name for p in parts]
        x = np.concatenate([p.reshape(p.shape[0], -1) for p in parts]).astype(self.wire_dtype)
        return x[:, :OUT] * 2

    def collect(self, out):
        return out


class NoMetrics:
    def __getattr__(self, name):
        return lambda *a, **k: None


class EngineThread:
    def __init__(self, path: str, runner, max_delay_ms: float = 0):
        listener = link.new_socket()
        listener.bind(path)
        listener.listen(8)
        settings = Settings(max_batch_size=64, max_delay_ms=max_delay_ms)
        self.engine = Engine(runner, listener, settings, SHAPE, NoMetrics())
        self.thread = threading.Thread(target=self.engine.serve, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self.engine

    def __exit__(self, *exc):
        self.engine.stopping = True
        self.thread.join(10)
        assert not self.thread.is_alive()


def ready_states(n: int = 1):
    return [SimpleNamespace(value=wire.READY) for _ in range(n)]


async def wait_until(check, timeout_s: float = 5.0):
    end = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.005)


@contextlib.contextmanager
def not_an_engine(tmp_path):
    """A listening Unix socket the test answers on instead of an engine: (its path, the listener)."""
    path = str(tmp_path / "engine.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    try:
        yield path, listener
    finally:
        listener.close()


async def connect_client(path: str, listener) -> tuple[EngineClient, socket.socket]:
    """An EngineClient connected to `listener`, and the test's end of that connection."""
    client = EngineClient([path], ready_states(), OUT)
    client.start()
    conn = await asyncio.get_running_loop().run_in_executor(None, lambda: listener.accept()[0])
    await wait_until(lambda: client._socks[0] is not None)
    return client, conn


@pytest.mark.parametrize("wire_dtype", ["float16", "float32"])
def test_rows_travel_in_the_engines_wire_dtype_and_come_back_float32(tmp_path, wire_dtype):
    path = str(tmp_path / "engine.sock")
    runner = StubRunner(wire_dtype)
    x = np.random.default_rng(0).uniform(-8, 8, (5, *SHAPE)).astype(np.float32)

    async def scenario():
        client = EngineClient([path], ready_states(), OUT)
        client.start()
        # Before the HELLO is read (the connection is made on the first state poll): float32 on the wire.
        await wait_until(lambda: client._socks[0] is not None)
        before = client.submit(x[:2], time.monotonic() + 5, time.monotonic())[1]
        await wait_until(lambda: client._wire[0] is not None)
        after = client.submit(x[2:], time.monotonic() + 5, time.monotonic())[1]
        outs = await asyncio.wait_for(asyncio.gather(before, after), 5)
        client.close()
        return outs

    with EngineThread(path, runner):
        (early, early_mode), (late, late_mode) = asyncio.run(scenario())
    assert early.dtype == np.float32 and late.dtype == np.float32
    assert early_mode == late_mode == "fused"  # each answer names the executor that computed it
    # The early rows reached the engine as float32; the later ones in the wire dtype, cast by the front end.
    assert runner.seen[0] == "float32" and runner.seen[-1] == wire_dtype
    want = (x.reshape(5, -1)[:, :OUT].astype(wire_dtype) * 2).astype(np.float32)
    np.testing.assert_array_equal(np.concatenate([early, late]), want)


def test_a_front_end_that_hears_no_hello_treats_the_engine_as_gone(tmp_path):
    async def scenario(path, listener):
        client, conn = await connect_client(path, listener)
        fut = client.submit(np.zeros((1, *SHAPE), np.float32) + 1, time.monotonic() + 5, time.monotonic())[1]
        conn.sendall(link.frame(b"HTTP/1.1 200 OK"))  # not an engine
        with pytest.raises(EngineGone, match="HELLO"):
            await asyncio.wait_for(fut, 5)
        assert client.states() == [wire.STOPPED]
        conn.close()
        client.close()

    with not_an_engine(tmp_path) as (path, listener):
        asyncio.run(scenario(path, listener))


def test_a_long_turn_sends_every_flush_every_requests_and_the_rest_at_its_end(tmp_path):
    every = engine_client.FLUSH_EVERY
    x = np.random.default_rng(3).uniform(-4, 4, (2 * every + 3, 1, *SHAPE)).astype(np.float32)

    def messages(conn, reader, want: int) -> list:
        """Read until `want` messages came, or nothing is waiting."""
        got = []
        while len(got) < want:
            try:
                chunk = conn.recv(1 << 20)
            except BlockingIOError:
                break
            assert chunk, "the front end closed its end"
            got += [bytes(m) for m in reader.feed(chunk)]
        return got

    async def scenario(path, listener):
        client, conn = await connect_client(path, listener)
        conn.sendall(link.frame(wire.hello(np.float32)))
        await wait_until(lambda: client._wire[0] is not None)
        reader = link.Reader()
        conn.settimeout(5)
        assert messages(conn, reader, 1) == [wire.pack([], [])]  # the arena's message
        # One turn (no await in between): the first 2 * FLUSH_EVERY requests leave as they are taken, in two
        # messages; the last three wait for the turn's end.
        counts = []
        for k, rows in enumerate(x):
            client.submit(rows, time.monotonic() + 5, time.monotonic())
            if (k + 1) % every == 0:
                counts += [len(wire.unpack(m, wire.REQUEST)[0]) for m in messages(conn, reader, 1)]
        conn.setblocking(False)
        assert counts == [every, every] and messages(conn, reader, 1) == []
        await asyncio.sleep(0.01)
        conn.settimeout(5)
        last = messages(conn, reader, 1)
        records = wire.unpack(last[0], wire.REQUEST)[0]
        # A front end numbers its requests from its pid << 32 (unique on the host: engine warnings name them).
        base = os.getpid() << 32
        assert len(last) == 1 and [r[2] - base for r in records] == [2 * every + 1, 2 * every + 2, 2 * every + 3]
        conn.close()
        client.close()

    with not_an_engine(tmp_path) as (path, listener):
        asyncio.run(scenario(path, listener))


# ---------------------------------------------------------------------------- the arena


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 3000), st.integers(0, 100)), max_size=60))
def test_arena_ring_never_hands_out_overlapping_slots(ops):
    """Takes and gives back (in any order) never overlap a live slot or leave the arena; an empty ring has room."""
    arena = Arena(8192)
    live = []
    try:
        for take, n, pick in ops:
            if take or not live:
                slot = arena.take(n)
                if slot is None:
                    assert live, "an empty arena refused a slot that fits"
                    continue
                a, b, _ = slot
                assert a % ALIGN == 0 and 0 <= a < b <= arena.size and b - a >= n
                assert all(b <= x[0] or x[1] <= a for x in live), (slot, live)
                live.append(slot)
            else:
                arena.give_back(live.pop(pick % len(live)))
            assert arena.slots_live == len(live)
        for slot in live:
            arena.give_back(slot)
        assert arena.take(8192) is not None  # all given back: the whole arena is free again
    finally:
        arena.close()


def test_a_cancelled_request_gives_its_rows_back_and_never_runs(tmp_path):
    path = str(tmp_path / "engine.sock")
    runner = StubRunner("float16")
    x = np.ones((3, *SHAPE), np.float32)

    async def scenario():
        client = EngineClient([path], ready_states(), OUT)
        client.start()
        await wait_until(lambda: client._wire[0] is not None)
        rid, fut = client.submit(x, time.monotonic() + 5, time.monotonic())
        assert client._arenas[0].slots_live == 1 and rid in client._slots
        client.cancel(rid)  # the engine holds it (max_delay_ms) and drops it on the cancel
        await wait_until(lambda: not client._slots)
        assert client._arenas[0].slots_live == 0 and not fut.done()
        rid2, fut2 = client.submit(x * 2, time.monotonic() + 5, time.monotonic())
        out, _ = await asyncio.wait_for(fut2, 5)
        client.close()
        return out

    with EngineThread(path, runner, max_delay_ms=300):
        out = asyncio.run(scenario())
    assert len(runner.seen) == 1  # only the second request ran
    np.testing.assert_array_equal(out, np.full((3, OUT), 4, np.float32))


def test_requests_that_find_the_arena_full_travel_inside_their_message(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_client, "ARENA_BYTES", 1024)  # room for one 60-row float16 request (720 B), not two
    path = str(tmp_path / "engine.sock")
    runner = StubRunner("float16")
    x = np.random.default_rng(2).uniform(-4, 4, (6, 60, *SHAPE)).astype(np.float32)

    async def scenario():
        client = EngineClient([path], ready_states(), OUT)
        client.start()
        await wait_until(lambda: client._wire[0] is not None)
        futs = [client.submit(r, time.monotonic() + 5, time.monotonic())[1] for r in x]
        assert len(client._slots) == 1  # the first went to the arena, the rest inline
        outs = await asyncio.wait_for(asyncio.gather(*futs), 5)
        assert not client._slots and client._arenas[0].slots_live == 0
        client.close()
        return outs

    with EngineThread(path, runner):
        outs = asyncio.run(scenario())
    for r, (out, _) in zip(x, outs, strict=True):
        np.testing.assert_array_equal(out, (r.reshape(60, -1)[:, :OUT].astype(np.float16) * 2).astype(np.float32))


def test_a_slot_going_back_wakes_whoever_waits_for_room(tmp_path, monkeypatch):
    """`fits` says whether an arena could ever take rows in place; `slot_returned` is set when a slot goes back, by
    release or by the engine's answer (service/v2/arena_body.py waits on it while the arena is full)."""
    monkeypatch.setattr(engine_client, "ARENA_BYTES", 1024)  # room for one 60-row float16 request (720 B), not two
    path = str(tmp_path / "engine.sock")
    x = np.random.default_rng(5).uniform(-4, 4, (60, *SHAPE)).astype(np.float32)
    f16 = np.dtype(np.float16)

    async def scenario():
        client = EngineClient([path], ready_states(), OUT)
        client.start()
        await wait_until(lambda: client._wire[0] is not None)
        assert client.fits(720, f16) and not client.fits(2048, f16) and not client.fits(720, np.dtype(np.float32))
        held = client.reserve(720, f16)
        assert held is not None and client.reserve(720, f16) is None  # full for now
        room = client.slot_returned()
        assert client.slot_returned() is room and not room.is_set()
        client.release(held)
        assert room.is_set() and client.slot_returned() is not room  # woken; the next waiter gets a fresh event
        fut = client.submit(x, time.monotonic() + 5, time.monotonic())[1]
        assert len(client._slots) == 1  # its rows in the arena
        room = client.slot_returned()
        await asyncio.wait_for(fut, 5)
        assert room.is_set() and client._arenas[0].slots_live == 0
        client.close()

    with EngineThread(path, StubRunner("float16")):
        asyncio.run(scenario())


def test_the_arena_is_sized_for_two_full_batches_of_the_models_rows():
    """16 MB held three 32-image UINT8 224x224 requests: the rest went through the engine's socket."""
    image = 3 * 224 * 224
    assert engine_client.arena_bytes(1024, 64 * 4) == engine_client.ARENA_BYTES  # the digits MLP: the floor
    assert engine_client.arena_bytes(256, image) == 2 * 256 * image  # a ResNet's uint8 pixels: 77 MB
    assert engine_client.arena_bytes(1024, image * 4) == engine_client.ARENA_MAX_BYTES  # float32 rows: capped


def test_the_client_maps_an_arena_of_the_size_it_is_given(tmp_path):
    path = str(tmp_path / "engine.sock")
    size = 3 << 20

    async def scenario():
        client = EngineClient([path], ready_states(), OUT, size)
        client.start()
        await wait_until(lambda: client._wire[0] is not None)
        x = np.ones((2, *SHAPE), np.float32)
        out, _ = await asyncio.wait_for(client.submit(x, time.monotonic() + 5, time.monotonic())[1], 5)
        arena = client._arenas[0].size
        client.close()
        return out, arena

    with EngineThread(path, StubRunner("float32")):
        out, arena = asyncio.run(scenario())
    assert arena == size and out.shape == (2, OUT)


def test_rows_written_into_a_reserved_slot_reach_the_engine_where_they_are(tmp_path):
    """EngineClient.reserve, then submit_reserved (service/v2/arena_body.py writes a body's tensor in place): the
    engine reads the rows from the slot; rows of a dtype the wire would cast get no slot; a released slot goes back."""
    path = str(tmp_path / "engine.sock")
    runner = StubRunner("float16")
    x = np.random.default_rng(4).uniform(-4, 4, (5, *SHAPE)).astype(np.float16)

    async def scenario():
        client = EngineClient([path], ready_states(), OUT)
        client.start()
        await wait_until(lambda: client._wire[0] is not None)
        assert client.reserve(x.nbytes * 2, np.dtype(np.float32)) is None  # a float16 engine: float32 rows cast
        unused = client.reserve(64, np.dtype(np.float16))
        client.release(unused)
        reservation = client.reserve(x.nbytes, np.dtype(np.float16))
        rows = np.frombuffer(reservation.view, dtype=np.float16).reshape(x.shape)
        rows[:] = x
        rid, fut = client.submit_reserved(reservation, rows, time.monotonic() + 5, time.monotonic())
        assert client._slots[rid][1] is reservation.slot
        out, _ = await asyncio.wait_for(fut, 5)
        live = client._arenas[0].slots_live
        client.close()
        return out, live

    with EngineThread(path, runner):
        out, live = asyncio.run(scenario())
    assert live == 0 and runner.seen == ["float16"]
    np.testing.assert_array_equal(out, (x.reshape(5, -1)[:, :OUT] * 2).astype(np.float32))
