"""What does one batch's forward cost the engine, configured as the service configures it?

`bench serve` reads the engine's forward per batch from /metrics (fusedserve_forward_seconds): on an H100 the
fused digits MLP took 141 µs per 64-row batch there, where `runner_copies` (tuning off, no kernel timing)
measured 45 µs. This probe runs the service's ModelRunner the way an engine builds it (service.engine.core.build_runner:
tuning on with a fresh cache, kernel timing on every 16th batch, the real EngineMetrics) on the shipped digits MLP
and digits CNN in float16, fused and unfused, and times every `run()` on the host: CALLS batches at each row
count, interleaved by mode. Per case: mean (what /metrics reports), median, p99 and max of all batches, and the
mean of the graphed batches apart from the kernel-timed ones (which run launch by launch with CUDA events).
Then the same with the tuner off (each kernel's first config), to tell the tuned picks from the rest.

    python -m bench.probes.engine_forward --out DIR
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from service.config import Settings
from service.engine.core import build_runner
from service.metrics import EngineMetrics
from service.model.loader import load_model

from .common import REPO, main

CALLS = 1600  # a multiple of the timing period (16): 100 timed batches per case
ROUNDS = 4  # CALLS / ROUNDS batches per turn, the modes taking turns
ROWS = (1, 64, 74, 772, 1024)
MAX_BATCH = 1024


def _runner(model, mode: str, tuning: bool, cache: Path):
    settings = Settings(mode=mode, dtype="float16", tuning=tuning, tuning_cache=cache, max_batch_size=MAX_BATCH)
    metrics = EngineMetrics(model.name, mode, "cuda:0", "float16", engine=f"{mode}-{tuning}")
    runner = build_runner(settings, torch.device("cuda"), "float16", model, metrics)
    t = time.perf_counter()
    runner.warmup(MAX_BATCH)
    print(f"  {model.name} {mode} tuning={tuning}: warm in {time.perf_counter() - t:.1f} s", flush=True)
    return runner


def _times(runner, batch: np.ndarray, n: int) -> list[tuple[float, bool]]:
    """(host us, whether the batch was kernel-timed) of n runs."""
    out = []
    every = runner.kernel_timing_every
    for _ in range(n):
        timed = bool(every) and (runner._batches + 1) % every == 0
        t = time.perf_counter()
        runner.run(batch)
        out.append(((time.perf_counter() - t) * 1e6, timed))
    return out


def _summary(samples: list[tuple[float, bool]]) -> dict:
    all_us = sorted(s for s, _ in samples)
    graphed = [s for s, timed in samples if not timed]
    timed = [s for s, t in samples if t]
    return {
        "mean": statistics.fmean(all_us),
        "median": statistics.median(all_us),
        "p99": all_us[int(0.99 * (len(all_us) - 1))],
        "max": all_us[-1],
        "graphed_mean": statistics.fmean(graphed),
        "timed_mean": statistics.fmean(timed) if timed else float("nan"),
    }


def sweep() -> dict:
    os.environ.pop("FUSEDSERVE_TUNING_CACHE", None)
    torch.set_num_threads(1)  # as engine_main sets it for a CUDA engine
    results = {}
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        for tuning in (True, False):
            for name in ("digits-mlp", "digits-cnn"):
                model = load_model(REPO / "model_weights" / name)
                cache = Path(tmp) / f"tuning-{name}-{tuning}.json"
                runners = {mode: _runner(model, mode, tuning, cache) for mode in ("fused", "unfused")}
                for rows in ROWS:
                    batch = (rng.random((rows, *model.input_shape), dtype=np.float32) * 16).astype(np.float32)
                    samples = {mode: [] for mode in runners}
                    for _ in range(ROUNDS):
                        for mode, runner in runners.items():
                            samples[mode] += _times(runner, batch, CALLS // ROUNDS)
                    for mode, s in samples.items():
                        row = _summary(s)
                        results[f"{name} {mode} tuning={tuning} rows={rows}"] = row
                        print(
                            f"{name:10s} {mode:7s} tuning={'on ' if tuning else 'off'} rows={rows:4d}: mean "
                            f"{row['mean']:6.1f}  median {row['median']:6.1f}  p99 {row['p99']:7.1f}  max "
                            f"{row['max']:8.1f}  | graphed mean {row['graphed_mean']:6.1f}  kernel-timed mean "
                            f"{row['timed_mean']:7.1f} us",
                            flush=True,
                        )
                del runners
                torch.cuda.empty_cache()
    return results


if __name__ == "__main__":
    main("engine_forward", sweep)
