"""Helpers for end-to-end tests: the real service under real uvicorn, and a real Prometheus.

Every process runs on 127.0.0.1 on a port of its own (free_port), is waited for with a bounded
timeout, and is always stopped (terminate, then kill). Its output goes to a log file; a start that
fails raises with the log, and `dump_new_logs()` prints what the live processes logged since the
last call, which the test modules do after each test so that pytest shows it next to a failure.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .binaries import require_binary

REPO = Path(__file__).resolve().parents[1]
DEFAULT_READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0

_live: list[ManagedProcess] = []


def _die_with_parent_fn():
    """A preexec_fn that has Linux SIGKILL the child when this process dies (even by os._exit, as a
    pytest-timeout in thread mode does), so no server outlives the test run; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, before any fork
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1
    return lambda: prctl(pr_set_pdeathsig, signal.SIGKILL)


_DIE_WITH_PARENT = _die_with_parent_fn()


# Ports for the servers under test come from below the kernel's ephemeral range, one block per xdist worker. A port
# from bind(0) is an ephemeral one: between its release and the server's bind, the kernel may hand it to any
# outgoing connection (the tests open thousands) or to another worker's bind(0), and the server's start then fails
# on a taken port. Below the range nothing takes ports but explicit binds, and the workers' blocks do not overlap.
_PORT_BLOCK = 400
_PORT_BASE = 12000


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0  # not Linux: no range known, so bind(0)


def _worker_ports() -> Iterator[int]:
    """This worker's block, walked round from a random start (two pytest runs at once on one machine meet less)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    first = _PORT_BASE + _PORT_BLOCK * (int(worker) if worker.isdigit() else 0)
    if first + _PORT_BLOCK > _ephemeral_low():
        return
    start = int.from_bytes(os.urandom(2), "little") % _PORT_BLOCK
    while True:
        for i in range(_PORT_BLOCK):
            yield first + (start + i) % _PORT_BLOCK
        start = 0


_ports = _worker_ports()


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))  # no SO_REUSEADDR: a port in TIME_WAIT is passed over too
        except OSError:
            return False
        return True


def free_port() -> int:
    """A port free on 127.0.0.1 now that no other worker of this run and no outgoing connection will take: the
    next bindable one of this worker's block, or, where the block would reach the ephemeral range, bind(0)'s."""
    for _, port in zip(range(_PORT_BLOCK), _ports, strict=False):
        if _bindable(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Read at import, before any test ran: an in-process test of a CPU app sets TRITON_INTERPRET=1 in this
# process (service.frontend.app.prepare_backend must, before kernels are defined), and a CUDA server started
# later from the same worker would inherit it and run its kernels interpreted (seen on an H200).
_TRITON_INTERPRET_AT_START = os.environ.get("TRITON_INTERPRET")
# Kernel tuning changes which config runs, never a result: the GPU session switches it off
# (FUSEDSERVE_TUNING=false) so that servers warm up in seconds, not 10-50 s per batch bucket.
_PASSED_THROUGH = ("FUSEDSERVE_TUNING", "FUSEDSERVE_TUNING_TIMING", "FUSEDSERVE_TUNING_CACHE")


def service_env(**env: str | int | float) -> dict[str, str]:
    """The test process's environment without any FUSEDSERVE_* (a stray one would change the
    server or, unknown, stop it) but the tuning switches, plus `env`: keys without the prefix get it
    (max_delay_ms=20)."""
    out = {k: v for k, v in os.environ.items() if not k.startswith("FUSEDSERVE_") or k in _PASSED_THROUGH}
    out.pop("TRITON_INTERPRET", None)
    if _TRITON_INTERPRET_AT_START is not None:
        out["TRITON_INTERPRET"] = _TRITON_INTERPRET_AT_START
    out["PYTHONUNBUFFERED"] = "1"
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    # No drain delay unless a test asks for one: every stop of a test's server would wait its 5 s default.
    out["FUSEDSERVE_DRAIN_DELAY_S"] = "0"
    for k, v in env.items():
        key = k if k.startswith("FUSEDSERVE_") else "FUSEDSERVE_" + k.upper()
        out[key] = str(v)
    return out


class ManagedProcess:
    """A subprocess with its stdout+stderr in a log file, stopped for sure by stop()."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], cwd: Path, log_path: Path):
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in stop())
        self._shown = 0
        self.proc = subprocess.Popen(
            argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop() reaches any children too
            preexec_fn=_DIE_WITH_PARENT,
        )  # fmt: skip
        _live.append(self)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError as e:
            return f"<cannot read {self.log_path}: {e}>"

    def new_log(self) -> str:
        text = self.log()
        new, self._shown = text[self._shown :], len(text)
        return new

    def describe(self) -> str:
        return f"{self.name} (pid {self.proc.pid}, exit {self.proc.poll()}): {' '.join(self.argv)}\n{self.log()}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(STOP_TIMEOUT_S)
        self._log.close()

    def wait_http(
        self, url: str, timeout_s: float, ok=lambda r: r.status_code == 200, client_args: dict | None = None
    ) -> httpx.Response:
        """Poll `url` until ok(response); raises (with the log) when the process exits or time runs out.
        `client_args`: httpx.Client's TLS arguments (verify, cert) for an https URL."""
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        with httpx.Client(timeout=2.0, **(client_args or {})) as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited before {url} was ready\n{self.describe()}")
                try:
                    r = client.get(url)
                    if ok(r):
                        return r
                    last = f"HTTP {r.status_code}: {r.text[:300]}"
                except httpx.HTTPError as e:
                    last = f"{type(e).__name__}: {e}"
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{url} not ready after {timeout_s:g} s (last: {last})\n{self.describe()}")
                time.sleep(0.1)


