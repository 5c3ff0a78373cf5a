"""The ASGI app a front end serves: POST /predict and the Open Inference Protocol's /v2 routes answered directly,
everything else by FastAPI.

Why ahead of FastAPI: its per-request machinery (routing, dependency solving, exit stacks, exception middlewares,
Request and Response objects) is most of a request's Python time in a front end; an empty FastAPI route answers a
third as many requests per core as a raw ASGI app on the same host (docs/performance.md). The routes do the same
things either way: the same checks, errors, metrics and engine link.
"""

from __future__ import annotations

import orjson

from ..v2.rest import handle_v2
from .asgi import JSON, Answer, header
from .auth import CHALLENGE, api_of_path, needs_key
from .encoding import maybe_gzip
from .predict import handle_predict
from .state import FrontendState


class PredictFastPath:
    """ASGI wrapper: POST /predict (handle_predict) and the Open Inference Protocol's /v2 routes
    (service/v2/rest.py) are served directly, everything else by `app`. Restricted routes (FUSEDSERVE_RESTRICTED_API)
    without their header get 403 here, /metrics 404 when FUSEDSERVE_METRICS_PORT serves it elsewhere, and with API keys
    on the docs, /model and the statistics and model-configuration routes 401 without a key (auth.needs_key)."""

    def __init__(self, app, state: FrontendState):
        self.app = app
        self.state = state
        # None where nothing is restricted, moved or keyed: then no request pays for the look.
        s = state.settings
        keyed = s.api_key is not None or s.api_keys_file is not None
        self.gate = _gate if state.restrictions or s.metrics_port is not None or keyed else None
        # Docs off: no route to guard, so a 404 rather than a 401 that would say there is one.
        self.public = s.public_apis() | (set() if s.docs else {"docs"})

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        gate = self.gate
        if path == "/predict" and scope["method"] == "POST":
            status, body, headers = await handle_predict(self.state, scope, receive)
            body = maybe_gzip(scope, body, headers)  # Accept-Encoding: gzip, for answers large enough to pay
        elif path == "/v2" or path.startswith("/v2/"):
            refused = gate(self, scope, path, "error") if gate is not None else None
            if refused is not None:
                status, body, headers = refused
            else:
                status, body, headers = await handle_v2(self.state, scope, receive)
                body = maybe_gzip(scope, body, headers)
        else:
            refused = gate(self, scope, path, "detail") if gate is not None else None
            if refused is None:
                await self.app(scope, receive, send)
                return
            status, body, headers = refused
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _gate(served: PredictFastPath, scope: dict, path: str, error_key: str) -> Answer | None:
    """403 for a restricted route without its header and value, 404 for /metrics served on METRICS_PORT instead, 401
    for a keyed route without a valid API key; None to serve the request. Errors as the route family writes them:
    {"error"} under /v2, else {"detail"}."""
    api = api_of_path(path)
    if api is None:
        return None
    state = served.state
    if api == "metrics" and state.settings.metrics_port is not None:
        return _refuse(404, error_key, f"no route {path} on this port: /metrics is served on its own port")
    keys = state.api_keys
    if keys.digests is not None and needs_key(api, state.restrictions, served.public):
        if keys.allows(header(scope, b"authorization")):
            return None
        status, body, headers = _refuse(401, error_key, f"{api} needs a valid API key: Authorization: Bearer <key>")
        return status, body, [*headers, CHALLENGE]
    restrictions = state.restrictions
    name = restrictions.header_for(api)
    if name is None or restrictions.allows(api, header(scope, name.encode())):
        return None
    return _refuse(403, error_key, restrictions.refusal(api))


def _refuse(status: int, error_key: str, message: str) -> Answer:
    body = orjson.dumps({error_key: message})
    return status, body, [JSON, (b"content-length", str(len(body)).encode())]
