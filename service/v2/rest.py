"""The Open Inference Protocol's REST routes (/v2/...), served at the ASGI level beside POST /predict.

JSON tensors, and Triton Inference Server's binary tensor extension: a body whose first
`Inference-Header-Content-Length` bytes are the JSON header, followed by each input's raw little-endian bytes
(`parameters.binary_data_size` on the input) in input order. Binary data goes to the engine through
`np.frombuffer`, never through a JSON float parser. Outputs come back as JSON `data`, or as binary when the output
asks (`parameters.binary_data`) or the request does for every output (`parameters.binary_data_output`).

Triton's model-configuration and statistics extensions (service/v2/extensions.py): GET
/v2/models/{name}[/versions/{version}]/config, GET /v2/models/stats (every model's) and
/v2/models/{name}[/versions/{version}]/stats.

Errors are {"error": "..."}: 400 for a bad request, 404 for an unknown model or route, 405 for a route asked with a
method it does not take (with Allow), 413 past the size limits, 503 when not ready or overloaded, 504 when the request
outlived its timeout in the queue.
"""

from __future__ import annotations

import time

import numpy as np
import orjson

from ..frontend import requestid
from ..frontend.asgi import CLOSE, JSON, MODE_HEADER, Answer, header
from ..frontend.inputs import InputError
from ..frontend.media import check_v2
from ..frontend.serving import Refused, run_rows, unauthorized
from ..frontend.state import FrontendState
from . import extensions
from . import tensors as t
from .arena_body import HEADER_LENGTH, Direct, read_infer_body

PROTOCOL = "v2_rest"
SERVER_METADATA = {"name": "fusedserve", "version": "0.1.0", "extensions": list(extensions.EXTENSIONS)}
MODEL_ROUTES = ([], ["ready"], ["infer"], ["config"], ["stats"])  # what may follow /v2/models/{name}[/versions/{v}]
_OCTETS = (b"content-type", b"application/octet-stream")


def _answer(status: int, body: bytes, *headers: tuple[bytes, bytes]) -> Answer:
    return status, body, [*headers, (b"content-length", str(len(body)).encode())]


def _json(status: int, doc: object, *extra: tuple[bytes, bytes]) -> Answer:
    return _answer(status, orjson.dumps(doc), JSON, *extra)


def _error(status: int, message: str, *extra: tuple[bytes, bytes]) -> Answer:
    return _json(status, {"error": message}, *extra)


def _empty(status: int) -> Answer:
    return _answer(status, b"", JSON)


async def handle_v2(state: FrontendState, scope: dict, receive) -> Answer:
    """Any /v2 route, as (status, body, headers)."""
    parts = scope["path"].rstrip("/").split("/")[2:]  # "/v2/models/m/infer" -> ["models", "m", "infer"]
    method = scope["method"]
    model = state.model
    if method == "GET" and not parts:
        return _json(200, SERVER_METADATA)
    if method == "GET" and parts == ["health", "live"]:
        return _empty(200)
    if method == "GET" and parts == ["health", "ready"]:
        return _empty(200 if state.ready else 503)
    if parts == ["models", "stats"]:  # every model's statistics, as Triton reads this path (not a model's metadata)
        if method == "GET":
            return _json(200, extensions.statistics(state))
    elif len(parts) >= 2 and parts[0] == "models":
        name, version, rest = parts[1], None, parts[2:]
        if len(rest) >= 2 and rest[0] == "versions":
            version, rest = rest[1], rest[2:]
        try:
            if rest in MODEL_ROUTES:
                t.check_model(model, name, version)
        except InputError as e:
            if rest == ["infer"] and method == "POST":
                state.metrics.observe_request(e.outcome, protocol=PROTOCOL)
            return _error(e.status, e.message)
        if method == "GET" and rest == []:
            return _json(200, t.model_metadata(model))
        if method == "GET" and rest == ["ready"]:
            return _empty(200 if state.ready else 503)
        if method == "POST" and rest == ["infer"]:
            return await handle_infer(state, scope, receive)
        if method == "GET" and rest == ["config"]:
            return _json(200, extensions.model_config(state))
        if method == "GET" and rest == ["stats"]:
            return _json(200, extensions.statistics(state))
    allowed = _allowed(parts)
    if allowed is not None:  # a route that exists, asked with another method: 405 with Allow, as HTTP says
        return _error(405, f"{method} is not allowed on {scope['path']}; use {allowed}", (b"allow", allowed.encode()))
    return _error(404, f"no route {method} {scope['path']}; see GET /v2 and GET /v2/models/{model.name}")


