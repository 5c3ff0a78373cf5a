"""The OpenAPI schema of a front end, with what FastAPI cannot infer: /predict reads its body itself (at the ASGI
level, service/frontend/predict.py), so its request and answers are described here from the model being served, and
every status a route can answer is listed with its body. Schema-driven clients and fuzzers (schemathesis in
tests/test_fuzz_openapi.py) then know what a good request is and what each answer looks like.
"""

from __future__ import annotations

import math

import numpy as np

from ..link import wire
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
            "mode": {"type": "string", "enum": list(wire.MODES)},
        },
        "required": ["outputs", "predictions", "model", "mode"],
    }
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
        "responses": {
            "200": _answer("outputs (one row of logits per input row) and the predicted labels", answer),
            "400": _error("the body is not JSON"),
            "413": _error("more rows than MAX_ROWS_PER_REQUEST, or a body too large for that many"),
            "415": _error("a Content-Type or Content-Encoding it does not take (the message names those it does)"),
            "422": _error('not {"inputs": [...]}, a row of the wrong shape, or a value that is not a finite float32'),
            "500": _error("the forward of the request's batch failed"),
            "503": _error("overloaded, not ready, or out of GPU memory for this request alone (Retry-After: 1)"),
            "504": _error("the request waited longer than REQUEST_TIMEOUT_MS in the queue"),
        },
    }


def describe_routes(schema: dict, input_shape: tuple[int, ...], max_rows: int, model_name: str | None = None) -> dict:
    """Complete FastAPI's generated `schema` in place (and return it); the /v2 routes too when `model_name` is
    given."""
    paths = schema.get("paths", {})
    if model_name is not None:
        describe_v2(schema, model_name, input_shape, max_rows)
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


def describe_images(schema: dict, max_rows: int) -> None:
    """An image model's /predict also takes an encoded file as the body, files in multipart/form-data, and base64
    `instances` (service/frontend/image_forms.py)."""
    operation = schema.get("paths", {}).get("/predict", {}).get("post")
    if operation is None:
        return
    content = operation["requestBody"]["content"]
    file = {"type": "string", "format": "binary"}
    for media in ("image/jpeg", "image/png", "image/webp"):
        content[media] = {"schema": file}
    content["multipart/form-data"] = {"schema": {"type": "object", "additionalProperties": file}}
    b64 = {"type": "object", "properties": {"b64": {"type": "string", "format": "byte"}}, "required": ["b64"]}
    instances = {"type": "object", "properties": {"instances": {"type": "array", "items": b64, "minItems": 1,
                 "maxItems": max_rows}}, "required": ["instances"], "additionalProperties": False}  # fmt: skip
    content["application/json"]["schema"] = {"oneOf": [content["application/json"]["schema"], instances]}
    operation["responses"]["422"]["description"] += "; an image that does not decode (the message names it)"
    operation["responses"]["413"]["description"] += "; an image over IMAGE_MAX_PIXELS"


def describe_security(schema: dict, keys: bool, restrictions: dict[str, tuple[str, bytes]], metrics_port) -> dict:
    """Who may call what (service/frontend/auth.py), in `schema`: with API keys on, the inference operations need a
    bearer key and may answer 401; each restricted route needs its header and may answer 403; /metrics is left out
    when METRICS_PORT serves it elsewhere."""
    from .auth import api_of_path

    paths = schema.get("paths", {})
    schemes = {}
    if metrics_port is not None:
        paths.pop("/metrics", None)
    for path, operations in paths.items():
        api = api_of_path(path)
        for method, operation in operations.items():
            inference = method == "post" and (path == "/predict" or path.endswith("/infer"))
            if inference and keys:
                schemes["apiKey"] = {"type": "http", "scheme": "bearer", "description": "an API key"}
                operation["security"] = [{"apiKey": []}]
                error = "error" if path.startswith("/v2") else "detail"
                body = {"type": "object", "properties": {error: {"type": "string"}}, "required": [error]}
                operation["responses"]["401"] = _answer("no valid API key (WWW-Authenticate: Bearer)", body)
            elif api in restrictions:
                header = restrictions[api][0]
                name = f"restricted-{api}"
                schemes[name] = {"type": "apiKey", "in": "header", "name": header}
                operation["security"] = [{name: []}]
                error = "error" if path.startswith("/v2") else "detail"
                body = {"type": "object", "properties": {error: {"type": "string"}}, "required": [error]}
                operation["responses"]["403"] = _answer(f"no {header} header with its value", body)
    if schemes:
        schema.setdefault("components", {}).setdefault("securitySchemes", {}).update(schemes)
    return schema


