"""HTTP routes only: parse, hand to the batcher, answer. The work lives in inputs, batching, model."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Annotated

import numpy as np
import orjson
from fastapi import APIRouter, Depends, Request, Response

from .batching import BatchFailed, DeadlineExceeded, Overloaded, ShuttingDown
from .inputs import InputError, parse_rows
from .state import AppState

router = APIRouter()
log = logging.getLogger("fusedserve.api")


def _state(request: Request) -> AppState:
    return request.app.state.fusedserve


State = Annotated[AppState, Depends(_state)]


def _json(doc: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return _json({"detail": message}, status, headers)


async def _wait_for_disconnect(request: Request) -> None:
    # After the body is read, the next ASGI message for this request is http.disconnect: the client
    # went away (or the response finished, by which time this task is already cancelled).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


@router.post("/predict")
async def predict(request: Request, state: State) -> Response:
    """{"inputs": [[...], ...]} -> {"outputs", "predictions", "model", "mode"}."""
    started = time.perf_counter()
    metrics = state.metrics
    if not state.ready:
        metrics.observe_request("overloaded")
        return _error(503, f"model is not ready ({state.status}); retry shortly", {"Retry-After": "1"})
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > state.max_body_bytes:
        metrics.observe_request("too_large")
        return _error(413, f"body is {length} bytes; at most {state.max_body_bytes}")
    body = await request.body()
    try:
        if len(body) > state.max_body_bytes:
            raise InputError(413, f"body is {len(body)} bytes; at most {state.max_body_bytes}", "too_large")
        rows = parse_rows(body, state.model.input_shape, state.settings.max_rows_per_request)
    except InputError as e:
        metrics.observe_request(e.outcome)
        return _error(e.status, e.message)

    deadline = time.monotonic() + state.settings.request_timeout_ms / 1e3
    work = asyncio.ensure_future(state.batcher.submit(rows, deadline))
    gone = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not work.done():
        # The client left: cancelling the submit drops the request before it reaches the GPU.
        work.cancel()
        metrics.observe_request("cancelled")
        return _error(499, "client closed the request")
    try:
        outputs = work.result()
    except Overloaded as e:
        metrics.observe_request("overloaded")
        return _error(503, f"server overloaded: {e}", {"Retry-After": "1"})
    except DeadlineExceeded as e:
        metrics.observe_request("timeout")
        return _error(504, f"request waited longer than {state.settings.request_timeout_ms:g} ms in the queue: {e}")
    except ShuttingDown:
        metrics.observe_request("overloaded")
        return _error(503, "server is shutting down", {"Retry-After": "1"})
    except BatchFailed as e:
        metrics.observe_request("error")
        return _error(500, f"inference failed: {e}")
    except Exception as e:  # a bug, not a bad request: count it and say so, never an uncounted 500
        log.exception("unexpected error serving /predict")
        metrics.observe_request("error")
        return _error(500, f"internal error: {type(e).__name__}: {e}")
    doc = {
        "outputs": outputs,
        "predictions": state.predictions(np.argmax(outputs, axis=1)),
        "model": state.model.name,
        "mode": state.settings.mode,
    }
    metrics.observe_request("ok", time.perf_counter() - started)
    return _json(doc)


@router.get("/health/live")
async def live() -> Response:
    return _json({"status": "live"})


@router.get("/health/ready")
async def ready(state: State) -> Response:
    doc = {"status": state.status, "model": state.model.name, "mode": state.settings.mode, "device": str(state.device)}
    if state.error:
        doc["detail"] = state.error
    return _json(doc, 200 if state.ready else 503)


@router.get("/model")
async def model_info(state: State) -> Response:
    """What is served: the input shape, labels, and the fused plan with its kernel names."""
    return _json(state.describe())


@router.get("/metrics")
async def metrics(state: State) -> Response:
    from .metrics import CONTENT_TYPE

    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
