"""HTTP routes only: parse, hand to an engine, answer. The work lives in inputs, engine_client, the engines."""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np
import orjson
from fastapi import APIRouter, Request, Response

from . import wire
from .engine_client import EngineError, EngineGone
from .inputs import InputError, parse_rows
from .state import FrontendState

router = APIRouter()
log = logging.getLogger("fusedserve.api")

# A request not answered this long starts watching for its client leaving. Below it no watcher exists: a task
# per request would cost more than the whole forward of a small model, and a request answered within 50 ms
# gains nothing from being dropped.
WATCH_AFTER_S = 0.05
_STATUS_OF = {
    wire.OVERLOADED: (503, "overloaded", "server overloaded: "),
    wire.TIMEOUT: (504, "timeout", "request waited longer than its timeout in the queue: "),
    wire.FAILED: (500, "error", "inference failed: "),
    wire.SHUTTING_DOWN: (503, "overloaded", "server is shutting down: "),
}
_RETRY = {"Retry-After": "1"}
_CLOSE = {"Connection": "close"}


def _state(request: Request) -> FrontendState:
    # Read directly, not through Depends: FastAPI runs a plain-function dependency in its thread pool, a thread
    # round trip per request (18% of a loaded front end's time in a py-spy profile).
    return request.app.state.fusedserve


def _json(doc: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return _json({"detail": message}, status, headers)


class ClientGone(Exception):
    pass


async def _watch_disconnect(request: Request, fut: asyncio.Future) -> None:
    # After the body is read, the next ASGI message for this request is http.disconnect: the client went away
    # (or the response finished, by which time this task is cancelled).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            if not fut.done():
                fut.set_exception(ClientGone())
            return


@router.post("/predict")
async def predict(request: Request) -> Response:
    """{"inputs": [[...], ...]} -> {"outputs", "predictions", "model", "mode"}."""
    started = time.perf_counter()
    state = _state(request)
    metrics = state.metrics
    engines = state.engines
    if not engines.ready():
        metrics.observe_request("overloaded")
        return _error(503, f"model is not ready ({state.status}); retry shortly", _RETRY)
    # While draining (SIGTERM), requests are still answered, each answer closing its connection.
    close = _CLOSE if state.draining else None
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
    rid, fut = engines.submit(rows, deadline)
    loop = asyncio.get_running_loop()
    watcher: list[asyncio.Task] = []

    def watch() -> None:
        if not fut.done():
            watcher.append(loop.create_task(_watch_disconnect(request, fut)))

    timer = loop.call_later(WATCH_AFTER_S, watch)
    try:
        outputs = await fut
    except ClientGone:
        engines.cancel(rid)  # dropped before its forward if it is still queued
        metrics.observe_request("cancelled")
        return _error(499, "client closed the request")
    except EngineGone as e:
        metrics.observe_request("overloaded")
        return _error(503, f"engine unavailable: {e.message}", _RETRY)
    except EngineError as e:
        status, outcome, prefix = _STATUS_OF[e.status]
        metrics.observe_request(outcome)
        return _error(status, prefix + e.message, _RETRY if status == 503 else None)
    except Exception as e:  # a bug, not a bad request: count it and say so, never an uncounted 500
        log.exception("unexpected error serving /predict")
        metrics.observe_request("error")
        return _error(500, f"internal error: {type(e).__name__}: {e}")
    finally:
        timer.cancel()
        if watcher:
            watcher[0].cancel()
    doc = {
        "outputs": outputs,
        "predictions": state.predictions(np.argmax(outputs, axis=1)),
        "model": state.model.name,
        "mode": state.settings.mode,
    }
    metrics.observe_request("ok", time.perf_counter() - started)
    return _json(doc, headers=close)


@router.get("/health/live")
async def live() -> Response:
    return _json({"status": "live"})


@router.get("/health/ready")
async def ready(request: Request) -> Response:
    state = _state(request)
    doc = {
        "status": state.status,
        "model": state.model.name,
        "mode": state.settings.mode,
        "device": state.plan().get("device"),
        "engines": state.engines.states_named(),
    }
    return _json(doc, 200 if state.ready else 503)


@router.get("/model")
async def model_info(request: Request) -> Response:
    """What is served: the input shape, labels, and the fused plan with its kernel names."""
    return _json(_state(request).describe())


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    from .metrics import CONTENT_TYPE

    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)