def install(app, input_shape: tuple[int, ...], max_rows: int, model_name: str | None = None, state=None) -> None:
    """Make `app.openapi()` return the completed schema (built once, on first request, as FastAPI does); with a
    FrontendState `state`, its API keys, restrictions and metrics port described too."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = describe_routes(generate(), input_shape, max_rows, model_name)
            if state is not None and state.model.image is not None:
                describe_images(schema, max_rows)
            if state is not None:
                describe_security(schema, state.api_keys.on, state.restrictions.rules, state.settings.metrics_port)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


# ------------------------------------------------------------------ the Open Inference Protocol (service/v2/rest.py)

# The largest double that rounds to a finite float16 (65504 is float16's largest; 65520 rounds to inf).
FLOAT16_LIMIT = 65504.0
_V2_ERROR = {"type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]}


def _v2_error(description: str) -> dict:
    return _answer(description, _V2_ERROR)


def _empty(description: str) -> dict:
    """An answer whose status is the whole answer: no body (the protocol's health and readiness routes)."""
    return {"description": description + " (empty body)"}


_REF = "#/components/schemas/"
_INFERENCE_STATS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit",
                    "cache_miss")  # fmt: skip


def v2_tensor_schemas(input_shape: tuple[int, ...]) -> dict:
    """Components the input's branches refer to (each branch would otherwise repeat them, max_rows times):
    a value in each datatype's range, and a row nested in each layout."""
    out = {}
    for group, limit in (("32", FLOAT32_LIMIT), ("16", FLOAT16_LIMIT)):
        out[f"V2Value{group}"] = {"type": "number", "minimum": -limit, "maximum": limit}
        for i, layout in enumerate(row_layouts(tuple(input_shape))):
            nested = {"$ref": f"{_REF}V2Value{group}"}
            for n in reversed(layout):
                nested = {"type": "array", "items": nested, "minItems": n, "maxItems": n}
            out[f"V2Row{group}_{i}"] = nested
    return out


def _v2_input(input_shape: tuple[int, ...], max_rows: int) -> dict:
    """The one input tensor: its `data` must hold exactly what `shape` declares (flat, row-major, or nested as the
    shape), in `datatype`'s range, so each (datatype range, row count, row layout) is a branch: JSON Schema cannot
    relate two fields otherwise. The values and rows are v2_tensor_schemas' components."""
    branches = []
    count = math.prod(input_shape)
    for datatypes, group in ((["FP32", "FP64"], "32"), (["FP16"], "16")):
        for rows in range(1, max_rows + 1):
            for i, layout in enumerate(row_layouts(tuple(input_shape))):
                flat = {"type": "array", "items": {"$ref": f"{_REF}V2Value{group}"}}
                nested = {"type": "array", "items": {"$ref": f"{_REF}V2Row{group}_{i}"}}
                branches.append({
                    "properties": {
                        "datatype": {"enum": datatypes},
                        "shape": {"const": [rows, *layout]},
                        "data": {"anyOf": [{**flat, "minItems": rows * count, "maxItems": rows * count},
                                           {**nested, "minItems": rows, "maxItems": rows}]},
                    }
                })  # fmt: skip
    layouts = " or ".join(str([-1, *s]) for s in row_layouts(tuple(input_shape)))
    return {
        "type": "object",
        "description": f"the model's one input: shape {layouts}, 1 to {max_rows} rows, `data` flat (row-major) "
        "or nested as `shape`. Triton's binary tensor extension (parameters.binary_data_size, the raw tensor "
        "after a JSON header of Inference-Header-Content-Length bytes) is served too, not described here.",
        "properties": {
            "name": {"const": "input"},
            "datatype": {"type": "string", "enum": ["FP32", "FP16", "FP64"]},
            "shape": {"type": "array", "items": {"type": "integer"}},
            "data": {"type": "array"},
            # Non-object parameters are ignored; binary_data_size (binary data after the JSON) is not JSON data.
            "parameters": {"properties": {"binary_data_size": {"type": "null"}}},
        },
        "required": ["name", "datatype", "shape", "data"],
        "anyOf": branches,
    }


