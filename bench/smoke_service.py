"""Serve the shipped model for real in each mode and check it answers held-out digits correctly.

    python -m bench.smoke_service [--modes fused,unfused] [--device auto]

Starts `python -m service.cli serve` on a free loopback port per mode, waits for /health/ready,
posts the 360 held-out digits (sklearn's split: test_size=0.2, random_state=0, stratified) in
requests of 32 rows, prints accuracy, request latency and the per-kernel histogram counts, and
exits non-zero if any mode is below 95% or fails to start.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from .local_server import free_port, get


def _post(url: str, doc: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(doc).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def smoke(mode: str, device: str, x: np.ndarray, y: np.ndarray) -> bool:
    port = free_port()
    env = os.environ | {"FUSEDSERVE_MODE": mode, "FUSEDSERVE_DEVICE": device, "FUSEDSERVE_PORT": str(port)}
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve"], env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                print(f"[{mode}] server exited with {proc.returncode}")
                return False
            try:
                status, body = get(base + "/health/ready", 2)
            except OSError:
                status, body = 0, b""
            if status == 200:
                break
            time.sleep(0.5)
        else:
            print(f"[{mode}] not ready after 300 s")
            return False
        print(f"[{mode}] ready: {body.decode()}")
        correct, latencies = 0, []
        for i in range(0, len(x), 32):
            t = time.perf_counter()
            r = _post(base + "/predict", {"inputs": x[i : i + 32].tolist()})
            latencies.append(time.perf_counter() - t)
            correct += sum(int(p) == int(t_) for p, t_ in zip(r["predictions"], y[i : i + 32], strict=True))
            assert r["mode"] == mode, r["mode"]
        acc = correct / len(x)
        print(f"[{mode}] accuracy {acc:.4f} on {len(x)} held-out digits; "
              f"median request {np.median(latencies) * 1e3:.2f} ms (32 rows, client-side)")  # fmt: skip
        _, metrics = get(base + "/metrics")
        for line in metrics.decode().splitlines():
            if line.startswith(
                ("fusedserve_kernel_seconds_sum", "fusedserve_kernel_seconds_count", "fusedserve_model_info")
            ):
                print(f"[{mode}]   {line}")
        return acc >= 0.95
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="fused,unfused")
    p.add_argument("--device", default="auto")
    args = p.parse_args()
    digits = load_digits()
    _, x, _, y = train_test_split(digits.data, digits.target, test_size=0.2, random_state=0, stratify=digits.target)
    ok = [smoke(m, args.device, x, y) for m in args.modes.split(",")]
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
