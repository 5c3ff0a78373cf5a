"""A front end's link to the engines: submit rows, get a future of their outputs (service/wire.py on the wire).

Built for microseconds on an asyncio loop: no task per request, no awaitable socket wrapper. `submit`
queues the request on its engine's outbox and schedules one flush per loop turn, so every request a
front end takes in one turn reaches the engine as one message; replies are read by a reader callback
on the socket's file descriptor. The least-loaded engine (fewest requests outstanding from this front
end) gets each request. The engines' states are shared integers written by the engines and the
supervisor; a poll every STATE_POLL_S fails at once the requests of an engine that died.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import numpy as np
import zmq

from . import wire

log = logging.getLogger("fusedserve.link")

STATE_POLL_S = 0.025
SOCKET_HWM = 1_000_000


class EngineError(Exception):
    """The engine refused or failed the request; `status` is a wire status (OVERLOADED, TIMEOUT, ...)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class EngineGone(EngineError):
    """The request's engine died (or was unreachable) before it answered."""

    def __init__(self, message: str):
        super().__init__(wire.SHUTTING_DOWN, message)


class EngineClient:
    def __init__(self, endpoints: list[str], states: list, output_features: int):
        self._ctx = zmq.Context(1)
        self._socks: list[zmq.Socket] = []
        for ep in endpoints:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, SOCKET_HWM)
            s.setsockopt(zmq.RCVHWM, SOCKET_HWM)
            s.connect(ep)
            self._socks.append(s)
        self._states = states
        self._out_features = output_features
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[asyncio.Future, int]] = {}
        self._load = [0] * len(endpoints)
        self._outbox: list[tuple[list[bytes], list]] = [([], []) for _ in endpoints]
        self._flush_scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._poll: asyncio.TimerHandle | None = None
        self._dead: set[int] = set()
        self._turn = 0

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._loop = loop = asyncio.get_running_loop()
        for i, s in enumerate(self._socks):
            loop.add_reader(s.getsockopt(zmq.FD), self._drain, i)
        self._poll = loop.call_later(STATE_POLL_S, self._watch_states)

    def close(self) -> None:
        if self._poll is not None:
            self._poll.cancel()
        if self._loop is not None:
            for s in self._socks:
                self._loop.remove_reader(s.getsockopt(zmq.FD))
        self._fail_where(lambda e: True, "the front end is stopping")
        for s in self._socks:
            s.close(0)
        self._ctx.term()

    # ------------------------------------------------------------------ state

    def states(self) -> list[int]:
        return [wire.STOPPED if i in self._dead else s.value for i, s in enumerate(self._states)]

    def states_named(self) -> list[str]:
        return [wire.ENGINE_STATES[s] for s in self.states()]

    def ready(self) -> bool:
        """Every engine is up and warm (one that died takes the service out of rotation: it is shutting down)."""
        return all(s == wire.READY for s in self.states())

    @property
    def outstanding(self) -> int:
        return len(self._pending)

    # ------------------------------------------------------------------ requests

    def submit(self, rows: np.ndarray, deadline: float) -> tuple[int, asyncio.Future]:
        """Send `rows` ((n, *input_shape) float32, C-contiguous) to the least-loaded ready engine. The future
        resolves to the (n, output_features) float32 outputs, or raises EngineError."""
        loop = self._loop
        fut = loop.create_future()
        load = self._load
        states = self._states
        n = len(states)
        # Least loaded, ties broken round-robin (from a rotating start), so idle engines share serial traffic too.
        self._turn = start = (self._turn + 1) % n
        best = -1
        for j in range(n):
            i = (start + j) % n
            if states[i].value == wire.READY and i not in self._dead and (best < 0 or load[i] < load[best]):
                best = i
        rid = next(self._ids)
        if best < 0:
            fut.set_exception(EngineGone("no engine is ready"))
            return rid, fut
        self._pending[rid] = (fut, best)
        load[best] += 1
        headers, frames = self._outbox[best]
        headers.append(wire.REQUEST.pack(wire.SUBMIT, rid, rows.shape[0], deadline))
        frames.append(rows)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        return rid, fut

    def cancel(self, rid: int) -> None:
        """The client left: forget the request and tell its engine to drop it if it is still queued."""
        entry = self._pending.pop(rid, None)
        if entry is None:
            return
        fut, i = entry
        self._load[i] -= 1
        self._outbox[i][0].append(wire.REQUEST.pack(wire.CANCEL, rid, 0, 0.0))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    # ------------------------------------------------------------------ socket work

    def _flush(self) -> None:
        self._flush_scheduled = False
        for i, (headers, frames) in enumerate(self._outbox):
            if not headers:
                continue
            msg = wire.pack(headers, frames)
            headers.clear()
            frames.clear()
            try:
                self._socks[i].send(msg, zmq.NOBLOCK)
            except zmq.ZMQError as e:  # Again: the engine has not taken a million messages; it is stuck
                self._fail_where(lambda e_, i=i: e_ == i, f"engine {i} is not taking requests ({e})")
        # The socket's descriptor signals edges, and a send may consume one: read what may have come meanwhile.
        for i in range(len(self._socks)):
            self._drain(i)

    def _drain(self, i: int) -> None:
        sock = self._socks[i]
        pending = self._pending
        load = self._load
        out_features = self._out_features
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                message = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            records, view, at = wire.unpack(message, wire.REPLY)
            for rid, status, n, size in records:
                payload = view[at : at + size]
                at += size
                entry = pending.pop(rid, None)
                if entry is None:
                    continue  # cancelled meanwhile
                fut, e = entry
                load[e] -= 1
                if fut.done():
                    continue
                if status == wire.OK:
                    fut.set_result(np.frombuffer(payload, dtype=np.float32).reshape(n, out_features))
                else:
                    fut.set_exception(EngineError(status, bytes(payload).decode(errors="replace")))

    def _watch_states(self) -> None:
        for i, state in enumerate(self._states):
            if i not in self._dead and state.value in (wire.STOPPED, wire.FAILED_START):
                # The engine is gone (or stopped): whatever it held will never be answered.
                self._dead.add(i)
                n = self._fail_where(lambda e, i=i: e == i, f"engine {i} stopped before answering")
                if n:
                    log.error("engine %d is gone; %d requests failed with 503", i, n)
        self._poll = self._loop.call_later(STATE_POLL_S, self._watch_states)

    def _fail_where(self, which, message: str) -> int:
        failed = [rid for rid, (_, e) in self._pending.items() if which(e)]
        for rid in failed:
            fut, e = self._pending.pop(rid)
            self._load[e] -= 1
            if not fut.done():
                fut.set_exception(EngineGone(message))
        return len(failed)
