"""How long does the service take to become ready on a model, fused with empty caches, fused with warm ones, and
unfused? Issue 34's start-up targets: ResNet-50 ready within 60 s with a warm tuning cache, 3 minutes with an
empty one.

Starts `fusedserve serve` (one front end, one engine) three times on the same model: fused with an empty tuning
cache and an empty Triton kernel cache (a fresh machine), fused again with both as the first start left them (a
restart), and unfused. Each is timed from the process start to /health/ready 200, and the engine's log is kept
(its tuning lines say where the time went). The caller's FUSEDSERVE_* settings pass: FUSEDSERVE_TUNING_STARTUP_S (60 s
by default) bounds the timing a start does before it defers the rest, `inf` times every key first, 0 none.

    python -m bench.probes.startup --out DIR [--model resnet50] [--max-batch-size 256]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
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


def start(model: Path, mode: str, env_extra: dict, log: Path, timeout_s: float) -> float:
    port = free_port()
    env = {**os.environ, **env_extra, "FUSEDSERVE_MODEL": str(model), "FUSEDSERVE_MODE": mode}
    env["FUSEDSERVE_WORKERS"] = "1"
    with log.open("w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "serve", "--port", str(port)], env=env, stdout=f, stderr=f
        )
        try:
            return wait_ready(f"http://127.0.0.1:{port}", timeout_s, proc)
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
            try:
                seconds = f"{start(model, mode, caches, log, args.timeout):.1f}"
            except RuntimeError as e:
                seconds = f"failed: {e}"
            rows.append((mode, cache, seconds))
            print(f"{args.model} {mode} ({cache}): ready in {seconds} s", flush=True)
    table = [
        f"Start-up of `fusedserve serve` on {args.model}, max batch {args.max_batch_size}, one front end and engine",
        "",
        "| mode | caches | seconds to /health/ready |",
        "|---|---|---|",
        *(f"| {m} | {c} | {s} |" for m, c, s in rows),
    ]
    (args.out / "startup.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
