"""A front end's link to the engines: submit rows, get a future of their outputs (service/link/stream.py, wire.py).

Built for microseconds on an asyncio loop: no task per request, no awaitable stream wrapper. `submit`
queues the request on its engine's outbox and schedules one flush per loop turn, so the requests a
front end takes in one turn reach the engine as one message (or one per FLUSH_EVERY of them); answers
are read by a reader callback on the socket. The least-loaded engine (fewest requests outstanding from
this front end) gets each request. The engines' states are shared integers written by the engines and
the supervisor; an engine whose socket closes has died, and its outstanding requests fail at once. The supervisor
starts a dead engine again on the same socket path: once the new one is warming or ready, it is connected again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from dataclasses import dataclass

import numpy as np

from ..link import stream, wire
from ..link.arena import Arena

log = logging.getLogger(__name__)

STATE_POLL_S = 0.025  # how often engine states are read, and engines not yet reached are connected
# A turn of a loaded front end's loop can hold hundreds of requests (one per readable connection, ~50 µs of parsing
# each): without a cap the first of them would wait for the last to be parsed before the engine saw any. Sending
# every 16 keeps the engine working while the rest are parsed, at one socket write per 16 requests.
FLUSH_EVERY = 16
# Shared memory per engine for rows on their way (service/link/arena.py): at least 512 requests of 256 float16 rows
# of the digits MLP at once, and for a larger model room for two full batches (`arena_bytes`). Pages are only
# touched as slots are used; a request that finds no room goes inside its message, through the engine's socket.
ARENA_BYTES = 16 << 20
ARENA_MAX_BYTES = 256 << 20


def arena_bytes(max_batch_size: int, row_bytes: int) -> int:
    """A front end's arena for one engine: two full batches of rows of `row_bytes` each on the wire, between
    ARENA_BYTES and ARENA_MAX_BYTES. At 16 MB, three 32-image UINT8 224x224 requests fit (4.8 MB each) and one FP16
    one, so at 8 requests in flight per front end (64 connections, 8 workers) most went through the socket, copied
    into the kernel and out again on the engine's one thread; two batches of 256 such images take 77 MB. Its pages
    become resident as the ring's slots pass over them, so under load a front end holds the whole arena per engine:
    the cap keeps 8 front ends within 2 GB an engine (the Kubernetes base allows 16 GiB)."""
    return max(ARENA_BYTES, min(ARENA_MAX_BYTES, 2 * max_batch_size * row_bytes))


class EngineError(Exception):
    """The engine refused or failed the request; `status` is a wire status (OVERLOADED, TIMEOUT, ...); `mode` the
    executor whose forward failed (FAILED), or None where none ran."""

    def __init__(self, status: int, message: str, mode: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.mode = mode


class EngineGone(EngineError):
    """The request's engine died (or was unreachable) before it answered."""

    def __init__(self, message: str):
        super().__init__(wire.SHUTTING_DOWN, message)


@dataclass
class ImageRequest:
    """An image request for an engine that decodes JPEGs on its GPU (FUSEDSERVE_IMAGE_DECODE): per image (wire kind,
    bytes, height, width), ENCODED_JPEG files as sent and PREPARED_ROW rows prepared here (service/frontend/
    images.py), and the files as sent ((what names each, its bytes)), which the front end prepares itself where the
    engine answers DECODE_ON_CPU."""

    items: list[tuple[int, bytes, int, int]]
    files: list[tuple[str, bytes]]

    def __len__(self) -> int:
        return len(self.items)


@dataclass
class Reservation:
    """A slot of an engine's arena held for rows written in place (`EngineClient.reserve`)."""

    engine: int
    arena: Arena
    slot: list
    code: int  # the rows' wire dtype (wire.DTYPES)
    view: memoryview  # the slot's bytes, writable