def _allowed(parts: list[str]) -> str | None:
    """The method a /v2 route takes (its path split after /v2), or None where no route has that path."""
    if parts in ([], ["health", "live"], ["health", "ready"]):
        return "GET"
    if len(parts) >= 2 and parts[0] == "models":
        rest = parts[2:]
        if len(rest) >= 2 and rest[0] == "versions":
            rest = rest[2:]
        if rest in ([], ["ready"], ["config"], ["stats"]):  # [] covers /v2/models/stats too
            return "GET"
        if rest == ["infer"]:
            return "POST"
    return None


async def handle_infer(state: FrontendState, scope: dict, receive) -> Answer:
    refused = unauthorized(state, scope, "error", PROTOCOL)  # before anything else: a 401 costs what a 404 does
    if refused is not None:
        return refused
    started = time.perf_counter()
    metrics = state.metrics
    # The request id (service/frontend/requestid.py): X-Request-Id, else the body's `id`, else a new one; in the
    # X-Request-Id answer header, and as the answer's `id` where the body had none.
    rid = requestid.given(scope)
    try:
        check_v2(scope)  # 415 for a Content-Type other than JSON or binary
        got = await read_infer_body(state, scope, receive)
        if isinstance(got, Direct):  # the tensor already in an engine's arena (service/v2/arena_body.py)
            doc, rows, reservation = got
            try:
                binary_out, wanted = _outputs(doc)
            except InputError:
                state.engines.release(reservation)
                raise
        else:
            doc, rows, binary_out, wanted = _parse(state, scope, got)
            reservation = None
            if isinstance(rows, list):  # encoded images: decoded and preprocessed in the image pool
                from ..frontend.images import pipeline  # imports torch: only a front end of an image model does

                rows = await pipeline(state).rows(rows)
        if rid is None:
            rid = doc["id"].encode() if requestid.valid(doc.get("id")) else requestid.new()
        arrival = time.monotonic()
        deadline = arrival + state.settings.request_timeout_ms / 1e3
        outputs, mode = await run_rows(state, rows, arrival, deadline, receive, rid, reservation)
    except InputError as e:
        metrics.observe_request(e.outcome, time.perf_counter() - started, protocol=PROTOCOL)
        return _error(e.status if e.status != 422 else 400, e.message, (requestid.HEADER, rid or requestid.new()))
    except Refused as e:
        metrics.observe_request(e.outcome, time.perf_counter() - started, protocol=PROTOCOL, mode=e.mode)
        return _error(e.status, e.message, *e.headers, (requestid.HEADER, rid or requestid.new()))
    if not isinstance(doc.get("id"), str):
        doc["id"] = rid.decode()
    ident = (requestid.HEADER, rid)
    extra = (MODE_HEADER[mode], ident, CLOSE) if state.draining else (MODE_HEADER[mode], ident)
    answer = _response(state, doc, outputs, binary_out, wanted, extra, mode)
    metrics.observe_request("ok", time.perf_counter() - started, protocol=PROTOCOL, mode=mode)
    return answer


