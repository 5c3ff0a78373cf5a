"""FastAPI routes: health, /model, /metrics, and /predict and the v2 routes for the OpenAPI schema (a front end
serves those two ahead of FastAPI, service/frontend/fastpath.py, with the same handlers)."""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Request, Response

from ..v2.rest import handle_v2
from .predict import handle_predict
from .state import FrontendState

router = APIRouter()


def _state(request: Request) -> FrontendState:
    return request.app.state.fusedserve


def _json(doc: object, status: int = 200) -> Response:
    return Response(orjson.dumps(doc), status_code=status, media_type="application/json")


@router.post("/predict")
async def predict(request: Request) -> Response:
    """{"inputs": [[...], ...]} -> {"outputs", "predictions", "model", "mode"}.

    A front end serves this route through service/frontend/fastpath.py's PredictFastPath, ahead of FastAPI; this
    route runs the same code for a caller that mounts the router alone.
    """
    status, body, headers = await handle_predict(_state(request), request.scope, request.receive)
    return Response(body, status_code=status, headers={k.decode(): v.decode() for k, v in headers})


@router.get("/health/live")
async def live(request: Request) -> Response:
    # 503 once an engine's GPU is broken (a sticky CUDA error): the service is exiting to be restarted.
    if _state(request).engines.broken():
        return _json({"status": "broken"}, 503)
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
    if not state.ready:  # what each starting engine is doing (service/engine/startup.py)
        from ..link.startup_progress import read_progress

        progress = read_progress(state.run_dir)
        if progress:
            doc["progress"] = progress
    return _json(doc, 200 if state.ready else 503)


@router.get("/model")
async def model_info(request: Request) -> Response:
    """What is served: the input shape, labels, and the fused plan with its kernel names."""
    return _json(_state(request).describe())


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    from ..metrics import CONTENT_TYPE

    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


# The Open Inference Protocol's REST routes, listed for the OpenAPI schema. A front end serves them through
# PredictFastPath, ahead of FastAPI, with the same handler these call.
V2_ROUTES = (
    ("GET", "/v2", "server metadata: name, version, extensions"),
    ("GET", "/v2/health/live", "200 while the process runs"),
    ("GET", "/v2/health/ready", "200 when every engine is ready, else 503"),
    # Before /v2/models/{name}: Triton reads this path as every model's statistics, not a model named "stats".
    ("GET", "/v2/models/stats", "every model's statistics (Triton's statistics extension)"),
    ("GET", "/v2/models/{name}", "model metadata: inputs and outputs with name, datatype and shape"),
    ("GET", "/v2/models/{name}/ready", "200 when the model is ready, else 503"),
    ("POST", "/v2/models/{name}/infer", "inference: JSON tensors or Triton's binary tensor extension"),
    ("GET", "/v2/models/{name}/config", "the model's configuration (Triton's model configuration extension)"),
    ("GET", "/v2/models/{name}/stats", "the model's statistics (Triton's statistics extension)"),
    ("GET", "/v2/models/{name}/versions/{version}", "model metadata (version 1)"),
    ("GET", "/v2/models/{name}/versions/{version}/ready", "model readiness (version 1)"),
    ("POST", "/v2/models/{name}/versions/{version}/infer", "inference (version 1)"),
    ("GET", "/v2/models/{name}/versions/{version}/config", "model configuration (version 1)"),
    ("GET", "/v2/models/{name}/versions/{version}/stats", "model statistics (version 1)"),
)


async def v2(request: Request) -> Response:
    status, body, headers = await handle_v2(_state(request), request.scope, request.receive)
    return Response(body, status_code=status, headers={k.decode(): v.decode() for k, v in headers})


for _method, _path, _summary in V2_ROUTES:
    router.add_api_route(_path, v2, methods=[_method], summary=_summary, tags=["Open Inference Protocol"])