class EngineClient:
    """A front end's side of the link: one connection per engine, requests out, answers matched back to futures."""

    def __init__(self, endpoints: list[str], states: list, output_features: int, arena_size: int | None = None):
        self._endpoints = endpoints
        self._arena_size = arena_size  # bytes of each engine's arena (`arena_bytes`); None: ARENA_BYTES
        self._socks: list = [None] * len(endpoints)  # connected once the engine listens
        self._readers = [stream.Reader() for _ in endpoints]
        self._unsent = [bytearray() for _ in endpoints]
        self._states = states
        self._out_features = output_features
        # From pid << 32: ids unique on the host, so an engine's warning names a request as one front end's
        # (wire.request_name), at no cost per request.
        self._ids = itertools.count((os.getpid() << 32) + 1)
        self._pending: dict[int, tuple[asyncio.Future, int]] = {}
        self._load = [0] * len(endpoints)
        self._outbox: list[tuple[list[bytes], list]] = [([], []) for _ in endpoints]
        self._flush_scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._poll: asyncio.TimerHandle | None = None
        self._dead: set[int] = set()
        self._restarting: set[int] = set()  # dead engines whose state has read LOADING since: started again
        self._turn = 0
        # Each engine's wire dtype (link/wire.py) as its index into wire.DTYPES, from its HELLO; None until then,
        # and rows go as float32.
        self._wire: list[int | None] = [None] * len(endpoints)
        self._flags = [0] * len(endpoints)  # each engine's HELLO flags (wire.DECODES_JPEG)
        # Each engine's arena (service/link/arena.py), and the slot of every request whose rows are in one, until the
        # engine answers it.
        self._arenas: list[Arena | None] = [None] * len(endpoints)
        self._slots: dict[int, tuple[int, list]] = {}  # request id -> (engine, slot)
        self._room: asyncio.Event | None = None  # set, and dropped, when a slot goes back to an arena (slot_returned)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._watch_states()

    def close(self) -> None:
        if self._poll is not None:
            self._poll.cancel()
        for i, sock in enumerate(self._socks):
            if sock is not None:
                self._disconnect(i)
        self._fail_where(lambda e: True, "the front end is stopping")

    def _connect(self, i: int) -> None:
        sock = stream.new_socket()
        try:
            sock.connect(self._endpoints[i])
        except (FileNotFoundError, ConnectionRefusedError, BlockingIOError):
            sock.close()  # the engine is not listening yet: the next state poll tries again
            return
        arena = None
        try:
            arena = Arena(self._arena_size or ARENA_BYTES)
        except (OSError, AttributeError) as e:  # no memfd (not Linux): every request's rows go inside its message
            log.warning("no shared memory for rows (%s); they travel through the socket", e)
        # The first bytes on the connection: an empty message, the arena's descriptor attached.
        if not stream.send_fd(sock, stream.frame(wire.pack([], [])), arena.fd if arena else None):
            if arena:
                arena.close()
            sock.close()
            return
        self._socks[i] = sock
        self._readers[i] = stream.Reader()
        self._wire[i] = None
        self._flags[i] = 0
        self._arenas[i] = arena
        self._loop.add_reader(sock.fileno(), self._drain, i)

    def _disconnect(self, i: int) -> None:
        sock, self._socks[i] = self._socks[i], None
        self._loop.remove_reader(sock.fileno())
        self._loop.remove_writer(sock.fileno())
        sock.close()
        arena, self._arenas[i] = self._arenas[i], None
        if arena is not None:
            arena.close()
            self._slots = {rid: s for rid, s in self._slots.items() if s[0] != i}

    # ------------------------------------------------------------------ state

    def states(self) -> list[int]:
        """Each engine's state; one not connected to yet reads as loading."""
        return [
            (s.value if s.value in (wire.BROKEN, wire.LOADING, wire.WARMING) else wire.STOPPED)  # LOADING: restarting
            if i in self._dead
            else (s.value if self._socks[i] is not None else min(s.value, wire.LOADING))
            for i, s in enumerate(self._states)
        ]

    def states_named(self) -> list[str]:
        return [wire.ENGINE_STATES[s] for s in self.states()]

    def broken(self) -> bool:
        """An engine's device hit a sticky error (engine/faults.py): the service is about to exit for a restart."""
        return any(s.value == wire.BROKEN for s in self._states)

    def ready(self) -> bool:
        """Every engine is up and warm (one that died takes the service out of rotation: it is shutting down): each
        state READY, connected, not known dead, as `states` reads them, without building its list per request."""
        socks, dead = self._socks, self._dead
        for i, s in enumerate(self._states):  # noqa: SIM110 - a loop, not all() over a generator: per request
            if s.value != wire.READY or socks[i] is None or i in dead:
                return False
        return True

    @property
    def outstanding(self) -> int:
        return len(self._pending)

    # ------------------------------------------------------------------ requests

    def decodes_jpeg(self) -> bool:
        """Whether the engines decode JPEGs themselves (their HELLO says so): then an image request's JPEGs go to them
        encoded (ImageRequest). Every engine runs the same settings; one not heard yet answers DECODE_ON_CPU."""
        return any(self._flags[i] & wire.DECODES_JPEG for i in range(len(self._flags)) if self._ready(i))

    def submit(self, rows: np.ndarray, deadline: float, arrival: float) -> tuple[int, asyncio.Future]:
        """Send `rows` ((n, *input_shape) float32, or uint8 for a uint8 model) to the least-loaded ready engine, float
        rows cast to its wire dtype here, on
        this front end's core rather than the engine's one thread; `deadline` and `arrival` are time.monotonic()
        values. The future resolves to (the (n, output_features) float32 outputs, the mode that computed them:
        fused or unfused), or raises EngineError."""
        fut = self._loop.create_future()
        load = self._load
        best = self._least_loaded()
        rid = next(self._ids)
        if best < 0:
            fut.set_exception(EngineGone("no engine is ready"))
            return rid, fut
        if isinstance(rows, ImageRequest):
            return self._submit_images(best, rid, fut, rows, deadline, arrival)
        self._pending[rid] = (fut, best)
        load[best] += 1
        headers, frames = self._outbox[best]
        code = self._wire[best]
        if rows.dtype == np.uint8:  # a uint8 model's pixels: as they are (service/link/wire.py)
            code = wire.UINT8
        elif code is None:
            code = wire.FLOAT32
        dtype = wire.DTYPES[code]
        arena = self._arenas[best]
        slot = arena.take(rows.size * dtype.itemsize) if arena is not None else None
        # beyond float16's range is inf, as the engine's own cast would give; rows already in the wire's dtype need no
        # errstate (~1 us a request)
        with np.errstate(over="ignore") if rows.dtype != dtype else contextlib.nullcontext():
            if slot is not None:  # the rows go to shared memory, cast on the way; the message says where
                view = np.frombuffer(arena.buf, dtype=dtype, count=rows.size, offset=slot[0]).reshape(rows.shape)
                np.copyto(view, rows, casting="same_kind")
                del view
                self._shared(best, rid, code, rows.shape[0], slot, deadline, arrival)
            else:
                rows = np.ascontiguousarray(rows, dtype=dtype)
                headers.append(wire.REQUEST.pack(wire.SUBMIT, code, rid, rows.shape[0], 0, deadline, arrival))
                frames.append(rows)
        self._sent(best)
        return rid, fut

    def _submit_images(self, i: int, rid: int, fut: asyncio.Future, request: ImageRequest, deadline: float,
                       arrival: float) -> tuple[int, asyncio.Future]:  # fmt: skip
        """`submit` of an ImageRequest to engine i: its IMAGES block in the arena (or inside the message where the
        arena has no room); DECODE_ON_CPU at once where engine i does not decode JPEGs."""
        if not self._flags[i] & wire.DECODES_JPEG:
            fut.set_exception(EngineError(wire.DECODE_ON_CPU, f"engine {i} does not decode images"))
            return rid, fut
        self._pending[rid] = (fut, i)
        self._load[i] += 1
        headers, frames = self._outbox[i]
        size = wire.images_size(request.items)
        arena = self._arenas[i]
        slot = arena.take(size) if arena is not None else None
        n = len(request.items)
        if slot is not None:
            wire.pack_images(request.items, memoryview(arena.buf)[slot[0] : slot[0] + size])
            self._shared(i, rid, wire.UINT8, n, slot, deadline, arrival, wire.SUBMIT_IMAGES_SHARED)
        else:
            headers.append(wire.REQUEST.pack(wire.SUBMIT_IMAGES, wire.UINT8, rid, n, 0, deadline, arrival))
            frames.append(wire.pack_images(request.items))
        self._sent(i)
        return rid, fut

    def _least_loaded(self) -> int:
        """The ready engine with the fewest requests outstanding, ties broken round-robin (from a rotating start), so
        idle engines share serial traffic too; -1 when none is ready."""
        load = self._load
        states = self._states
        n = len(states)
        self._turn = start = (self._turn + 1) % n
        best = -1
        for j in range(n):
            i = (start + j) % n
            if self._ready(i) and (best < 0 or load[i] < load[best]):
                best = i
        return best

    def _ready(self, i: int) -> bool:
        """Engine i takes requests: READY, connected, not known dead."""
        return self._states[i].value == wire.READY and self._socks[i] is not None and i not in self._dead

    def _sent(self, i: int) -> None:
        """A request went into engine i's outbox: send it once FLUSH_EVERY are there, else at the loop's next turn."""
        if len(self._outbox[i][0]) >= FLUSH_EVERY:
            self._send(i)
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    # ------------------------------------------------------------------ rows written in place

    def reserve(self, nbytes: int, dtype: np.dtype) -> Reservation | None:
        """A slot of `nbytes` in the arena of the engine the next request would go to, for rows of `dtype` that the
        caller writes in place as their bytes arrive (a large binary body, service/v2/arena_body.py), then hands to
        `submit_reserved`; or None where that engine has no arena or no room in it, or takes another dtype on its
        wire (uint8 rows go as they are; float rows in the engine's dtype): such rows take `submit`'s path."""
        best = self._least_loaded()
        arena = self._arenas[best] if best >= 0 else None
        code = self._in_place(best, dtype) if arena is not None else None
        if code is None:
            return None
        slot = arena.take(nbytes)
        if slot is None:
            return None
        return Reservation(best, arena, slot, code, memoryview(arena.buf)[slot[0] : slot[0] + nbytes])

    def _in_place(self, i: int, dtype: np.dtype) -> int | None:
        """The wire code (link/wire.py) of rows of `dtype` that engine i takes as they are, or None where its wire
        would cast them (uint8 rows go as they are; float rows in the engine's dtype)."""
        code = wire.UINT8 if dtype == np.uint8 else self._wire[i]
        return code if code is not None and wire.DTYPES[code] == dtype else None

    def fits(self, nbytes: int, dtype: np.dtype) -> bool:
        """Whether `reserve` could give such a slot once the arenas have room: some ready engine has an arena of at
        least `nbytes` that takes rows of `dtype` in place. Where it is only full for now, a caller may wait for
        `slot_returned` (service/v2/arena_body.py)."""
        return any(
            arena is not None and arena.size >= nbytes and self._ready(i) and self._in_place(i, dtype) is not None
            for i, arena in enumerate(self._arenas)
        )

    def slot_returned(self) -> asyncio.Event:
        """An event set the next time any request's slot goes back to its arena (the engine answered it, or its body
        was abandoned): every waiter then tries `reserve` again."""
        if self._room is None:
            self._room = asyncio.Event()
        return self._room

    def _returned(self, arena: Arena, slot: list) -> None:
        arena.give_back(slot)
        if self._room is not None:
            self._room.set()
            self._room = None

    def release(self, reservation: Reservation) -> None:
        """Give back a reservation that will not be submitted (a bad or abandoned body)."""
        with contextlib.suppress(BufferError):  # rows still viewing it: the view goes with them
            reservation.view.release()
        self._returned(reservation.arena, reservation.slot)

    def submit_reserved(
        self, reservation: Reservation, rows: np.ndarray, deadline: float, arrival: float
    ) -> tuple[int, asyncio.Future]:
        """`submit` for `rows`, a view of `reservation` (the rows written in place): the message says where they
        are. Where the reservation's engine is no longer connected, or ready, the rows are copied out and submitted
        as any rows are (to another engine, or refused as submit refuses)."""
        i = reservation.engine
        if (
            self._arenas[i] is not reservation.arena
            or self._states[i].value != wire.READY
            or i in self._dead
            or self._socks[i] is None
        ):
            rows = rows.copy()
            self.release(reservation)
            return self.submit(rows, deadline, arrival)
        fut = self._loop.create_future()
        rid = next(self._ids)
        self._pending[rid] = (fut, i)
        self._load[i] += 1
        self._shared(i, rid, reservation.code, rows.shape[0], reservation.slot, deadline, arrival)
        self._sent(i)
        return rid, fut

    def _shared(self, i: int, rid: int, code: int, n: int, slot: list, deadline: float, arrival: float,
                kind: int = wire.SUBMIT_SHARED) -> None:  # fmt: skip
        """Request `rid`'s n rows (or images) are in engine i's arena at `slot`: held there until it answers, and the
        message that says where queued in its outbox."""
        self._slots[rid] = (i, slot)
        self._outbox[i][0].append(wire.REQUEST.pack(kind, code, rid, n, slot[0], deadline, arrival))

    def cancel(self, rid: int) -> None:
        """The client left: forget the request and tell its engine to drop it if it is still queued."""
        entry = self._pending.pop(rid, None)
        if entry is None:
            return
        fut, i = entry
        self._load[i] -= 1
        # Its rows stay where they are until the engine answers (CANCELLED if it drops the request unrun).
        self._outbox[i][0].append(wire.REQUEST.pack(wire.CANCEL, wire.FLOAT32, rid, 0, 0, 0.0, 0.0))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    # ------------------------------------------------------------------ socket work

    def _flush(self) -> None:
        self._flush_scheduled = False
        for i, (headers, _) in enumerate(self._outbox):
            if headers:
                self._send(i)

    def _send(self, i: int) -> None:
        """Send engine i's outbox as one message."""
        headers, frames = self._outbox[i]
        data = stream.frame(wire.pack(headers, frames))
        headers.clear()
        frames.clear()
        sock = self._socks[i]
        if sock is None or not stream.send_some(sock, self._unsent[i], data):
            self._engine_gone(i, f"engine {i} closed its connection")
        elif self._unsent[i]:
            # The engine is not reading as fast as this front end sends: the rest goes when it can.
            self._loop.add_writer(sock.fileno(), self._write_rest, i)

    def _write_rest(self, i: int) -> None:
        sock = self._socks[i]
        if sock is None:
            return
        if not stream.send_some(sock, self._unsent[i], b""):
            self._engine_gone(i, f"engine {i} closed its connection")
        elif not self._unsent[i]:
            self._loop.remove_writer(sock.fileno())

    def _drain(self, i: int) -> None:
        sock = self._socks[i]
        if sock is None:
            return
        messages, closed = stream.read_available(sock, self._readers[i])
        pending = self._pending
        load = self._load
        out_features = self._out_features
        code = self._wire[i]
        dtype = None if code is None else wire.DTYPES[code]
        slots = self._slots
        arena = self._arenas[i]
        modes = wire.MODES
        for message in messages:
            if dtype is None:  # the first message of a connection: the engine's HELLO
                try:
                    code, self._flags[i] = wire.read_hello(message)
                    self._wire[i] = code
                except ValueError as e:
                    self._engine_gone(i, f"engine {i}: {e}")
                    return
                dtype = wire.DTYPES[code]
                continue
            records, view, at = wire.unpack(message, wire.REPLY)
            for rid, status, mode, n, size in records:
                payload = view[at : at + size]
                at += size
                slot = slots.pop(rid, None)
                if slot is not None:  # the engine is done with its rows
                    self._returned(arena, slot[1])
                entry = pending.pop(rid, None)
                if entry is None:
                    continue  # cancelled meanwhile
                fut, e = entry
                load[e] -= 1
                if fut.done():
                    continue
                if status == wire.OK:
                    out = np.frombuffer(payload, dtype=dtype).reshape(n, out_features)
                    fut.set_result((out if dtype == np.float32 else out.astype(np.float32), modes[mode]))
                else:
                    name = modes[mode] if mode < len(modes) else None
                    fut.set_exception(EngineError(status, bytes(payload).decode(errors="replace"), name))
        if closed:
            self._engine_gone(i, f"engine {i} closed its connection")

    def _engine_gone(self, i: int, message: str) -> None:
        """The engine died (its end of the socket closed): whatever it held will never be answered."""
        self._dead.add(i)
        if self._socks[i] is not None:
            self._disconnect(i)
        n = self._fail_where(lambda e: e == i, message)
        if n:
            log.error("engine %d is gone; %d requests failed with 503", i, n)

    def _watch_states(self) -> None:
        for i, state in enumerate(self._states):
            if i in self._dead:
                # Started again by the supervisor? Until it has seen the death, the state still reads as the old
                # engine left it, and the old engine's listening socket may outlive its connection by a moment:
                # so only a state that went back to LOADING since the death is a new engine.
                if state.value == wire.LOADING:
                    self._restarting.add(i)
                elif i in self._restarting and state.value in (wire.WARMING, wire.READY):
                    self._connect(i)
                    if self._socks[i] is not None:
                        self._dead.discard(i)
                        self._restarting.discard(i)
                        log.info("engine %d is back", i)
                continue
            if state.value in (wire.STOPPED, wire.FAILED_START, wire.BROKEN):
                self._engine_gone(i, f"engine {i} stopped before answering")
            elif self._socks[i] is None and state.value in (wire.WARMING, wire.READY):
                self._connect(i)
        self._poll = self._loop.call_later(STATE_POLL_S, self._watch_states)

    def _fail_where(self, which, message: str) -> int:
        failed = [rid for rid, (_, e) in self._pending.items() if which(e)]
        for rid in failed:
            fut, e = self._pending.pop(rid)
            self._load[e] -= 1
            if not fut.done():
                fut.set_exception(EngineGone(message))
        return len(failed)
