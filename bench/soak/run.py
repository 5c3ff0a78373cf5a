"""The soak's run (bench/soak/cli.py): start the server, run the client processes, sample memory, judge, report."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..gpu import gpu_name, results_dir, slug_of
from ..local_server import children, free_port, get
from .clients import MIX, client_main

HEADER_TIMEOUT_S = 2.0  # the server's header and body timeouts in the soak: slow clients are cut within the run
READY_TIMEOUT_S = 600.0  # a fused CUDA server compiles and tunes every batch bucket before it is ready
MB = 1024 * 1024


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def gpu_memory_mb(pids: list[int]) -> dict[str, float] | None:
    """GPU memory in use, from nvidia-smi: per engine pid where the driver reports it, and the device total."""
    try:
        apps = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
        total = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    if total.returncode != 0:
        return None
    out = {"device_total": sum(float(v) for v in total.stdout.split() if v.strip())}
    for line in apps.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) in pids:
            out[f"pid {parts[0]}"] = float(parts[1])
    return out


def request_counters(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    _, body = get(url + "/metrics", 10)
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(body.decode()):
        if fam.name in ("fusedserve_requests", "fusedserve_gpu_faults"):
            for s in fam.samples:
                if s.name.endswith("_total"):
                    key = s.labels.get("outcome") or f"gpu_fault_{s.labels.get('kind')}"
                    out[key] = out.get(key, 0) + s.value
    return out


class Sampler(threading.Thread):
    """RSS of every front end and engine (and GPU memory on CUDA) every `every_s`, until stopped."""

    def __init__(self, procs: dict[str, int], every_s: float, cuda: bool):
        super().__init__(daemon=True)
        self.procs = procs
        self.every_s = every_s
        self.cuda = cuda
        self.samples: list[dict] = []
        self._done = threading.Event()

    def run(self) -> None:
        started = time.monotonic()
        engines = [pid for name, pid in self.procs.items() if "engine" in name]
        while not self._done.is_set():
            sample = {"t": round(time.monotonic() - started, 2)}
            sample["rss_mb"] = {name: rss_mb(pid) for name, pid in self.procs.items()}
            if self.cuda:
                sample["gpu_mb"] = gpu_memory_mb(engines)
            self.samples.append(sample)
            self._done.wait(self.every_s)

    def stop(self) -> None:
        self._done.set()
        self.join()


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def memory_change(samples: list[dict], warmup_s: float) -> dict:
    """Per process (and GPU key): median of the first three samples after the warm-up against the last three."""
    steady = [s for s in samples if s["t"] >= warmup_s] or samples
    head, tail = steady[:3], steady[-3:]
    out = {}
    for field in ("rss_mb", "gpu_mb"):
        keys = sorted({k for s in steady for k in (s.get(field) or {})})
        for k in keys:
            start = _median([(s.get(field) or {}).get(k) for s in head])
            end = _median([(s.get(field) or {}).get(k) for s in tail])
            if start is not None and end is not None:
                out[f"{field}:{k}"] = {"start": round(start, 1), "end": round(end, 1), "grown": round(end - start, 1)}
    return out


def execute(plan: dict, command: str) -> int:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FUSEDSERVE_")}
    env.update({
        "FUSEDSERVE_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S), "FUSEDSERVE_BODY_TIMEOUT_S": str(HEADER_TIMEOUT_S),
        "FUSEDSERVE_MODE": plan["mode"], "FUSEDSERVE_DEVICE": plan["device"], "PYTHONUNBUFFERED": "1",
        # Tuning picks which kernel config runs, not how memory behaves; off, a CUDA server is ready in seconds
        # instead of 10-50 s per batch bucket.
        "FUSEDSERVE_TUNING": "false",
    })  # fmt: skip
    if plan["workers"]:
        env["FUSEDSERVE_WORKERS"] = str(plan["workers"])
    log_path = Path(tempfile.mkdtemp(prefix="fusedserve-soak-")) / "server.log"
    argv = [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "wb") as log:
        server = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                print(f"bench soak: the server did not become ready\n{log_path.read_text()[-4000:]}", file=sys.stderr)
                return 2
            with contextlib.suppress(OSError):
                if get(url + "/health/ready", 2)[0] == 200:
                    break
            time.sleep(0.2)
        procs = children(server.pid)
        _, body = get(url + "/model")
        device = json.loads(body).get("device") or "?"
        cuda = device.startswith("cuda")
        counters_before = request_counters(url)
        sampler = Sampler(procs, plan["sample_s"], cuda)
        sampler.start()
        end_wall = time.time() + plan["duration_s"]
        ctx = multiprocessing.get_context("spawn")
        print(f"bench soak: {plan['duration_s']:.0f} s of load from {plan['clients']} client process(es) on {url} "
              f"({plan['mode']} on {device})", flush=True)  # fmt: skip
        with concurrent.futures.ProcessPoolExecutor(plan["clients"], mp_context=ctx) as pool:
            futures = [
                pool.submit(client_main, port, end_wall, HEADER_TIMEOUT_S, seed) for seed in range(plan["clients"])
            ]
            counts: dict[str, int] = {}
            for f in futures:
                for k, v in f.result(timeout=plan["duration_s"] + 120).items():
                    counts[k] = counts.get(k, 0) + v
        time.sleep(HEADER_TIMEOUT_S + 1)  # the last slow and disconnected connections are closed and counted
        sampler.stop()
        counters_after = request_counters(url)
        alive = server.poll() is None
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
    server_counts = {k: counters_after.get(k, 0) - counters_before.get(k, 0) for k in counters_after}
    memory = memory_change(sampler.samples, plan["warmup_s"])
    return _report(plan, command, device, counts, server_counts, memory, sampler.samples, alive, server.returncode)


def _judge(plan, counts, server_counts, memory, alive, exit_code) -> list[str]:
    problems = [f"{k}: {v}" for k, v in sorted(counts.items()) if k.startswith("lost:")]
    for kind in MIX:
        if not any(k.startswith(kind + ":") for k in counts):
            problems.append(f"no {kind} client completed anything")
    answered_ok = counts.get("good:200", 0)
    if server_counts.get("ok", 0) < answered_ok:
        problems.append(f"the server counted {server_counts.get('ok', 0):.0f} ok for {answered_ok} answered 200")
    if server_counts.get("too_large", 0) < counts.get("oversized:413", 0):
        problems.append("the server counted fewer too_large than the clients got 413")
    bad = counts.get("bad:400", 0) + counts.get("bad:422", 0)
    if server_counts.get("invalid", 0) < bad:
        problems.append(f"the server counted {server_counts.get('invalid', 0):.0f} invalid for {bad} refused")
    if server_counts.get("error", 0):
        problems.append(f"the server counted {server_counts['error']:.0f} errors (500)")
    for key, m in memory.items():
        bound = plan["gpu_bound_mb"] if key.startswith("gpu_mb") else plan["rss_bound_mb"]
        if m["grown"] > bound:
            problems.append(f"{key} grew {m['grown']} MB (bound {bound} MB)")
    if not alive:
        problems.append(f"the server exited during the soak (exit {exit_code})")
    return problems


def _report(plan, command, device, counts, server_counts, memory, samples, alive, exit_code) -> int:
    gpu = gpu_name() if device.startswith("cuda") else None
    slug = slug_of(gpu)
    problems = _judge(plan, counts, server_counts, memory, alive, exit_code)
    doc = {
        "command": command,
        "gpu": gpu,
        "device": device,
        "mode": plan["mode"],
        "duration_s": plan["duration_s"],
        "clients": plan["clients"],
        "connections_per_client": MIX,
        "header_timeout_s": HEADER_TIMEOUT_S,
        "client_outcomes": dict(sorted(counts.items())),
        "server_outcomes": {k: int(v) for k, v in sorted(server_counts.items())},
        "memory": memory,
        "bounds_mb": {"rss": plan["rss_bound_mb"], "gpu": plan["gpu_bound_mb"]},
        "samples": samples,
        "problems": problems,
        "passed": not problems,
    }
    out: Path = plan["out"] or results_dir(slug)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"soak_{slug}.json").write_text(json.dumps(doc, indent=1))
    lines = [
        f"# Soak: {plan['duration_s'] / 60:.1f} minutes of mixed traffic, {plan['mode']} on {gpu or device}",
        "",
        f"`{command}`; {plan['clients']} client processes, each with {MIX} connections; header and body "
        f"timeouts {HEADER_TIMEOUT_S:g} s. Verdict: **{'passed' if not problems else 'FAILED'}**.",
        "",
        "| client kind: what happened | count |",
        "|---|---:|",
        *[f"| {k} | {v:,} |" for k, v in sorted(counts.items())],
        "",
        "| server `fusedserve_requests_total` over the soak | count |",
        "|---|---:|",
        *[f"| {k} | {int(v):,} |" for k, v in sorted(server_counts.items())],
        "",
        "| memory (median of 3 samples), MB | after warm-up | end | grown | bound |",
        "|---|---:|---:|---:|---:|",
        *[
            f"| {k} | {m['start']:,} | {m['end']:,} | {m['grown']:,} | "
            f"{plan['gpu_bound_mb'] if k.startswith('gpu_mb') else plan['rss_bound_mb']:g} |"
            for k, m in memory.items()
        ],
        "",
        *(["Problems:", "", *[f"- {p}" for p in problems], ""] if problems else []),
    ]
    (out / f"soak_{slug}.md").write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"bench soak: wrote {out / f'soak_{slug}.md'} and .json")
    return 0 if not problems else 1
