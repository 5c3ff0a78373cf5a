"""service/frontend/access_log.py without a server: the ASGI wrapper's record of a request (status, id, rows, mode,
latency, an error's reason), its text and JSON lines, sampling that keeps every error, and what it costs."""

from __future__ import annotations

import asyncio
import json
import os
import time

import orjson
import pytest

from service.frontend.access_log import AccessLog, note_rows


def _app(status: int, body: dict, rows: int | None = None, mode: bytes | None = None):
    async def app(scope, receive, send):
        if rows is not None:
            note_rows(rows)  # as serving.run_rows does
        headers = [(b"x-request-id", b"rid-1")] + ([(b"x-fusedserve-mode", mode)] if mode else [])
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": orjson.dumps(body)})

    return app


def _serve(wrapper: AccessLog, n: int = 1, path: str = "/predict") -> None:
    async def go():
        for _ in range(n):
            scope = {"type": "http", "method": "POST", "path": path, "headers": []}
            await wrapper(scope, None, _noop)

    asyncio.run(go())


async def _noop(message):
    pass


def _lines(path, wrapper: AccessLog) -> list[bytes]:
    """Every line the writer wrote, once it has stopped."""
    wrapper.writer.close()
    return path.read_bytes().splitlines()


@pytest.fixture
def pipe(tmp_path):
    """(the log file, a descriptor appending to it): standard output in a front end."""
    path = tmp_path / "access.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    yield path, fd
    os.close(fd)


def test_a_json_line_per_request_with_rows_mode_and_latency(pipe):
    r, w = pipe
    log = AccessLog(_app(200, {"outputs": []}, rows=8, mode=b"fused"), "json", fd=w)
    _serve(log)
    (line,) = _lines(r, log)
    doc = json.loads(line)
    assert {k: doc[k] for k in ("request_id", "method", "route", "status", "rows", "mode")} == {
        "request_id": "rid-1", "method": "POST", "route": "/predict", "status": 200, "rows": 8, "mode": "fused"
    }  # fmt: skip
    assert 0 <= doc["latency_ms"] < 1000 and "reason" not in doc


def test_a_refusal_is_logged_with_its_reason_in_text(pipe):
    r, w = pipe
    log = AccessLog(_app(422, {"detail": 'row 0 has 3 values; the model takes 64 "pixels"'}), "text", fd=w)
    _serve(log, path="/v2/models/digits-mlp/infer")
    (line,) = _lines(r, log)
    text = line.decode()
    assert " 422 POST /v2/models/digits-mlp/infer id=rid-1 rows=- mode=- " in text
    assert text.endswith('reason="row 0 has 3 values; the model takes 64 \\"pixels\\""')


def test_sampling_keeps_a_share_of_the_answers_and_every_error(pipe):
    r, w = pipe
    ok = AccessLog(_app(200, {}), "text", sample=0.1, fd=w)
    _serve(ok, n=2000)
    bad = AccessLog(_app(503, {"detail": "server overloaded"}), "text", sample=0.1, fd=w)
    _serve(bad, n=20)
    ok.writer.close()
    lines = _lines(r, bad)  # both wrote to the one file
    refused = [x for x in lines if b" 503 " in x]
    assert len(refused) == 20
    assert 120 <= len(lines) - 20 <= 280, len(lines)  # 10% of 2000 is 200 (binomial sd ~13)


def test_the_wrapper_costs_microseconds_per_request(pipe):
    """The request path's share: a tuple on a queue, the status and headers noted. Bounded loosely (a shared 2-core
    machine); bench/probes/access_log.py measures it (docs/api.md gives the numbers)."""
    r, w = pipe
    n = 3000
    bare = _app(200, {"outputs": [[0.0] * 10]}, rows=1, mode=b"fused")
    wrapped = AccessLog(bare, "json", fd=w)

    async def loop(app):
        scope = {"type": "http", "method": "POST", "path": "/predict", "headers": []}
        t = time.perf_counter()
        for _ in range(n):
            await app(dict(scope), None, _noop)
        return (time.perf_counter() - t) / n

    async def both():
        return min([await loop(bare) for _ in range(3)]), min([await loop(wrapped) for _ in range(3)])

    plain, logged = asyncio.run(both())
    assert logged - plain < 50e-6, (plain, logged)
    assert len(_lines(r, wrapped)) == 3 * n
