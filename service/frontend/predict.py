"""POST /predict: {"inputs": [[...], ...]} rows in, {"outputs", "predictions", "model", "mode"} out; for a model that
takes encoded images (config.json's input.image) also a JPEG, PNG or WebP file as the body, files in
multipart/form-data, or base64 images in {"instances": [{"b64": ...}]}, one row each.

Served at the ASGI level by service/frontend/fastpath.py; FastAPI's own /predict route (kept for the OpenAPI schema
and for any caller that mounts the router alone) calls the same `handle_predict`.
"""

from __future__ import annotations

import time

import numpy as np
import orjson

from . import requestid
from .asgi import CLOSE, JSON, MODE_HEADER, Answer
from .inputs import InputError, parse_rows
from .media import media_type, predict_form
from .serving import Refused, read_request, run_rows, unauthorized
from .state import FrontendState


def _answer(status: int, doc: object, *extra: tuple[bytes, bytes]) -> Answer:
    body = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    return status, body, [JSON, (b"content-length", str(len(body)).encode()), *extra]


def _error(status: int, message: str, *extra: tuple[bytes, bytes]) -> Answer:
    return _answer(status, {"detail": message}, *extra)


async def image_rows(state: FrontendState, scope: dict, form: str, body: bytes) -> np.ndarray:
    """An image model's rows from encoded images: one file as the body ("image"), files in multipart/form-data, or
    base64 `instances` in JSON (service/frontend/image_forms.py), decoded and preprocessed (images.py)."""
    from .image_forms import b64_instances, multipart_files
    from .images import pipeline

    limit = state.settings.max_rows_per_request
    if form == "image":
        images = [("the body", body)]
    elif form == "multipart":
        images = multipart_files(body, media_type(scope)[1], limit)
    else:
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError as e:
            raise InputError(400, f"body is not valid JSON: {e}") from None
        if not isinstance(doc, dict) or "instances" not in doc:  # "instances" was inside a string: rows after all
            return parse_rows(body, state.model.input_shape, limit, state.model.input_dtype)
        images = b64_instances(doc, limit)
    return await pipeline(state).rows(images)


async def handle_predict(state: FrontendState, scope: dict, receive) -> Answer:
    """{"inputs": [[...], ...]} -> {"outputs", "predictions", "model", "mode"}, as (status, body, headers); "mode"
    (and the X-Fusedserve-Mode header) is the executor that computed the outputs, fused or unfused."""
    refused = unauthorized(state, scope, "detail", "predict")  # before anything else: a 401 costs what a 404 does
    if refused is not None:
        return refused
    started = time.perf_counter()
    metrics = state.metrics
    ident = (requestid.HEADER, requestid.of_scope(scope))  # the client's X-Request-Id, or a new one
    # While draining (SIGTERM), requests are still answered, each answer closing its connection.
    extra = (ident, CLOSE) if state.draining else (ident,)
    try:
        model = state.model
        form = predict_form(scope, model.image is not None)  # 415 for a Content-Type it does not take
        body = await read_request(state, scope, receive)
        if form == "json" and (model.image is None or b'"instances"' not in body):
            rows = parse_rows(body, model.input_shape, state.settings.max_rows_per_request, model.input_dtype)
        else:
            rows = await image_rows(state, scope, form, body)
        arrival = time.monotonic()
        deadline = arrival + state.settings.request_timeout_ms / 1e3
        outputs, mode = await run_rows(state, rows, arrival, deadline, receive, ident[1])
    except InputError as e:
        metrics.observe_request(e.outcome, time.perf_counter() - started)
        return _error(e.status, e.message, ident)
    except Refused as e:
        metrics.observe_request(e.outcome, time.perf_counter() - started, mode=e.mode)
        return _error(e.status, e.message, *e.headers, ident)
    doc = {
        "outputs": outputs,
        "predictions": state.predictions(outputs.argmax(axis=1)),
        "model": state.model.name,
        "mode": mode,
    }
    answer = _answer(200, doc, MODE_HEADER[mode], *extra)
    metrics.observe_request("ok", time.perf_counter() - started, mode=mode)
    return answer
