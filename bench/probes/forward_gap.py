"""Does a batch's forward cost the engine more when batches are rare?

In `bench serve` the engine's forward per batch (fusedserve_forward_seconds) reads 35-55 µs when batches come
back to back, but 362 µs for 249 single-row requests when one front end sends one such batch every ~29 ms
(serve_h100.md at a98ffa0: one worker, 256 connections). This probe runs the service's ModelRunner as an engine
builds it (service.engine.core.build_runner: the tuning cache given, kernel timing every 16th batch) on the shipped
digits MLP in float16, fused and unfused, with batches made of parts as the engine gets them (one array per
request), and waits between batches as an idle engine does (FUSEDSERVE_ENGINE_SPIN_MS of polling, 2 ms by default,
then asleep), or polling the whole gap (spin = gap).
Per case it splits the host's time as /metrics counts it (launch + collect) into launch (stage the rows, queue
the replay) and wait (synchronize), and times the replay on the GPU with CUDA events: if the GPU's own time grows
with the gap, the GPU idles down between batches; if only the host's does, the engine's core does.

    python -m bench.probes.forward_gap --out DIR [--tuning-cache FILE]
"""

from __future__ import annotations

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

MAX_BATCH = 1024
# (requests, rows each): one row; the batches of one front end at 64 and 256 connections; 64-row requests
SHAPES = ((1, 1), (28, 1), (126, 1), (249, 1), (15, 64))
SPIN_MS = Settings().engine_spin_ms
# (gap, polling ms of it): back to back; idle as the engine is; idle polling all along
GAPS_MS = ((0.0, 0.0), (1.0, SPIN_MS), (5.0, SPIN_MS), (5.0, 5.0), (28.0, SPIN_MS), (28.0, 28.0))
SPAN_S = 1.2  # each case's batches, per mode, at least 30 of them
ROUNDS = 3  # the modes take turns this many times per case


def _wait(gap_s: float, spin_s: float) -> None:
    """What an engine does between batches: poll for spin_s, then sleep in select."""
    if gap_s <= 0:
        return
    end = time.perf_counter() + gap_s
    spin_end = time.perf_counter() + min(spin_s, gap_s)
    while time.perf_counter() < spin_end:
        pass
    rest = end - time.perf_counter()
    if rest > 0:
        time.sleep(rest)


def _batches(runner, parts, gap_s: float, spin_s: float, n: int) -> list[tuple[float, float, float, float]]:
    """(host µs as /metrics counts it, launch µs, wait µs, GPU µs of the replay) of n batches."""
    out = []
    stream = torch.cuda.current_stream()
    for _ in range(n):
        _wait(gap_s, spin_s)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record(stream)
        inflight = runner.launch(parts)
        end.record(stream)
        t1 = time.perf_counter()
        runner.collect(inflight)
        t2 = time.perf_counter()
        out.append(((t2 - t0) * 1e6, (t1 - t0) * 1e6, (t2 - t1) * 1e6, start.elapsed_time(end) * 1e3))
    return out


def sweep(args) -> dict:
    torch.set_num_threads(1)  # as engine_main sets it for a CUDA engine
    model = load_model(REPO / "model_weights" / "digits-mlp")
    rng = np.random.default_rng(0)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        cache = args.tuning_cache or Path(tmp) / "tuning.json"
        runners = {}
        for mode in ("fused", "unfused"):
            settings = Settings(mode=mode, dtype="float16", tuning_cache=cache, max_batch_size=MAX_BATCH)
            metrics = EngineMetrics(model.name, mode, "cuda:0", "float16", engine=mode)
            runners[mode] = build_runner(settings, torch.device("cuda"), "float16", model, metrics)
            t = time.perf_counter()
            runners[mode].warmup(MAX_BATCH)
            print(f"{mode}: warm in {time.perf_counter() - t:.1f} s", flush=True)
        print("per batch, µs: host (launch + collect, as /metrics) mean / median; launch and wait medians; GPU "
              "median (events around the replay)", flush=True)  # fmt: skip
        for requests, each in SHAPES:
            parts = [(rng.random((each, 64)) * 16).astype(np.float16) for _ in range(requests)]
            for gap_ms, spin_ms in GAPS_MS:
                n = max(30, min(400, int(SPAN_S / max(gap_ms * 1e-3, 3e-3)))) // ROUNDS
                samples = {mode: [] for mode in runners}
                for _ in range(ROUNDS):
                    for mode, runner in runners.items():
                        # the first batch of a turn comes after the other mode's: left out
                        samples[mode] += _batches(runner, parts, gap_ms * 1e-3, spin_ms * 1e-3, n)[1:]
                for mode, s in samples.items():
                    host, launch, wait, gpu = (list(c) for c in zip(*s, strict=True))
                    row = {
                        "requests": requests, "rows": requests * each, "gap_ms": gap_ms, "spin_ms": spin_ms,
                        "batches": len(s),
                        "host_mean": statistics.fmean(host), "host_median": statistics.median(host),
                        "launch_median": statistics.median(launch), "wait_median": statistics.median(wait),
                        "gpu_median": statistics.median(gpu), "gpu_mean": statistics.fmean(gpu),
                    }  # fmt: skip
                    results[f"{mode} {requests}x{each} gap={gap_ms:g}ms spin={spin_ms:g}ms"] = row
                    print(f"{mode:7s} {requests:4d} x {each:2d} rows, gap {gap_ms:4g} ms (spin {spin_ms:4g}): host "
                          f"{row['host_mean']:6.1f} / {row['host_median']:6.1f}  launch {row['launch_median']:6.1f}  "
                          f"wait {row['wait_median']:6.1f}  GPU {row['gpu_median']:6.1f} (mean {row['gpu_mean']:6.1f})",
                          flush=True)  # fmt: skip
    return results


def _options(p) -> None:
    p.add_argument("--tuning-cache", type=Path, help="the tuner's cache to read (a fresh one: tunes every bucket)")


if __name__ == "__main__":
    main("forward_gap", sweep, _options)
