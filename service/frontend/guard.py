"""Slow clients, bounded: uvicorn's httptools protocol with a header and a body read timeout, and a cap on
open connections.

Past `max_connections` open connections, a request is answered 503 at once (JSON, `Retry-After: 1`, the
connection closed) and counted `overloaded`, as uvicorn's `limit_concurrency` would answer it, but counted
and in the service's own error format.

uvicorn closes a keep-alive connection that stays idle, but not one that sends half a header and then
nothing: 1,500 such connections were all still open after 7 s (issue 22). Here a connection whose request
headers are not complete `header_timeout_s` after its first byte (or after it opened), or whose body sends
nothing for `body_timeout_s`, is closed: with a 408 when no request has started yet, else by closing the
transport (the handler then sees the client gone and counts the request `cancelled`).

Cost: no timer per request. The hot path only stores the phase of the connection (a few attribute writes
per request, one per body chunk); `sweep()` runs on the server's own 0.1 s tick (service/frontend/app.py) every
SWEEP_EVERY_TICKS ticks, stamps connections it sees in a reading phase for the first time and closes those
that stayed there too long. So a timeout fires between T and T + the sweep period (0.5 s) after it is due.

A request refused before its body is all read (413) closes its connection; closing a socket that still has
unread bytes sends a reset, and a client still writing its body may then lose the 413 it has not read yet
(8 of 131 oversized requests in a CPU soak). So a request announcing a large body (chunked, or 100,000 bytes
or more) gets a lingering close, as nginx and Apache do: the answer is followed by a FIN, what the client
still sends is discarded unparsed for LINGER_S, then the socket closes.

Over TLS (FUSEDSERVE_TLS_CERT), a transport's close() sends close_notify and then waits for the peer's, up to 30 s
(asyncio's and uvloop's ssl_shutdown_timeout, which uvicorn does not expose): a slow client that never answers it
would keep its socket that long after its timeout. So a connection closed here for a timeout is aborted TLS_CLOSE_S
later if its socket is still open, and a refused body's (the lingering close, which over TLS is that wait for
close_notify, the client's bytes discarded meanwhile) TLS_LINGER_S later: long enough for a client still writing to
read its 413 first, as an abort throws away what the client has not read.
"""

from __future__ import annotations

import contextlib

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

LINGER_S = 1.0  # how long a refused body is discarded after the answer, before the socket closes
SWEEP_EVERY_TICKS = 5  # uvicorn ticks every 0.1 s: sweep twice a second (1,500 connections take ~0.3 ms)
TLS_CLOSE_S = 1.0  # over TLS, how long a timed-out connection may wait for the client's close_notify before its abort
TLS_LINGER_S = 5.0  # the same for a connection whose body was refused (413, 401) while the client was writing it

