"""First timing of a served model's forward, fused vs unfused, as the service runs it.

    python -m bench.forward_timing [--model digits-mlp] [--dtype float32] [--batches 1,32,256] [--out DIR]

For each mode and batch size, three numbers per call (median of --iters calls, fresh random rows,
inputs rotated over 8 buffers so no call reads what the last one left in L2):
  device us : CUDA events around executor.forward on device-resident input (all of the plan's kernels)
  wall us   : host clock around executor.forward + synchronize: Python and launch overhead included
  e2e us    : host clock around ModelRunner.run: numpy in, H2D copy, forward, D2H copy, numpy out
            (what one batch costs the service's worker thread)
Writes a markdown table (and prints it). Not the full provider-by-provider benchmark (cuBLASLt,
torch.compile, CUDA graphs): that is `bench/` work in a later issue.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from service.config import Settings
from service.model.executors import Executor
from service.model.loader import load_model
from service.model.runner import DTYPES, ModelRunner, warmup_sizes

ROTATE = 8


def _median_device_us(fn, inputs, iters):
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        fn(inputs[i % ROTATE])
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)) * 1e3


def _median_wall_us(fn, inputs, iters, sync):
    times = []
    for i in range(iters):
        t = time.perf_counter()
        fn(inputs[i % ROTATE])
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


@torch.inference_mode()  # as the service runs it (ModelRunner.run)
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="digits-mlp")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--batches", default="1,32,256")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model = load_model(Settings(model=args.model).model_path())
    batches = [int(b) for b in args.batches.split(",")]
    iters = args.iters if cuda else max(3, args.iters // 50)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    rows = []
    for mode in ("unfused", "fused"):
        ex = Executor(model, mode, device, DTYPES[args.dtype])
        runner = ModelRunner(model, mode, device, args.dtype)
        runner.warmup(max(batches))  # compile + autotune every bucket first
        for b in sorted(set(batches) | set(warmup_sizes(max(batches), device))):
            runner.run(np.random.default_rng(b).standard_normal((b, *model.input_shape), dtype=np.float32))
        for b in batches:
            gen = torch.Generator().manual_seed(b)
            host = [torch.randn((b, *model.input_shape), generator=gen) for _ in range(ROTATE)]
            dev = [h.to(device, DTYPES[args.dtype]) for h in host]
            nps = [h.numpy() for h in host]
            for x in dev[:3]:
                ex.forward(x)
            sync()
            device_us = _median_device_us(ex.forward, dev, iters) if cuda else float("nan")
            wall_us = _median_wall_us(ex.forward, dev, iters, sync)
            e2e_us = _median_wall_us(runner.run, nps, iters, lambda: None)
            rows.append((mode, b, device_us, wall_us, e2e_us))
            print(f"{mode:8s} batch {b:5d}: device {device_us:8.1f} us  wall {wall_us:8.1f} us  e2e {e2e_us:8.1f} us",
                  flush=True)  # fmt: skip

    name = torch.cuda.get_device_name() if cuda else "CPU (Triton interpreter for fused)"
    import triton

    lines = [
        f"# {model.name} forward, {args.dtype}: fused vs unfused",
        "",
        f"Device: {name}; torch {torch.__version__}; triton {triton.__version__}; "
        f"TF32 {'on' if torch.backends.cuda.matmul.allow_tf32 else 'off'}; median of {iters} calls.",
        f"Command: `python -m bench.forward_timing --model {args.model} --dtype {args.dtype} --batches {args.batches}`",
        "",
        "| batch | unfused device us | fused device us | device speedup | unfused wall us | fused wall us "
        "| unfused e2e us | fused e2e us |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by = {(m, b): (d, w, e) for m, b, d, w, e in rows}
    for b in batches:
        ud, uw, ue = by[("unfused", b)]
        fd, fw, fe = by[("fused", b)]
        lines.append(f"| {b} | {ud:.1f} | {fd:.1f} | {ud / fd:.2f}x | {uw:.1f} | {fw:.1f} | {ue:.1f} | {fe:.1f} |")
    lines += ["", "device: CUDA events around the plan's kernels; wall: host clock incl. launch overhead; "
              "e2e: numpy in -> numpy out (copies included)."]  # fmt: skip
    table = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"forward_{model.name}_{args.dtype}.md"
    path.write_text(table)
    print(table)


if __name__ == "__main__":
    main()
