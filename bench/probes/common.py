"""What the probes share: timing a CUDA graph cold and hot, forcing a kernel config, the digits MLP's
layers on the GPU, two trivial kernels (one store; a pure read), and the command-line runner.

    python -m bench.probes.NAME --out DIR     # writes DIR/probe_NAME.json; the log goes to stdout
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.mlp import MLPLayer
from kernels.pdl import gdc_launch_dependents, gdc_wait
from service.model.loader import load_model
from service.model.planner import group_mlps, plan

from ..kernels.timing import Timing, back_to_back_us, capture, device_us

REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def tuned_by(module, tune):
    """module's kernels call `tune` (kernels.tuning.tune's signature) instead of the tuner, until the block ends."""
    orig = module.tune
    module.tune = tune
    try:
        yield
    finally:
        module.tune = orig


def forced(module, cfg):
    """module's kernels take cfg instead of tuning, until the block ends."""
    return tuned_by(module, lambda *a, **k: cfg)


def graph_us(fn) -> float:
    """Device us of one replay of fn captured as a CUDA graph, cold (L2 cleared by reading, as the benchmark)."""
    graph, _ = capture(fn)
    return device_us(graph.replay, Timing())


def replay_cold_hot(fn, ref: torch.Tensor, warmups: int) -> dict:
    """fn captured as a CUDA graph (after `warmups` calls): its replay's cold time (L2 cleared by reads), hot time
    (bench.kernels.timing.back_to_back_us, 200 replays) and the captured output's normwise error against `ref`, as the
    conv probes report them."""
    from kernels.cold_timing import cold_us
    from kernels.graph_capture import capture as capture_graph

    graph, y = capture_graph(fn, warmups=warmups)
    graph.replay()  # a tensor fn allocates under capture holds nothing until the graph first runs
    torch.cuda.synchronize()
    err = float((y.float() - ref).norm() / ref.norm())
    return {
        "cold_us": cold_us(graph.replay, warmup_ms=5, rep_ms=30),
        "hot_us": back_to_back_us(graph.replay, 200, warmups=5),
        "err": err,
    }


def hot_graph_us(fn) -> float:
    """Back to back in one graph (do_bench_cudagraph): weights stay in L2 between calls, as in a busy server."""
    return float(triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")) * 1e3


def relu_layer(M, K, N, dtype):
    """x, W, b of one layer (outputs O(1) whatever K) and relu(x W^T + b) in float64, all on the GPU."""
    x = torch.randn(M, K, device="cuda").to(dtype)
    w = (torch.randn(N, K, device="cuda") / K**0.5).to(dtype)
    b = torch.randn(N, device="cuda").to(dtype)
    return x, w, b, torch.relu(F.linear(x.double(), w.double(), b.double()))


def digits_layers(dtype=torch.float16) -> list[MLPLayer]:
    """The shipped digits MLP's layers, on the GPU in dtype."""
    digits = load_model(REPO / "model_weights" / "digits-mlp")
    steps = [s for step in group_mlps(plan(digits.ops), digits.tensors) for s in getattr(step, "layers", [])]
    t = {k: v.to("cuda", dtype).contiguous() for k, v in digits.tensors.items()}
    return [MLPLayer(t[s.weight], t[s.bias] if s.bias else None, s.activation) for s in steps]


@triton.jit
def one_store(y_ptr, PDL: tl.constexpr = False):
    """Stores one float; with PDL (launched with launch_pdl), waits for the kernel before it and lets the next in."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    tl.store(y_ptr, 1.0)


@triton.jit
def stream_sum(w_ptr, out_ptr, n, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    """Reads STEPS blocks of BLOCK fp16 values and stores one sum: what a pure weight stream costs."""
    base = tl.program_id(0) * BLOCK * STEPS
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(STEPS):
        acc += tl.load(w_ptr + base + s * BLOCK + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


def one_store_floor() -> dict:
    """A kernel that stores one float, replayed from a graph cold and hot: the fixed cost of one graph
    replay under each method, which no forward can go below."""
    y = torch.empty(1, device="cuda")
    floor = {"cold": graph_us(lambda: one_store[(1,)](y)), "hot": hot_graph_us(lambda: one_store[(1,)](y))}
    print(f"one-store kernel, graph replay: cold {floor['cold']:.2f} us, hot {floor['hot']:.2f} us", flush=True)
    return floor


def write_named_by_gpu(out: Path | None, name: str, text: str, rows: list) -> None:
    """A probe's table and rows as out/<name>_<gpu>.txt and .json (probe_conv_h100.txt: the names results/ keeps);
    without --out, into bench/results/<gpu>/."""
    from bench.gpu import results_dir, slug_of

    slug = slug_of(torch.cuda.get_device_name())
    out = results_dir(slug) if out is None else out
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"{name}_{slug}"
    base.with_suffix(".txt").write_text(text)
    base.with_suffix(".json").write_text(json.dumps(rows, indent=1))


def main(
    name: str, sweep: Callable[..., dict], options: Callable[[argparse.ArgumentParser], None] | None = None
) -> None:
    """Run one probe: print the device, run sweep(), write its result to --out/probe_<name>.json.
    `options` adds the probe's own arguments to the parser; sweep then gets the parsed arguments."""
    p = argparse.ArgumentParser(prog=f"python -m bench.probes.{name}")
    p.add_argument("--out", type=Path, default=Path("."))
    if options is not None:
        options(p)
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.exit(2, f"{p.prog}: no CUDA GPU here; the probes time kernels on one\n")
    t0 = time.time()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    result = sweep(args) if options is not None else sweep()
    (args.out / f"probe_{name}.json").write_text(json.dumps(result, default=str, indent=1))
    print(f"[{time.time() - t0:.0f}s]", flush=True)
