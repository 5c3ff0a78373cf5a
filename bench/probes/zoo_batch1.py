"""Does each zoo family serve fused at batch 1, how long until its first graph is captured, and where does it stand
against the module in eager channels_last? A quick look for one short device call, not the zoo's full timing
(`fusedserve bench zoo --gpu`: compile anchors, onnxruntime, batch 256, tuning on).

Per family (bench/zoo/families.py, full size): export_module (torch.export), load, Executor("fused") in fp16 under a
GraphedExecutor of one bucket; the capture's seconds (tuning as FUSEDSERVE_TUNING says: `false` takes each kernel's
first candidate untimed, so a start compiles one config a key); the output's error against the module in float64;
hot device time per replay (median of 50, CUDA events), against the fp16 module in channels_last replayed from a
CUDA graph; and how many steps the fused plan runs with torch ops in them.

    FUSEDSERVE_TUNING=false python -m bench.probes.zoo_batch1 --out DIR squeezenet1_1 mobilenet_v2 ...
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

REPS = 50


def _replays(fn) -> float:
    """Median µs of `fn` (itself a graph replay) over REPS calls, each between two CUDA events."""
    fn()
    times = []
    for _ in range(REPS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def _graphed(fn) -> float:
    """Median µs of one replay of `fn` captured into a CUDA graph (warmed on a side stream first)."""
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        fn()
    return _replays(graph.replay)


def family(name: str) -> dict:
    from bench.zoo import exporters, families
    from service.model.executors import Executor, torch_parts
    from service.model.graphs import GraphedExecutor

    dev = torch.device("cuda")
    module = families.build(name, "full", 0).eval()
    image = families.image_shape(name, "full")
    t = time.perf_counter()
    model = exporters.load(exporters.export("torch.export", module, image, Path(tempfile.mkdtemp()), name))
    load_s = time.perf_counter() - t
    executor = Executor(model, "fused", dev, torch.float16)
    graphed = GraphedExecutor(executor, 1)
    t = time.perf_counter()
    graphed.capture(1)
    torch.cuda.synchronize()
    ready_s = time.perf_counter() - t
    x = torch.randn(1, *image, device=dev, dtype=torch.float16)
    exact = copy.deepcopy(module).to(dev).double()
    eager = module.to(dev).half().to(memory_format=torch.channels_last)
    xc = x.to(memory_format=torch.channels_last)
    with torch.no_grad():
        ref = exact(x.double()).float()
        ours_out = graphed.forward(x).float()
        eager_out = eager(xc).float()
        row = {
            "family": name, "load_s": round(load_s, 1), "ready_s": round(ready_s, 1),
            "error": float((ours_out - ref).norm() / ref.norm()),
            "eager_error": float((eager_out - ref).norm() / ref.norm()),
            "ours_us": round(_replays(lambda: graphed.forward(x))),
            "eager_cl_us": round(_graphed(lambda: eager(xc))),
            "steps": len(executor.steps), "torch_steps": sum(1 for s in executor.steps if torch_parts(s)),
        }  # fmt: skip
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/probes"))
    parser.add_argument("families", nargs="+")
    args = parser.parse_args()
    rows = []
    for name in args.families:
        try:
            rows.append(family(name))
        except Exception as e:  # noqa: BLE001 - a family that fails is a finding; the next one runs
            rows.append({"family": name, "error_message": repr(e)[:300]})
        print(rows[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "probe_zoo_batch1.json").write_text(json.dumps(rows, indent=1))
    print("family | load s | ready s | error | eager fp16 error | ours hot us | eager-cl graph us | steps / with torch")
    for r in rows:
        if "error_message" in r:
            print(f"{r['family']} | {r['error_message']}")
        else:
            print(f"{r['family']} | {r['load_s']} | {r['ready_s']} | {r['error']:.1e} | {r['eager_error']:.1e} | "
                  f"{r['ours_us']} | {r['eager_cl_us']} | {r['steps']} / {r['torch_steps']}")  # fmt: skip


if __name__ == "__main__":
    main()
