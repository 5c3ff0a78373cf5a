"""`fusedserve serve`: check the configuration, start one engine per device and FUSEDSERVE_WORKERS front ends,
watch them, and stop them in order.

    supervisor ─┬─ engine 0 (GPU 0: model, CUDA graphs, tuner, batch queue), listening on <run dir>/engine-0.sock
                ├─ engine 1 (GPU 1) ...
                ├─ front end 0 (FastAPI + uvicorn on :port, SO_REUSEPORT), a Unix socket to every engine
                └─ front end 1 ...

Start: the supervisor finds the model (ModelNotFound names the places looked at) and starts the engines; engine 0
reads the model and sends what the front ends must know of it (link.model_info.ModelInfo), or why the loader refuses
it, which `serve` reports as before any process serves (exit 2). The front ends start then, while the engines
compile and warm up; the ready banner waits for every engine and for every front end's socket to listen. The
supervisor never imports torch on a host with no GPU driver (backend.device_type): torch's import was 2.8 CPU-s of
a 2-core machine's start, before the engine could begin its own.

Why processes: a small model's forward takes microseconds on the GPU, while Python's HTTP handling takes
hundreds per request per core; so front ends scale over the host's cores, and each GPU keeps one queue
(one engine), where batches form from every front end's requests.

Faults: a front end that dies is started again (its own connections are lost, nothing else). An engine that
dies is started again in place: its outstanding requests get 503 at once, and until it is ready again every
request gets 503 with Retry-After and /health/ready reads 503, while the front ends keep their connections. The
new engine finds Triton's compile cache and the tuner's cache on disk, so it is ready in seconds rather than a
cold start. An engine that dies MAX_ENGINE_DEATHS times within ENGINE_DEATH_WINDOW_S, or fails to start, takes
the service down: the front ends drain and the supervisor exits 1, for Docker or Kubernetes to restart the
whole. So does an engine whose GPU hits a sticky error (service/engine/faults.py): it answers what it holds 503,
marks itself broken (/health/live turns 503 too) and exits 4; only a new process tree is sure to get a working
device.
SIGTERM or SIGINT: the front ends stop accepting and answer every accepted request, then the engines
answer what they hold and stop; exit 0 within FUSEDSERVE_SHUTDOWN_GRACE_S.

SIGHUP: read the configuration again (the environment, the configuration file, the command line, in the same order of
precedence as at start) and, if it is valid as a whole, hand its live settings (service.config.LIVE_SETTINGS) to every
engine and front end (service/link/live.py); a file with an invalid value is refused whole and the running
configuration stays. Settings that only a restart can change are named in the log, not applied. Counted in
fusedserve_config_reloads_total{outcome}. The API keys file is read again too, by the supervisor alone: front ends
hold the supervisor's keys in force, handed to each one it starts and published with each new generation
(service/frontend/auth.py), so a keys file emptied or removed by mistake never reaches a front end, restarted or not.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .config import (
    ENV_PREFIX,
    LIVE_SETTINGS,
    Settings,
    SettingsError,
    changed_settings,
    config_file_of,
    load_settings,
    overridden_in_file,
    setting_name,
)
from .link import wire
from .link.live import write_live
from .processes import GRPC, HTTP, HTTP_AND_GRPC, STARTUP_FAILED, signals_held_for_children

if TYPE_CHECKING:
    from .link.model_info import ModelInfo

log = logging.getLogger(__name__)

# Front ends per engine at most: on a 16-core host with one GPU, the empty FastAPI route gains 7% from 8 to 12 workers,
# not worth the memory; a host with more GPUs has more cores, and its front ends were the limit with 8 (two H200s
# served a CNN no faster than one): so the cap grows with the engines (docs/configuration.md, FUSEDSERVE_WORKERS).
WORKERS_PER_ENGINE = 8
RESTART_WINDOW_S, MAX_RESTARTS = 60.0, 5  # more front-end deaths than this in the window is a crash loop: stop
ENGINE_DEATH_DRAIN_S = 1.0  # before stopping for a dead engine, /health/ready reads 503 this long
# An engine that dies this often within the window is not helped by starting it again: stop the service instead.
ENGINE_DEATH_WINDOW_S, MAX_ENGINE_DEATHS = 300.0, 3
ENGINE_STOP_MIN_S = 5.0  # engines get at least this long to answer what they hold, whatever the grace left


class StartError(RuntimeError):
    """The service cannot start; the message says why."""


def host_cores() -> int:
    """The CPUs the service may use: its affinity, capped by its container's CPU quota (service/cpus.py)."""
    from .cpus import usable_cpus

    return usable_cpus()