def _parse(
    state: FrontendState, scope: dict, body: bytes
) -> tuple[dict, np.ndarray | list[tuple[str, bytes]], dict[str, bool], list[str]]:
    """(the JSON header, the rows (or an image model's encoded images), per output whether it goes binary, the outputs
    to give), or InputError."""
    model = state.model
    header_length = header(scope, HEADER_LENGTH)
    if header_length is not None:
        if not header_length.isdigit() or int(header_length) > len(body):
            raise InputError(
                400, f"Inference-Header-Content-Length is {header_length.decode(errors='replace')!r}; it must be "
                f"the JSON header's length in bytes, at most the body's {len(body)}"
            )  # fmt: skip
        n = int(header_length)
        head, binary = body[:n], memoryview(body)[n:]
    else:
        head, binary = body, memoryview(b"")
    try:
        doc = orjson.loads(head)
    except orjson.JSONDecodeError as e:
        raise InputError(400, f"request is not valid JSON{_nan_note(head, e.pos)}: {e}") from None
    if not isinstance(doc, dict):
        raise InputError(400, 'request must be a JSON object {"inputs": [...]}')
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
        raise InputError(400, f"inputs must be a list of one tensor, {t.INPUT!r}; the model takes one input")
    inp = inputs[0]
    shape = inp.get("shape")
    name = inp.get("name")
    images = t.is_image_input(model, name, inp.get("datatype"))  # BYTES: encoded images, decoded by the caller
    if images:
        count = t.image_count(name, shape, state.settings.max_rows_per_request)
    else:
        dtype, _ = t.check_input(model, name, inp.get("datatype"), shape, state.settings.max_rows_per_request)
    size = t.parameter(inp.get("parameters"), "binary_data_size")
    if size is not None:
        if "data" in inp:
            raise InputError(400, f"input {t.INPUT!r} has both data and binary_data_size; send one")
        if not isinstance(size, int) or size < 0 or size > len(binary):
            raise InputError(
                400, f"input {t.INPUT!r} binary_data_size is {size!r}; the body holds {len(binary)} bytes after "
                "its JSON header (is Inference-Header-Content-Length set?)"
            )  # fmt: skip
        if images:
            rows = t.bytes_elements(binary[:size], count, name)
        else:
            rows = t.rows_from_buffer(model, binary[:size], dtype, shape)
        binary = binary[size:]
    elif "data" in inp:
        rows = t.base64_elements(inp["data"], count, name) if images else t.rows_from_json(model, inp["data"], dtype,
                                                                                             shape)  # fmt: skip
    else:
        raise InputError(400, f"input {t.INPUT!r} has neither data nor parameters.binary_data_size")
    if len(binary):
        raise InputError(400, f"the body holds {len(binary)} bytes after the inputs' binary data; none belong there")
    binary_out, wanted = _outputs(doc)
    return doc, rows, binary_out, wanted


def _outputs(doc: dict) -> tuple[dict[str, bool], list[str]]:
    """(per output whether it goes binary, the outputs to give) from a request's JSON header, or InputError."""
    outputs = doc.get("outputs")
    if outputs is None:  # absent or null: every output (a falsy non-list, such as {}, is refused below)
        outputs = []
    if not isinstance(outputs, list) or not all(isinstance(o, dict) for o in outputs):
        raise InputError(400, 'outputs must be a list of {"name": ...}')
    wanted = t.check_outputs([o.get("name") for o in outputs])
    all_binary = bool(t.parameter(doc.get("parameters"), "binary_data_output", False))
    binary_out = {name: all_binary for name in wanted}
    for o in outputs:
        params = o.get("parameters")
        if t.parameter(params, "classification") is not None:
            raise InputError(400, f"output {o['name']!r} asks for classification, an extension this server lacks")
        binary_out[o["name"]] = bool(t.parameter(params, "binary_data", all_binary))
    return binary_out, wanted


def _response(
    state: FrontendState,
    doc: dict,
    outputs: np.ndarray,
    binary_out: dict[str, bool],
    wanted: list[str],
    extra,
    mode: str,
) -> Answer:
    model = state.model
    n = len(outputs)
    tensors, blobs = [], []
    for name in wanted:
        if name == t.LOGITS:
            meta = {"name": name, "datatype": "FP32", "shape": [n, model.output_features]}
            if binary_out[name]:
                blob = outputs.tobytes()
                meta["parameters"] = {"binary_data_size": len(blob)}
                blobs.append(blob)
            else:
                meta["data"] = outputs.reshape(-1)
        else:
            meta = {"name": name, "datatype": "BYTES", "shape": [n]}
            if binary_out[name]:
                blob = t.labels_tensor(model, outputs)
                meta["parameters"] = {"binary_data_size": len(blob)}
                blobs.append(blob)
            else:
                meta["data"] = t.label_names(model, outputs)
        tensors.append(meta)
    # parameters.mode: the executor that computed the outputs (fused or unfused), as X-Fusedserve-Mode says too.
    out = {"model_name": model.name, "model_version": t.VERSION, "parameters": {"mode": mode}, "outputs": tensors}
    if isinstance(doc.get("id"), str):
        out["id"] = doc["id"]
    head = orjson.dumps(out, option=orjson.OPT_SERIALIZE_NUMPY)
    if not blobs:
        return _answer(200, head, JSON, *extra)
    return _answer(200, b"".join([head, *blobs]), _OCTETS, (HEADER_LENGTH, str(len(head)).encode()), *extra)


def _nan_note(doc: bytes, pos: int) -> str:
    """A hint where the parser stopped at NaN or Infinity (Python's json.dumps writes them), else nothing: the error
    is then about something else, and naming NaN would mislead."""
    at = bytes(doc[pos : pos + 9]).lstrip(b"-")
    return " (NaN and Infinity are not JSON numbers)" if at.startswith((b"NaN", b"Infinity")) else ""
