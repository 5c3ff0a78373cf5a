"""The ASGI app a front end serves: POST /predict and the Open Inference Protocol's /v2 routes answered directly,
everything else by FastAPI.

Why ahead of FastAPI: its per-request machinery (routing, dependency solving, exit stacks, exception middlewares,
Request and Response objects) is most of a request's Python time in a front end; an empty FastAPI route answers a
third as many requests per core as a raw ASGI app on the same host (docs/performance.md). The routes do the same
things either way: the same checks, errors, metrics and engine link.
"""

from __future__ import annotations

from ..v2.rest import handle_v2
from .predict import handle_predict
from .state import FrontendState


class PredictFastPath:
    """ASGI wrapper: POST /predict (handle_predict) and the Open Inference Protocol's /v2 routes
    (service/v2/rest.py) are served directly, everything else by `app`."""

    def __init__(self, app, state: FrontendState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path == "/predict" and scope["method"] == "POST":
            status, body, headers = await handle_predict(self.state, scope, receive)
        elif path == "/v2" or path.startswith("/v2/"):
            status, body, headers = await handle_v2(self.state, scope, receive)
        else:
            await self.app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
