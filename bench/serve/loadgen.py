"""HTTP load generator for `bench serve`: closed loop and open loop (fixed rate) over several client processes.

Closed loop: each connection sends its next request when the last one was answered (what `wrk` and
the baseline aiohttp clients do). Open loop: requests are due at a fixed rate (slot k at start + k/rate,
shared by the connections of one process; an idle connection takes the next slot and sleeps until it is
due). A request that was due before any connection was free to send it is timed from its due time, so a
stall counts against every request it delayed (coordinated omission corrected, as wrk2 and perf_analyzer's
fixed-rate mode do); one sent on time is timed from its send, so the client's timer resolution (1 ms under
libuv) is not charged to the server. The latency from the actual send is kept too ("service").

Every process keeps its connections open from warm-up to the end of the phase: it warms up, drains,
reports ready and waits; the parent reads the server's metrics, says go, the processes run the measured
window, drain every outstanding request, report, and close. So the window holds no connection set-up
and the server's counters, read between the windows, cover exactly the measured requests.

Two clients, same accounting: `raw` (default), an asyncio Protocol that writes one pre-encoded HTTP/1.1
request and reads the status line and Content-Length of the answer (a few µs of Python per request, so
the client leaves the host's cores to the server), and `aiohttp` (ClientSession, one pooled connector per
process), the client the baseline figures were taken with. uvloop is used where it is installed.
A phase whose protocol is `v2_grpc` uses a third: grpc.aio, one channel (one HTTP/2 connection) per
connection, sending pre-serialized ModelInferRequest bytes and reading the answer's status only (grpcio's
own Python per call is ~30 µs); an answer's gRPC status is recorded as the HTTP status it stands for
(OK 200, UNAVAILABLE 503, DEADLINE_EXCEEDED 504, RESOURCE_EXHAUSTED 413, INVALID_ARGUMENT 400, else 500),
and a transport failure as a lost request.

Per phase and process: requests sent, answers by status, connection errors by kind, and every latency
(float64 seconds; 40,000 req/s for 5 s is 1.6 MB). Error kinds:
  lost     the request was written on an established connection and the connection closed (or reset)
           before a whole answer came back
  refused  opening a connection failed (nothing was sent on it)
  timeout  still unanswered `drain_timeout` seconds after the window ended (cancelled then)
Each error is also kept with its time (up to 1,000 a process), so a SIGTERM phase can tell connections
refused after the shutdown began from errors before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import random
import signal
import sys
import time
from array import array
from dataclasses import dataclass, field

FEATURES = 64
MAX_ERROR_EVENTS = 1000
BIG_WRITE = 64 << 10  # bodies from 64 KB on are written after their head instead of joined to it


def make_bodies(rows: int, count: int = 16, seed: int = 0) -> list[bytes]:
    """`count` different /predict bodies of `rows` rows of 64 pixel values 0..16 (integers, like the digits
    data and model_weights/digits-mlp/examples.json), pre-encoded."""
    rng = random.Random(seed * 1000 + rows)
    out = []
    for _ in range(count):
        text = ",".join("[" + ",".join(str(rng.randint(0, 16)) for _ in range(FEATURES)) + "]" for _ in range(rows))
        out.append(b'{"inputs":[' + text.encode() + b"]}")
    return out


@dataclass(frozen=True)
class PhaseSpec:
    """What one client process runs in one phase."""

    host: str
    port: int
    path: str
    bodies: tuple[bytes, ...]
    connections: int
    warmup_s: float
    duration_s: float
    rate: float = 0.0  # requests/s for this process; 0 = closed loop
    client: str = "raw"  # raw | aiohttp
    drain_timeout_s: float = 30.0
    seed: int = 0
    protocol: str = "predict"  # predict | v2_binary (HTTP, like predict) | v2_grpc (path: the gRPC method)
    headers: bytes = b""  # extra HTTP header lines, each ending in \r\n
    # Sent with every request (`Authorization: Bearer KEY`; gRPC: metadata `authorization`), for a server with API
    # keys on: bench/serve/run.py passes BENCH_API_KEY's value. None: no such header.
    api_key: str | None = None


@dataclass
class Recorder:
    """One process's counts for one window."""

    sent: int = 0
    status: dict[int, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    events: list[tuple[str, float]] = field(default_factory=list)
    latency: array = field(default_factory=lambda: array("d"))
    service: array = field(default_factory=lambda: array("d"))  # open loop: from the actual send
    first_send: float = 0.0
    last_done: float = 0.0
    cpu_s: float = 0.0  # this process's CPU time (every thread) over the window and its drain
    wall_s: float = 0.0  # the window and its drain, as this process saw them
    backlog: int = 0  # open loop: due slots never sent (the drain limit passed)
    why: dict[str, int] = field(default_factory=dict)  # "kind: exception" -> count (20 distinct at most)

    def error(self, kind: str, why: str = "") -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1
        if why and (why in self.why or len(self.why) < 20):
            self.why[why] = self.why.get(why, 0) + 1
        if len(self.events) < MAX_ERROR_EVENTS:
            self.events.append((kind, time.monotonic()))

    def result(self) -> dict:
        return {
            "sent": self.sent,
            "status": dict(self.status),
            "errors": dict(self.errors),
            "events": list(self.events),
            "latency": self.latency.tobytes(),
            "service": self.service.tobytes(),
            "first_send": self.first_send,
            "last_done": self.last_done,
            "cpu_s": self.cpu_s,
            "wall_s": self.wall_s,
            "backlog": self.backlog,
            "why": dict(self.why),
        }


class Lost(Exception):
    """Sent on an established connection; it closed before the whole answer came back."""


class Refused(Exception):
    """A connection could not be opened."""


# ---------------------------------------------------------------------------------------------- raw


class _RawProtocol(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection with at most one request outstanding."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future | None = None
        self.closed = False
        self._head_end = -1
        self._total = 0
        self._status = 0
        self._close_after = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        if self._head_end < 0:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buf[:end]).lower()
            self._status = int(head[9:12])
            i = head.find(b"\r\ncontent-length:")
            if i < 0:  # the servers measured always send Content-Length; anything else is a broken answer
                self._fail(Lost("answer without content-length"))
                return
            j = head.find(b"\r\n", i + 2)
            self._total = end + 4 + int(head[i + 17 : j if j > 0 else len(head)])
            self._close_after = b"\r\nconnection: close" in head
            self._head_end = end
        if len(self.buf) < self._total:
            return
        del self.buf[: self._total]
        self._head_end = -1
        if self._close_after:  # the server closes after this answer (it is shutting down): do not reuse
            self.closed = True
            self.transport.close()
        waiter.set_result(self._status)

    def _fail(self, exc: Exception) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(Lost(f"connection closed: {exc!r}"))


class RawConnection:
    def __init__(self, host: str, port: int, head: bytes) -> None:
        self.host, self.port, self.head = host, port, head
        self.proto: _RawProtocol | None = None

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, self.proto = await loop.create_connection(_RawProtocol, self.host, self.port)
        except OSError as e:
            raise Refused(repr(e)) from None

    async def request(self, body: bytes, rec: Recorder) -> int:
        """Send one request (opening a connection first if the last one was closed) and return the status."""
        if self.proto is None or self.proto.closed:
            await self.connect()
        proto = self.proto
        proto.waiter = fut = asyncio.get_running_loop().create_future()
        proto._head_end = -1
        rec.sent += 1
        head = self.head + str(len(body)).encode() + b"\r\n\r\n"
        if len(body) < BIG_WRITE:
            proto.transport.write(head + body)
        else:  # a 9.6 MB image batch: two writes rather than a copy of the body per request
            proto.transport.write(head)
            proto.transport.write(body)
        try:
            return await fut
        finally:
            proto.waiter = None

    def close(self) -> None:
        if self.proto is not None and self.proto.transport is not None:
            self.proto.transport.close()


# ------------------------------------------------------------------------------------------ aiohttp


class AiohttpConnection:
    """One logical connection over a process-wide aiohttp session (aiohttp pools the sockets)."""

    session = None

    def __init__(self, url: str, api_key: str | None = None) -> None:
        self.url = url
        self.headers = {"content-type": "application/json"}
        if api_key:
            self.headers["authorization"] = f"Bearer {api_key}"

    async def connect(self) -> None:
        pass

    async def request(self, body: bytes, rec: Recorder) -> int:
        import aiohttp

        rec.sent += 1
        try:
            async with self.session.post(self.url, data=body, headers=self.headers) as r:
                await r.read()
                return r.status
        except aiohttp.ClientConnectorError as e:
            rec.sent -= 1  # the connection was never opened: nothing was sent
            raise Refused(repr(e)) from None
        except (aiohttp.ClientError, OSError) as e:
            raise Lost(repr(e)) from None

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------------------ gRPC

# gRPC statuses recorded as the HTTP status of the same meaning (the accounting reads HTTP statuses).
_GRPC_AS_HTTP = {
    "OK": 200, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504, "RESOURCE_EXHAUSTED": 413, "INVALID_ARGUMENT": 400,
    "NOT_FOUND": 404, "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403,
}  # fmt: skip
# UNAVAILABLE is also how grpcio reports a broken connection; the server's own refusals say why in these words.
_SERVER_UNAVAILABLE = ("overloaded", "not ready", "shutting down", "engine unavailable")


class GrpcConnection:
    """One gRPC channel (its own HTTP/2 connection: no subchannel sharing) calling one unary method with bytes."""

    def __init__(self, host: str, port: int, method: str, api_key: str | None = None) -> None:
        self.target, self.method = f"{host}:{port}", method
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self.channel = None
        self.call = None

    async def connect(self) -> None:
        import grpc

        if self.channel is None:
            self.channel = grpc.aio.insecure_channel(
                self.target, options=[("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", -1)]
            )
            # No serializers: the request is already bytes, and the answer is read as bytes (never parsed).
            self.call = self.channel.unary_unary(self.method)
        try:
            await asyncio.wait_for(self.channel.channel_ready(), 10.0)
        except (asyncio.TimeoutError, Exception) as e:
            raise Refused(repr(e)) from None

    async def request(self, body: bytes, rec: Recorder) -> int:
        import grpc

        if self.call is None:
            await self.connect()
        rec.sent += 1
        try:
            await self.call(body, metadata=self.metadata)
            return 200
        except grpc.aio.AioRpcError as e:
            code = e.code().name
            if code == "UNAVAILABLE" and not any(w in (e.details() or "") for w in _SERVER_UNAVAILABLE):
                raise Lost(f"{code}: {e.details()}") from None
            return _GRPC_AS_HTTP.get(code, 500)

    async def aclose(self) -> None:
        if self.channel is not None:
            channel, self.channel, self.call = self.channel, None, None
            await channel.close()

    def close(self) -> None:
        pass  # aclose() closed the channel


# ------------------------------------------------------------------------------------------ workers


async def _closed_worker(conn, rec: Recorder, bodies: tuple[bytes, ...], offset: int, end_at: float) -> None:
    n = len(bodies)
    i = offset
    now = time.monotonic
    while True:
        t0 = now()
        if t0 >= end_at:
            return
        try:
            status = await conn.request(bodies[i % n], rec)
        except Refused as e:
            rec.error("refused", f"refused: {e}")
            return  # a server that refuses connections is gone (or going): stop this connection
        except Lost as e:
            rec.error("lost", f"lost: {e}")
            continue
        t1 = now()
        rec.status[status] = rec.status.get(status, 0) + 1
        rec.latency.append(t1 - t0)
        rec.last_done = t1
        i += 1


class _Slots:
    def __init__(self, start: float, rate: float) -> None:
        self.start, self.rate, self.k = start, rate, 0

    def next_due(self) -> float:
        k = self.k
        self.k += 1
        return self.start + k / self.rate


async def _open_worker(conn, rec: Recorder, bodies, offset: int, slots: _Slots, end_at: float, stop_at: float) -> None:
    n = len(bodies)
    i = offset
    now = time.monotonic
    while True:
        due = slots.next_due()
        if due >= end_at:
            return
        t0 = now()
        if t0 >= stop_at:  # far behind schedule: give up on the backlog instead of draining it for minutes
            rec.backlog += 1
            continue
        start = due  # behind schedule: the wait for a free connection counts (coordinated omission)
        if due > t0:
            await asyncio.sleep(due - t0)
            # On time: from the send. The timer fires up to ~1 ms late (libuv's resolution), which is the client's
            # delay, not the server's.
            start = t0 = now()
        try:
            status = await conn.request(bodies[i % n], rec)
        except Refused as e:
            rec.error("refused", f"refused: {e}")
            return
        except Lost as e:
            rec.error("lost", f"lost: {e}")
            continue
        t1 = now()
        rec.status[status] = rec.status.get(status, 0) + 1
        rec.latency.append(t1 - start)
        rec.service.append(t1 - t0)
        rec.last_done = t1
        i += 1


async def _window(spec: PhaseSpec, conns: list, rec: Recorder, start_at: float, seconds: float) -> None:
    """Run the load on `conns` from `start_at` for `seconds`, then wait for every outstanding answer."""
    delay = start_at - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    end_at = start_at + seconds
    rec.first_send = time.monotonic()
    cpu0 = time.process_time()
    try:
        await _load(spec, conns, rec, start_at, end_at)
    finally:
        rec.cpu_s = time.process_time() - cpu0
        rec.wall_s = time.monotonic() - rec.first_send


async def _load(spec: PhaseSpec, conns: list, rec: Recorder, start_at: float, end_at: float) -> None:
    if spec.rate > 0:
        slots = _Slots(start_at, spec.rate)
        stop_at = end_at + spec.drain_timeout_s / 2
        coros = [_open_worker(c, rec, spec.bodies, k, slots, end_at, stop_at) for k, c in enumerate(conns)]
    else:
        coros = [_closed_worker(c, rec, spec.bodies, k, end_at) for k, c in enumerate(conns)]
    tasks = [asyncio.ensure_future(c) for c in coros]
    done, pending = await asyncio.wait(tasks, timeout=max(0.0, end_at - time.monotonic()) + spec.drain_timeout_s)
    for t in pending:
        t.cancel()
        rec.error("timeout")  # the request it was waiting for never came back
    if pending:
        await asyncio.wait(pending)
    for t in done:
        if t.exception() is not None:
            raise t.exception()


async def _phase(spec: PhaseSpec, pipe) -> dict:
    if spec.protocol == "v2_grpc":
        conns = [GrpcConnection(spec.host, spec.port, spec.path, spec.api_key) for _ in range(spec.connections)]
    elif spec.client == "aiohttp" and spec.protocol == "predict":  # binary v2 needs its header: the raw client
        import aiohttp

        AiohttpConnection.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
            timeout=aiohttp.ClientTimeout(total=None),
            skip_auto_headers=("User-Agent",),
        )
        url = f"http://{spec.host}:{spec.port}{spec.path}"
        conns = [AiohttpConnection(url, spec.api_key) for _ in range(spec.connections)]
    else:
        ctype = "application/octet-stream" if spec.protocol == "v2_binary" else "application/json"
        head = (
            (f"POST {spec.path} HTTP/1.1\r\nHost: {spec.host}:{spec.port}\r\nContent-Type: {ctype}\r\n").encode()
            + spec.headers
            + (f"Authorization: Bearer {spec.api_key}\r\n".encode() if spec.api_key else b"")
            + b"Content-Length: "
        )
        conns = [RawConnection(spec.host, spec.port, head) for _ in range(spec.connections)]
    warm = Recorder()
    try:
        for c in conns:
            try:
                await c.connect()
            except Refused:
                warm.error("refused")
        if spec.warmup_s > 0:
            await _window(spec, conns, warm, time.monotonic(), spec.warmup_s)
        pipe.send({"ready": True})
        go = pipe.recv()  # blocks the loop on purpose: every connection is idle until the parent says go
        if go.get("start_at") is None:
            return {"aborted": True, "warmup": warm.result()}
        rec = Recorder()
        await _window(spec, conns, rec, go["start_at"], spec.duration_s)
        out = rec.result()
        out["warmup"] = warm.result()
        return out
    finally:
        if spec.protocol == "v2_grpc":
            await asyncio.gather(*(c.aclose() for c in conns))
        for c in conns:
            c.close()
        if AiohttpConnection.session is not None:
            await AiohttpConnection.session.close()
            AiohttpConnection.session = None


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


