"""`bench serve`'s run: start each system as a real server, run its phases within the time budget, stop it
with SIGTERM and check how it exited; then the report (bench/serve/report.py).

Order: the systems as given; by default the empty route first (so that `--rates auto` knows its peak), then the
empty gRPC server, fusedserve fused and unfused, and the eager app last, so that a run short of time loses the
optional first. For each system: its closed-loop phases (every rows x connections), its open-loop phases, and, for
the SIGTERM system (fused at N workers by default), a last phase in which SIGTERM is the stop. The empty gRPC
server (no HTTP) has only its single-row gRPC phases, at the connection counts of fusedserve's. Fused and unfused
at the same worker count are one A/B pair: both servers run at once (idle, a server costs the other nothing) and
take turns phase by phase, so the comparison is not spread over minutes of a host whose speed drifts.

Time budget: each phase costs warm-up + duration + what phases took beyond that so far (0.5 s before the
first: drain, /metrics, set-up); each start what the same kind of server took before in this run (the first
fused start on a GPU tunes kernels for every batch bucket: up to two minutes; later starts read the tuning
cache). Before each phase the run keeps back what the remaining systems' essential phases need (the
closed-loop phases at 1, 64 and 256 connections of the empty route and of fusedserve, the gRPC phases of fused
and of the empty gRPC server at N workers, and the SIGTERM phase)
and skips an optional phase (4 connections, the eager app, open loop) that would eat into it; every skipped
phase is listed in the report.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from ..gpu import gpu_name, results_dir, slug_of
from ..local_server import free_port
from . import images, v2
from .accounting import account, delta, scrape, server_split
from .gpu_busy import GpuSampler
from .loadgen import ClientPool, PhaseSpec, make_bodies, percentiles
from .plan import Plan, System
from .report import CDF_POINTS

REPO = Path(__file__).resolve().parents[2]
PHASE_OVERHEAD_S = 0.5
SHUTDOWN_GRACE_S = 30.0  # fusedserve's default FUSEDSERVE_SHUTDOWN_GRACE_S
STOP_WAIT_S = SHUTDOWN_GRACE_S + 15.0
# pil starts a fused fusedserve as its upstream first (bench/serve/apps/pil.py)
START_GUESS_S = {"empty": 3.0, "empty_grpc": 3.0, "eager": 12.0, "fused": 20.0, "unfused": 12.0, "pil": 25.0}
FIRST_FUSED_GPU_START_S = 120.0  # kernel tuning of every batch bucket, once per run (about 100 s seen on an H200)
ESSENTIAL_CONNECTIONS = (1, 64, 256)
# The API key every request carries, for a fusedserve started with keys on (its FUSEDSERVE_API_KEY or
# FUSEDSERVE_API_KEYS_FILE, passed on from this environment): from the environment, not a flag, so that it shows in
# no command line, results file or log. The other systems ignore the header.
API_KEY_ENV = "BENCH_API_KEY"
OPEN_FRACTIONS = (0.25, 0.5, 0.75)


def _die_with_parent():
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: no server outlives the benchmark


_PREEXEC = _die_with_parent()


def http_status(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


class Server:
    """One system as a process group on a free loopback port, its output in a log file."""

    def __init__(self, system: System, plan: Plan, log_dir: Path, tuning_cache: Path) -> None:
        self.system = system
        self.plan = plan
        self.log_dir = log_dir
        self.tuning_cache = tuning_cache
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.grpc_port = 0  # the Open Inference Protocol over gRPC: fusedserve's second port, empty_grpc's only one
        self.log_path = log_dir / f"{system.name}-{system.workers}.log"
        self._log = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        s, p = self.system, self.plan
        host = ["--host", "127.0.0.1", "--port", str(self.port)]
        if s.fusedserve:
            return [
                sys.executable, "-m", "service.cli", "serve", *host, "--mode", s.name, "--workers", str(s.workers),
                "--dtype", p.dtype, "--device", p.device, "--tuning-cache", str(self.tuning_cache),
                "--log-level", "info", "--grpc-port", str(self.grpc_port), "--model", p.model.path,
            ]  # fmt: skip
        if s.name == "pil":
            return [
                sys.executable, "-m", "bench.serve.apps.pil", *host, "--workers", str(s.workers), "--model",
                p.model.path, "--device", p.device, "--dtype", p.dtype, "--tuning-cache", str(self.tuning_cache),
            ]  # fmt: skip
        if s.grpc_only:
            return [sys.executable, "-m", f"bench.serve.apps.{s.name}", "--host", "127.0.0.1", "--port",
                    str(self.grpc_port), "--workers", str(s.workers)]  # fmt: skip
        return [
            sys.executable, "-m", "uvicorn", f"bench.serve.apps.{s.name}:app", *host, "--workers", str(s.workers),
            "--log-level", "info", "--no-access-log",
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        if self.system.name == "eager":
            env["BENCH_EAGER_DEVICE"] = self.plan.device
            env["BENCH_EAGER_DTYPE"] = self.plan.dtype
        return env

    def start(self) -> None:
        self.port = free_port()
        self.grpc_port = self.port if self.system.grpc_only else free_port()
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            self.argv(), env=self.env(), cwd=REPO, stdin=subprocess.DEVNULL, stdout=self._log,
            stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_PREEXEC,
        )  # fmt: skip

    def wait_ready(self, timeout_s: float) -> None:
        """Until GET /health/ready answers 200; a gRPC-only server, until its ServerReady says ready."""
        deadline = time.monotonic() + timeout_s
        probe = self._grpc_probe(timeout_s) if self.system.grpc_only else None
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"exited with {self.proc.returncode} before it was ready:\n{self.log_tail()}")
                if probe is None:
                    if http_status(self.url + "/health/ready") == 200:
                        return
                elif probe.poll() is not None:
                    if probe.returncode == 0:
                        return
                    raise TimeoutError(f"ServerReady not ready after {timeout_s:g} s:\n{self.log_tail()}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not ready after {timeout_s:g} s:\n{self.log_tail()}")
                time.sleep(0.05 if probe is not None else 0.2)
        finally:
            if probe is not None and probe.poll() is None:
                probe.kill()
                probe.wait(10)

    def _grpc_probe(self, timeout_s: float) -> subprocess.Popen:
        """The ServerReady poll, in a process of its own: this one forks the client processes (again after a
        failed phase), and a fork of a process that has used grpcio is not one its children can use grpcio in."""
        argv = [sys.executable, "-m", "bench.serve.apps.empty_grpc", "--host", "127.0.0.1", "--port",
                str(self.grpc_port), "--wait-ready", f"{timeout_s:g}"]  # fmt: skip
        return subprocess.Popen(
            argv, env=self.env(), cwd=REPO, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_PREEXEC,
        )  # fmt: skip

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as e:
            return f"<no log: {e}>"

    def signal_term(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGTERM)

    def wait_exit(self, timeout_s: float = STOP_WAIT_S) -> dict:
        """After SIGTERM: exit status, seconds, and whether the shutdown was graceful. uvicorn (0.29+) re-raises
        the signal after a graceful shutdown, so -SIGTERM with its 'Application shutdown complete' (or
        'Finished server process') in the log is graceful too."""
        t0 = time.monotonic()
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            self._close_log()
            return {"rc": None, "seconds": timeout_s, "graceful": False, "why": f"still running {timeout_s:g} s later"}
        seconds = time.monotonic() - t0
        leftover = self._group_alive(2.0)  # a worker or engine process that outlived its parent
        if leftover:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self._close_log()
        log = self.log_tail(200)
        reraised = rc == -signal.SIGTERM and ("Application shutdown complete" in log or "Finished server" in log)
        graceful = (rc == 0 or reraised) and not leftover
        why = "exit 0" if rc == 0 else ("SIGTERM re-raised by uvicorn after a clean shutdown" if reraised else "")
        if rc != 0 and not reraised:
            why = f"exit status {rc}"
        if leftover:
            why += "; processes of its group still ran 2 s after it exited (killed)"
        return {"rc": rc, "seconds": round(seconds, 3), "graceful": graceful, "why": why}

    def _group_alive(self, wait_s: float) -> bool:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                return True
            if time.monotonic() > deadline:
                return True
            time.sleep(0.05)

    def stop(self) -> dict:
        if self.proc is None:
            return {"rc": None, "seconds": 0.0, "graceful": False, "why": "never started"}
        if self.proc.poll() is None:
            self.signal_term()
        return self.wait_exit()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


# ------------------------------------------------------------------------------------------- phases


def phase_list(system: System, plan: Plan, sigterm_system: System | None) -> list[dict]:
    """The phases of one system, in order, each with a priority: 1 essential (the targets need it: kept while any
    time is left), 2 optional (run when the essential phases still to come fit after it; eager@1's are marked 3)."""
    if system.cannot_serve(plan.model):
        return []
    if system.grpc_only:
        return grpc_ceiling_phases(system, plan)
    if system.name == "pil":  # files in only: the encoded-image phases, against fused@N's own
        return [p for p in v2_phases(system, plan) if p["protocol"] in ("v2_jpeg", "v2_png")]
    essential_system = system.name != "eager"
    out = []
    for rows in plan.rows:
        for c in plan.connections:
            prio = 1 if essential_system and c in ESSENTIAL_CONNECTIONS else 2
            if system.name == "eager" and system.workers == 1:
                prio = 3
            out.append({"kind": "closed", "rows": rows, "connections": c, "priority": prio})
    if system.fusedserve:
        out += v2_phases(system, plan)
    elif system.name == "empty" and plan.model.image:  # the images-in ceiling: binary REST only (no gRPC route)
        out += [p for p in v2_phases(system, plan) if p["protocol"] == "v2_binary"]
    if system in plan.open_systems:
        out.append({"kind": "open", "rows": 1, "connections": plan.open_connections, "priority": 2})
    if plan.sigterm and system == sigterm_system:
        if plan.model.image:  # its only traffic: the v2 phases' requests
            out.append({"kind": "sigterm", "protocol": plan.v2[0], "rows": plan.v2_rows,
                        "connections": max(plan.connections), "priority": 1})  # fmt: skip
        else:
            out.append({"kind": "sigterm", "rows": 1, "connections": max(plan.connections), "priority": 1})
    return out


def v2_connections(plan: Plan) -> list[int]:
    """The connection counts of the Open Inference Protocol phases: the run's of 64 and more (its largest, in a run
    without any); an image model's, every one (its only phases)."""
    if plan.model.image:
        return list(plan.connections)
    return [c for c in plan.connections if c >= 64] or [max(plan.connections)]


def v2_phases(system: System, plan: Plan) -> list[dict]:
    """The Open Inference Protocol phases of a fusedserve system: binary REST and gRPC with v2_rows-row requests
    (the rows/s target), and gRPC with 1-row requests (against /predict's), closed loop at v2_connections.
    Essential for fused@N, the targets' system; optional elsewhere (6 phases of ~4 s each per system in the full
    run). Also the empty route's phases for an image model (binary REST only: phase_list)."""
    conns = v2_connections(plan)
    # An image model's targets compare fused with unfused at N, and images in with the empty route's ceiling: all
    # three essential there.
    targeted = ("fused", "unfused", "empty", "pil") if plan.model.image else ("fused",)
    prio = 1 if system.name in targeted and system.workers == plan.workers else 2
    out = []
    for protocol in plan.v2:
        # gRPC: v2_rows rows and 1 row (once with --v2-rows 1, a run narrowed to the single-row phases); an image
        # model's: its images a request only
        single = protocol == "v2_grpc" and not plan.model.image
        rows = tuple(dict.fromkeys((plan.v2_rows, 1))) if single else (plan.v2_rows,)
        for r in rows:
            out += [
                {"kind": "closed", "protocol": protocol, "rows": r, "connections": c, "priority": prio} for c in conns
            ]
    return out


def grpc_ceiling_phases(system: System, plan: Plan) -> list[dict]:
    """The empty gRPC server's phases: 1-row ModelInfer at v2_connections, as fused's single-row gRPC phases, and
    nothing else (2 phases of ~4 s in the full run). Essential at N workers, the ceiling the report sets beside
    issue 21's single-row gRPC target; optional at 1."""
    if "v2_grpc" not in plan.v2:
        return []
    prio = 1 if system.workers == plan.workers else 2
    return [
        {"kind": "closed", "protocol": "v2_grpc", "rows": 1, "connections": c, "priority": prio}
        for c in v2_connections(plan)
    ]


def pair_up(work: list[tuple[System, list[dict]]]) -> list[list[tuple[System, list[dict]]]]:
    """Groups of systems whose servers run at the same time: fused and unfused at the same worker count (at the
    first one's place in the order), every other system alone. A pair's phases interleave (interleave()), so the
    A/B comparison sees the same minutes of a host whose speed drifts by a quarter over a run."""
    groups: list[list[tuple[System, list[dict]]]] = []
    placed: dict[tuple[str, int], list] = {}
    for system, phases in work:
        if system.fusedserve:
            other = placed.get(("unfused" if system.name == "fused" else "fused", system.workers))
            if other is not None and len(other) == 1:
                other.append((system, phases))
                continue
        group = [(system, phases)]
        placed[(system.name, system.workers)] = group
        groups.append(group)
    return groups


def interleave(lists: list[list[dict]], rounds: int = 1) -> list[tuple[int, dict]]:
    """The order a group's phases run in, as (member, phase): a phase every member has runs once per member back to
    back, who goes first alternating from one such phase to the next, and the whole sequence of shared phases
    `rounds` times (each repeat a copy with its "round"); phases only some members have follow once, in each
    member's order, and a SIGTERM phase (which ends its server) comes last."""

    def key(p: dict) -> tuple:
        return p["kind"], p.get("protocol", "predict"), p["rows"], p["connections"]

    keys = [{key(p) for p in phases} for phases in lists]
    shared_keys = [
        key(p) for p in (lists[0] if lists else []) if p["kind"] != "sigterm" and all(key(p) in k for k in keys[1:])
    ]
    shared, own = [], []
    flip = 0
    for r in range(rounds if len(lists) > 1 else 1):
        for k in shared_keys:
            members = [(m, next(q for q in lists[m] if key(q) == k)) for m in range(len(lists))]
            if flip:
                members.reverse()
            flip ^= 1
            shared += [(m, {**p, "round": r} if r else p) for m, p in members]
    for m, phases in enumerate(lists):
        own += [(m, p) for p in phases if key(p) not in shared_keys]
    own.sort(key=lambda mp: mp[1]["kind"] == "sigterm")
    return shared + own


def pick_sigterm_system(plan: Plan) -> System | None:
    fs = [s for s in plan.systems if s.fusedserve]
    if not fs:
        return None
    fused = [s for s in fs if s.name == "fused"]
    return max(fused or fs, key=lambda s: s.workers)


def pick_perf_analyzer_system(plan: Plan) -> System | None:
    """The server perf_analyzer runs against: fused at N workers, the system the targets read; in a run without it (a
    smoke run), the SIGTERM system, before its SIGTERM phase."""
    fused_n = System("fused", plan.workers)
    return fused_n if fused_n in plan.systems else pick_sigterm_system(plan)


class Budget:
    def __init__(self, plan: Plan) -> None:
        self.t0 = time.monotonic()
        self.total = plan.time_budget_s
        self.plan = plan
        self.starts: dict[str, float] = {}
        self.overheads: list[float] = []  # seconds each phase took beyond warm-up + window: drain, scrapes, set-up

    def observe(self, phase_s: float) -> None:
        self.overheads.append(max(0.0, phase_s - self.plan.warmup_s - self.plan.duration_s))

    def left(self) -> float:
        return float("inf") if self.total <= 0 else self.total - (time.monotonic() - self.t0)

    def phase_cost(self, phase: dict, rates: int = 1) -> float:
        extra = sum(self.overheads) / len(self.overheads) if self.overheads else PHASE_OVERHEAD_S
        per = self.plan.warmup_s + self.plan.duration_s + extra
        return per * (rates if phase["kind"] == "open" else 1)

    def start_cost(self, system: System) -> float:
        if system.name in self.starts:
            return self.starts[system.name] + 2.0
        if self.plan.device == "cuda" and system.name == "fused" and "fused" not in self.starts:
            return FIRST_FUSED_GPU_START_S
        return START_GUESS_S[system.name] + (2.0 if system.workers > 1 else 0.0)

    def reserve(self, later: list[tuple[System, list[dict]]]) -> float:
        """What the essential phases still to come need, their servers' starts included."""
        total = 0.0
        for system, phases in later:
            ess = [p for p in phases if p["priority"] == 1]
            if ess:
                total += self.start_cost(system) + 2.0 + sum(self.phase_cost(p) for p in ess)
        return total


def _latency_block(lat) -> dict:
    import numpy as np

    out = percentiles(lat)
    out["cdf"] = [float(v) for v in np.percentile(np.asarray(lat) * 1e3, CDF_POINTS)] if len(lat) else []
    return out


def run_phase(pool: ClientPool, server: Server, system: System, phase: dict, plan: Plan, bodies, rate: float = 0.0):
    # After a SIGTERM the server may take its whole grace period to answer what it accepted.
    drain = max(plan.drain_timeout_s, SHUTDOWN_GRACE_S + 5.0) if phase["kind"] == "sigterm" else plan.drain_timeout_s
    protocol = phase.get("protocol", "predict")
    port, path, headers = server.port, "/predict", b""
    if protocol == "v2_binary":
        head = v2.binary_header(phase["rows"], plan.model.input_shape, plan.input_dtype)
        path, headers = v2.rest_path(plan.model.name), f"Inference-Header-Content-Length: {len(head)}\r\n".encode()
    elif protocol == "v2_grpc":
        port, path = server.grpc_port, v2.GRPC_METHOD
    elif protocol in images.PROTOCOLS:  # encoded files in one BYTES tensor (binary REST)
        path, headers = v2.rest_path(plan.model.name), images.header()
    spec = PhaseSpec(
        host="127.0.0.1", port=port, path=path, bodies=tuple(bodies[protocol, phase["rows"]]),
        connections=phase["connections"], warmup_s=plan.warmup_s, duration_s=plan.duration_s, rate=rate,
        client=plan.client, drain_timeout_s=drain, seed=plan.seed, protocol=protocol, headers=headers,
        api_key=os.environ.get(API_KEY_ENV) or None,
    )  # fmt: skip
    readings: dict = {}
    sig: dict = {}
    timer: list[threading.Timer] = []
    gpu = GpuSampler() if plan.device == "cuda" else None

    def on_ready() -> None:
        if gpu is not None:
            gpu.start()  # ~0.2 s before the window: nvidia-smi's first line is out by then
        if system.fusedserve:
            readings["before"] = scrape(server.url)

    def on_start(start_at: float) -> None:
        if phase["kind"] != "sigterm":
            return

        def fire() -> None:
            sig["at"] = time.monotonic()
            server.signal_term()
            # Wait here, not after the window, so that the exit is timed from the signal.
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.proc.wait(STOP_WAIT_S)
                sig["exited"] = time.monotonic()

        t = threading.Timer(max(0.0, start_at + plan.duration_s / 2 - time.monotonic()), fire)
        t.start()
        timer.append(t)

    try:
        client = pool.run(spec, on_ready=on_ready, on_start=on_start)
    finally:
        if gpu is not None:
            gpu.stop()
    for t in timer:
        t.join()
    exit_info = None
    if phase["kind"] == "sigterm":
        exit_info = server.wait_exit(timeout_s=5.0 if "at" in sig else STOP_WAIT_S)
        if "exited" in sig:
            exit_info["seconds"] = round(sig["exited"] - sig["at"], 3)
            if exit_info["seconds"] > SHUTDOWN_GRACE_S:
                exit_info["graceful"] = False
                exit_info["why"] += f"; exited {exit_info['seconds']:.1f} s after SIGTERM, grace {SHUTDOWN_GRACE_S:g} s"
        server_delta = None
    else:
        readings["after"] = scrape(server.url) if system.fusedserve else None
        server_delta = delta(readings.get("before"), readings.get("after"))
    acc = account(client, server_delta, sigterm_at=sig.get("at"), has_metrics=system.fusedserve)
    if exit_info is not None and not exit_info["graceful"]:
        acc["problems"].append(f"server did not exit cleanly after SIGTERM: {exit_info['why']}")
    rows = phase["rows"]
    sent_bytes = sum(len(b) for b in spec.bodies) / len(spec.bodies)
    result = {
        "system": system.key,
        "name": system.name,
        "workers": system.workers,
        "kind": phase["kind"],
        "protocol": protocol,
        "rows": rows,
        "connections": phase["connections"],
        "round": phase.get("round", 0),
        "rate": rate or None,
        "duration_s": plan.duration_s,
        "elapsed_s": round(client["elapsed_s"], 4),
        "clients": client["processes"],
        "sent": client["sent"],
        "answered": client["answered"],
        "status": {str(k): v for k, v in client["status"].items()},
        "errors": client["errors"],
        "error_reasons": client.get("why", {}),
        "req_per_s": client["req_per_s"],
        "rows_per_s": client["req_per_s"] * rows,
        "request_bytes": round(sent_bytes),
        "request_mb_per_s": client["req_per_s"] * sent_bytes / 1e6,
        "gpu_util": gpu.window(client["start_at"], client["start_at"] + client["elapsed_s"]) if gpu else None,
        "client_cpu": client["client_cpu"],
        "latency_ms": _latency_block(client["latency"]),
        "server": server_split(server_delta),
        "accounting": acc,
        "lost": acc["lost"],
        "ok": not acc["problems"],
    }
    if phase["kind"] == "open":
        result["service_ms"] = percentiles(client["service"])
        result["backlog"] = client["backlog"]
        result["achieved_per_s"] = client["req_per_s"]
    if phase["kind"] == "sigterm":
        result["sigterm_after_s"] = round(sig["at"] - client["start_at"], 3) if "at" in sig else None
        result["exit"] = exit_info
        result["refused_after_sigterm"] = acc["refused_after_sigterm"]
    return result


def phase_label(p: dict, rate: float | None = None) -> str:
    """A phase (planned, or its result) as the progress lines and the skipped list name it."""
    what = f"{p['kind']} rows={p['rows']} conns={p['connections']}" + (f" rate={rate:.0f}" if rate else "")
    if p.get("protocol", "predict") != "predict":
        what += f" {p['protocol']}"
    if p.get("round"):
        what += f" (round {p['round'] + 1})"
    return what


def _describe(r: dict) -> str:
    lat = r["latency_ms"]
    p50 = "-" if lat["p50"] is None else f"{lat['p50']:.2f}"
    p99 = "-" if lat["p99"] is None else f"{lat['p99']:.2f}"
    what = phase_label(r, r["rate"])
    verdict = "ok" if r["ok"] else "LOST: " + "; ".join(r["accounting"]["problems"])
    return f"  {r['system']:<11} {what:<40} {r['req_per_s']:>9.0f} req/s  p50 {p50} p99 {p99} ms  {verdict}"


# ------------------------------------------------------------------------------------------- meta


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def meta(plan: Plan, command: str, gpu: str | None) -> dict:
    import platform

    from .loadgen import loop_name

    # COMMIT names it where the tree's .git is absent or stale (the lent GPU host's copy; tests/gpu_suite.sh reads
    # it too)
    commit = os.environ.get("COMMIT")
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = (
            commit
            or subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
            ).stdout.strip()
        )
    dists = ("torch", "triton", "fastapi", "starlette", "uvicorn", "orjson", "numpy", "uvloop", "httptools", "aiohttp")
    return {
        "command": command,
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "device": plan.device,
        "gpu": gpu,
        "slug": slug_of(gpu) if plan.device == "cuda" else "cpu",
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "versions": {d: _version(d) for d in dists},
        "commit": commit or None,
        "client": plan.client,
        "client_loop": loop_name(),
        "clients": plan.clients,
        "workers": plan.workers,
        "dtype": plan.dtype,
        "duration_s": plan.duration_s,
        "warmup_s": plan.warmup_s,
        "time_budget_s": plan.time_budget_s,
        "systems": [s.key for s in plan.systems],
        "connections": list(plan.connections),
        "rows": list(plan.rows),
        "v2": list(plan.v2),
        "v2_rows": plan.v2_rows,
        "model": {
            "name": plan.model.name,
            "path": plan.model.path,
            "input_shape": list(plan.model.input_shape),
            "input_dtype": plan.model.input_dtype,
            "image": plan.model.image,
        },
        "input_dtype": plan.input_dtype,
        "open_connections": plan.open_connections,
        "quick": plan.quick,
    }