def dump_new_logs() -> None:
    """Print what each process logged since the last call (pytest shows it on failure); processes
    stopped since then are printed one last time and forgotten."""
    for p in list(_live):
        new = p.new_log()
        if new.strip():
            state = "running" if p.proc.poll() is None else f"exited {p.proc.returncode}"
            print(f"----- {p.name} ({state}) log -----\n{new}", end="" if new.endswith("\n") else "\n")
        if p.proc.poll() is not None:
            _live.remove(p)


def _bind_failed(p: ManagedProcess) -> bool:
    return p.proc.poll() is not None and "address already in use" in p.log().lower()


class Server:
    """One `python -m service.cli serve` process; `url` is its base URL once ready. `mode` None: no --mode, so the
    environment or the configuration file chooses it (a SIGHUP reload can change it then). A server with `tls_cert`
    in its env is https, polled with `client_args` (httpx's verify and cert)."""

    def __init__(
        self, mode: str | None, log_dir: Path, env: dict[str, str | int | float], client_args: dict | None = None
    ):
        self.mode = mode
        self.env = env
        self.log_dir = log_dir
        self.port = 0
        self.url = ""
        self.process: ManagedProcess | None = None
        self.client_args = client_args or {}

    def start(self) -> None:
        self.port = free_port()
        scheme = "https" if self.env.get("tls_cert") or self.env.get("FUSEDSERVE_TLS_CERT") else "http"
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        if self.mode is not None:
            argv += ["--mode", self.mode]
        # cwd: an empty directory, so a developer's .env in the checkout cannot change the server.
        self.process = ManagedProcess(
            f"fusedserve-{self.mode or 'config'}:{self.port}", argv, service_env(**self.env), self.log_dir,
            self.log_dir / f"fusedserve-{self.mode or 'config'}-{self.port}.log",
        )  # fmt: skip

    def wait_ready(self, timeout_s: float) -> None:
        """Wait for /health/ready == 200, then for the supervisor's ready banner where it logs at info (the first
        front end answers before the others, or a gRPC-only one, listen; the banner waits for all); restarts once on
        another port if the port was taken meanwhile."""
        assert self.process is not None
        for attempt in range(3):
            try:
                deadline = time.monotonic() + timeout_s
                self.process.wait_http(self.url + "/health/ready", timeout_s, client_args=self.client_args)
                level = str(self.env.get("log_level", self.env.get("FUSEDSERVE_LOG_LEVEL", "info")))
                while level in ("info", "debug") and "fusedserve ready" not in self.process.log():
                    if self.process.proc.poll() is not None or time.monotonic() > deadline:
                        raise TimeoutError(f"no ready banner after {timeout_s:g} s\n{self.process.describe()}")
                    time.sleep(0.05)
                return
            except RuntimeError:
                if attempt == 2 or not _bind_failed(self.process):
                    raise
                self.process.stop()
                self.start()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    def log(self) -> str:
        return self.process.log() if self.process else ""