def _child(pipe) -> None:
    # The parent handles ^C and SIGTERM (a `timeout` signals the whole process group), finishes the phase under way
    # and stops us through the pipe; if it dies instead, so do we (Linux: PR_SET_PDEATHSIG).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    loop = _new_loop()
    asyncio.set_event_loop(loop)
    while True:
        try:
            msg = pipe.recv()
        except EOFError:
            return
        if msg is None:
            return
        try:
            pipe.send(loop.run_until_complete(_phase(msg, pipe)))
        except Exception as e:  # reported to the parent, which fails the phase with it
            pipe.send({"failed": f"{type(e).__name__}: {e}"})


def loop_name() -> str:
    try:
        import uvloop  # noqa: F401

        return "uvloop"
    except ImportError:
        return "asyncio"


# ------------------------------------------------------------------------------------------- parent


def split(total: float, parts: int) -> list[float]:
    """`total` connections (or req/s) over `parts` processes, as evenly as integers allow."""
    if isinstance(total, int):
        base, extra = divmod(total, parts)
        return [base + (1 if i < extra else 0) for i in range(parts)]
    return [total / parts] * parts


class ClientPool:
    """`processes` client processes, started once and reused for every phase."""

    def __init__(self, processes: int) -> None:
        ctx = mp.get_context("fork" if os.name == "posix" else "spawn")
        self.pipes = []
        self.procs = []
        for _ in range(max(1, processes)):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_child, args=(child,), daemon=True)
            p.start()
            child.close()
            self.pipes.append(parent)
            self.procs.append(p)

    @property
    def size(self) -> int:
        return len(self.procs)

    def run(
        self,
        spec: PhaseSpec,
        on_ready=None,
        on_start=None,
        start_delay_s: float = 0.05,
        timeout_s: float | None = None,
    ) -> dict:
        """Run one phase: `spec.connections` and `spec.rate` are totals, split over as many processes as there
        are connections (at most the pool). `on_ready()` runs when every process has warmed up and drained
        (read the server's metrics there); `on_start(start_at)` right after go. Returns merge()'s dict."""
        used = min(self.size, spec.connections)
        conns = split(spec.connections, used)
        rates = split(float(spec.rate), used) if spec.rate > 0 else [0.0] * used
        pipes = self.pipes[:used]
        for k, (pipe, c, r) in enumerate(zip(pipes, conns, rates, strict=True)):
            mine = spec.bodies[k::used] or spec.bodies
            pipe.send(PhaseSpec(**{**spec.__dict__, "connections": c, "rate": r, "bodies": mine}))
        limit = timeout_s or (spec.warmup_s + spec.duration_s + spec.drain_timeout_s + 60)
        deadline = time.monotonic() + limit
        results: list[dict | None] = [None] * used
        failures = []
        for k, pipe in enumerate(pipes):
            msg = self._recv(pipe, deadline)
            if not msg.get("ready"):
                failures.append(msg.get("failed", "no ready message"))
                results[k] = msg
        if failures:
            for k, pipe in enumerate(pipes):
                if results[k] is None:
                    pipe.send({"start_at": None})
                    self._recv(pipe, deadline)
            raise RuntimeError(f"client process failed before the window: {failures[0]}")
        if on_ready is not None:
            on_ready()
        start_at = time.monotonic() + start_delay_s
        for pipe in pipes:
            pipe.send({"start_at": start_at})
        if on_start is not None:
            on_start(start_at)
        for k, pipe in enumerate(pipes):
            results[k] = self._recv(pipe, deadline)
        bad = [r["failed"] for r in results if "failed" in r]
        if bad:
            raise RuntimeError(f"client process failed: {bad[0]}")
        return merge(results, start_at, spec.duration_s, spec.rate)

    def _recv(self, pipe, deadline: float) -> dict:
        left = deadline - time.monotonic()
        if left <= 0 or not pipe.poll(left):
            raise TimeoutError("a client process did not answer in time")
        return pipe.recv()

    def close(self) -> None:
        for pipe in self.pipes:
            with contextlib.suppress(OSError):
                pipe.send(None)
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        self.pipes, self.procs = [], []

    def __enter__(self) -> ClientPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _sum_counts(dicts) -> dict:
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def merge(results: list[dict], start_at: float, duration_s: float, rate: float) -> dict:
    """Merge the processes' windows into one: totals, latencies as one array (numpy), throughput.

    Throughput is answers over the time from the window's start to the last answer (the window plus
    the drain of the requests outstanding at its end)."""
    import numpy as np

    lat = np.concatenate([np.frombuffer(r["latency"], dtype=np.float64) for r in results])
    service = np.concatenate([np.frombuffer(r["service"], dtype=np.float64) for r in results])
    last = max((r["last_done"] for r in results), default=start_at)
    elapsed = max(duration_s, last - start_at)
    status = _sum_counts(r["status"] for r in results)
    answered = sum(status.values())
    warm = [r["warmup"] for r in results]
    cpu = [r.get("cpu_s", 0.0) for r in results]
    walls = [r.get("wall_s", 0.0) for r in results]
    return {
        "sent": sum(r["sent"] for r in results),
        "status": {int(k): v for k, v in sorted(status.items())},
        "errors": _sum_counts(r["errors"] for r in results),
        "why": _sum_counts(r["why"] for r in results),
        "events": sorted((e for r in results for e in r["events"]), key=lambda e: e[1]),
        "latency": lat,
        "service": service,
        "answered": answered,
        "start_at": start_at,
        "elapsed_s": elapsed,
        "req_per_s": answered / elapsed if elapsed > 0 else 0.0,
        "rate": rate,
        "backlog": sum(r["backlog"] for r in results),
        "processes": len(results),
        "client_cpu": client_cpu(cpu, walls),
        "warmup": {
            "sent": sum(w["sent"] for w in warm),
            "status": {int(k): v for k, v in _sum_counts(w["status"] for w in warm).items()},
            "errors": _sum_counts(w["errors"] for w in warm),
        },
    }


