"""A front end: create_app() builds the FastAPI app around an engine link; frontend_main() is the process that
serves it under uvicorn, on a socket of its own bound with SO_REUSEPORT (the kernel spreads connections over
the front ends). service/supervisor.py starts these processes and the engines."""

from __future__ import annotations

import gc
import logging
import os
import socket
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI

from ..config import Settings
from ..processes import GRPC, HTTP, HTTP_AND_GRPC

log = logging.getLogger(__name__)

DRAIN_MAX_S = 5.0  # longest a front end keeps answering (each answer closing its connection) after SIGTERM
DRAIN_QUIET_S = 0.2  # a front end with no connection this long after SIGTERM has drained


def create_app(settings: Settings, model, engines, run_dir: Path, keys=None, grpc: bool | None = None,
               on_started=None) -> FastAPI:  # fmt: skip
    """The HTTP app of one front end. `model`: a state.ModelInfo; `engines`: an EngineClient (not yet started);
    `keys`: the supervisor's API keys in force (auth.KeysInForce); None: read from `settings` (a front end on its
    own); `grpc`: whether its lifespan runs the gRPC server (None: where GRPC_PORT is set); `on_started`: called
    once the lifespan's start is done (the gRPC server listening)."""
    if grpc is None:
        grpc = settings.grpc_port is not None
    from ..metrics import RequestMetrics
    from .auth import ApiKeys
    from .routes import router
    from .state import FrontendState

    api_keys = None if keys is None else ApiKeys(settings, keys)
    metrics = RequestMetrics(model.name, settings.mode)
    state = FrontendState(settings, model, engines, metrics, run_dir, api_keys=api_keys)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engines.start()
        watcher = _LiveSettingsWatch(state)
        grpc_server = None
        if grpc:
            from ..v2 import grpc_server as v2_grpc

            grpc_server = await v2_grpc.start(state)
        if on_started is not None:
            on_started()
        gc.freeze()  # the app lives as long as the process: keep it out of the collector's passes
        try:
            yield
        finally:
            watcher.cancel()
            if grpc_server is not None:
                # After uvicorn's drain and shutdown: RPCs under way get the rest of the grace to finish.
                await grpc_server.stop(settings.shutdown_grace_s / 2)
            engines.close()

    # FUSEDSERVE_DOCS=false: no /docs, /redoc or /openapi.json (404), as the container image runs. The pages are
    # service/frontend/docs_pages.py's (pinned scripts with integrity), not FastAPI's. No redirect of /path/ to /path:
    # Starlette's takes its URL from the Host header (`POST /predict/` answered `location: http://<Host>/predict`).
    from .docs_pages import OPENAPI_URL
    from .docs_pages import install as install_docs

    app = FastAPI(title="fusedserve", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=OPENAPI_URL if settings.docs else None, redirect_slashes=False)  # fmt: skip
    if settings.docs:
        install_docs(app)
    app.state.fusedserve = state
    app.include_router(router)
    from .openapi import install

    install(
        app, model.input_shape, settings.max_rows_per_request, model.name, state
    )  # /predict's body, every route's answers
    return app


