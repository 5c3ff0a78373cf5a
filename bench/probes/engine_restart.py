"""How long is the service away when its engine dies under load, and is every request answered 200 or 503?

Starts `fusedserve serve` (a real supervisor, front ends and engine) with an empty tuning cache, times the cold
start, drives closed-loop single-row /predict load from --connections aiohttp clients, SIGKILLs the engine
--kills times (each once the service is ready again and has served a few seconds), and times each restart:
from the kill to /health/ready 200, and to the first 200 answer after it. Every answer is counted by status;
anything but 200 and 503 (a reset, a 500) is a failure. Issue 36's target: serving again within 15 s on the GPU
host with the caches warm.

    python -m bench.probes.engine_restart --out DIR [--model digits-mlp] [--mode fused] [--kills 2]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.local_server import children, free_port, get, stop


def wait_ready(url: str, timeout_s: float, proc: subprocess.Popen) -> float:
    """Seconds until /health/ready answers 200."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the service exited with {proc.returncode}")
        try:
            if get(url + "/health/ready", timeout=1.0)[0] == 200:
                return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"not ready within {timeout_s} s")


def wait_not_ready(url: str, timeout_s: float) -> float:
    """Seconds until /health/ready stops answering 200: the front ends have seen the engine die."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if get(url + "/health/ready", timeout=1.0)[0] != 200:
                return time.monotonic() - t0
        except OSError:
            return time.monotonic() - t0
        time.sleep(0.005)
    raise RuntimeError(f"/health/ready still 200 {timeout_s} s after the engine was killed")


def engine_pid(supervisor: int, timeout_s: float = 30.0) -> int:
    """The engine's pid, once it has named itself (a spawned process is `python` until then)."""
    deadline = time.monotonic() + timeout_s
    while (pid := children(supervisor).get("fs-engine-0")) is None:
        if time.monotonic() > deadline:
            raise RuntimeError("no fs-engine-0 under the supervisor")
        time.sleep(0.05)
    return pid


async def load(url: str, connections: int, stop: asyncio.Event, counts: collections.Counter, first_ok: list) -> None:
    body = json.dumps({"inputs": [[float(i % 17) for i in range(64)]]}).encode()
    headers = {"content-type": "application/json"}

    async def client(session: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            try:
                async with session.post(url + "/predict", data=body, headers=headers) as r:
                    await r.read()
                    counts[r.status] += 1
                    if r.status == 200:
                        first_ok.append(time.monotonic())
                        del first_ok[:-1]  # only the latest matters
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                counts[type(e).__name__] += 1
                await asyncio.sleep(0.01)

    conn = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=30)) as session:
        await asyncio.gather(*(client(session) for _ in range(connections)))


async def scenario(url: str, proc: subprocess.Popen, args) -> dict:
    counts: collections.Counter = collections.Counter()
    first_ok: list[float] = []
    stop = asyncio.Event()
    task = asyncio.create_task(load(url, args.connections, stop, counts, first_ok))
    restarts = []
    loop = asyncio.get_running_loop()
    for _ in range(args.kills):
        await asyncio.sleep(args.serve_s)
        engine = await loop.run_in_executor(None, engine_pid, proc.pid)
        killed = time.monotonic()
        os.kill(engine, signal.SIGKILL)
        seen_s = await loop.run_in_executor(None, wait_not_ready, url, 5.0)
        ready_s = seen_s + await loop.run_in_executor(None, wait_ready, url, 120.0, proc)
        while not first_ok or first_ok[-1] < killed + ready_s:
            await asyncio.sleep(0.01)
        restarts.append({
            "seen_s": round(seen_s, 3), "ready_s": round(ready_s, 2), "first_200_s": round(first_ok[-1] - killed, 2),
        })  # fmt: skip
    await asyncio.sleep(args.serve_s)
    stop.set()
    await task
    return {"restarts": restarts, "answers": {str(k): v for k, v in sorted(counts.items(), key=str)}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="digits-mlp")
    p.add_argument("--mode", default="fused")
    p.add_argument("--kills", type=int, default=2, help="at most 2: the third death within 5 minutes stops the service")
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--serve-s", type=float, default=3.0, help="seconds of load before each kill and after the last")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        env = {
            **os.environ,
            "FUSEDSERVE_PORT": str(port),
            "FUSEDSERVE_MODEL": args.model,
            "FUSEDSERVE_MODE": args.mode,
            "FUSEDSERVE_TUNING_CACHE": str(Path(tmp) / "tuning.json"),
        }
        log = open(args.out / "engine_restart_server.log", "w")  # noqa: SIM115 (closed below)
        proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve"], env=env, stdout=log, stderr=log)
        try:
            cold_s = wait_ready(url, 600.0, proc)
            result = {"model": args.model, "mode": args.mode, "cold_start_s": round(cold_s, 1)}
            result.update(asyncio.run(scenario(url, proc, args)))
        finally:
            stop(proc, 60)
            log.close()
    bad = {k: v for k, v in result["answers"].items() if k not in ("200", "503")}
    result["only_200_and_503"] = not bad
    (args.out / "probe_engine_restart.json").write_text(json.dumps(result, indent=1))
    print("| model | mode | cold start s | restart: 503 from s | ready again s | first 200 s | answers |")
    print("|---|---|---|---|---|---|---|")
    cols = [", ".join(str(r[k]) for r in result["restarts"]) for k in ("seen_s", "ready_s", "first_200_s")]
    print(f"| {args.model} | {args.mode} | {result['cold_start_s']} | {' | '.join(cols)} | {result['answers']} |")
    return 0 if not bad else 1


if __name__ == "__main__":
    raise SystemExit(main())
