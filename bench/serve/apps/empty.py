"""The ceiling: FastAPI, POST /predict parses the body with orjson and answers an orjson body shaped like
fusedserve's (10 zero logits and a label per row it got), with no model. Nothing a server adds to a request
can cost less than this in FastAPI.

POST /v2/models/{model}/infer is the ceiling of an image model's binary requests (a 32-image UINT8 224x224 request
is 4.8 MB): it receives the body's chunks and drops them, keeping only the JSON header (Inference-Header-Content-
Length) for the row count, and answers what fusedserve answers, FP32 logits (zeros) and a label per row, binary. An
ASGI app cannot take a body in for less: whatever uvicorn and the socket cost per byte, this pays and nothing else.

    python -m uvicorn bench.serve.apps.empty:app --workers N --port P
"""

from __future__ import annotations

import functools

import orjson
from fastapi import FastAPI, Request, Response

app = FastAPI(title="bench-empty")
OUTPUTS = 10
_ROW = [0.0] * OUTPUTS


def _json(doc: object, status: int = 200) -> Response:
    return Response(orjson.dumps(doc), status_code=status, media_type="application/json")


@app.post("/predict")
async def predict(request: Request) -> Response:
    try:
        rows = orjson.loads(await request.body())["inputs"]
        n = len(rows)
    except (orjson.JSONDecodeError, KeyError, TypeError) as e:
        return _json({"detail": f"bad body: {e}"}, 422)
    return _json({"outputs": [_ROW] * n, "predictions": ["0"] * n, "model": "empty", "mode": "empty"})


@app.post("/v2/models/{model}/infer")
async def infer(model: str, request: Request) -> Response:
    try:
        head_length = int(request.headers["inference-header-content-length"])
    except (KeyError, ValueError):
        return _json({"error": "needs Inference-Header-Content-Length: the binary tensor extension"}, 400)
    head, received = bytearray(), 0
    async for chunk in request.stream():
        if len(head) < head_length:
            head += chunk[: head_length - len(head)]
        received += len(chunk)
    try:
        rows = int(orjson.loads(bytes(head))["inputs"][0]["shape"][0])
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, ValueError) as e:
        return _json({"error": f"bad inference header: {e}"}, 400)
    if received < head_length or rows < 1:
        return _json({"error": f"{received} bytes for a {head_length}-byte header and {rows} rows"}, 400)
    answer, answer_head_length = _binary_answer(model, rows)
    headers = {"inference-header-content-length": answer_head_length}
    return Response(answer, media_type="application/octet-stream", headers=headers)


@functools.lru_cache(maxsize=64)
def _binary_answer(model: str, rows: int) -> tuple[bytes, str]:
    """fusedserve's binary answer for `rows` rows (service/v2/rest.py): the JSON header, then the logits' and the
    labels' bytes; built once per (model, rows)."""
    logits = bytes(4 * OUTPUTS * rows)
    labels = b"\x01\x00\x00\x000" * rows  # BYTES: a 4-byte little-endian length, then "0"
    outputs = [
        {"name": "logits", "datatype": "FP32", "shape": [rows, OUTPUTS],
         "parameters": {"binary_data_size": len(logits)}},
        {"name": "label", "datatype": "BYTES", "shape": [rows], "parameters": {"binary_data_size": len(labels)}},
    ]  # fmt: skip
    doc = {"model_name": model, "model_version": "1", "parameters": {"mode": "empty"}, "outputs": outputs}
    head = orjson.dumps(doc)
    return head + logits + labels, str(len(head))


@app.get("/health/live")
async def live() -> Response:
    return _json({"status": "live"})


@app.get("/health/ready")
async def ready() -> Response:
    return _json({"status": "ready"})