class _LiveSettingsWatch:
    """Looks at the supervisor's configuration generation every CONFIG_POLL_S on the event loop, and takes new live
    settings when it changed (service/link/live.py)."""

    def __init__(self, state):
        import asyncio

        from ..link.live import CONFIG_POLL_S

        self.state = state
        self.every = CONFIG_POLL_S
        self.loop = asyncio.get_running_loop()
        self.handle = self.loop.call_later(self.every, self._look)

    def _look(self) -> None:
        try:
            if self.state.take_live_settings():
                log.info("configuration %d taken: mode %s", self.state.config_seen, self.state.settings.mode)
        except Exception:  # a bad read must not stop the looking: the next generation may be fine
            log.exception("could not take the new configuration")
        self.handle = self.loop.call_later(self.every, self._look)

    def cancel(self) -> None:
        self.handle.cancel()


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket with SO_REUSEPORT, so that every front end binds the same port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def frontend_main(
    settings: Settings,
    model,
    endpoints: list[str],
    states: list,
    run_dir: str,
    index: int,
    config: tuple | None = None,
    keys: tuple | None = None,
    listening=None,
    role: str = HTTP_AND_GRPC,
) -> None:
    """Entry point of a front-end process (spawned by the supervisor); `config`: (the supervisor's shared
    configuration generation, the generation `settings` is) for SIGHUP reloads; `keys`: the supervisor's API keys in
    force (auth.KeysInForce), which this front end holds whatever the keys file says by now (issue 53); `listening`:
    a shared flag set once its socket listens (connections queue from then on), which the supervisor's ready banner
    waits for; `role`: what it serves (supervisor.frontend_roles): "http", "grpc" or "http+grpc" (gRPC where
    GRPC_PORT is set). A gRPC-only front end runs the same app, lifespan and uvicorn loop (live settings, drain,
    memory trim) with no HTTP socket."""
    from ..processes import child_setup, configure_logging

    child_setup(f"fs-frontend-{index}")
    configure_logging(settings.log_level)
    if keys is None and (settings.api_key is not None or settings.api_keys_file is not None):
        # Never read the keys file here: emptied or gone since the supervisor read it, it would open the service or
        # stop it. Without the supervisor's keys, refuse to serve at all.
        log.error("front end %d: API keys are configured but the supervisor handed none; not serving", index)
        raise SystemExit(2)
    import uvicorn

    from .auth import check_tls
    from .engine_client import EngineClient, arena_bytes
    from .guard import guarded_protocol

    # A row on the wire: uint8 pixels as sent, floats as float32 at most (float16 to a float16 engine).
    row_bytes = model.input_features * (1 if model.input_dtype == "uint8" else 4)
    engines = EngineClient(endpoints, states, model.output_features, arena_bytes(settings.max_batch_size, row_bytes))
    http = role != GRPC
    grpc = role != HTTP and settings.grpc_port is not None

    def started() -> None:  # a gRPC-only front end listens once its lifespan has started the gRPC server
        if not http and listening is not None:
            listening.value = 1

    app = create_app(settings, model, engines, Path(run_dir), keys=keys if keys is not None else (None, ""),
                     grpc=grpc, on_started=started)  # fmt: skip
    from .fastpath import PredictFastPath

    state = app.state.fusedserve
    if config is not None:
        state.config_generation, state.config_seen = config
    served = PredictFastPath(app, state)  # POST /predict ahead of FastAPI's routing
    if settings.access_log != "off":  # off: not even a wrapper
        from .access_log import AccessLog

        served = AccessLog(served, settings.access_log, settings.access_log_sample)
    sockets = [listen_socket(settings.host, settings.port)] if http else []
    if http and listening is not None:
        listening.value = 1
    config = uvicorn.Config(
        served,
        log_level=settings.log_level,
        access_log=False,
        timeout_graceful_shutdown=settings.shutdown_grace_s,
        # Keep-alive connections are the norm under load; a client idle this long is closed.
        timeout_keep_alive=30,
        # Slow clients (service/frontend/guard.py): header and body read timeouts, and a cap on open connections past
        # which a request gets 503 at once, counted as overloaded.
        # TLS (FUSEDSERVE_TLS_*) too: the protocol wraps each accepted connection, its handshake under the header
        # timeout and counted against the cap (service/frontend/accept.py), so uvicorn is given no TLS settings.
        http=guarded_protocol(
            settings.max_connections,
            lambda: state.metrics.observe_request("overloaded"),
            tls=check_tls(settings),
            handshake_s=settings.header_timeout_s,
            per_client=settings.max_connections_per_client,
            connect_rate=settings.connect_rate(),
        ),
        server_header=False,
        date_header=False,
    )
    if http:
        log.info("front end %d (pid %d) serving on %s://%s:%d", index, os.getpid(),
                 "https" if settings.tls else "http", settings.host, settings.port)  # fmt: skip
    else:
        log.info("front end %d (pid %d) serving gRPC alone on %s:%d", index, os.getpid(), settings.host,
                 settings.grpc_port)  # fmt: skip
    drain_s = min(DRAIN_MAX_S, settings.shutdown_grace_s / 2)
    server = _draining_server(uvicorn.Server)(config, app.state.fusedserve, drain_s)
    server.fs_timeouts = (settings.header_timeout_s, settings.body_timeout_s)
    server.fs_drain_delay_s = settings.drain_delay_s
    server.run(sockets=sockets)
    if not server.started:  # the lifespan failed (logged by uvicorn): say so to the supervisor, which then stops
        from ..processes import STARTUP_FAILED

        raise SystemExit(STARTUP_FAILED)


def _draining_server(base):
    from .guard import SWEEP_EVERY_TICKS, sweep
    from .heap import TRIM_EVERY_TICKS, trimmer

    class DrainingServer(base):
        """uvicorn's server with a drain before its shutdown. On SIGTERM, /health/ready turns 503 and every answer
        closes its connection (`Connection: close`), so that clients move off on their own; once no connection
        is left for DRAIN_QUIET_S, or after `drain_s`, uvicorn's own shutdown runs: stop accepting, answer what
        was accepted, exit. Closing a keep-alive connection while its client is sending the next request would
        lose that request; a client told `Connection: close` never sends one."""

        def __init__(self, config, state, drain_s: float):
            super().__init__(config)
            self._fs_state = state
            self._drain_s = drain_s
            self._drain_started: float | None = None
            self._quiet_since: float | None = None
            self.fs_timeouts: tuple[float, float] | None = None  # (header, body) read timeouts for guard.sweep
            self.fs_drain_delay_s = 0.0  # accepting on this long after SIGTERM before the drain
            self.fs_trim = trimmer()

        def handle_exit(self, sig, frame) -> None:
            if self._drain_started is None:
                # FUSEDSERVE_DRAIN_DELAY_S: accepting and answering on, /health/ready 503, until load balancers have
                # seen it; the drain below starts after that. Not ready (still warming, an engine down), the health
                # check has read 503 all along: no delay.
                delay = self.fs_drain_delay_s if self._fs_state.ready else 0.0
                self._drain_started = time.monotonic() + delay
                self._fs_state.draining = True
                return
            super().handle_exit(sig, frame)  # a second signal: shut down now

        async def on_tick(self, counter: int) -> bool:
            if self.fs_timeouts is not None and counter % SWEEP_EVERY_TICKS == 0:
                sweep(self.server_state.connections, time.monotonic(), *self.fs_timeouts)
            if self.fs_trim is not None and counter % TRIM_EVERY_TICKS == 0:
                self.fs_trim()  # freed memory back to the system (service/frontend/heap.py)
            if self._drain_started is not None and not self.should_exit and time.monotonic() >= self._drain_started:
                now = time.monotonic()
                if self.server_state.connections:
                    self._quiet_since = None
                elif self._quiet_since is None:
                    self._quiet_since = now
                if (self._quiet_since is not None and now - self._quiet_since >= DRAIN_QUIET_S) or (
                    now - self._drain_started >= self._drain_s
                ):
                    self.should_exit = True
            return await super().on_tick(counter)

    return DrainingServer
