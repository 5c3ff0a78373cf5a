"""How much of a cold timing is the flush's own write-back?

`triton.testing.do_bench` clears L2 before every rep by zeroing a 256 MB buffer. That leaves L2 (50 MB on
an H200) full of dirty lines, so a timed call that reads from DRAM first has L2 write those lines back.
Nothing in a serving loop dirties L2 like that. Flushing by reading 256 MB leaves L2 as cold but clean.

Times each case two ways, L2 flushed by zeroing and by reading (kernels/cold_timing.py):
- a kernel that stores one float (the fixed cost of one graph replay under the method)
- a kernel that only reads 8, 32 and 48 MB of fp16 (what a weight stream can reach)
- the wide MLP (1024-4096-4096-1024, fp16) at batch 1: ours (GraphedExecutor), and F.linear + relu and
  torch.compile (default) under a CUDA graph
- 1024^3 fp16 relu: FusedLinear against the cuBLASLt epilogue, each a graph replay
- the digits MLP at batches 1 and 256: ours against F.linear + relu and torch.compile
and a third column with no flush at all, which with nothing keeping the device busy times the host's
launch gaps, not the kernel.

    python -m bench.probes.l2_flush --out DIR

What it finds (H200; bench/results/h200/probe_l2_flush_h200.txt), zeroing against reading: one-store 3.94
against 3.01 us; reading 48 MB 24.6 against 19.2; 1024^3 fp16 ours 10.78 against 10.30, cuBLASLt 10.21
against 9.84; the wide MLP at batch 1 ours 26.1 against 21.3, torch.compile 37.9 against 33.2.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from kernels import FusedLinear
from kernels.cold_timing import FLUSH_BYTES, cold_us

from ..kernels.models import ModelProviders, build_wide, load_named
from ..kernels.timing import capture
from .common import main, one_store, stream_sum

FLUSHES = ("write", "read")
_CACHE = {}


def flushed_us(fn, flush: str) -> float:
    """Median cold device time of fn in us, L2 cleared by "write" (zero 256 MB, as do_bench) or "read"."""
    if flush == "read":
        return cold_us(fn)
    if "zeros" not in _CACHE:
        _CACHE["zeros"] = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    return cold_us(fn, flush=_CACHE["zeros"].zero_)


def _graphed(fn):
    graph, _ = capture(fn)
    _CACHE.setdefault("graphs", []).append(graph)  # kept alive for the run
    return graph.replay


def sweep() -> dict:
    rows = []

    def row(name, fn, nbytes=None):
        r = {"case": name, **{f: flushed_us(fn, f) for f in FLUSHES}}
        if nbytes:
            r["bytes"] = nbytes
        rows.append(r)
        rates = f"   read at {nbytes / r['read'] / 1e6:.2f} TB/s" if nbytes else ""
        print(f"   {name:40s} write {r['write']:7.2f}   read {r['read']:7.2f} us{rates}", flush=True)

    y = torch.empty(1, device="cuda")
    row("one-store kernel (graph)", _graphed(lambda: one_store[(1,)](y)))
    out = torch.empty(1 << 16, device="cuda")
    for mb in (8, 32, 48):
        w = torch.randn((mb << 20) // 2, device="cuda").to(torch.float16)
        grid = (w.numel() // (8192 * 4),)
        row(f"read {mb} MB (graph)", _graphed(lambda w=w, grid=grid: stream_sum[grid](
            w, out, w.numel(), BLOCK=8192, STEPS=4, num_warps=4)), nbytes=mb << 20)  # fmt: skip

    x = torch.randn(1024, 1024, device="cuda").to(torch.float16)
    wt = (torch.randn(1024, 1024, device="cuda") / 32).to(torch.float16)
    b = torch.randn(1024, device="cuda").to(torch.float16)
    lin = FusedLinear(wt, b, "relu")
    row("1024^3 fp16 relu: ours (graph)", _graphed(lambda: lin(x)))
    row("1024^3 fp16 relu: cuBLASLt (graph)", _graphed(lambda: torch._addmm_activation(b, x, wt.t())))

    with tempfile.TemporaryDirectory() as tmp:
        for name, batches in (("wide", (1,)), ("digits", (1, 256))):
            model = build_wide(Path(tmp), seed=0) if name == "wide" else load_named(name, Path(tmp), 0)
            providers = ModelProviders(model, torch.device("cuda"), torch.float16, max_batch_size=max(batches))
            nbytes = sum(t.numel() * 2 for t in model.tensors.values()) if name == "wide" else None
            for batch in batches:
                xin = torch.randn(batch, model.input_features, device="cuda").to(torch.float16)
                for prov in ("ours", "linear", "compile"):
                    prep = providers.prepare(prov, xin)
                    fn = prep.fn if prep.graphed else _graphed(prep.fn)
                    row(f"{name} batch {batch}: {prov} (graph)", fn, nbytes=nbytes)
    return {"rows": rows}


if __name__ == "__main__":
    main("l2_flush", sweep)