def v2_infer_operation(input_shape: tuple[int, ...], max_rows: int) -> dict:
    """POST /v2/models/{name}[/versions/{version}]/infer: the JSON inference request and every answer."""
    request = {
        "type": "object",
        "properties": {
            "id": {"description": "echoed in the response when it is a string"},
            "parameters": {
                "description": "binary_data_output: true asks for every output in binary (application/octet-stream)"
            },
            "inputs": {"type": "array", "items": {"$ref": f"{_REF}V2InferInput"}, "minItems": 1, "maxItems": 1},
            "outputs": {
                "description": "the outputs to give (all when absent or empty); parameters.binary_data: true gives "
                "that output in binary",
                "type": ["array", "null"],
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": ["logits", "label"]},
                        "parameters": {"properties": {"classification": {"type": "null"}}},
                    },
                    "required": ["name"],
                },
            },
        },
        "required": ["inputs"],
    }
    tensor = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "datatype": {"type": "string"},
            "shape": {"type": "array", "items": {"type": "integer"}},
            "data": {"type": "array"},
            "parameters": {"type": "object"},
        },
        "required": ["name", "datatype", "shape"],
    }
    answer = {
        "type": "object",
        "properties": {
            "model_name": {"type": "string"},
            "model_version": {"type": "string"},
            "id": {"type": "string"},
            "parameters": {
                "type": "object",
                "properties": {"mode": {"type": "string", "enum": list(wire.MODES)}},
                "description": "mode: the executor that computed the outputs (as the X-Fusedserve-Mode header says)",
            },
            "outputs": {"type": "array", "items": tensor},
        },
        "required": ["model_name", "outputs"],
    }
    ok = _answer("the outputs: logits [rows, classes] FP32 and label [rows] BYTES", answer)
    ok["content"]["application/octet-stream"] = {
        "schema": {"type": "string", "format": "binary"},
    }
    ok["description"] += (
        "; application/octet-stream when an output is asked in binary: the JSON header (its length in the "
        "Inference-Header-Content-Length header), then each binary output's bytes"
    )
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
        "responses": {
            "200": ok,
            "400": _v2_error("not a valid inference request: bad JSON, an unknown input or output, a wrong "
                             "datatype or shape, data that does not fill the shape, or a value not finite in it"),
            "404": _v2_error("no such model or version"),
            "413": _v2_error(f"more than {max_rows} rows, or a body larger than the limit"),
            "415": _v2_error("a Content-Type or Content-Encoding it does not take (the message names those it does)"),
            "500": _v2_error("the forward of the request's batch failed"),
            "503": _v2_error("overloaded, not ready, or out of GPU memory for this request alone (Retry-After: 1)"),
            "504": _v2_error("the request waited longer than REQUEST_TIMEOUT_MS in the queue"),
        },
    }  # fmt: skip


