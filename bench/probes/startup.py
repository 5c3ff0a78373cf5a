"""How long does the service take to become ready on a model, fused with empty caches, fused with warm ones, and
unfused? Issue 34's start-up targets: ResNet-50 ready within 60 s with a warm tuning cache, 3 minutes with an
empty one.

Starts `fusedserve serve` (one front end, one engine) three times on the same model: fused with an empty tuning
cache and an empty Triton kernel cache (a fresh machine), fused again with both as the first start left them (a
restart), and unfused. Each is timed from the process start to /health/ready 200, and the engine's log is kept
(its tuning lines say where the time went). The caller's FUSEDSERVE_* settings pass: FUSEDSERVE_TUNING_STARTUP_S (60 s
by default) bounds the timing a start does before it defers the rest, `inf` times every key first, 0 none. With
`--settle S` the first start stays up, idle, for up to S seconds after ready, until its background tuning has timed
every key it deferred: the warm start then finds a full tuning cache, as a restarted server does.

    python -m bench.probes.startup --out DIR [--model resnet50] [--max-batch-size 256] [--settle 600]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.local_server import free_port, stop
from bench.probes.engine_restart import wait_ready

RUNS = (("fused", "empty caches"), ("fused", "warm caches"), ("unfused", "-"))


def model_path(name: str, tmp: Path) -> Path:
    """A model directory or .onnx file as given, or the ResNet of that name built into tmp (bench/resnets.py)."""
    if name in ("resnet18", "resnet50"):
        from bench import resnets

        return resnets.write(name, tmp / name)[0].parent
    return Path(name)


def pending_keys(url: str) -> float | None:
    """fusedserve_tuning_pending_keys summed over its labels, from the service's /metrics; None where it cannot be
    read (the gauge appears once the engine has reported)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    values = [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "fusedserve_tuning_pending_keys"
    ]
    return sum(values) if values else None


def settle(url: str, proc: subprocess.Popen, timeout_s: float) -> str:
    """Keep an idle service running until its background tuning has timed every deferred key (the pending-keys gauge
    at 0), at most timeout_s: what the next start's warm tuning cache then holds."""
    t0 = time.monotonic()
    left = None
    while time.monotonic() - t0 < timeout_s and proc.poll() is None:
        left = pending_keys(url)
        if left == 0:
            return f"every key timed {time.monotonic() - t0:.0f} s after ready"
        time.sleep(2.0)
    if proc.poll() is not None:
        return f"the service exited ({proc.returncode}) {time.monotonic() - t0:.0f} s after ready"
    return f"{left:.0f} keys untimed {timeout_s:.0f} s after ready" if left is not None else "no tuning gauge read"


def start(model: Path, mode: str, env_extra: dict, log: Path, timeout_s: float, settle_s: float = 0.0):
    """(seconds to ready, what `settle` saw or "")."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, **env_extra, "FUSEDSERVE_MODEL": str(model), "FUSEDSERVE_MODE": mode}
    env["FUSEDSERVE_WORKERS"] = "1"
    with log.open("w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "serve", "--port", str(port)], env=env, stdout=f, stderr=f
        )
        try:
            ready = wait_ready(url, timeout_s, proc)
            return ready, settle(url, proc, settle_s) if settle_s > 0 else ""
        finally:
            stop(proc, 30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="resnet50", help="resnet18, resnet50, or a model path [resnet50]")
    p.add_argument("--max-batch-size", type=int, default=256, help="the service's largest batch [256]")
    p.add_argument("--timeout", type=float, default=420.0, help="seconds a start may take [420]")
    p.add_argument(
        "--cache-dir",
        type=Path,
        help="where the tuning cache (tuning.json) and Triton's kernel cache (triton/) go, emptied first and kept "
        "after, for a later run to start warm [a temporary directory]",
    )
    p.add_argument(
        "--settle",
        type=float,
        default=0.0,
        help="seconds the empty-cache start may stay up after ready, idle, while its background tuning times the "
        "keys it deferred, so that the warm start finds every key (0: stop at ready, and the warm start has only "
        "what the first start's budget timed) [0]",
    )
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="fusedserve-startup-") as tmp:
        tmp = Path(tmp)
        model = model_path(args.model, tmp)
        cache_dir = args.cache_dir or tmp / "caches"
        if cache_dir.exists():
            shutil.rmtree(cache_dir)
        caches = {
            "FUSEDSERVE_TUNING_CACHE": str(cache_dir / "tuning.json"),
            "TRITON_CACHE_DIR": str(cache_dir / "triton"),
            "FUSEDSERVE_MAX_BATCH_SIZE": str(args.max_batch_size),
        }
        for mode, cache in RUNS:
            log = args.out / f"startup_{mode}_{cache.split()[0] if cache != '-' else 'plain'}.log"
            settle_s = args.settle if cache == "empty caches" else 0.0
            try:
                ready, after = start(model, mode, caches, log, args.timeout, settle_s)
                seconds = f"{ready:.1f}"
            except RuntimeError as e:
                seconds, after = f"failed: {e}", ""
            rows.append((mode, cache, seconds, after))
            print(f"{args.model} {mode} ({cache}): ready in {seconds} s {after}".rstrip(), flush=True)
    table = [
        f"Start-up of `fusedserve serve` on {args.model}, max batch {args.max_batch_size}, one front end and engine",
        "",
        "| mode | caches | seconds to /health/ready | after ready |",
        "|---|---|---|---|",
        *(f"| {m} | {c} | {s} | {a or '-'} |" for m, c, s, a in rows),
    ]
    (args.out / "startup.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
