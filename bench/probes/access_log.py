"""Probe: what the access log costs (FUSEDSERVE_ACCESS_LOG, service/frontend/access_log.py; issue 51). Two numbers,
on the CPU, without a server, so that nothing but the log is measured:

1. The request path's share: an ASGI app that answers at once, called --requests times on one event loop, bare and
   wrapped by AccessLog (text and json): the difference per request is what a front end's event loop pays.
2. The writer thread's share: records formatted into lines and written to /dev/null, per line: the CPU time the
   thread takes beside the event loop (on another core where there is one; a GIL share where there is not).

    python -m bench.probes.access_log                      # ~10 s; prints a table
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import orjson

from service.frontend.access_log import AccessLog, Writer, note_rows

BODY = orjson.dumps({"outputs": [[0.5] * 10], "predictions": ["7"], "model": "digits-mlp", "mode": "fused"})
HEADERS = [(b"content-type", b"application/json"), (b"x-request-id", b"5f3a9c1e00000001"),
           (b"x-fusedserve-mode", b"fused")]  # fmt: skip


async def _answer(scope, receive, send) -> None:
    note_rows(1)
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": BODY})


async def _sent(message) -> None:
    pass


async def _per_request_s(app, n: int) -> float:
    scope = {"type": "http", "method": "POST", "path": "/predict", "headers": []}
    t = time.perf_counter()
    for _ in range(n):
        await app(dict(scope), None, _sent)
    return (time.perf_counter() - t) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    null = os.open(os.devnull, os.O_WRONLY)
    rows = []

    async def request_path():
        wrapped = {fmt: AccessLog(_answer, fmt, fd=null) for fmt in ("text", "json")}
        out = {"off": [], "text": [], "json": []}
        for _ in range(args.rounds):  # taking turns: a busy neighbour slows all alike
            out["off"].append(await _per_request_s(_answer, args.requests))
            for fmt, app in wrapped.items():
                out[fmt].append(await _per_request_s(app, args.requests))
        for app in wrapped.values():
            app.writer.close()
        return out

    times = asyncio.run(request_path())
    base = statistics.median(times["off"])
    for fmt in ("text", "json"):
        rows.append((f"request path, {fmt}", (statistics.median(times[fmt]) - base) * 1e6))
    record = (time.time(), "POST", "/predict", 200, b"5f3a9c1e00000001", 1, b"fused", 0.000312, b"")
    refused = (time.time(), "POST", "/predict", 422, b"5f3a9c1e00000002", None, None, 0.000101,
               b'{"detail":"row 0 has 3 values; the model takes 64"}')  # fmt: skip
    for fmt in ("text", "json"):
        for name, rec in (("ok", record), ("422", refused)):
            writer = Writer(fmt, null)
            writer.close()  # its thread stopped: _write is timed on this one
            batch = [rec] * 256
            laps = []
            for _ in range(args.rounds):
                t = time.thread_time()
                for _ in range(args.requests // 256):
                    writer._write(batch)
                laps.append((time.thread_time() - t) / (args.requests // 256 * 256))
            rows.append((f"writer thread, {fmt}, {name} line", statistics.median(laps) * 1e6))
    os.close(null)
    print(f"bare app: {base * 1e6:.2f} us per request ({args.requests} requests x {args.rounds} rounds)")
    print("| what | us per request |\n|---|---:|")
    for name, us in rows:
        print(f"| {name} | {us:.2f} |")


if __name__ == "__main__":
    main()