def describe_v2(schema: dict, model_name: str, input_shape: tuple[int, ...], max_rows: int) -> None:
    """Complete the /v2 routes' operations in `schema` (FastAPI lists them with no parameters or answers)."""
    paths = schema.get("paths", {})
    if not any(p == "/v2" or p.startswith("/v2/") for p in paths):
        return
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(v2_tensor_schemas(input_shape))
    components["V2InferInput"] = _v2_input(input_shape, max_rows)  # once, for both infer routes
    name = {
        "name": "name",
        "in": "path",
        "required": True,
        "description": f"the model's name; this server serves {model_name!r} (any other: 404)",
        "schema": {"type": "string", "enum": [model_name]},
    }
    version = {
        "name": "version",
        "in": "path",
        "required": True,
        "description": "the model's version; it has one, '1' (any other: 404)",
        "schema": {"type": "string", "enum": ["1"]},
    }
    server = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "version": {"type": "string"},
            "extensions": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "version", "extensions"],
    }
    tensor = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "datatype": {"type": "string"},
            "shape": {"type": "array", "items": {"type": "integer"}},
        },
        "required": ["name", "datatype", "shape"],
    }
    model = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "versions": {"type": "array", "items": {"type": "string"}},
            "platform": {"type": "string"},
            "inputs": {"type": "array", "items": tensor},
            "outputs": {"type": "array", "items": tensor},
        },
        "required": ["name", "platform", "inputs", "outputs"],
    }
    duration = {
        "type": "object",
        "properties": {"count": {"type": "integer", "minimum": 0}, "ns": {"type": "integer", "minimum": 0}},
        "required": ["count", "ns"],
    }
    stat = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "version": {"type": "string"},
            "last_inference": {"type": "integer", "minimum": 0},
            "inference_count": {"type": "integer", "minimum": 0},
            "execution_count": {"type": "integer", "minimum": 0},
            "inference_stats": {
                "type": "object",
                "properties": {k: duration for k in _INFERENCE_STATS},
                "required": list(_INFERENCE_STATS),
            },
            "batch_stats": {"type": "array"},
        },
        "required": ["name", "version", "last_inference", "inference_count", "execution_count", "inference_stats"],
    }
    stats = {
        "type": "object",
        "properties": {"model_stats": {"type": "array", "items": stat}},
        "required": ["model_stats"],
    }
    io = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "data_type": {"type": "string"},
            "dims": {"type": "array", "items": {"type": "integer"}},
        },
        "required": ["name", "data_type", "dims"],
    }
    config = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "platform": {"type": "string"},
            "backend": {"type": "string"},
            "max_batch_size": {"type": "integer", "minimum": 1},
            "input": {"type": "array", "items": io},
            "output": {"type": "array", "items": io},
            "dynamic_batching": {"type": "object"},
            "instance_group": {"type": "array", "items": {"type": "object"}},
            "parameters": {"type": "object"},
        },
        "required": ["name", "platform", "backend", "max_batch_size", "input", "output"],
    }
    no_model = _v2_error("no such model or version")
    operations = {
        ("get", "/v2/models/stats"): {"responses": {"200": _answer("every model's statistics", stats)}},
        ("get", "/v2"): {"responses": {"200": _answer("server metadata", server)}},
        ("get", "/v2/health/live"): {"responses": {"200": _empty("the server is live")}},
        ("get", "/v2/health/ready"): {
            "responses": {"200": _empty("every engine is ready"), "503": _empty("not ready")}
        },
        ("get", "/v2/models/{name}"): {"responses": {"200": _answer("model metadata", model), "404": no_model}},
        ("get", "/v2/models/{name}/ready"): {
            "responses": {"200": _empty("the model is ready"), "503": _empty("not ready"), "404": no_model}
        },
        ("post", "/v2/models/{name}/infer"): v2_infer_operation(input_shape, max_rows),
        ("get", "/v2/models/{name}/config"): {
            "responses": {"200": _answer("the model's configuration, as Triton's", config), "404": no_model}
        },
        ("get", "/v2/models/{name}/stats"): {
            "responses": {"200": _answer("the model's statistics, as Triton's", stats), "404": no_model}
        },
    }
    for (method, path), operation in list(operations.items()):
        if path.startswith("/v2/models/{name}"):
            versioned = path.replace("{name}", "{name}/versions/{version}")
            operations[method, versioned] = {**operation, "parameters": [name, version]}
            operation["parameters"] = [name]
    for (method, path), operation in operations.items():
        if method in paths.get(path, {}):
            paths[path][method].update(operation)
