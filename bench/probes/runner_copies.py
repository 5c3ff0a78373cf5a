"""Does a batch's forward get cheaper when its copies in and out are inside the CUDA graph?

The engine's forward per batch is host time around a few microseconds of kernels: a cast into pinned
memory, the copy in, the replay, the copy out, a synchronisation. Two ways, timed interleaved (round r runs
each once; a variant's figure is its median round), host microseconds per batch over CALLS back-to-back
batches, the shipped digits MLP and digits CNN in float16, fused and unfused, at 1, 64 and 700 rows (tuning
off: both ways run the same kernel configs):
- `copies outside`: a plain graph per bucket; the batch is cast into a pinned buffer, copied into the graph's
  input with one torch call, replayed, copied out with another, and the stream synchronised
- `copies inside`: the service's ModelRunner, whose graphs (GraphedExecutor host_io) copy in, run and copy
  out in one replay

    python -m bench.probes.runner_copies --out DIR
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from kernels import tuning
from service.model.executors import Executor
from service.model.graphs import GraphedExecutor
from service.model.loader import load_model
from service.model.runner import ModelRunner

from .common import REPO, main

CALLS = 500
ROUNDS = 7
ROWS = (1, 64, 700)
MAX_BATCH = 1024


class CopiesOutside:
    """The forward with its copies issued from Python around a plain graph."""

    def __init__(self, model, mode: str):
        ex = Executor(model, mode, torch.device("cuda"), torch.float16)
        self.graphs = GraphedExecutor(ex, MAX_BATCH)
        self.graphs.capture_all()
        self.host_in = torch.empty((MAX_BATCH, *model.input_shape), dtype=torch.float16, pin_memory=True)
        self.host_out = torch.empty((MAX_BATCH, model.output_features), dtype=torch.float16, pin_memory=True)
        self.stream = torch.cuda.current_stream()

    def run(self, batch: np.ndarray) -> np.ndarray:
        rows = batch.shape[0]
        host_in = self.host_in[:rows]
        host_in.copy_(torch.from_numpy(batch))
        y = self.graphs.forward(host_in, non_blocking=True)
        host_out = self.host_out[:rows]
        host_out.copy_(y, non_blocking=True)
        self.stream.synchronize()
        return host_out.to(torch.float32, copy=True).numpy()


def per_batch_us(run, batch: np.ndarray) -> float:
    run(batch)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(CALLS):
        run(batch)
    return (time.perf_counter() - t) / CALLS * 1e6


def sweep() -> dict:
    tuning.set_enabled(False)
    results = {}
    rng = np.random.default_rng(0)
    for name in ("digits-mlp", "digits-cnn"):
        model = load_model(REPO / "model_weights" / name)
        for mode in ("fused", "unfused"):
            inside = ModelRunner(model, mode, torch.device("cuda"), "float16", kernel_timing_every=0,
                                 max_batch_size=MAX_BATCH)  # fmt: skip
            inside.warmup(MAX_BATCH)
            outside = CopiesOutside(model, mode)
            for rows in ROWS:
                batch = (rng.random((rows, *model.input_shape), dtype=np.float32) * 16).astype(np.float32)
                np.testing.assert_allclose(inside.run(batch), outside.run(batch), rtol=1e-2, atol=1e-2)
                runs = {"copies outside": [], "copies inside": []}
                for _ in range(ROUNDS):
                    runs["copies outside"].append(per_batch_us(outside.run, batch))
                    runs["copies inside"].append(per_batch_us(inside.run, batch))
                row = {k: statistics.median(v) for k, v in runs.items()}
                results[f"{name} {mode} rows={rows}"] = row
                print(f"{name:10s} {mode:7s} rows={rows:4d}: copies outside {row['copies outside']:6.1f} us, "
                      f"copies inside {row['copies inside']:6.1f} us per batch", flush=True)  # fmt: skip
    return results


if __name__ == "__main__":
    main("runner_copies", sweep)
