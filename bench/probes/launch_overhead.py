"""Where a fused forward's host time goes: per-layer launch cost with and without inference_mode,
and whether each layer launches from its cached tuned config (no autotuner on the hot path).

    python -m bench.probes.launch_overhead [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from service.config import Settings
from service.model.executors import Executor
from service.model.loader import load_model
from service.model.runner import DTYPES


def _wall_us(fn, x, iters=300):
    for _ in range(20):
        fn(x)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn(x)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    args = p.parse_args()
    model = load_model(Settings().model_path())
    dev = torch.device("cuda")
    for mode in ("unfused", "fused"):
        ex = Executor(model, mode, dev, DTYPES[args.dtype])
        for b in (1, 32):
            x = torch.randn(b, *model.input_shape, device=dev).to(DTYPES[args.dtype])
            plain = _wall_us(ex.forward, x)
            with torch.inference_mode():
                xi = x.clone()
                inf = _wall_us(ex.forward, xi)
            cached = [len(getattr(layer, "configs", {})) for _, layer in ex.layers if hasattr(layer, "configs")]
            print(f"{mode:8s} {args.dtype} batch {b:3d}: plain {plain:7.1f} us  inference_mode {inf:7.1f} us  "
                  f"cached configs per layer {cached}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
