"""Development probe (issue 3): the wide MLP at batch 1 with more W tiles in flight per GEMV program.

A kernel that only reads 48 MB cold went 18.3 -> 16.2 us when each program issued its four loads before
using any (bench/results/probe_stream_h200.txt). The GEMV (kernels/linear_gemv.py) had one W tile in
flight per program in its K loop; its UNROLL config now requests the first 1, 2 or 4 tiles before the
PDL wait. This times every GEMV candidate per layer of the wide MLP (fp16, cold graph replays, L2 cleared
by reads as the benchmark), then the three-layer chain with the best UNROLL=1 picks, with the best picks
of any UNROLL, and as the tuner picks (what the service runs).

    python -m bench.probe_hopper --only gemv-unroll --out $OUT

What it found (H200; bench/results/probe_gemv_unroll_h200.txt): no gain. 1x4096x4096 8x1024: 14.05 us at
UNROLL 1, 15.78 at 2, 14.62 at 4; 16x512 and 32x256 likewise (18.4-18.6 at 4). The chain: 21.47 us with
the best UNROLL=1 picks, 21.62 with the best of any (the same picks), 21.63 tuned. UNROLL was taken out.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

import kernels.linear as linear_mod
import kernels.linear_gemv as gemv
from kernels import FusedLinear
from kernels.cold_timing import cold_us

from .kernel_timing import capture

LAYERS = ((1024, 4096, "relu"), (4096, 4096, "relu"), (4096, 1024, "none"))  # (K, N, activation)


@contextlib.contextmanager
def picks_by_shape(table: dict):
    """FusedLinear's tuner returns table[(N, K)] for a layer of that shape, until the block ends."""
    orig = linear_mod.tune

    def pick(scope, key, candidates, run, bench=None):
        n, k = (int(part[1:]) for part in key.split("|")[:2])
        return table[(n, k)]

    linear_mod.tune = pick
    try:
        yield
    finally:
        linear_mod.tune = orig


def _cold_graph(fn) -> float:
    graph, _ = capture(fn)
    return cold_us(graph.replay)


def sweep() -> dict:
    dtype = torch.float16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    weights = []
    for k, n, act in LAYERS:
        w = (torch.randn(n, k, device="cuda") * (2.0 / k) ** 0.5).to(dtype)
        weights.append((w, (torch.randn(n, device="cuda") * 0.1).to(dtype), act))
    x0 = torch.randn(1, LAYERS[0][0], device="cuda").to(dtype)
    ref = x0.double()
    for w, b, act in weights:
        ref = F.linear(ref, w.double(), b.double())
        ref = torch.relu(ref) if act == "relu" else ref

    res = {"layers": [], "chains": []}
    best_any, best_one = {}, {}
    for (w, b, act), (k, n, _) in zip(weights, LAYERS, strict=True):
        x = torch.randn(1, k, device="cuda").to(dtype)
        rows = []
        for cfg in gemv.cuda_configs(n, k, sms):
            with picks_by_shape({(n, k): cfg}):
                fl = FusedLinear(w, b, act)
                want = F.linear(x.double(), w.double(), b.double())
                want = torch.relu(want) if act == "relu" else want
                err = float((fl(x).double() - want).norm() / want.norm())
                us = _cold_graph(lambda fl=fl, x=x: fl(x))
            rows.append({"config": cfg.meta(), "us": us, "err": err})
            print(f"   1x{k}x{n}: {us:7.2f} us  err {err:.1e}  {cfg.meta()}", flush=True)
            if us < best_any.get((n, k), (float("inf"),))[0]:
                best_any[(n, k)] = (us, cfg)
            if cfg["UNROLL"] == 1 and us < best_one.get((n, k), (float("inf"),))[0]:
                best_one[(n, k)] = (us, cfg)
        res["layers"].append({"K": k, "N": n, "rows": rows})

    def chain_us(label: str, table: dict | None) -> None:
        with picks_by_shape(table) if table is not None else contextlib.nullcontext():
            fls = [FusedLinear(w, b, act) for w, b, act in weights]

            def chain():
                h = x0
                for fl in fls:
                    h = fl(h)
                return h

            err = float((chain().double() - ref).norm() / ref.norm())
            us = _cold_graph(chain)
        picks = {
            f"{n}x{k}": [cfg.meta() for cfg in fl.configs.values()] for fl, (k, n, _) in zip(fls, LAYERS, strict=True)
        }
        res["chains"].append({"chain": label, "us": us, "err": err, "picks": picks})
        print(f"chain {label:26s} {us:7.2f} us  err {err:.1e}  {picks}", flush=True)

    chain_us("best UNROLL=1 per layer", {key: cfg for key, (_, cfg) in best_one.items()})
    chain_us("best of any UNROLL", {key: cfg for key, (_, cfg) in best_any.items()})
    chain_us("tuned (as served)", None)
    return res