def default_workers(engines: int, cores: int | None = None) -> int:
    """One front end per core left after the engines, at most WORKERS_PER_ENGINE per engine, at least one."""
    cores = host_cores() if cores is None else cores
    return max(1, min(WORKERS_PER_ENGINE * engines, cores - engines))


def engine_devices(settings: Settings, device_type: str) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES for each engine: one engine per visible GPU by default (None on the CPU)."""
    if device_type != "cuda":
        return [None] * (settings.engines or 1)
    import torch

    count = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",") if v.strip()][:count] if visible else [str(i) for i in range(count)]
    if not ids:  # else no engine at all, or a modulo by zero below
        raise StartError(f"no CUDA device visible (torch sees {count}; CUDA_VISIBLE_DEVICES={visible!r})")
    n = settings.engines or len(ids)
    return [ids[i % len(ids)] for i in range(n)]


def _reserve_port(host: str, port: int, setting: str = "FUSEDSERVE_PORT") -> socket.socket:
    """Bind (without listening) one of the service's ports with SO_REUSEPORT, so that its front ends can bind it too
    and nothing else can while the service runs. A port something already listens on is reported now, naming the
    `setting`: first bound without SO_REUSEPORT, which Linux refuses while any socket listens there. Bound with
    SO_REUSEPORT alone, the port would be shared with a second fusedserve on it, or any server that sets it (gRPC
    does), and the kernel would split the connections between them."""
    from .frontend.app import listen_socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as alone:
            alone.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed connection's TIME_WAIT is no owner
            alone.bind((host, port))
        sock = listen_socket(host, port)
    except OSError as e:
        raise StartError(f"cannot listen on {host}:{port} ({setting}): {e.strerror or e}") from None
    # Closed for listening at once: a reserved socket must not take connections the front ends should get.
    sock.close()
    hold = socket.socket(family, socket.SOCK_STREAM)
    hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    hold.bind((host, port))
    return hold


class Supervisor:
    """The parent process: starts the engines and front ends, watches them, and stops them in order."""

    def __init__(self, settings: Settings, overrides: dict | None = None):
        self.settings = settings
        # The command line's settings: they beat the environment and the file at every reload too.
        self.overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
        self._stop_requested = False
        # every engine ready and every front end listening (the ready banner logged), until an engine restarts: a stop
        # before it (or while an engine is back to starting) has no drain delay, as the front ends judge it too
        self._announced = False
        self._reload_requested = False
        self._generation = 0
        self._shared_generation = None
        self._run_dir: Path | None = None
        self._model_name = settings.model
        self._ctx = multiprocessing.get_context("spawn")
        self.engines: list[multiprocessing.process.BaseProcess] = []
        self.frontends: list[multiprocessing.process.BaseProcess] = []
        self._restarts: list[float] = []
        self._engine_deaths: list[float] = []
        self._metrics = None  # SupervisorMetrics, once the metrics directory is set
        self._keys = None  # the API keys (service/frontend/auth.py), read at start and again on SIGHUP

    def run(self) -> int:
        s = self.settings
        from .frontend.auth import ApiKeys, Restrictions, SecurityFileError, check_tls, describe_access

        try:  # the keys file and TLS files are read now: one unreadable stops the start, naming it
            keys = self._keys = ApiKeys(s)
            check_tls(s)
        except SecurityFileError as e:
            raise StartError(str(e)) from None
        log.info("%s", describe_access(s, keys))
        if not keys.on and keys.source:
            log.warning("%s holds no API key: inference is open", keys.source)
        # From the start: a SIGHUP's default action is to end the process. One that comes before the children
        # run is taken once they do.
        signal.signal(signal.SIGHUP, self._request_reload)
        run_dir = Path(tempfile.mkdtemp(prefix="fusedserve-"))
        multiproc_before = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        try:
            metrics_dir = run_dir / "metrics"
            metrics_dir.mkdir()
            # Each process writes its values there (service/metrics.py); the supervisor's own counters too.
            from .metrics import use_multiprocess_dir

            use_multiprocess_dir(str(metrics_dir))
            from .backend import prepare_device_type
            from .dependencies import DependencyError, check_imports, front_end_modules

            try:  # here, once: a front end that cannot import would die at each start again (a crash loop)
                check_imports(front_end_modules(grpc=s.grpc_port is not None))
            except DependencyError as e:
                raise StartError(str(e)) from None
            # The model is found here (ModelNotFound names every place looked at) and read by engine 0 (_model_info):
            # the supervisor never imports torch where the host has no GPU driver.
            s.model_path()
            devices = engine_devices(s, prepare_device_type(s))
            workers = s.workers or default_workers(len(devices))
            port_hold = _reserve_port(s.host, s.port, setting_name("port", self.overrides))
            grpc_hold = None
            metrics_port = None
            try:
                if s.grpc_port is not None:
                    grpc_hold = _reserve_port(s.host, s.grpc_port, setting_name("grpc_port", self.overrides))
                if s.metrics_port is not None:
                    from .metrics_server import MetricsServer

                    try:
                        metrics_port = MetricsServer(s.host, s.metrics_port, Restrictions(s.restrictions()))
                    except OSError as e:
                        raise StartError(f"cannot listen on {s.host}:{s.metrics_port} "
                                         f"({setting_name('metrics_port', self.overrides)}): "
                                         f"{e.strerror or e}") from None  # fmt: skip
                for sig in (signal.SIGTERM, signal.SIGINT):
                    signal.signal(sig, self._request_stop)
                return self._run(devices, workers, run_dir)
            finally:
                port_hold.close()
                if grpc_hold is not None:
                    grpc_hold.close()
                if metrics_port is not None:
                    metrics_port.close()
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
            # A caller in the same process (a test, a library user) must not inherit a directory that is gone.
            from .metrics import use_multiprocess_dir

            use_multiprocess_dir(multiproc_before)

    def _request_stop(self, signum, frame) -> None:
        s, name = self.settings, signal.Signals(signum).name
        if not self._stop_requested:
            self._stop_requested = True
            if not self._announced:
                log.info("%s: stopping before ready (nothing served yet: no drain delay)", name)
            elif s.drain_delay_s > 0:
                log.info("%s: /health/ready reads 503; still serving for %g s (FUSEDSERVE_DRAIN_DELAY_S) while load "
                         "balancers notice, then stopping within %g s (FUSEDSERVE_SHUTDOWN_GRACE_S); %s again stops "
                         "now", name, s.drain_delay_s, s.shutdown_grace_s, name)  # fmt: skip
            else:
                log.info("%s: stopping (grace %g s)", name, s.shutdown_grace_s)
            return
        # A second signal: the front ends skip the rest of their drain delay (DrainingServer.handle_exit's second call).
        log.info("%s again: stopping now (accepted requests are still answered)", name)
        for p in self.frontends:
            _signal(p, signal.SIGTERM)

    def _request_reload(self, signum, frame) -> None:
        self._reload_requested = True

    def reload(self) -> str:
        """Read the configuration again and hand its live settings to the children; returns the outcome (applied,
        unchanged, invalid), which is counted and logged."""
        outcome = self._reload()
        if self._metrics is not None:
            self._metrics.config_reloaded(outcome)
        return outcome

    def _reload(self) -> str:
        s = self.settings
        env_file = config_file_of(self.overrides)
        try:
            new = load_settings(**self.overrides)
        except SettingsError as e:
            why = str(e).replace("\n  ", " ").replace("invalid configuration: ", "")
            log.error("SIGHUP: %s refused whole, the running configuration stays: %s", env_file, why)
            return "invalid"
        live, fixed = changed_settings(s, new)
        shadowed = overridden_in_file(env_file, self.overrides)
        if shadowed:
            log.warning("SIGHUP: %s in %s %s overridden by the environment or the command line", ", ".join(shadowed),
                        env_file, "is" if len(shadowed) == 1 else "are")  # fmt: skip
        if fixed:
            log.warning(
                "SIGHUP: %s changed in %s; only a restart applies %s, so the service keeps %s",
                ", ".join(ENV_PREFIX + f.upper() for f in fixed), env_file,
                "it" if len(fixed) == 1 else "them", ", ".join(f"{f}={getattr(s, f)}" for f in fixed),
            )  # fmt: skip
        keys_before = self._keys.in_force() if self._keys is not None else None
        keys_changed = self._reload_keys()
        if not live and not keys_changed:
            log.info("SIGHUP: %s read; no live setting changed", env_file)
            return "unchanged"
        if self._run_dir is not None and self._keys is not None:
            from .frontend.auth import write_keys_in_force

            # The keys in force go out first, under the generation about to be announced: every front end takes this
            # set (FrontendState.take_keys), and one started later gets it with its arguments.
            try:
                write_keys_in_force(self._run_dir, self._generation + 1, self._keys)
            except OSError as e:
                self._keys.digests, self._keys.source = keys_before
                log.error("SIGHUP: cannot publish the API keys to the front ends (%s); the configuration and keys "
                          "in force stay", e.strerror or e)  # fmt: skip
                return "failed"
        self.settings = s.model_copy(update=live)
        self._generation += 1
        if self._run_dir is not None:
            values = {k: getattr(self.settings, k) for k in LIVE_SETTINGS}
            write_live(self._run_dir, self._generation, values)
            self._shared_generation.value = self._generation
        from .processes import set_log_level

        set_log_level(self.settings.log_level)
        log.info("SIGHUP: configuration %d from %s: %s", self._generation, env_file,
                 ", ".join(f"{ENV_PREFIX}{k.upper()}={v}" for k, v in live.items()))  # fmt: skip
        return "applied"

    def _reload_keys(self) -> bool:
        """SIGHUP: read the API keys file again; True if the keys changed, so that they are published to the front ends
        (auth.write_keys_in_force, taken on the new generation). A file that cannot be read (missing, unreadable, a bad
        line), or that would turn keys off, is logged and changes nothing: the last good keys stay in force here and,
        since front ends only ever take the supervisor's, in every front end, restarted ones included."""
        from .frontend.auth import SecurityFileError

        if self._keys is None:
            return False
        before = self._keys.digests
        try:
            self._keys.reload()
        except SecurityFileError as e:
            log.error("SIGHUP: API keys not reloaded, those in force stay: %s", e)
            return False
        if self._keys.digests == before:
            return False
        log.info("SIGHUP: %s", self._keys.describe())
        return True

    def _model_info(self, reader, engine) -> ModelInfo | None:
        """What engine 0 reads of the model (link.model_info.ModelInfo), once it has loaded it; ModelFormatError with
        the engine's words where the model is refused; None where the engine died first (its log says why) or a stop
        signal came."""
        from .model.spec import ModelFormatError

        while not self._stop_requested:
            ready = multiprocessing.connection.wait([reader, engine.sentinel], timeout=0.1)
            if reader in ready:
                try:
                    kind, value = reader.recv()
                except EOFError:  # the engine died before it sent anything
                    return None
                if kind == "refused":
                    raise ModelFormatError(value)
                return value
            if engine.sentinel in ready:
                return None
        return None

    def _run(self, devices: list[str | None], workers: int, run_dir: Path) -> int:
        s = self.settings
        endpoints = [str(run_dir / f"engine-{i}.sock") for i in range(len(devices))]
        states = [self._ctx.Value("i", wire.LOADING, lock=False) for _ in devices]
        roles = frontend_roles(workers, s.grpc_port is not None, s.grpc_workers)  # each front end's, by index
        threads = max(1, (host_cores() - len(roles)) // len(devices))  # torch threads of a CPU engine
        self._run_dir = run_dir
        generation = self._shared_generation = self._ctx.Value("i", self._generation, lock=False)

        # A child started again after a reload gets the settings as they are now, and the generation they are.
        def start_engine(i: int, info_to=None) -> multiprocessing.process.BaseProcess:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(endpoints[i])  # a dead engine's socket file: the new one binds the same path
            states[i].value = wire.LOADING
            config = (generation, self._generation)
            p = self._ctx.Process(
                target=_engine_main,
                args=(self.settings, i, endpoints[i], states[i], devices[i], str(run_dir), threads, config, info_to),
                name=f"engine-{i}",
            )
            with signals_held_for_children():
                p.start()
            return p

        # Engine 0 sends what the front ends must know of the model once it has read it; the front ends start then,
        # while the engines compile and warm up.
        reader, writer = self._ctx.Pipe(duplex=False)
        for i in range(len(devices)):
            self.engines.append(start_engine(i, writer if i == 0 else None))
        writer.close()
        try:
            info = self._model_info(reader, self.engines[0])
        except BaseException:  # a refused model (or an interrupt): no engine is left running behind the message
            _stop(self.engines, time.monotonic() + ENGINE_STOP_MIN_S)
            raise
        finally:
            reader.close()
        if info is None:
            if self._stop_requested:
                return self._shutdown(0)
            self.engines[0].join(1.0)  # its pipe closed as it died: its exit code once it is reaped
            log.error("engine 0 exited with %s before it had read the model (its log above says why); stopping the "
                      "service", _exit_status(self.engines[0].exitcode))  # fmt: skip
            return self._shutdown(1)
        from .metrics import SupervisorMetrics

        self._model_name = info.name
        self._metrics = SupervisorMetrics(info.name)  # every reload outcome visible at 0 from the start

        # A front end started again (a crash, an OOM kill) gets the keys in force now, never the keys file's content.
        listening = [self._ctx.Value("b", 0, lock=False) for _ in roles]

        def start_frontend(k: int) -> multiprocessing.process.BaseProcess:
            config = (generation, self._generation)
            keys = self._keys.in_force()
            listening[k].value = 0
            p = self._ctx.Process(
                target=_frontend_main,
                args=(self.settings, info, endpoints, states, str(run_dir), k, config, keys, listening[k], roles[k]),
                name=f"frontend-{k}",
            )
            with signals_held_for_children():
                p.start()
            return p

        for k in range(len(roles)):
            self.frontends.append(start_frontend(k))
        scheme = "https" if s.tls else "http"
        grpc_only = f" and {s.grpc_workers} gRPC front end(s)" if roles[-1] == GRPC else ""
        log.info(
            "fusedserve: %s on %s, %d engine(s) %s, %d front end(s)%s, %s://%s:%d",
            info.name, s.mode, len(devices), [d if d is not None else "cpu" for d in devices], workers, grpc_only,
            scheme, s.host, s.port,
        )  # fmt: skip
        from .console import TerminalProgress, ready_banner
        from .link.startup_progress import read_progress

        bar = TerminalProgress(sys.stderr)  # a terminal: the engines' start-up progress, redrawn in place

        code = 0
        while not self._stop_requested:
            sentinels = [p.sentinel for p in self.engines + self.frontends]
            multiprocessing.connection.wait(sentinels, timeout=0.1)
            if self._reload_requested:
                self._reload_requested = False
                self.reload()
            # Ready once every engine is and every front end listens: the banner's URLs then take connections.
            if not self._announced and all(st.value == wire.READY for st in states) and all(f.value for f in listening):
                self._announced = True
                bar.clear()
                log.info("%s", ready_banner(s, len(devices)))
            elif not self._announced:
                bar.update(lambda: read_progress(run_dir))
            if self._stop_requested:  # an engine the stop signal reached too (a signal to the group) stays down
                break
            dead = [(i, p) for i, p in enumerate(self.engines) if not p.is_alive()]
            for i, p in dead:
                _forget_process(p.pid)
                if self._restart_engine(i, p.exitcode, states[i].value):
                    self.engines[i] = start_engine(i)
                    self._announced = False  # "ready" is logged again once every engine is back
                    continue
                if states[i].value not in (wire.FAILED_START, wire.BROKEN):
                    states[i].value = wire.STOPPED
                code = 1
            if code:
                # Front ends see the engine gone within STATE_POLL_S and answer 503; let load balancers see
                # /health/ready fail before the port closes.
                time.sleep(ENGINE_DEATH_DRAIN_S)
                break
            for k, p in enumerate(self.frontends):
                if p.is_alive():
                    continue
                _forget_process(p.pid)
                if p.exitcode == STARTUP_FAILED:
                    log.error("front end %d could not start (exit %d, its log above says why); "
                              "starting it again would fail the same way: stopping", k, p.exitcode)  # fmt: skip
                    code = 1
                    break
                now = time.monotonic()
                self._restarts = [t for t in self._restarts if now - t < RESTART_WINDOW_S] + [now]
                if len(self._restarts) > MAX_RESTARTS:
                    log.error("front end %d exited with code %s, the %d-th time in %g s; stopping",
                              k, p.exitcode, len(self._restarts), RESTART_WINDOW_S)  # fmt: skip
                    code = 1
                    break
                log.error("front end %d exited with code %s; starting it again", k, p.exitcode)
                self.frontends[k] = start_frontend(k)
            if code:
                break
        return self._shutdown(code)

    def _restart_engine(self, i: int, exitcode: int | None, state: int) -> bool:
        """Whether engine i, just dead, is started again (and why not, logged)."""
        if state in (wire.FAILED_START, wire.BROKEN):
            why = "could not start" if state == wire.FAILED_START else "hit a sticky device error"
            log.error("engine %d exited with code %s: it %s; stopping the service", i, exitcode, why)
            return False
        now = time.monotonic()
        self._engine_deaths = [t for t in self._engine_deaths if now - t < ENGINE_DEATH_WINDOW_S] + [now]
        if len(self._engine_deaths) >= MAX_ENGINE_DEATHS:
            log.error(
                "engine %d exited with code %s, engine death %d within %g s; stopping the service",
                i, exitcode, len(self._engine_deaths), ENGINE_DEATH_WINDOW_S,
            )  # fmt: skip
            return False
        log.error("engine %d exited with code %s; starting it again", i, exitcode)
        if self._metrics is not None:
            self._metrics.engine_restarted(i)
        return True

    def _shutdown(self, code: int) -> int:
        """Front ends first (they stop accepting and answer what they accepted), then the engines."""
        deadline = time.monotonic() + self.settings.drain_delay_s + self.settings.shutdown_grace_s
        clean = _stop(self.frontends, deadline)
        clean = _stop(self.engines, max(deadline, time.monotonic() + ENGINE_STOP_MIN_S)) and clean
        code = code or (0 if clean else 1)
        log.info("fusedserve stopped (exit %d)", code)
        return code


def _exit_status(code: int | None) -> str:
    """A child's end as a log line says it: "code 3", "signal SIGKILL" (multiprocessing's negative codes)."""
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
    return f"code {code}"


def frontend_roles(workers: int, grpc: bool, grpc_workers: int) -> list[str]:
    """What each front end serves, by index: `workers` HTTP ones, each serving gRPC too where gRPC is on and
    GRPC_WORKERS is 0; otherwise GRPC_WORKERS more after them serving gRPC alone."""
    if not grpc:
        return [HTTP] * workers
    if grpc_workers == 0:
        return [HTTP_AND_GRPC] * workers
    return [HTTP] * workers + [GRPC] * grpc_workers


# The children's targets, named here: the supervisor never runs a model, and importing the engine to hand
# multiprocessing its entry point imported the kernels and Triton in this process too (0.5 CPU-s a start).
def _engine_main(*args) -> None:
    from .engine.core import engine_main

    engine_main(*args)


def _frontend_main(*args) -> None:
    from .frontend.app import frontend_main

    frontend_main(*args)


def _stop(procs, deadline: float) -> bool:
    """SIGTERM every process, wait for each until `deadline`, kill what is left; False if any had to be killed."""
    for p in procs:
        _signal(p, signal.SIGTERM)
    clean = True
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            log.error("%s did not stop in time; killing it", p.name)
            _signal(p, signal.SIGKILL)
            p.join(1.0)
            clean = False
    return clean


def _signal(p, sig: int) -> None:
    if p.pid is not None and p.is_alive():
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, sig)


def _forget_process(pid: int | None) -> None:
    if pid is not None:
        from .metrics import process_exited

        process_exited(pid)


def serve(settings: Settings, overrides: dict | None = None) -> int:
    """Run the service; `overrides`: the command line's settings, which beat the environment and the configuration
    file at every SIGHUP reload as at start."""
    return Supervisor(settings, overrides).run()
