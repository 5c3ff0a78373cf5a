"""How fast can one kernel read 48 MB cold, the wide MLP's weights at batch 1?

The wide MLP's batch-1 goal is 75% of the copy-bandwidth floor. This asks what any kernel that only reads
the weights can reach: a loop of dependent loads, the loads unrolled so each program has all of them in
flight, a persistent grid striding over the tensor, eviction hints, and torch's own sum, each timed cold
with L2 flushed by zeroing (do_bench's way) and by reading.

    python -m bench.probes.stream --out DIR

What it finds (H200; bench/results/h200/probe_stream_h200.txt): the best shape, 8192x2 unrolled over 4 warps,
reads 48 MB in 16.0 us cold (3.14 TB/s); the loop with one load in flight 18.3; persistent grids are no
faster (16.4 at 8 programs per SM, 19.5 at 2). So the wide MLP's 50 MB floor of 11.9 us is 74% of what
the fastest pure read takes. evict_first helps only when L2 was cleared by zeroing (18.6 against 21.0):
it evicts the kernel's own clean lines instead of the flush's dirty ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import main, stream_sum
from .l2_flush import _graphed, flushed_us


@triton.jit
def _stream_unrolled(w_ptr, out_ptr, BLOCK: tl.constexpr, STEPS: tl.constexpr, EVICT_FIRST: tl.constexpr):
    """STEPS loads of BLOCK fp16, all issued before the first add: STEPS * BLOCK * 2 bytes in flight."""
    base = tl.program_id(0) * BLOCK * STEPS
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(STEPS):
        if EVICT_FIRST:
            acc += tl.load(w_ptr + base + s * BLOCK + tl.arange(0, BLOCK), eviction_policy="evict_first").to(tl.float32)
        else:
            acc += tl.load(w_ptr + base + s * BLOCK + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


@triton.jit
def _stream_persistent(w_ptr, out_ptr, CHUNKS, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    """Programs stride over CHUNKS chunks of UNROLL * BLOCK fp16, UNROLL loads in flight per step."""
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in range(tl.program_id(0), CHUNKS, tl.num_programs(0)):
        base = c * BLOCK * UNROLL
        for s in tl.static_range(UNROLL):
            acc += tl.load(w_ptr + base + s * BLOCK + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


def sweep(mb: int = 48) -> dict:
    w = torch.randn((mb << 20) // 2, device="cuda").to(torch.float16)
    out = torch.empty(1 << 16, device="cuda")
    sink = torch.empty((), device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = w.numel()
    variants = {"torch sum": lambda: torch.sum(w, dim=0, dtype=torch.float32, out=sink)}
    variants["loop 8192x4 w4"] = lambda: stream_sum[(n // (8192 * 4),)](w, out, n, BLOCK=8192, STEPS=4, num_warps=4)
    for block, steps, warps in ((4096, 2, 4), (4096, 4, 4), (8192, 2, 4), (8192, 4, 4), (8192, 4, 8), (8192, 8, 8),
                                (16384, 2, 8), (2048, 4, 2)):  # fmt: skip
        for evict in (False, True) if (block, steps, warps) == (8192, 4, 4) else (False,):
            grid = (n // (block * steps),)
            variants[f"unrolled {block}x{steps} w{warps}{' evict_first' if evict else ''}"] = (
                lambda grid=grid, block=block, steps=steps, warps=warps, evict=evict: _stream_unrolled[grid](
                    w, out, BLOCK=block, STEPS=steps, EVICT_FIRST=evict, num_warps=warps
                )
            )
    for per_sm, block, unroll, warps in ((1, 8192, 4, 8), (2, 8192, 4, 4), (4, 4096, 4, 4), (8, 4096, 2, 4),
                                         (4, 8192, 2, 4)):  # fmt: skip
        chunks = n // (block * unroll)
        grid = (sms * per_sm,)
        variants[f"persistent {per_sm}/SM {block}x{unroll} w{warps}"] = (
            lambda grid=grid, chunks=chunks, block=block, unroll=unroll, warps=warps: _stream_persistent[grid](
                w, out, chunks, BLOCK=block, UNROLL=unroll, num_warps=warps
            )
        )
    rows = []
    for name, fn in variants.items():
        try:
            fn()
            torch.cuda.synchronize()
            g = _graphed(fn)
            r = {"variant": name, "write": flushed_us(g, "write"), "read": flushed_us(g, "read")}
        except Exception as e:  # a variant that does not compile or launch is reported, not fatal
            print(f"   {name:40s} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        rows.append(r)
        print(f"   {name:40s} write {r['write']:7.2f} us   read {r['read']:7.2f} us "
              f"({(mb << 20) / r['read'] / 1e6:.2f} TB/s)", flush=True)  # fmt: skip
    return {"mb": mb, "rows": rows}


if __name__ == "__main__":
    main("stream", sweep)
