"""A/B in one service under load: FUSEDSERVE_MODE=ab against fused alone, the shadow's cost, and a SIGHUP switch.

    python -m bench.serve.ab                     # on the GPU host: ~4 minutes (`fusedserve bench ab` once registered)
    python -m bench.serve.ab --device cpu --quick --workers 1 --out /tmp/ab   # smoke on the CPU: ~2 minutes

Three fusedserve systems at N workers run at the same time on one GPU and take turns phase by phase (the order
rotating each round), so the comparison sees the same minutes of the host: `fused` (FUSEDSERVE_MODE=fused), `ab`
(FUSEDSERVE_MODE=ab: both executors, each batch run by one) and `ab_shadow` (ab with FUSEDSERVE_SHADOW_EVERY=16).
Each is loaded closed loop with 1-row and 64-row /predict bodies at each --connections, --rounds times; the report
compares them on the median of the rounds' throughput. Then the switch: a fourth service started in fused mode from
a configuration file (FUSEDSERVE_CONFIG_FILE), under 1-row load at --switch-connections, gets the file rewritten and
SIGHUP at a third of the window (to unfused, an executor it must load while it serves) and at two thirds (back to
fused); a probe connection outside the load sends one request every PROBE_S and reads X-Fusedserve-Mode, so each
switch's delay is the time from the signal to the first probe answer in the new mode, after which no answer in the
old one came back.

Targets (bench/README.md): ab within 5% of fused at 1 and 64 rows, ab_shadow within 3% of ab, and the switch loses
nothing (sent = answered, no 5xx, the server's counters agree: bench/serve_accounting.py) and takes effect within 2 s.
Writes ab_<gpu>.md and .json under --out; exit 1 when a phase lost anything or a target was missed.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.gpu import gpu_name, slug_of

REPO = Path(__file__).resolve().parents[2]
# fusedserve's systems: the options each is served with (beside host, port, workers, device, dtype, cache). bench
# serve's Server.argv can take them from serve_args(), so that its --systems accept ab and ab_shadow too.
SERVE_ARGS = {
    "fused": ["--mode", "fused"],
    "unfused": ["--mode", "unfused"],
    "ab": ["--mode", "ab"],
    "ab_shadow": ["--mode", "ab", "--shadow-every", "16"],
}
SYSTEMS = ("fused", "ab", "ab_shadow")  # this benchmark's, in turns
PROBE_S = 0.01
TARGETS = {"ab/fused": 0.95, "ab_shadow/ab": 0.97, "switch_s": 2.0}


def serve_args(name: str) -> list[str]:
    """The `fusedserve serve` options of a fusedserve system (the hook for bench serve's own argv)."""
    return list(SERVE_ARGS[name])


class Service:
    """`python -m service.cli serve` on a free loopback port, its output in a log file, its process group stopped."""

    def __init__(self, name: str, args: argparse.Namespace, log_dir: Path, extra: list[str], env: dict | None = None):
        from ..local_server import free_port

        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [
            sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
            "--workers", str(args.workers), "--device", args.device, "--dtype", args.dtype,
            "--tuning-cache", str(args.tuning_cache), "--log-level", "info", *extra,
        ]  # fmt: skip
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed in stop())
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(argv, env=full_env, cwd=log_dir, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def wait_ready(self, timeout_s: float) -> None:
        from ..local_server import get

        end = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if get(self.url + "/health/ready", 2.0)[0] == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > end:
                raise TimeoutError(f"{self.name} not ready after {timeout_s:g} s:\n{self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(40)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


def _phase(pool, service: Service, rows: int, connections: int, args, bodies, on_start=None, probe=None) -> dict:
    """One closed-loop window on `service`, with the server's counters read around it and the accounting. `probe`:
    a Probe started by `on_start`, stopped here before the counters are read again, its answers taken off them."""
    from .accounting import account, delta, scrape
    from .loadgen import PhaseSpec, percentiles

    spec = PhaseSpec(
        host="127.0.0.1", port=service.port, path="/predict", bodies=tuple(bodies[rows]), connections=connections,
        warmup_s=args.warmup, duration_s=args.duration, client="raw", drain_timeout_s=10.0,
    )  # fmt: skip
    readings = {}
    try:
        client = pool.run(spec, on_ready=lambda: readings.update(before=scrape(service.url)), on_start=on_start)
    finally:
        if probe is not None:
            probe.stop.set()
            probe.join(30)
    server = delta(readings["before"], scrape(service.url))
    if probe is not None:
        server["outcome:ok"] -= sum(1 for a in probe.answers if a[2] == 200)
    acc = account(client, server)
    lat = percentiles(client["latency"])
    return {
        "system": service.name, "rows": rows, "connections": connections, "req_per_s": client["req_per_s"],
        "sent": client["sent"], "answered": client["answered"], "p50_ms": lat["p50"], "p99_ms": lat["p99"],
        "problems": acc["problems"], "ok": not acc["problems"],
    }  # fmt: skip


class Probe(threading.Thread):
    """One keep-alive connection outside the load: a 1-row /predict every PROBE_S, each answer's mode recorded."""

    def __init__(self, port: int, body: bytes):
        super().__init__(daemon=True)
        self.port, self.body = port, body
        self.answers: list[tuple[float, float, int, str | None]] = []  # (sent, answered, status, mode)
        self.stop = threading.Event()

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        headers = {"content-type": "application/json"}
        while not self.stop.is_set():
            sent = time.monotonic()
            try:
                conn.request("POST", "/predict", self.body, headers)
                r = conn.getresponse()
                r.read()
                self.answers.append((sent, time.monotonic(), r.status, r.getheader("x-fusedserve-mode")))
            except (OSError, http.client.HTTPException) as e:
                self.answers.append((sent, time.monotonic(), -1, type(e).__name__))
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            time.sleep(max(0.0, sent + PROBE_S - time.monotonic()))
        conn.close()


def switch_delay(answers, at: float, mode: str, until: float = float("inf")) -> float | None:
    """Seconds from `at` (the signal) to the probe answer from which every answer to a request sent before `until`
    (the next signal) is in `mode`; None if there is none."""
    later = [(done, m) for sent, done, status, m in answers if at <= sent < until and status == 200]
    for k, (done, _) in enumerate(later):
        if all(m == mode for _, m in later[k:]):
            return done - at
    return None


def run_switch(pool, args, log_dir: Path, bodies) -> dict:
    """The SIGHUP phase: fused -> unfused -> fused under load (module docstring)."""
    conf = log_dir / "switch.env"
    conf.write_text("FUSEDSERVE_MODE=fused\n")
    service = Service("switch", args, log_dir, [], env={"FUSEDSERVE_CONFIG_FILE": str(conf)})
    try:
        service.wait_ready(args.ready_timeout)
        probe = Probe(service.port, bodies[1][0])
        signals: list[tuple[float, str]] = []
        timers = []

        def on_start(start_at: float) -> None:
            probe.start()
            for frac, mode in ((1 / 3, "unfused"), (2 / 3, "fused")):

                def fire(mode=mode) -> None:
                    conf.write_text(f"FUSEDSERVE_MODE={mode}\n")
                    signals.append((time.monotonic(), mode))
                    os.kill(service.proc.pid, signal.SIGHUP)

                t = threading.Timer(max(0.0, start_at + frac * args.switch_duration - time.monotonic()), fire)
                t.start()
                timers.append(t)

        saved = args.duration
        args.duration = args.switch_duration
        try:
            result = _phase(pool, service, 1, args.switch_connections, args, bodies, on_start=on_start, probe=probe)
        finally:
            args.duration = saved
            for t in timers:
                t.join()
        ends = [at for at, _ in signals[1:]] + [float("inf")]
        delays = {
            mode: switch_delay(probe.answers, at, mode, end) for (at, mode), end in zip(signals, ends, strict=True)
        }
        failed = [a for a in probe.answers if a[2] != 200]
        if failed:
            result["problems"].append(f"probe: {len(failed)} answers other than 200: {failed[:3]}")
        for mode, d in delays.items():
            if d is None or d > TARGETS["switch_s"]:
                result["problems"].append(f"switch to {mode}: not in effect within {TARGETS['switch_s']:g} s ({d})")
        result.update(system="switch", delays_s=delays, probes=len(probe.answers), ok=not result["problems"])
        return result
    finally:
        service.stop()


def execute(args: argparse.Namespace, command: str) -> int:
    from .loadgen import ClientPool, make_bodies

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="fusedserve-bench-ab-"))
    args.tuning_cache = args.tuning_cache or log_dir / "tuning.json"
    bodies = {rows: make_bodies(rows) for rows in sorted({1, *args.rows})}
    results: list[dict] = []
    services: list[Service] = []
    clients = args.clients or max(2, min(4, (os.cpu_count() or 4) - args.workers - 2))
    with ClientPool(clients) as pool:
        try:
            # One at a time: three cold starts at once would tune the same kernels three times over.
            for name in SYSTEMS:
                services.append(Service(name, args, log_dir, serve_args(name)))
                services[-1].wait_ready(args.ready_timeout)
            for r in range(args.rounds):
                for rows in args.rows:
                    for conns in args.connections:
                        turn = services[r % len(services) :] + services[: r % len(services)]
                        for s in turn:
                            res = _phase(pool, s, rows, conns, args, bodies)
                            res["round"] = r
                            results.append(res)
                            print(f"  {s.name:<10} rows={rows} conns={conns} round {r + 1}: "
                                  f"{res['req_per_s']:>9.0f} req/s  {'ok' if res['ok'] else res['problems']}",
                                  flush=True)  # fmt: skip
        finally:
            for s in services:
                s.stop()
        if args.switch:
            res = run_switch(pool, args, log_dir, bodies)
            results.append(res)
            print(f"  switch: {res['req_per_s']:.0f} req/s, delays {res['delays_s']}, "
                  f"{'ok' if res['ok'] else res['problems']}", flush=True)  # fmt: skip
    summary = compare(results, args)
    gpu = _gpu_name(args.device)
    doc = {"command": command, "gpu": gpu, "workers": args.workers, "targets": TARGETS, "summary": summary,
           "results": results}  # fmt: skip
    (out / f"ab_{gpu}.json").write_text(json.dumps(doc, indent=1))
    (out / f"ab_{gpu}.md").write_text(report(doc))
    print(report(doc))
    ok = all(r["ok"] for r in results) and all(row["met"] for row in summary)
    return 0 if ok else 1


