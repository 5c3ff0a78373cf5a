"""The body limit on every /predict path in the process, without a server: the ASGI fast path (what a front end
serves) and FastAPI's own route (what a caller that mounts service.frontend.routes's router alone gets). A 200 MB body
offered 64 KiB at a time is refused with 413 after the limit's worth of pieces, and the answer closes the
connection so that the server reads no more of it."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI

from service.config import Settings
from service.frontend.fastpath import PredictFastPath
from service.frontend.routes import router
from service.frontend.state import FrontendState, ModelInfo
from service.link import wire
from service.metrics import RequestMetrics

PIECE = 64 * 1024
HUGE = 200 * 1024 * 1024


class ReadyEngines:
    """Stands in for the engine link: ready, never asked to run anything (every body here is refused)."""

    def ready(self) -> bool:
        return True

    def states(self) -> list[int]:
        return [wire.READY]


def make_app(tmp_path, fast_path: bool):
    state = FrontendState(
        Settings(max_batch_size=64), ModelInfo("t", None, (64,), 10, None), ReadyEngines(),
        RequestMetrics("t", "unfused"), tmp_path,
    )  # fmt: skip
    app = FastAPI()
    app.include_router(router)
    app.state.fusedserve = state
    return (PredictFastPath(app, state) if fast_path else app), state


@pytest.mark.parametrize("fast_path", [True, False], ids=["asgi-fast-path", "fastapi-route"])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "content-length"])
def test_an_oversized_body_is_refused_after_the_limit_and_not_read_further(tmp_path, fast_path, chunked):
    app, state = make_app(tmp_path, fast_path)
    pulled = 0

    async def body():
        nonlocal pulled
        for _ in range(HUGE // PIECE):
            pulled += 1
            yield b"1" * PIECE

    async def post() -> httpx.Response:
        headers = {} if chunked else {"content-length": str(HUGE)}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as client:
            return await client.post("/predict", content=body(), headers=headers)

    r = asyncio.run(post())
    assert r.status_code == 413, r.text
    assert "at most" in r.json()["detail"]
    assert r.headers.get("connection") == "close", r.headers
    limit_pieces = state.max_body_bytes // PIECE + 2
    assert pulled <= limit_pieces, f"{pulled} pieces of 64 KiB read for a limit of {state.max_body_bytes} bytes"
