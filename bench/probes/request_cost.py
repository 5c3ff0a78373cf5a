"""Probe: what one single-row POST /predict costs a front end, against the empty FastAPI route (issue 50, "the
single-row path back at the ceiling"). One worker each, on loopback, loaded by bench.serve.loadgen's raw client:
for each system and connection count, req/s, p50, and the CPU time its server processes spent per answered request
(utime + stime from /proc over the window: the front end's, and fusedserve's engine apart), the systems taking turns
--rounds times; the median of the rounds is reported. `--profile` samples the front end with py-spy (--native) at the
last connection count and prints its top frames.

    python -m bench.probes.request_cost --device cpu --mode unfused               # ~1 min on 2 cores
    python -m bench.probes.request_cost --device cpu --mode unfused --profile /tmp/rc

CPU time per request is what a worker can serve per core (1e6 / us), whatever the host's load; on a 2-core host
the client and the engine share the cores with the front end, so req/s there says less than the CPU time does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.local_server import children, free_port, get
from bench.serve.loadgen import ClientPool, PhaseSpec, make_bodies, percentiles

REPO = Path(__file__).resolve().parents[2]
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


class Server:
    """One system on a free loopback port: `empty` (uvicorn, bench/serve/apps/empty.py) or fusedserve."""

    def __init__(self, name: str, a, out: Path):
        self.name = name
        self.port = free_port()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        if name == "empty":
            argv = [sys.executable, "-m", "uvicorn", "bench.serve.apps.empty:app", "--host", "127.0.0.1", "--port",
                    str(self.port), "--workers", "1", "--log-level", "warning", "--no-access-log"]  # fmt: skip
        else:
            argv = [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                    "--workers", "1", "--mode", a.mode, "--device", a.device, "--log-level", "warning"]  # fmt: skip
            if a.dtype:
                argv += ["--dtype", a.dtype]
        self.log = (out / f"{name}_server.log").open("wb")
        self.proc = subprocess.Popen(argv, env=env, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # fmt: skip

    def wait_ready(self, timeout_s: float = 300) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if get(f"http://127.0.0.1:{self.port}/health/ready", 2.0)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        else:
            raise TimeoutError(self.name)
        if self.name == "empty":
            self.pids = {"frontend": self.proc.pid}
        else:
            kids = children(self.proc.pid)
            self.pids = {"frontend": kids["fs-frontend-0"], "engine": kids["fs-engine-0"]}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def phase(pool: ClientPool, server: Server, conns: int, a) -> dict:
    spec = PhaseSpec("127.0.0.1", server.port, "/predict", tuple(make_bodies(1)), connections=conns,
                     warmup_s=a.warmup, duration_s=a.duration)  # fmt: skip
    before: dict[str, float] = {}

    def on_ready() -> None:
        before.update({k: cpu_s(p) for k, p in server.pids.items()})

    r = pool.run(spec, on_ready=on_ready)
    used = {k: cpu_s(p) - before[k] for k, p in server.pids.items()}
    n = r["status"].get(200, 0)
    bad = {s: c for s, c in r["status"].items() if s != 200}
    if bad or r["errors"]:
        print(f"  !! {server.name}@{conns}: statuses {bad} errors {r['errors']}", flush=True)
    return {
        "req_per_s": r["req_per_s"],
        "p50_ms": percentiles(r["latency"])["p50"],
        "answered": n,
        **{f"{k}_us": 1e6 * v / max(n, 1) for k, v in used.items()},
    }


def profile(server: Server, pool: ClientPool, conns: int, a, out: Path) -> Path:
    path = out / f"pyspy_{server.name}.txt"
    spec = PhaseSpec("127.0.0.1", server.port, "/predict", tuple(make_bodies(1)), connections=conns,
                     warmup_s=0.5, duration_s=a.profile_s + 1.0)  # fmt: skip
    spy = str(Path(sys.executable).with_name("py-spy"))  # the venv's
    cmd = [spy, "record", "-p", str(server.pids["frontend"]), "-d", str(int(a.profile_s)), "-r", "250", "-f", "raw",
           "--nonblocking", "-o", str(path)]  # fmt: skip
    if a.native:
        cmd.append("--native")
    procs = []
    pool.run(spec, on_start=lambda t: procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL)))
    for p in procs:
        p.wait(60)
    return path


def summary(path: Path, top: int = 40) -> str:
    import collections

    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        k = int(n)
        total += k
        frames = stack.split(";")
        own[frames[-1]] += k
        for f in set(frames):
            incl[f] += k
    lines = [f"{path.name}: {total} samples", "  own time:"]
    lines += [f"    {100 * v / total:5.1f}% {f[:160]}" for f, v in own.most_common(top)]
    lines.append("  inclusive (service/ frames):")
    lines += [f"    {100 * v / total:5.1f}% {f[:160]}" for f, v in incl.most_common() if "service/" in f][:top]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/request_cost"))
    ap.add_argument("--systems", default="empty,fusedserve")
    ap.add_argument("--connections", default="1,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--mode", default="unfused")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype")
    ap.add_argument("--profile", type=Path, help="py-spy the front ends at the last connection count into DIR")
    ap.add_argument("--profile-s", type=int, default=5)
    ap.add_argument("--native", action="store_true", help="py-spy --native")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    conns = [int(c) for c in a.connections.split(",")]
    servers = [Server(n, a, a.out) for n in a.systems.split(",")]
    rows: dict[tuple[str, int], list[dict]] = {}
    try:
        for s in servers:
            s.wait_ready()
        with ClientPool(1) as pool:
            for _ in range(a.rounds):
                for c in conns:
                    for s in servers:
                        rows.setdefault((s.name, c), []).append(phase(pool, s, c, a))
            if a.profile:
                a.profile.mkdir(parents=True, exist_ok=True)
                for s in servers:
                    print(summary(profile(s, pool, conns[-1], a, a.profile)), flush=True)
    finally:
        for s in servers:
            s.stop()
    print(f"{'system':>12} {'conns':>5} {'req/s':>8} {'p50 ms':>7} {'front end us/req':>17} {'engine us/req':>14}")
    doc = []
    for (name, c), rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        doc.append({"system": name, "connections": c, **med, "rounds": rs})
        eng = f"{med['engine_us']:14.1f}" if "engine_us" in med else f"{'':>14}"
        print(f"{name:>12} {c:5d} {med['req_per_s']:8.0f} {med['p50_ms']:7.3f} {med['frontend_us']:17.1f} {eng}")
    (a.out / "request_cost.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
