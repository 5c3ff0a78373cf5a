"""Probe: where does a loaded server spend its time? Starts the empty FastAPI route and fusedserve (N workers each,
one after the other), drives each with bench.serve.loadgen (default: 256 connections of single-row JSON /predict), and
samples one worker process (and fusedserve's engine) with py-spy meanwhile; prints the client's throughput and
latency, the engine's forward and batch size from /metrics, and each profile's top frames by own time and by
file group. `--systems fused,unfused` profiles both modes of fusedserve (one server each); `--protocol v2_binary`
sends the Open Inference Protocol's binary tensors (the empty route receives and drops them: bench/serve/apps/empty.py).

    python -m bench.probes.profile_serve --out /tmp/profile      # on the GPU host, py-spy on PATH
    python -m bench.probes.profile_serve --systems fused,unfused --workers 1 --rows 64 --conns 1

`--model DIR --images 32 --input-dtype UINT8` serves an image model instead (a model directory or .onnx file, as
`bench serve --model` takes it) and sends it 32-image binary requests: where a front end and the engine spend their
time on MB-sized bodies.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from bench.serve.accounting import delta, scrape, server_split
from bench.serve.loadgen import ClientPool, PhaseSpec, make_bodies

SAMPLE_HZ, SAMPLE_S = 400, 4  # py-spy's rate and duration: a process busy all the time gives 1,600 samples
GROUPS = (
    ("service/", "fusedserve"),
    ("bench/serve/apps", "app"),
    ("fastapi", "fastapi+starlette"),
    ("starlette", "fastapi+starlette"),
    ("uvicorn", "uvicorn"),
    ("asyncio", "asyncio"),
    ("numpy", "numpy"),
    ("prometheus_client", "prometheus"),
    ("torch", "torch"),
)


def _children(pid: int) -> dict[int, str]:
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    out[int(entry.name)] = (entry / "comm").read_text().strip()
            except OSError:
                continue
    return out


def _wait_ready(url: str, timeout_s: float = 300) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            if httpx.get(url + "/health/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


def _summary(path: Path, top: int = 22) -> str:
    own: collections.Counter[str] = collections.Counter()
    groups: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        k = int(n)
        total += k
        leaf = stack.split(";")[-1]
        own[leaf] += k
        groups[next((g for key, g in GROUPS if key in leaf), "other")] += k
    busy = total / (SAMPLE_HZ * SAMPLE_S)
    lines = [f"{path.name}: {total} samples (idle excluded: busy {busy:.0%} of the time)"]
    lines.append("  by file group (own time):")
    lines += [f"    {100 * v / total:5.1f}% {g}" for g, v in groups.most_common()]
    lines.append("  top frames (own time):")
    lines += [f"    {100 * v / total:5.1f}% {f[:150]}" for f, v in own.most_common(top)]
    return "\n".join(lines)


def profile(name: str, argv: list[str], port: int, pick, out: Path, a, spec_args: dict) -> None:
    log = open(out / f"{name}_server.log", "wb")  # noqa: SIM115 (closed below)
    server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url)
        time.sleep(1)
        targets = pick(server.pid)
        spec = PhaseSpec("127.0.0.1", port, connections=a.conns, warmup_s=1.0, duration_s=6.0, **spec_args)
        before = scrape(url) if name != "empty" else None
        samplers = []

        def sample(start_at: float) -> None:
            time.sleep(max(0.0, start_at - time.monotonic()) + 1.0)
            for label, pid in targets.items():
                path = out / f"profile_{name}_{label}.txt"
                cmd = ["py-spy", "record", "-p", str(pid), "-d", str(SAMPLE_S), "-r", str(SAMPLE_HZ), "-f", "raw",
                       "-o", str(path)]  # fmt: skip
                samplers.append((path, subprocess.Popen([*cmd, "--nonblocking"], stdout=subprocess.DEVNULL)))

        with ClientPool(min(a.clients, a.conns)) as pool:
            result = pool.run(spec, on_start=lambda t: threading.Thread(target=sample, args=(t,)).start())
        for _, p in samplers:
            p.wait(30)
        p50 = float(np.median(result["latency"])) * 1e3 if len(result["latency"]) else float("nan")
        images = f" ({result['req_per_s'] * a.images:,.0f} images/s)" if a.model else ""
        print(f"== {name}: {result['req_per_s']:.0f} req/s{images}, p50 {p50:.3f} ms, statuses {result['status']}, "
              f"client cores {result.get('client_cpu', {})}", flush=True)  # fmt: skip
        if before is not None:
            split = server_split(delta(before, scrape(url)))
            if split["batches"]:
                print(f"   engine: {split['forward_us']:.1f} us forward per batch, {split['batch_rows']:.1f} rows per "
                      f"batch, {split['batches']} batches, queue wait "
                      f"{split['queue_wait_ms']:.2f} ms")  # fmt: skip
        for path, _ in samplers:
            if path.is_file():
                print(_summary(path), flush=True)
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/profile"))
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--systems", default="empty,fused", help="empty, fused, unfused, comma-separated [empty,fused]")
    ap.add_argument("--rows", type=int, default=1, help="rows per request [1]")
    ap.add_argument("--conns", type=int, default=256, help="connections [256]")
    ap.add_argument("--protocol", default="predict", choices=("predict", "v2_binary"))
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--model", help="an image model to serve (directory or .onnx): binary requests of --images images")
    ap.add_argument("--images", type=int, default=32, help="images per request with --model [32]")
    ap.add_argument("--input-dtype", default="UINT8", choices=("FP32", "FP16", "UINT8"), help="with --model [UINT8]")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    model_args: list[str] = []
    if a.model:
        from bench.serve import model as served
        from bench.serve import v2

        info = served.resolve(a.model)
        count = v2.body_count(a.images, info.input_shape, a.input_dtype)
        bodies, headers = v2.binary_bodies(a.images, count, shape=info.input_shape, datatype=a.input_dtype)
        spec_args = {"path": v2.rest_path(info.name), "bodies": tuple(bodies), "protocol": "v2_binary",
                     "headers": headers}  # fmt: skip
        model_args = ["--model", info.path]
    elif a.protocol == "v2_binary":
        from bench.serve import v2

        bodies, headers = v2.binary_bodies(a.rows)
        spec_args = {"path": v2.REST_PATH, "bodies": tuple(bodies), "protocol": "v2_binary", "headers": headers}
    else:
        spec_args = {"path": "/predict", "bodies": tuple(make_bodies(a.rows))}

    def a_worker(pid: int) -> dict[str, int]:
        return {"worker": min(_children(pid), default=pid)}  # one worker: uvicorn serves in its own process

    def front_and_engine(pid: int) -> dict[str, int]:
        names = {v: k for k, v in _children(pid).items()}
        return {"frontend": names["fs-frontend-0"], "engine": names["fs-engine-0"]}

    for port, name in enumerate(a.systems.split(","), start=18101):
        if name == "empty":
            argv = [py, "-m", "uvicorn", "bench.serve.apps.empty:app", "--port", str(port), "--workers", str(a.workers)]
            profile(name, [*argv, "--log-level", "warning", "--no-access-log"], port, a_worker, a.out, a, spec_args)
            continue
        argv = [py, "-m", "service.cli", "serve", "--port", str(port), "--workers", str(a.workers), "--mode", name]
        argv += ["--dtype", a.dtype, "--log-level", "warning", *model_args]
        profile(name, argv, port, front_and_engine, a.out, a, spec_args)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
