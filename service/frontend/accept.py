"""What a connection goes through before its first request is parsed (issue 53): the limit per client address, and
over TLS the handshake, under a deadline and counted among the front end's connections.

Handed a TLS context, uvicorn passes it to loop.create_server, whose handshake runs before the HTTP protocol sees
the connection: up to 60 s (uvloop's default, which uvicorn does not expose) and outside uvicorn's connection count,
so that 700 connections each sending 3 bytes of a ClientHello held a front end for a minute while MAX_CONNECTIONS
was never reached. So a front end listens in plain TCP and wraps each accepted connection itself, with the loop's
own SSLProtocol (the class create_server would use): the handshake must end within `handshake_s` (the header
timeout) of the accept, the connection counts against MAX_CONNECTIONS from the accept, and one accepted with the cap
reached is closed before any handshake work.

`admit` is called by the protocol (service/frontend/guard.py) once per accepted connection; `wrap_tls` then hands the
connection to TLS, and the protocol's connection_made runs again with the TLS transport once the handshake is done.

New connections per client address per second (`ConnectRate`, FUSEDSERVE_PER_CLIENT_CONNECT_RATE): a token bucket per
address, taken first of all at the accept, before the protocol has set up anything of HTTP (guard.py builds the rest
only for a connection it admits) and before any TLS work: what costs a front end under a connection flood is the
handshake each new TLS connection asks for (an attacker opening 85 a second took ~10% of the front end's samples),
and a refused connection costs an accept and a close.
"""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger(__name__)

# Longest wait for a client's close_notify once the front end closes a TLS connection (uvloop's default: 30 s); a
# refused body's lingering close over TLS is this wait, the client's bytes discarded meanwhile (guard.py).
TLS_SHUTDOWN_S = 1.0

_REFUSED_BODY = b'{"detail":"too many open connections from this address; retry shortly"}'
_REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: %d\r\nretry-after: 1\r\n"
    b"connection: close\r\n\r\n%s" % (len(_REFUSED_BODY), _REFUSED_BODY)
)


def client_ip(transport) -> str | None:
    peer = transport.get_extra_info("peername")
    return peer[0] if isinstance(peer, tuple) and peer else None


def _refused(reason: str) -> None:
    from ..metrics import connection_refused  # here: prometheus-client reads its multiprocess setting at import

    connection_refused(reason)


# A connection refused for its rate is closed REFUSED_HOLD_S after its accept, unread (its ClientHello, or what it
# sends, waits in the kernel's buffer). Closed at once, a client that retries as soon as it is refused (an attacker's
# 16 tasks) came back ~150 times a second per address, and each refusal (accept, close, the TCP exchange) costs ~85 us
# of the front end's core: under the attack benchmark, as much as the handshakes the bound spared. Held, such a client
# comes back once a second per task. At most REFUSED_HELD_MAX are held at once (a descriptor and kernel buffers each);
# past it, closed at once.
REFUSED_HOLD_S = 1.0
REFUSED_HELD_MAX = 256


class ConnectRate:
    """A token bucket per client address: `burst` connections at once, then `rate` a second. A refused connection takes
    no token. Buckets that have filled up again are forgotten (pruned when their number doubles, from PRUNE_AT), so
    memory follows the addresses seen in the last `burst / rate` seconds."""

    PRUNE_AT = 4096

    __slots__ = ("rate", "burst", "buckets", "held", "_prune_at")

    def __init__(self, rate: float, burst: int):
        self.rate = float(rate)
        self.burst = float(burst)
        self.buckets: dict[str, list[float]] = {}  # address -> [tokens, when they were counted]
        self.held = 0  # refused connections held before their close (within_rate)
        self._prune_at = self.PRUNE_AT

    def take(self, ip: str, now: float) -> bool:
        """One connection from `ip` at `now` (time.monotonic()): True if admitted (a token taken)."""
        bucket = self.buckets.get(ip)
        if bucket is None:
            if len(self.buckets) >= self._prune_at:
                self.prune(now)
            self.buckets[ip] = [self.burst - 1.0, now]
            return True
        tokens = bucket[0] + (now - bucket[1]) * self.rate
        if tokens > self.burst:
            tokens = self.burst
        bucket[1] = now
        if tokens < 1.0:
            bucket[0] = tokens
            return False
        bucket[0] = tokens - 1.0
        return True

    def prune(self, now: float) -> None:
        full, rate = self.burst, self.rate
        self.buckets = {ip: b for ip, b in self.buckets.items() if b[0] + (now - b[1]) * rate < full}
        self._prune_at = max(self.PRUNE_AT, 2 * len(self.buckets))


