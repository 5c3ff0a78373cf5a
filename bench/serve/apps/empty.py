"""The ceiling: FastAPI, POST /predict parses the body with orjson and answers an orjson body shaped like
fusedserve's (10 zero logits and a label per row it got), with no model. Nothing a server adds to a request
can cost less than this in FastAPI.

    python -m uvicorn bench.serve.apps.empty:app --workers N --port P
"""

from __future__ import annotations

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


@app.get("/health/live")
async def live() -> Response:
    return _json({"status": "live"})


@app.get("/health/ready")
async def ready() -> Response:
    return _json({"status": "ready"})