def _log_dir(log_dir: Path | None) -> Path:
    return Path(tempfile.mkdtemp(prefix="fusedserve-e2e-")) if log_dir is None else log_dir


@contextlib.contextmanager
def running_servers(
    specs: dict[str, tuple], log_dir: Path | None = None, timeout_s: float = DEFAULT_READY_TIMEOUT_S
) -> Iterator[dict[str, Server]]:
    """Start several servers at once ({key: (mode, env)}, or (mode, env, client_args) for a TLS server), wait until
    all are ready, stop all on exit."""
    log_dir = _log_dir(log_dir)
    servers = {
        key: Server(spec[0], log_dir, spec[1], spec[2] if len(spec) > 2 else None) for key, spec in specs.items()
    }
    try:
        for s in servers.values():
            s.start()
        deadline = time.monotonic() + timeout_s
        failure = None
        for s in servers.values():
            try:
                s.wait_ready(max(1.0, deadline - time.monotonic()))
            except (RuntimeError, TimeoutError) as e:
                failure = f"server did not become ready: {e}"
                break
        if failure:
            pytest.fail(failure, pytrace=False)
        yield servers
    finally:
        for s in servers.values():
            s.stop()


@contextlib.contextmanager
def running_server(
    mode: str, log_dir: Path | None = None, timeout_s: float = DEFAULT_READY_TIMEOUT_S, client_args=None, **env
):
    """`python -m service.cli serve --mode MODE` on a free loopback port with FUSEDSERVE_* from `env`
    (max_delay_ms=20 or FUSEDSERVE_MAX_DELAY_MS=20); yields the base URL once /health/ready is 200. `client_args`:
    httpx's TLS arguments to poll an https server with."""
    with running_servers({"s": (mode, env, client_args)}, log_dir, timeout_s) as servers:
        yield servers["s"].url


# ---------------------------------------------------------------------------------- Prometheus

PROMETHEUS_MISSING = "the `prometheus` binary is not installed (apt-get install prometheus)"


@contextlib.contextmanager
def running_prometheus(
    config_text: str, work_dir: Path, timeout_s: float = 60.0
) -> Iterator[tuple[str, ManagedProcess]]:
    """A real Prometheus with `config_text` on a free loopback port; yields (base URL, process).

    `config_text` may contain `{listen}`, replaced by the address Prometheus listens on (for its
    self-scrape job)."""
    binary = require_binary("prometheus", PROMETHEUS_MISSING)
    for attempt in range(3):
        port = free_port()
        listen = f"127.0.0.1:{port}"
        config = work_dir / f"prometheus-{port}.yml"
        config.write_text(config_text.replace("{listen}", listen))
        data = work_dir / f"tsdb-{port}"
        data.mkdir()
        argv = [
            binary, f"--config.file={config}", f"--storage.tsdb.path={data}", f"--web.listen-address={listen}",
            "--log.level=info",
        ]  # fmt: skip
        proc = ManagedProcess(
            f"prometheus:{port}", argv, dict(os.environ), work_dir, work_dir / f"prometheus-{port}.log"
        )
        try:
            failure = None
            try:
                proc.wait_http(f"http://{listen}/-/ready", timeout_s)
            except (RuntimeError, TimeoutError) as e:
                failure = f"prometheus did not become ready: {e}"
            if failure and attempt < 2 and _bind_failed(proc):
                continue
            if failure:
                pytest.fail(failure, pytrace=False)
            yield f"http://{listen}", proc
            return
        finally:
            proc.stop()