# ------------------------------------------------------------------------------------------- run


def execute(plan: Plan, command: str) -> int:
    gpu = gpu_name() if plan.device == "cuda" else None
    if plan.device == "cuda" and not gpu:
        print("fusedserve bench serve: no CUDA device found (nvidia-smi and torch see none); "
              "pass --device cpu --quick for a smoke run", file=sys.stderr)  # fmt: skip
        return 2
    run = _Run(plan, command, gpu)
    try:
        run.all()
    finally:
        run.close()
    results = run.results
    results["meta"]["wall_s"] = round(time.monotonic() - run.budget.t0, 1)
    results["meta"]["peaks_req_per_s"] = run.peaks
    for r in results["phases"]:
        for p in r["accounting"]["problems"]:
            results["problems"].append(f"{r['system']} {r['kind']} rows={r['rows']} conns={r['connections']}: {p}")

    from .report import write_all

    out = plan.out or results_dir(results["meta"]["slug"])
    write_all(results, out)
    if results["problems"]:  # the servers' logs say why; the run's temporary directory goes with the host
        for log in sorted(run.tmp.glob("*.log")):
            shutil.copy(log, Path(out) / f"server-{log.name}")
        print(f"problems: the servers' logs copied to {out}/server-*.log", flush=True)
    return 1 if results["problems"] else 0