def compare(results: list[dict], args) -> list[dict]:
    """Per rows x connections: the median over rounds of each system's throughput, and the targets' ratios."""
    rows_out = []
    for rows in args.rows:
        for conns in args.connections:
            med = {}
            for name in SYSTEMS:
                got = [r["req_per_s"] for r in results if r["system"] == name and r["rows"] == rows
                       and r["connections"] == conns]  # fmt: skip
                med[name] = statistics.median(got) if got else None
            for key, (a, b) in {"ab/fused": ("ab", "fused"), "ab_shadow/ab": ("ab_shadow", "ab")}.items():
                ratio = med[a] / med[b] if med[a] and med[b] else None
                met = ratio is not None and ratio >= TARGETS[key]
                rows_out.append(
                    {
                        "rows": rows,
                        "connections": conns,
                        "ratio": key,
                        "value": ratio,
                        "target": TARGETS[key],
                        "met": met,
                    }
                )
    return rows_out


def report(doc: dict) -> str:
    lines = [
        f"# bench ab on {doc['gpu']} ({doc['workers']} workers)",
        "",
        f"`{doc['command']}`",
        "",
        "| rows | connections | ratio | median of rounds | target | met |",
        "|---|---|---|---|---|---|",
    ]
    for row in doc["summary"]:
        value = "-" if row["value"] is None else f"{row['value']:.3f}"
        lines.append(f"| {row['rows']} | {row['connections']} | {row['ratio']} | {value} | ≥ {row['target']} | "
                     f"{'yes' if row['met'] else 'NO'} |")  # fmt: skip
    lines += ["", "| system | rows | connections | round | req/s | p50 ms | p99 ms | sent | answered | ok |",
              "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in doc["results"]:
        p50 = "-" if r["p50_ms"] is None else f"{r['p50_ms']:.2f}"
        p99 = "-" if r["p99_ms"] is None else f"{r['p99_ms']:.2f}"
        lines.append(f"| {r['system']} | {r['rows']} | {r['connections']} | {r.get('round', '-')} | "
                     f"{r['req_per_s']:.0f} | {p50} | {p99} | {r['sent']} | {r['answered']} | "
                     f"{'yes' if r['ok'] else 'NO: ' + '; '.join(r['problems'])} |")  # fmt: skip
    switch = [r for r in doc["results"] if r["system"] == "switch"]
    for r in switch:
        delays = ", ".join(f"to {m}: {'-' if d is None else f'{d:.3f} s'}" for m, d in r["delays_s"].items())
        lines += ["", f"Switch under {r['connections']} connections: {delays} (target ≤ {doc['targets']['switch_s']} "
                  f"s, from SIGHUP to the first of the probe's answers that are all in the new mode); {r['probes']} "
                  f"probes."]  # fmt: skip
    return "\n".join(lines) + "\n"


def _gpu_name(device: str) -> str:
    """The results' GPU slug (bench.gpu: 'NVIDIA H100 80GB HBM3' -> 'h100'), 'cpu' without CUDA, 'gpu' when unnamed."""
    if device != "cuda":
        return "cpu"
    name = gpu_name()
    return slug_of(name) if name else "gpu"


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="bench/results", help="output directory [bench/results]")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), help="[float16; cpu: float32]")
    p.add_argument("--workers", type=int, default=8, help="front ends of every service [8]")
    p.add_argument("--rows", type=_ints, default=(1, 64), help="rows per request [1,64]")
    p.add_argument("--connections", type=_ints, default=(64, 256), help="closed-loop connections [64,256]")
    p.add_argument("--duration", type=float, default=2.5, help="seconds measured per phase [2.5]")
    p.add_argument("--warmup", type=float, default=0.75, help="seconds of load before each phase [0.75]")
    p.add_argument("--rounds", type=int, default=3, help="times each phase runs per system, in turns [3]")
    p.add_argument("--switch-connections", type=int, default=256, help="connections of the switch phase [256]")
    p.add_argument("--switch-duration", type=float, default=9.0, help="seconds of the switch phase's window [9]")
    p.add_argument("--no-switch", dest="switch", action="store_false", help="skip the SIGHUP switch phase")
    p.add_argument("--clients", type=int, help="client processes [cores - workers - 2, between 2 and 4]")
    p.add_argument("--tuning-cache", type=Path, help="fusedserve's tuning cache for every start [a temp file]")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds a service may take to be ready")
    p.add_argument("--quick", action="store_true", help="smoke: 1 round, 1 row, 4 connections, short windows")


def run(args: argparse.Namespace, command: str) -> int:
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "float16")
    if args.quick:
        args.rounds, args.rows, args.connections = 1, (1,), (4,)
        args.duration, args.warmup, args.switch_duration, args.switch_connections = 0.5, 0.2, 6.0, 8
    return execute(args, command)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.serve.ab", description=__doc__.splitlines()[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_arguments(parser)
    argv = sys.argv[1:] if argv is None else list(argv)
    return run(parser.parse_args(argv), shlex.join(["python", "-m", "bench.serve.ab", *argv]))


if __name__ == "__main__":
    sys.exit(main())
