"""The OpenAPI schema of a front end, with what FastAPI cannot infer: /predict reads its body itself (at the ASGI
level, service/predict.py), so its request and answers are described here from the model being served, and
every status a route can answer is listed with its body. Schema-driven clients and fuzzers (schemathesis in
tests/test_fuzz_openapi.py) then know what a good request is and what each answer looks like.
"""

from __future__ import annotations

import numpy as np

from .inputs import row_layouts

# The largest double that still rounds to a finite float32 (the next one, halfway to 2**128, rounds to inf):
# values up to here are accepted, past it refused with 422.
FLOAT32_LIMIT = float(np.nextafter(3.4028235677973366e38, 0))

_DETAIL = {
    "type": "object",
    "properties": {"detail": {"type": "string"}},
    "required": ["detail"],
}


def _answer(description: str, schema: dict, media: str = "application/json") -> dict:
    return {"description": description, "content": {media: {"schema": schema}}}


def _error(description: str) -> dict:
    return _answer(description, _DETAIL)


def _row_schema(input_shape: tuple[int, ...]) -> dict:
    number = {"type": "number", "minimum": -FLOAT32_LIMIT, "maximum": FLOAT32_LIMIT}

    def nested(shape: tuple[int, ...]) -> dict:
        inner = number if len(shape) == 1 else nested(shape[1:])
        return {"type": "array", "items": inner, "minItems": shape[0], "maxItems": shape[0]}

    layouts = [nested(s) for s in row_layouts(tuple(input_shape))]
    return layouts[0] if len(layouts) == 1 else {"anyOf": layouts}


def predict_operation(input_shape: tuple[int, ...], max_rows: int) -> dict:
    """POST /predict: the request body the model takes and every answer it can get."""
    request = {
        "type": "object",
        "properties": {
            "inputs": {"type": "array", "items": _row_schema(input_shape), "minItems": 1, "maxItems": max_rows}
        },
        "required": ["inputs"],
        "additionalProperties": False,
    }
    answer = {
        "type": "object",
        "properties": {
            "outputs": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
            "predictions": {"type": "array", "items": {"type": ["string", "integer"]}},
            "model": {"type": "string"},
            "mode": {"type": "string", "enum": ["fused", "unfused"]},
        },
        "required": ["outputs", "predictions", "model", "mode"],
    }
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
        "responses": {
            "200": _answer("outputs (one row of logits per input row) and the predicted labels", answer),
            "400": _error("the body is not JSON"),
            "413": _error("more rows than MAX_ROWS_PER_REQUEST, or a body too large for that many"),
            "422": _error('not {"inputs": [...]}, a row of the wrong shape, or a value that is not a finite float32'),
            "500": _error("the forward of the request's batch failed"),
            "503": _error("overloaded, not ready, or out of GPU memory for this request alone (Retry-After: 1)"),
            "504": _error("the request waited longer than REQUEST_TIMEOUT_MS in the queue"),
        },
    }


def describe_routes(schema: dict, input_shape: tuple[int, ...], max_rows: int) -> dict:
    """Complete FastAPI's generated `schema` in place (and return it)."""
    paths = schema.get("paths", {})
    if "post" in paths.get("/predict", {}):
        paths["/predict"]["post"].update(predict_operation(input_shape, max_rows))
    any_json = {"type": "object"}
    for path, status in (("/health/live", "the GPU is broken: the service is exiting"), ("/health/ready", "not ready")):
        if "get" in paths.get(path, {}):
            paths[path]["get"]["responses"]["503"] = _answer(status, any_json)
    if "get" in paths.get("/metrics", {}):
        paths["/metrics"]["get"]["responses"]["200"] = _answer(
            "Prometheus text format", {"type": "string"}, "text/plain"
        )
    return schema


def install(app, input_shape: tuple[int, ...], max_rows: int) -> None:
    """Make `app.openapi()` return the completed schema (built once, on first request, as FastAPI does)."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = describe_routes(generate(), input_shape, max_rows)
        return app.openapi_schema

    app.openapi = openapi