class _Run:
    """The run's state: budget, client pool, results, and the server being measured."""

    def __init__(self, plan: Plan, command: str, gpu: str | None) -> None:
        self.plan = plan
        self.budget = Budget(plan)
        self.results = {"meta": meta(plan, command, gpu), "servers": [], "phases": [], "skipped": [], "problems": []}
        self.tmp = Path(tempfile.mkdtemp(prefix="fusedserve-bench-serve-"))
        self.tuning_cache = plan.tuning_cache or self.tmp / "tuning.json"
        self.results["meta"]["logs"] = str(self.tmp)
        self.bodies = {("predict", rows): make_bodies(rows, 16, plan.seed) for rows in plan.rows}
        model, dt = plan.model, plan.input_dtype
        if any(s.fusedserve or s.grpc_only for s in plan.systems):
            for rows in {plan.v2_rows} if model.image else {plan.v2_rows, 1}:
                n = v2.body_count(rows, model.input_shape, dt)
                if "v2_binary" in plan.v2:
                    self.bodies["v2_binary", rows] = v2.binary_bodies(rows, n, plan.seed, model.input_shape, dt)[0]
                if "v2_grpc" in plan.v2:
                    self.bodies["v2_grpc", rows] = v2.grpc_bodies(rows, n, plan.seed, model.input_shape, dt, model.name)
                for protocol in (p for p in plan.v2 if p in images.PROTOCOLS):
                    self.bodies[protocol, rows] = images.bodies(protocol, rows, 8, plan.seed, model.input_shape[0])
        if model.image:
            why = f"{model.name} is an image model {model.input_shape}: its requests go through the v2 phases"
            self.skip("every system", "JSON /predict and open-loop phases", why)
        sigterm_system = pick_sigterm_system(plan)
        self.perf_analyzer_system = pick_perf_analyzer_system(plan)
        self.work = pair_up([(s, phase_list(s, plan, sigterm_system)) for s in plan.systems])
        self.peaks: dict[str, float] = {}
        self.live: list[Server] = []
        self.pool: ClientPool | None = None
        self.interrupted = False

    def skip(self, system: System | str, what: str, why: str) -> None:
        key = system if isinstance(system, str) else system.key
        self.results["skipped"].append({"system": key, "what": what, "why": why})

    def all(self) -> None:
        plan = self.plan
        groups = sum(len(p) for group in self.work for _, p in group)
        print(f"bench serve: {len(plan.systems)} systems, {groups} phase groups; {plan.clients} client processes "
              f"({plan.client}); budget {plan.time_budget_s:g} s; logs {self.tmp}", flush=True)  # fmt: skip
        self.pool = ClientPool(plan.clients)
        previous = {s: signal.signal(s, self._interrupt) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            for i, group in enumerate(self.work):
                if self.interrupted:
                    for system, _ in group:
                        self.skip(system, "every phase", "interrupted (SIGTERM/SIGINT)")
                    continue
                self.group(group, [member for later in self.work[i + 1 :] for member in later])
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        if self.interrupted:
            self.results["problems"].append("the run was interrupted before every phase ran")

    def _interrupt(self, signum, frame) -> None:
        """First SIGTERM/SIGINT: finish the phase under way, skip the rest, stop the server and write the report
        (a `timeout` around the run still leaves a report). A second one: stop at once."""
        if self.interrupted:
            raise KeyboardInterrupt
        self.interrupted = True
        print(f"bench serve: {signal.Signals(signum).name}: finishing the phase under way, then the report", flush=True)

    def group(self, members: list[tuple[System, list[dict]]], later: list) -> None:
        """Start each member's server (one after another: a first fused start tunes kernels on the GPU, and must have
        it alone), run their phases in interleave()'s order, and stop them."""
        budget = self.budget
        live: dict[System, tuple[Server, dict]] = {}  # member order
        for k, (system, phases) in enumerate(members):
            if not phases:  # an MLP-only app with an image model; empty_grpc without gRPC phases (cli refuses that)
                why = system.cannot_serve(self.plan.model) or "no phase of this system in the run"
                self.skip(system, "every phase", why)
                continue
            cheapest = min(budget.phase_cost(p) for p in phases)
            essential = any(p["priority"] == 1 for p in phases)
            need = budget.start_cost(system) + cheapest
            after = budget.reserve([*members[k + 1 :], *later])
            if budget.left() < need or (not essential and budget.left() - after < need):
                start_s, left_s = budget.start_cost(system), budget.left()
                why = f"time budget: start (~{start_s:.0f} s) and shortest phase need {need:.0f} s, {left_s:.0f} s left"
                self.skip(system, "every phase", why)
                continue
            started = self._start(system)
            if started is not None:
                live[system] = started
        schedule = interleave([phases for system, phases in members if system in live], self.plan.rounds)
        systems = list(live)
        for n, (k, phase) in enumerate(schedule):
            system = systems[k]
            server, info = live[system]
            what = phase_label(phase)
            if self.interrupted:
                self.skip(system, what, "interrupted")
                continue
            if server.proc.poll() is not None:
                if "exit" not in info:
                    why = f"exited ({server.proc.returncode}) before its phases ended"
                    info["exit"] = {"rc": server.proc.returncode, "seconds": 0.0, "graceful": False, "why": why}
                    self.results["problems"].append(f"{system.key} {why}")
                self.skip(system, what, "its server had exited")
                continue
            rest = [p for _, p in schedule[n + 1 :]]
            keep = budget.reserve(later) + sum(budget.phase_cost(p) for p in rest if p["priority"] == 1) + 2.0
            if phase["kind"] == "open":
                for rate, why in _open_rates(self.plan, system, self.peaks):
                    if why or budget.left() - keep < budget.phase_cost(phase):
                        self.skip(system, phase_label(phase, rate), why or "time budget")
                    else:
                        self.phase(server, system, phase, rate)
                continue
            cost = budget.phase_cost(phase)
            if budget.left() - keep < cost and (phase["priority"] > 1 or budget.left() < cost):
                self.skip(system, what, "time budget")
                continue
            if phase["kind"] == "sigterm":  # its server's last phase, run alone: the others stop first
                self._perf_analyzer(system, server, budget.left() - keep - cost)
                for other, (other_server, other_info) in live.items():
                    if other != system:
                        self._stop(other_server, other_info)
            r = self.phase(server, system, phase)
            if r and phase["kind"] == "closed" and phase["rows"] == 1 and r["protocol"] == "predict":
                self.peaks[system.key] = max(self.peaks.get(system.key, 0.0), r["req_per_s"])
            if r and phase["kind"] == "sigterm":
                info["exit"] = r["exit"]
        for system, (server, _) in live.items():  # a run without a SIGTERM phase
            self._perf_analyzer(system, server, budget.left() - budget.reserve(later))
        for server, info in live.values():
            self._stop(server, info)

    def _perf_analyzer(self, system: System, server: Server, seconds: float) -> None:
        """perf_analyzer against fused@N (pick_perf_analyzer_system(); perf_analyzer.py), once, where its binary runs:
        before that server's SIGTERM phase, or after its phases in a run without one; within `seconds`."""
        plan = self.plan
        if system != self.perf_analyzer_system or "perf_analyzer" in self.results or server.proc.poll() is not None:
            return
        from . import perf_analyzer

        protocols = tuple(p for p, v2 in (("http", "v2_binary"), ("grpc", "v2_grpc")) if v2 in plan.v2)
        if self.interrupted or seconds < 20 or not protocols or plan.perf_analyzer == "":
            why = ("interrupted" if self.interrupted else "--perf-analyzer none" if plan.perf_analyzer == ""
                   else "no --v2 protocol" if not protocols else "time budget")  # fmt: skip
            self.results["perf_analyzer"] = {"version": None, "runs": [], "skipped": [f"every run: {why}"],
                                             "problems": []}  # fmt: skip
            return
        http, grpc = server.url.removeprefix("http://"), f"127.0.0.1:{server.grpc_port}"
        rows = tuple(dict.fromkeys((1, plan.v2_rows)))
        pa = perf_analyzer.run(http, grpc, self.tmp / "perf_analyzer", binary=plan.perf_analyzer, model=plan.model.name,
                               protocols=protocols, rows=rows, concurrency=plan.connections,
                               time_budget_s=seconds)  # fmt: skip
        pa["system"] = system.key
        self.results["perf_analyzer"] = pa
        self.results["problems"] += pa["problems"]

    def _start(self, system: System) -> tuple[Server, dict] | None:
        server = Server(system, self.plan, self.tmp, self.tuning_cache)
        self.live.append(server)
        t_start = time.monotonic()
        try:
            server.start()
            server.wait_ready(self.plan.ready_timeout_s)
        except (RuntimeError, TimeoutError, OSError) as e:
            server.kill()
            self.live.remove(server)
            self.results["servers"].append({"system": system.key, "ready": False, "error": str(e)})
            self.results["problems"].append(f"{system.key} did not start: {str(e).splitlines()[0]}")
            print(f"{system.key}: did not start: {e}", flush=True)
            return None
        ready_s = time.monotonic() - t_start
        self.budget.starts[system.name] = max(self.budget.starts.get(system.name, 0.0), ready_s)
        print(f"{system.key}: ready in {ready_s:.1f} s on port {server.port}", flush=True)
        info = {"system": system.key, "ready": True, "ready_s": round(ready_s, 2), "port": server.port}
        self.results["servers"].append(info)
        return server, info

    def _stop(self, server: Server, info: dict) -> None:
        """SIGTERM, once, unless the server already exited (its SIGTERM phase, or a crash)."""
        if server not in self.live:
            return
        if "exit" not in info:
            info["exit"] = server.stop()
            if not info["exit"]["graceful"]:
                self.results["problems"].append(f"{info['system']} did not stop cleanly: {info['exit']['why']}")
        else:
            server.kill()  # reaps what is left; the SIGTERM phase already judged its exit
        self.live.remove(server)

    def phase(self, server: Server, system: System, phase: dict, rate: float = 0.0) -> dict | None:
        """Run one phase; a phase that cannot finish (a client process failed, /metrics did not answer) is a
        problem of the run, and the client pool is started afresh for the next one."""
        t0 = time.monotonic()
        try:
            r = run_phase(self.pool, server, system, phase, self.plan, self.bodies, rate)
            self.budget.observe(time.monotonic() - t0)
        except (RuntimeError, TimeoutError, OSError) as e:
            what = phase_label(phase, rate)
            self.results["problems"].append(f"{system.key} {what}: could not run: {type(e).__name__}: {e}")
            print(f"  {system.key:<11} {what}: could not run: {type(e).__name__}: {e}", flush=True)
            self.pool.close()
            self.pool = ClientPool(self.plan.clients)
            return None
        self.results["phases"].append(r)
        print(_describe(r), flush=True)
        return r

    def close(self) -> None:
        for server in self.live:
            server.kill()
        if self.pool is not None:
            self.pool.close()


def _round_rates(base: float, fractions) -> list[float]:
    step = 1000.0 if base >= 4000 else (100.0 if base >= 400 else 10.0)
    return sorted({max(step, round(base * f / step) * step) for f in fractions})


def _open_rates(plan: Plan, system: System, peaks: dict[str, float]) -> list[tuple[float, str | None]]:
    """[(rate, why skipped or None)]: --rates, or auto: 25, 50 and 75% of the empty route's closed-loop peak at N
    workers (the same rates for every system, so their latencies compare), or of the system's own peak without
    it. A rate above 1.1x the system's own closed-loop peak would only measure a growing backlog: skipped; with
    auto, a system too slow for every shared rate runs at 50 and 75% of its own peak instead."""
    own = peaks.get(system.key)
    if plan.rates is not None:
        rates = list(plan.rates)
    else:
        base = peaks.get(f"empty@{plan.workers}") or own
        if not base:
            return []
        rates = _round_rates(base, OPEN_FRACTIONS)
    out = []
    for rate in rates:
        if own and rate > 1.1 * own:
            out.append((rate, f"above 1.1x its closed-loop peak ({own:.0f} req/s)"))
        else:
            out.append((rate, None))
    if plan.rates is None and own and all(why for _, why in out):
        out += [(rate, None) for rate in _round_rates(own, (0.5, 0.75))]
    return out
