"""The access log (FUSEDSERVE_ACCESS_LOG=text|json): one line per request on standard output, with its time,
request id, method and route, status, rows, mode, latency in the server and, for an error, the reason the answer gave.
A gRPC ModelInfer has a line too (`grpc_call`): method GRPC, route its full method name, and as its status the HTTP
status its outcome has on REST (200, 401, 4xx, 503, 504, 499 for a client that left, 500).

Nothing but a tuple on the request's path: the ASGI wrapper notes the status and headers as they are sent and appends
one tuple to a deque; a thread of its own formats the lines every 50 ms and writes them, many per write. All told
(the wrapper, and the thread's formatting, which shares the GIL) 13-15 us a request on the shared 2-core CI machine,
against the few hundred a front end spends on a /predict request (bench/probes/access_log.py; docs/api.md, "Access
log"). Off (the default), no wrapper is installed at all.

Sampling (FUSEDSERVE_ACCESS_LOG_SAMPLE < 1) keeps that share of the answers below 400, drawn per request; every error
is logged, since a refused request otherwise leaves no trace but a counter.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import contextvars
import os
import random
import threading
import time

import orjson

# Rows of the request being served, set by serving.run_rows where the access log is on (a cell per request: reading
# and writing it costs ~50 ns, and the handler runs in the wrapper's task, so it sees the wrapper's cell).
ROWS: contextvars.ContextVar[list | None] = contextvars.ContextVar("fusedserve_access_rows", default=None)
REASON_BYTES = 300  # of an error answer's body, read for its message
PIPE_BUF = 4096  # one write() of at most this many bytes to a pipe is never interleaved with another process's


def note_rows(n: int) -> None:
    cell = ROWS.get()
    if cell is not None:
        cell[0] = n


class AccessLog:
    """ASGI wrapper: a record per HTTP request, handed to a writer thread."""

    def __init__(self, app, fmt: str, sample: float = 1.0, fd: int = 1):
        self.app = app
        self.sample = sample
        self.writer = Writer(fmt, fd)
        global _grpc
        _grpc = (self.writer, sample)  # the same front end's gRPC server logs through it (grpc_call)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        seen: list = [0, None, None, b""]  # status, request id, mode, the start of an error's body
        cell = [None]
        token = ROWS.set(cell)

        async def noting(message) -> None:
            kind = message["type"]
            if kind == "http.response.start":
                seen[0] = status = message["status"]
                for k, v in message.get("headers", ()):
                    if k == b"x-request-id":
                        seen[1] = v
                    elif k == b"x-fusedserve-mode":
                        seen[2] = v
                if status >= 400:
                    seen[3] = None  # the body is wanted
            elif kind == "http.response.body" and seen[3] is None:
                seen[3] = bytes(message.get("body", b"")[:REASON_BYTES])
            await send(message)

        try:
            await self.app(scope, receive, noting)
        finally:
            ROWS.reset(token)
            status = seen[0]
            if status >= 400 or self.sample >= 1.0 or random.random() < self.sample:
                self.writer.put(
                    (time.time(), scope["method"], scope["path"], status, seen[1], cell[0], seen[2],
                     time.perf_counter() - started, seen[3] or b"")
                )  # fmt: skip


GRPC_ROUTE = "/inference.GRPCInferenceService/ModelInfer"
_grpc: tuple[Writer, float] | None = None  # (writer, sample) where the access log is on in this process


def grpc_call(started: float, status: int, request_id: str | None, rows: int | None, mode: str | None,
              message: str | None = None) -> None:  # fmt: skip
    """One gRPC ModelInfer answered (`status` as REST would answer it; `message` the error's), where the access log
    is on; nothing where it is off."""
    on = _grpc
    if on is None:
        return
    writer, sample = on
    if status >= 400 or sample >= 1.0 or random.random() < sample:
        body = orjson.dumps({"error": message}) if message else b""
        rid = request_id.encode("ascii", "replace") if request_id else None
        writer.put((time.time(), "GRPC", GRPC_ROUTE, status, rid, rows, mode.encode() if mode else None,
                    time.perf_counter() - started, body))  # fmt: skip


class Writer:
    """The thread that formats records into lines and writes them to `fd`: every FLUSH_S, what gathered meanwhile.

    A timer, not a wake-up per record: a queue's put wakes the waiting thread each time, and those hand-offs of the GIL
    cost the event loop more than the line itself (measured: ~20 us a request against ~3 with the timer)."""

    FLUSH_S = 0.05

    def __init__(self, fmt: str, fd: int = 1):
        self.format = FORMATS[fmt]
        self.fd = fd
        self.records: collections.deque = collections.deque()  # append and popleft are atomic: no lock
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="access-log", daemon=True)
        self.thread.start()
        atexit.register(self.flush)

    def put(self, record: tuple) -> None:
        self.records.append(record)

    def _run(self) -> None:
        while not self._stop.wait(self.FLUSH_S):
            self.flush()
        self.flush()

    def flush(self) -> None:
        """Write what gathered (also at exit: the last requests' lines are not lost with the daemon thread)."""
        records, batch = self.records, []
        while records:
            batch.append(records.popleft())
        if batch:
            self._write(batch)

    def close(self) -> None:
        """Write what gathered and stop the thread (a test's; a front end's ends with its process)."""
        self._stop.set()
        self.thread.join(5.0)
        atexit.unregister(self.flush)

    def _write(self, batch: list[tuple]) -> None:
        chunk = b""
        for record in batch:
            line = self.format(record)
            if len(chunk) + len(line) > PIPE_BUF and chunk:
                self._out(chunk)
                chunk = b""
            chunk += line
        if chunk:
            self._out(chunk)

    def _out(self, data: bytes) -> None:
        view = memoryview(data)
        with contextlib.suppress(OSError):  # standard output closed: the service goes on, unlogged
            while view:
                view = view[os.write(self.fd, view) :]


def reason(body: bytes) -> str | None:
    """The message of an error answer ({"detail": ...} or {"error": ...}), else its start as text."""
    if not body:
        return None
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.decode("utf-8", "replace")
    if isinstance(doc, dict):
        message = doc.get("detail", doc.get("error"))
        if message is not None:
            return message if isinstance(message, str) else orjson.dumps(message).decode()
    return body.decode("utf-8", "replace")


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"


def _text(record: tuple) -> bytes:
    t, method, path, status, rid, rows, mode, seconds, body = record
    line = (
        f"{_iso(t)} {status} {method} {path} id={rid.decode('ascii', 'replace') if rid else '-'} "
        f"rows={rows if rows is not None else '-'} mode={mode.decode() if mode else '-'} {seconds * 1e3:.2f}ms"
    )
    if status >= 400:
        why = reason(body)
        if why is not None:
            line += " reason=" + orjson.dumps(why[:REASON_BYTES]).decode()
    return line.encode("utf-8", "replace") + b"\n"


def _json(record: tuple) -> bytes:
    t, method, path, status, rid, rows, mode, seconds, body = record
    doc = {
        "time": _iso(t),
        "request_id": rid.decode("ascii", "replace") if rid else None,
        "method": method,
        "route": path,
        "status": status,
        "rows": rows,
        "mode": mode.decode() if mode else None,
        "latency_ms": round(seconds * 1e3, 3),
    }
    if status >= 400:
        doc["reason"] = reason(body)
    return orjson.dumps(doc) + b"\n"


FORMATS = {"text": _text, "json": _json}
