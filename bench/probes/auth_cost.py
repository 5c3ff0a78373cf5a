"""Probe: what API keys cost (issue 38, docs/security.md). Two questions, on the real service with bench.loadgen's raw
client processes (the benchmark's own, so that the client is not the limit):

1. Does a refused request cost no more than a 404? Against one server with API keys on, closed loop at
   --connections (64): POST /predict with a wrong key (401, refused before its body is read) against POST
   /v2/models/nope/infer with a valid key and the same body (404, refused before its body is read, by the same fast
   path): p50 of each, taking turns --rounds times (who goes first alternating). Target: p50(401) <= p50(404).
2. Does checking a key slow the service? Single-row POST /predict, closed loop at --throughput-connections (256),
   against a server with keys off and one with keys on, taking turns --rounds times; every request carries the
   same Authorization header in both, so that only the server's check differs. Target: keys-on throughput within 3%
   of keys-off (the median over rounds).

    python -m bench.probes.auth_cost --out /tmp/auth     # on the GPU host; writes /tmp/auth/probe_auth_cost.json
    python -m bench.probes.auth_cost --device cpu --mode unfused --duration 1 --rounds 1   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.local_server import free_port, get
from bench.serve.loadgen import ClientPool, PhaseSpec, make_bodies, percentiles

REPO = Path(__file__).resolve().parents[2]


class _Server:
    """`python -m service.cli serve` on a free loopback port with FUSEDSERVE_* from `env`, until stop()."""

    def __init__(self, env: dict[str, str], log: Path):
        self.port = free_port()
        # The caller's FUSEDSERVE_* settings (FUSEDSERVE_TUNING_CACHE, ...) pass, but for the ones this probe decides.
        mine = ("FUSEDSERVE_API_KEY", "FUSEDSERVE_API_KEYS_FILE", "FUSEDSERVE_PORT", "FUSEDSERVE_HOST")
        full = {k: v for k, v in os.environ.items() if k not in mine}
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))  # the GPU host's wheels too
        full |= {"PYTHONUNBUFFERED": "1", "PYTHONPATH": path, "FUSEDSERVE_PORT": str(self.port)}
        full |= {"FUSEDSERVE_HOST": "127.0.0.1", **env}
        self._log = log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "serve"], env=full, cwd=REPO, stdout=self._log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    def wait_ready(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}; see {self._log.name}")
            try:
                if get(f"http://127.0.0.1:{self.port}/health/ready", 2.0)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"not ready after {timeout_s:g} s; see {self._log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self._log.close()


def _phase(pool: ClientPool, port: int, path: str, key: str, connections: int, args, bodies) -> dict:
    spec = PhaseSpec(
        host="127.0.0.1", port=port, path=path, bodies=tuple(bodies), connections=connections,
        warmup_s=args.warmup, duration_s=args.duration, headers=f"Authorization: Bearer {key}\r\n".encode(),
    )  # fmt: skip
    result = pool.run(spec)  # loadgen.merge's dict
    return {
        "status": result["status"], "errors": result["errors"], "req_per_s": result["req_per_s"],
        "latency_ms": percentiles(result["latency"]),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.auth_cost", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("."), help="directory for probe_auth_cost.json [.]")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--mode", choices=("fused", "unfused"), default="fused")
    p.add_argument("--workers", type=int, help="FUSEDSERVE_WORKERS [the service's default]")
    p.add_argument("--clients", type=int, default=4, help="client processes [4]")
    p.add_argument("--connections", type=int, default=64, help="connections of the 401-vs-404 phases [64]")
    p.add_argument("--throughput-connections", type=int, default=256, help="connections of the throughput phases")
    p.add_argument("--duration", type=float, default=3.0, help="seconds measured per phase [3]")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds of load before each phase [1]")
    p.add_argument("--rounds", type=int, default=3, help="turns each pair of phases takes [3]")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    key = secrets.token_hex(16)  # 32 characters, as `openssl rand -hex 16` gives
    base = {"FUSEDSERVE_DEVICE": args.device, "FUSEDSERVE_MODE": args.mode}
    if args.workers:
        base["FUSEDSERVE_WORKERS"] = str(args.workers)
    bodies = make_bodies(1, 16)
    report: dict = {"argv": sys.argv, "key_chars": len(key), "connections": args.connections,
                    "throughput_connections": args.throughput_connections, "rounds": []}  # fmt: skip
    pool = ClientPool(args.clients)
    servers: dict[str, _Server] = {}
    try:
        for name, env in (("off", base), ("on", {**base, "FUSEDSERVE_API_KEY": key})):
            servers[name] = _Server(env, args.out / f"auth_cost_server_keys_{name}.log")
        for s in servers.values():
            s.wait_ready(args.ready_timeout)
        on, off = servers["on"].port, servers["off"].port
        for r in range(args.rounds):
            pairs = [
                {"refused_401": (on, "/predict", "wrong-" + key, args.connections),
                 "not_found_404": (on, "/v2/models/nope/infer", key, args.connections)},
                {"keys_off": (off, "/predict", key, args.throughput_connections),
                 "keys_on": (on, "/predict", key, args.throughput_connections)},
            ]  # fmt: skip
            row = {}
            for pair in pairs:  # who goes first alternates from round to round, so neither always meets a warmer host
                names = list(pair) if r % 2 == 0 else list(pair)[::-1]
                for name in names:
                    port, path, presented, conns = pair[name]
                    row[name] = _phase(pool, port, path, presented, conns, args, bodies)
            report["rounds"].append(row)
            print(
                f"round {r + 1}: p50 401 {row['refused_401']['latency_ms']['p50']:.3f} ms vs 404 "
                f"{row['not_found_404']['latency_ms']['p50']:.3f} ms; 1-row /predict keys off "
                f"{row['keys_off']['req_per_s']:.0f}/s, on {row['keys_on']['req_per_s']:.0f}/s",
                flush=True,
            )
    finally:
        for s in servers.values():
            s.stop()
        pool.close()
    rounds = report["rounds"]
    p50 = {k: statistics.median(x[k]["latency_ms"]["p50"] for x in rounds) for k in ("refused_401", "not_found_404")}
    rps = {k: statistics.median(x[k]["req_per_s"] for x in rounds) for k in ("keys_off", "keys_on")}
    statuses_ok = all(
        set(x["refused_401"]["status"]) == {401} and set(x["not_found_404"]["status"]) == {404}
        and set(x["keys_off"]["status"]) == {200} and set(x["keys_on"]["status"]) == {200}
        for x in rounds
    )  # fmt: skip
    report["summary"] = {
        "p50_401_ms": p50["refused_401"], "p50_404_ms": p50["not_found_404"],
        "p50_401_over_404": p50["refused_401"] / p50["not_found_404"],
        "req_per_s_keys_off": rps["keys_off"], "req_per_s_keys_on": rps["keys_on"],
        "keys_on_over_off": rps["keys_on"] / rps["keys_off"], "statuses_as_expected": statuses_ok,
        "targets_met": statuses_ok and p50["refused_401"] <= p50["not_found_404"] * 1.02
        and rps["keys_on"] >= 0.97 * rps["keys_off"],
    }  # fmt: skip
    (args.out / "probe_auth_cost.json").write_text(json.dumps(report, indent=1, default=float))
    print(json.dumps(report["summary"], indent=1))
    return 0 if report["summary"]["targets_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
