"""The steps every inference route of a front end takes, whatever its protocol: refuse it without a valid API key
(`unauthorized`), admit it (ready, size) and read its body (`read_request`), then hand its rows to an engine and
await the outputs (`run_rows`). `/predict`
(service/frontend/predict.py), the Open Inference Protocol's REST infer (service/v2/rest.py) and its gRPC ModelInfer
(service/v2/grpc_server.py) each call these and answer in their own format."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import orjson

from ..link import wire
from . import requestid
from .access_log import note_rows
from .asgi import CLOSE, JSON, RETRY, Answer, ClientGone, content_length, header, watch_disconnect
from .auth import CHALLENGE
from .encoding import check_encoding, decode_body, encoded
from .engine_client import EngineError, EngineGone, ImageRequest
from .guard import DROP_UNREAD
from .inputs import InputError
from .state import FrontendState

log = logging.getLogger(__name__)

# A request not answered this long starts watching for its client leaving. Below it no watcher exists: a task
# per request would cost more than the whole forward of a small model, and a request answered within 50 ms
# gains nothing from being dropped.
WATCH_AFTER_S = 0.05
# A request refused 401 keeps its connection when its body is at most this long (uvicorn reads and drops that much);
# one that announces more, or a chunked one, has its connection closed unread (guard.drop_unread: reading stops, then
# the socket is aborted), so that an unauthenticated body costs at most what came with its headers.
UNAUTHORIZED_KEEP_BYTES = 64 * 1024
UNAUTHORIZED_MESSAGE = "a valid API key is needed: Authorization: Bearer <key>"
_STATUS_OF = {
    wire.OVERLOADED: (503, "overloaded", "server overloaded: "),
    wire.TIMEOUT: (504, "timeout", "request waited longer than its timeout in the queue: "),
    wire.FAILED: (500, "error", "inference failed: "),
    wire.SHUTTING_DOWN: (503, "overloaded", "server is shutting down: "),
}


class Refused(Exception):
    """A request the engines did not answer: HTTP status, outcome label and a message naming why."""

    def __init__(self, status: int, outcome: str, message: str, close: bool = False, mode: str | None = None):
        super().__init__(message)
        self.status = status
        self.outcome = outcome
        self.message = message
        self.close = close  # refused before the whole body was read: close the connection, so it is never read
        self.mode = mode  # the executor whose forward failed; None where none ran (the metrics' configured mode)

    @property
    def headers(self) -> tuple[tuple[bytes, bytes], ...]:
        """Retry-After on a 503 (not ready, overloaded, shutting down); Connection: close where `close`."""
        extra = (RETRY,) if self.status == 503 else ()
        return extra + ((CLOSE,) if self.close else ())


def _unauthorized_answer(error_key: str) -> tuple[bytes, tuple[tuple[bytes, bytes], ...]]:
    body = orjson.dumps({error_key: UNAUTHORIZED_MESSAGE})
    return body, (JSON, (b"content-length", str(len(body)).encode()), CHALLENGE)


# The 401's body and headers, encoded once per error format: {"detail"} for /predict, {"error"} for the v2 routes.
_UNAUTHORIZED = {key: _unauthorized_answer(key) for key in ("detail", "error")}


def unauthorized(state: FrontendState, scope: dict, error_key: str, protocol: str) -> Answer | None:
    """None when the request may run inference (keys off, or a valid key); else its 401 answer, counted
    `unauthorized`, the body unread. Made of bytes encoded at import, as cheap as a 404 (issue 38's target): no
    exception raised and caught, no JSON encoded, no clock read (counted without seconds, as gRPC's and every refusal
    made before a handler's work are). It carries the request id, and closes the connection when the body announced
    is over UNAUTHORIZED_KEEP_BYTES or unknown (chunked), so that no large body of an unauthenticated client is read.
    """
    keys = state.api_keys
    if keys.digests is None or keys.allows(header(scope, b"authorization")):
        return None
    state.metrics.observe_request("unauthorized", protocol=protocol)
    body, headers = _UNAUTHORIZED[error_key]
    rid = (requestid.HEADER, requestid.of_scope(scope))
    length = content_length(scope)
    if length is None or length > UNAUTHORIZED_KEEP_BYTES:
        scope[DROP_UNREAD] = True
        return 401, body, [*headers, rid, CLOSE]
    return 401, body, [*headers, rid]


def admit(state: FrontendState, scope: dict) -> int:
    """The checks before a body is read (`read_request` says which): the body's size limit, or Refused."""
    if not state.engines.ready():
        raise Refused(503, "overloaded", f"model is not ready ({state.status}); retry shortly")
    limit = state.max_body_bytes
    length = content_length(scope)
    if length is not None and length > limit:
        raise Refused(413, "too_large", f"body is {length} bytes; at most {limit}", close=True)
    try:
        check_encoding(scope)  # gzip, deflate or identity (service/frontend/encoding.py)
    except InputError as e:
        raise Refused(e.status, e.outcome, e.message, close=True) from None
    return limit


async def read_request(state: FrontendState, scope: dict, receive) -> bytes:
    """The body of an inference request (whose API key `unauthorized` has checked), its gzip or deflate coding
    undone; or Refused: 503 while the model is not ready, 413 past the size limit (counted while the bytes arrive,
    and again as they decode), 415 for a coding it cannot decode, 499 when the client left; InputError for a coded
    body that does not decode.

    A body refused before it is all read closes its connection (`Refused.close`): uvicorn then reads no more of it
    (it would otherwise read and discard the rest, 200 MB of it if the client says so, to keep the connection).
    """
    limit = admit(state, scope)
    chunks: list[bytes] = []
    await read_chunks(receive, limit, chunks)
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    return decode_body(scope, body, limit) if encoded(scope) else body


async def body_chunk(receive, size: int, limit: int) -> tuple[bytes, bool]:
    """The next message of a request body after `size` bytes of it: (its bytes, whether more follow), or Refused: 499
    when the client left, 413 once the body passes `limit` bytes (closing: the rest is not read)."""
    message = await receive()
    if message["type"] == "http.disconnect":
        raise Refused(499, "cancelled", "client closed the request")
    chunk = message.get("body", b"")
    if size + len(chunk) > limit:
        raise Refused(413, "too_large", f"body is more than {limit} bytes; at most {limit}", close=True)
    return chunk, message.get("more_body", False)


async def read_chunks(
    receive, limit: int, chunks: list[bytes], size: int = 0, until: int | None = None
) -> tuple[int, bool]:
    """Append a body's messages to `chunks` (`size` bytes of it read already) until it ends, or until `until` bytes
    are in: (bytes read, whether more follow)."""
    more = True
    while more and (until is None or size < until):
        chunk, more = await body_chunk(receive, size, limit)
        size += len(chunk)
        chunks.append(chunk)
    return size, more


class _DecodeOnCpu(Exception):
    """The engine did not decode an ImageRequest's JPEGs (wire.DECODE_ON_CPU): the front end prepares them itself."""


async def run_rows(
    state: FrontendState,
    rows: np.ndarray | ImageRequest,
    arrival: float,
    deadline: float,
    receive=None,
    request_id=None,
    reservation=None,
) -> tuple[np.ndarray, str]:
    """`_run_once`; an image request whose JPEGs its engine did not decode (nvJPEG refused one, or the engine does not
    decode: wire.DECODE_ON_CPU) is prepared here (Pillow) and submitted again as rows, before the same deadline, so
    that a file the GPU path does not take fails or succeeds as on the CPU path, alone."""
    if not isinstance(rows, ImageRequest):
        return await _run_once(state, rows, arrival, deadline, receive, request_id, reservation)
    try:
        return await _run_once(state, rows, arrival, deadline, receive, request_id)
    except _DecodeOnCpu:
        from .images import pipeline

        prepared = await pipeline(state).cpu_rows(rows.files)
        return await _run_once(state, prepared, arrival, deadline, receive, request_id)


async def _run_once(
    state: FrontendState,
    rows: np.ndarray | ImageRequest,
    arrival: float,
    deadline: float,
    receive=None,
    request_id=None,
    reservation=None,
) -> tuple[np.ndarray, str]:
    """Submit `rows` to an engine and await (their outputs ((n, output_features) float32), the mode that computed
    them: fused or unfused), or raise Refused. `reservation`: the engine arena's slot that `rows` were written into
    as they arrived (EngineClient.reserve), which the engine then reads where they are.

    `receive` (ASGI) is watched for the client leaving once the request is older than WATCH_AFTER_S; a caller
    without one (gRPC) is cancelled by its server instead, and the engine is told to drop the request either way.
    A failure (500) is logged with `request_id` (service/frontend/requestid.py) and the engine's name for the request
    (wire.request_name), which its own warning uses; other refusals (503, 504: load, counted in the metrics) only at
    debug level.
    """
    engines = state.engines
    note_rows(len(rows))  # for the access log, where it is on
    if reservation is None:
        rid, fut = engines.submit(rows, deadline, arrival)
    else:
        rid, fut = engines.submit_reserved(reservation, rows, deadline, arrival)
    loop = asyncio.get_running_loop()
    watcher: list[asyncio.Task] = []

    def watch() -> None:
        if not fut.done():
            watcher.append(loop.create_task(watch_disconnect(receive, fut)))

    timer = loop.call_later(WATCH_AFTER_S, watch) if receive is not None else None
    try:
        return await fut
    except (ClientGone, asyncio.CancelledError) as e:
        engines.cancel(rid)  # dropped before its forward if it is still queued
        if isinstance(e, asyncio.CancelledError):
            raise
        raise Refused(499, "cancelled", "client closed the request") from None
    except EngineGone as e:
        raise Refused(503, "overloaded", f"engine unavailable: {e.message}") from None
    except EngineError as e:
        if e.status == wire.DECODE_ON_CPU:
            raise _DecodeOnCpu(e.message) from None
        status, outcome, prefix = _STATUS_OF[e.status]
        log.log(logging.WARNING if status == 500 else logging.DEBUG, "request %s (engine request %s): %d %s%s",
                _text(request_id), wire.request_name(rid), status, prefix, e.message)  # fmt: skip
        raise Refused(status, outcome, prefix + e.message, mode=e.mode) from None
    except Exception as e:  # a bug, not a bad request: count it and say so, never an uncounted 500
        log.exception("unexpected error serving request %s (engine request %s)", _text(request_id),
                      wire.request_name(rid))  # fmt: skip
        raise Refused(500, "error", f"internal error: {type(e).__name__}: {e}") from None
    finally:
        if timer is not None:
            timer.cancel()
        if watcher:
            watcher[0].cancel()


def _text(request_id) -> str:
    return request_id.decode("ascii", "replace") if isinstance(request_id, bytes) else str(request_id or "-")