IDLE, HEADERS, BODY, HANDLING = 0, 1, 2, 3
_408_BODY = b"request headers took too long\n"
_TIMEOUT_408 = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_408_BODY), _408_BODY)
)


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """HttpToolsProtocol that records which part of a request it is reading, for `sweep()`, and refuses requests
    past the connection cap. `guarded_protocol()` makes the class with the cap and the refusal counter set."""

    fs_max_connections: int | None = None
    fs_on_refused = None  # called once per request refused past the cap (counts it)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.fs_phase = HEADERS  # an open connection owes its first request's headers
        self.fs_since: float | None = None  # set by the first sweep that sees this phase

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.fs_phase = HEADERS
        self.fs_since = None

    def on_headers_complete(self) -> None:
        cap = self.fs_max_connections
        if cap is not None and (len(self.connections) > cap or len(self.tasks) >= cap):
            app, self.app = self.app, self._refuse  # this request only: uvicorn starts its task with self.app
            try:
                super().on_headers_complete()
            finally:
                self.app = app
        else:
            super().on_headers_complete()
        self.fs_phase = BODY
        self.fs_since = None
        for name, value in self.headers:  # a few headers; only a large body's cycle gets the lingering close
            if name == b"transfer-encoding" or (name == b"content-length" and len(value) > 5):
                if self.cycle is not None:
                    self.cycle.transport = _LingeringClose(self.transport, self)
                break

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        self.fs_since = None  # progress: the body timeout counts from the last bytes

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self.fs_phase = HANDLING  # the request's own timeout (REQUEST_TIMEOUT_MS) applies from here

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.fs_phase == HANDLING:
            self.fs_phase = IDLE  # uvicorn's keep-alive timeout applies until the next request's first byte

    async def _refuse(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        if self.fs_on_refused is not None:
            self.fs_on_refused()
        await send({"type": "http.response.start", "status": 503, "headers": _REFUSED_HEADERS})
        await send({"type": "http.response.body", "body": _REFUSED_BODY})


_REFUSED_BODY = b'{"detail":"server overloaded: too many open connections; retry shortly"}'
_REFUSED_HEADERS = [
    (b"content-type", b"application/json"),
    (b"content-length", str(len(_REFUSED_BODY)).encode()),
    (b"retry-after", b"1"),
    (b"connection", b"close"),
]


def guarded_protocol(max_connections: int | None, on_refused=None) -> type[GuardedHttpToolsProtocol]:
    """The protocol class for one front end: at most `max_connections` open connections are served."""
    return type(
        "GuardedHttpToolsProtocol",
        (GuardedHttpToolsProtocol,),
        {"fs_max_connections": max_connections, "fs_on_refused": staticmethod(on_refused) if on_refused else None},
    )


class _Discard:
    """Stands in for the HTTP parser of a lingering connection: what arrives is dropped, never parsed or kept."""

    def feed_data(self, data: bytes) -> None:
        pass


class _LingeringClose:
    """The transport of one large-body request's cycle: its close() lingers when the body is not all read."""

    __slots__ = ("_transport", "_protocol")

    def __init__(self, transport, protocol: GuardedHttpToolsProtocol):
        self._transport = transport
        self._protocol = protocol

    def __getattr__(self, name: str):
        return getattr(self._transport, name)

    def close(self) -> None:
        transport, protocol = self._transport, self._protocol
        if protocol.fs_phase != BODY or transport.is_closing() or not transport.can_write_eof():
            close(transport, protocol.loop, TLS_LINGER_S)  # TLS cannot write EOF alone: close sends close_notify
            return
        protocol.fs_phase = IDLE  # out of the sweep's view: LINGER_S closes it
        protocol.parser = _Discard()
        with contextlib.suppress(Exception):
            transport.write_eof()  # FIN after the answer: the client reads the 413, then end of stream
        protocol.flow.resume_reading()
        protocol.loop.call_later(LINGER_S, transport.close)


def sweep(connections, now: float, header_timeout_s: float, body_timeout_s: float) -> int:
    """Close every connection stuck reading headers or body past its timeout; returns how many were closed."""
    closed = 0
    for conn in list(connections):
        phase = getattr(conn, "fs_phase", IDLE)
        if phase in (IDLE, HANDLING):
            continue
        if phase == BODY and conn.flow is not None and conn.flow.read_paused:
            conn.fs_since = None  # the app has not taken the body yet: the wait is ours, not the client's
            continue
        since = conn.fs_since
        if since is None:
            conn.fs_since = now
            continue
        if now - since < (header_timeout_s if phase == HEADERS else body_timeout_s):
            continue
        transport = conn.transport
        if transport is None or transport.is_closing():
            continue
        if phase == HEADERS and (conn.cycle is None or conn.cycle.response_complete):
            transport.write(_TIMEOUT_408)
        close(transport, conn.loop)
        conn.fs_phase = IDLE
        closed += 1
    return closed


def close(transport, loop, tls_grace_s: float = TLS_CLOSE_S) -> None:
    """transport.close(), and over TLS an abort `tls_grace_s` later if the client has not answered close_notify."""
    transport.close()
    if transport.get_extra_info("sslcontext") is not None:
        loop.call_later(tls_grace_s, transport.abort)