CLIENT_BOUND = 0.85  # clients busier than this share of their cores may be what limits the phase


def client_cpu(cpu_s: list[float], wall_s: list[float]) -> dict:
    """The client processes' CPU over the window: cores used (CPU seconds over the longest wall), out of the cores
    given (one per process: each runs one event loop), the busiest process's share of its core, and `bound` when the
    clients used more than CLIENT_BOUND of their cores (the load, not the server, may be the limit)."""
    wall = max(wall_s, default=0.0)
    if wall <= 0:
        return {"cores_used": None, "cores_given": len(cpu_s), "busiest": None, "bound": None}
    used = sum(cpu_s) / wall
    busiest = max(c / w for c, w in zip(cpu_s, wall_s, strict=True) if w > 0)
    return {"cores_used": round(used, 3), "cores_given": len(cpu_s), "busiest": round(busiest, 3),
            "bound": used > CLIENT_BOUND * len(cpu_s)}  # fmt: skip


def percentiles(lat, qs=(50, 90, 99, 99.9)) -> dict[str, float | None]:
    """Latency percentiles in ms (None without samples), plus the mean and max."""
    import numpy as np

    if len(lat) == 0:
        return {**{f"p{q:g}": None for q in qs}, "mean": None, "max": None}
    ms = np.asarray(lat) * 1e3
    out = {f"p{q:g}": float(v) for q, v in zip(qs, np.percentile(ms, qs), strict=True)}
    out["mean"] = float(ms.mean())
    out["max"] = float(ms.max())
    return out