def within_rate(rate: ConnectRate | None, ip: str | None, protocol, transport) -> bool:
    """The first check of a connection just accepted from `ip` (guard.py, before its protocol sets up anything):
    within `rate`, else refused, counted (`connect_rate`), and closed: held unread for REFUSED_HOLD_S first while fewer
    than REFUSED_HELD_MAX are (`protocol.fs_held`; guard.py's connection_lost gives the place back), else at once. No
    answer is written, plain HTTP too."""
    if rate is None or ip is None or rate.take(ip, time.monotonic()):
        return True
    log.debug("connection from %s refused: faster than PER_CLIENT_CONNECT_RATE", ip)
    _refused("connect_rate")
    if rate.held >= REFUSED_HELD_MAX:
        transport.abort()
        return False
    rate.held += 1
    protocol.fs_held = True
    transport.pause_reading()
    asyncio.get_running_loop().call_later(REFUSED_HOLD_S, transport.abort)
    return False


def admit(protocol, transport, ip: str | None) -> bool:
    """Count `transport` (just accepted, from `ip`) against its address's limit, or refuse it: closed at once, after a
    503 in plain HTTP (a TLS client cannot read one before a handshake, which is the work refused). Over TLS a
    connection accepted with MAX_CONNECTIONS reached is refused too; in plain HTTP it is kept and its request answered
    503 (guard.py), which costs less than the handshake a TLS one would need first."""
    tls = protocol.fs_tls is not None
    cap = protocol.fs_max_connections
    if tls and cap is not None and len(protocol.connections) >= cap:
        log.debug("TLS connection refused at the accept: %d connections open (the cap)", len(protocol.connections))
        _refused("tls_capacity")
        transport.abort()
        return False
    per_client = protocol.fs_per_client
    if per_client is None or ip is None:
        return True
    counts = protocol.fs_clients
    n = counts.get(ip, 0)
    if n >= per_client:
        log.debug("connection from %s refused: %d open from it (MAX_CONNECTIONS_PER_CLIENT)", ip, n)
        _refused("per_client")
        if tls:
            transport.abort()
        else:
            transport.write(_REFUSED)
            transport.close()
        return False
    counts[ip] = n + 1
    protocol.fs_client_ip = ip
    return True


def release(protocol) -> None:
    """The connection counted by `admit` is gone (idempotent)."""
    ip = protocol.fs_client_ip
    if ip is None:
        return
    protocol.fs_client_ip = None
    counts = protocol.fs_clients
    n = counts.get(ip, 1) - 1
    if n > 0:
        counts[ip] = n
    else:
        counts.pop(ip, None)


def _ssl_protocol_class(loop):
    try:
        import uvloop
        from uvloop.loop import SSLProtocol as UvSSLProtocol
    except ImportError:  # pragma: no cover  (uvloop is a dependency; asyncio's class takes the same arguments)
        uvloop = None
    if uvloop is not None and isinstance(loop, uvloop.Loop):
        return UvSSLProtocol
    from asyncio.sslproto import SSLProtocol

    return SSLProtocol


def wrap_tls(protocol, transport, on_failed) -> None:
    """Start the TLS handshake of `transport` (accepted in plain TCP) for `protocol`, whose connection_made the
    SSLProtocol calls with the TLS transport once the handshake is done. A handshake not done within
    `protocol.fs_handshake_s` is aborted by the SSLProtocol itself (ConnectionAbortedError, logged at debug level, as
    a failed handshake is); `on_failed()` then runs, as it does for every handshake that does not end in
    connection_made (failed, aborted, or closed by the client)."""
    loop = protocol.loop
    waiter = loop.create_future()

    def over(fut: asyncio.Future) -> None:
        if not fut.cancelled():
            fut.exception()  # retrieved: a failed handshake is the client's doing, not an unhandled error
        if not protocol.fs_tls_done:
            on_failed()

    waiter.add_done_callback(over)
    tls = _ssl_protocol_class(loop)(
        loop,
        protocol,
        protocol.fs_tls,
        waiter,
        server_side=True,
        ssl_handshake_timeout=protocol.fs_handshake_s,
        ssl_shutdown_timeout=TLS_SHUTDOWN_S,
    )
    # Called from the transport's connection_made, before it starts reading: its first bytes go to the SSLProtocol.
    transport.set_protocol(tls)
    tls.connection_made(transport)
