"""The least a cold forward of the digits MLP (64-256-256-10, fp16) can take, whatever the kernel.

Any forward must at least read the model's 172 KB of packed weights and the input from memory and store
the output; if it spreads the weights over P programs to read them in parallel, their results must also
meet once (the last program to arrive combines them). This times exactly that and nothing else, the
floor of every design of that shape:

- P programs (P = 1 to 64, 4, 8 or 16 warps), each loading its 1/P of the 172 KB with every load issued at
  once (one masked tile load, up to 16384 elements per program; more in a pipelined loop), plus the 64 inputs
- each reduces what it read to one fp32 value (so the loads cannot be dropped) and stores it
- for P > 1: an acq_rel arrival counter; the last program reads the P values and stores the result
  (and resets the counter), as the whole-MLP kernel's split does
- no MMA, no layer after layer: a real forward has those as well

beside a kernel that stores one float (the fixed cost of one graph replay cold) and the digits FusedMLP at
batch 1 (the tuned kernel), each a graph replay timed cold (kernels/cold_timing.py) and hot (back to back).

    python -m bench.probes.digits_floor --out DIR

What it finds (H200; bench/results/h200/probe_digits_floor_h200.txt): at least 6.67 us cold (16 programs,
8 warps; 9.1 in one program), against 8.93 for the FusedMLP and 2.75 for the one-store kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.mlp import FusedMLP

from .common import digits_layers, graph_us, hot_graph_us, main, one_store_floor

W_ELEMENTS = 64 * 256 + 256 * 256 + 256 * 16  # the packed (padded) digits weights, fp16: 172,032 bytes
MAX_TILE = 16384  # elements one program loads in one tile (128 per thread at 4 warps: 64 registers)


@triton.jit
def _read_and_meet(w_ptr, x_ptr, part_ptr, cnt_ptr, y_ptr, N, SHARE: tl.constexpr, TILE: tl.constexpr,
                   P: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    x = tl.load(x_ptr + tl.arange(0, 64)).to(tl.float32)
    acc = tl.sum(x, axis=0)
    base = pid * SHARE
    if SHARE <= TILE:  # every load of the share issued at once
        offs = base + tl.arange(0, TILE)
        w = tl.load(w_ptr + offs, mask=(offs < base + SHARE) & (offs < N), other=0.0)
        acc += tl.sum(w.to(tl.float32), axis=0)
    else:
        for i in tl.range(0, SHARE, TILE, num_stages=STAGES):
            offs = base + i + tl.arange(0, TILE)
            w = tl.load(w_ptr + offs, mask=(offs < base + SHARE) & (offs < N), other=0.0)
            acc += tl.sum(w.to(tl.float32), axis=0)
    if P == 1:
        tl.store(y_ptr, acc)
    else:
        tl.store(part_ptr + pid, acc)
        arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel")
        if arrived == P - 1:
            total = tl.sum(tl.load(part_ptr + tl.arange(0, P)), axis=0)
            tl.store(y_ptr, total)
            tl.store(cnt_ptr, 0)


def floor_case(programs: int, num_warps: int) -> dict:
    w = torch.randn(W_ELEMENTS, device="cuda").to(torch.float16)
    x = torch.randn(64, device="cuda").to(torch.float16)
    part = torch.empty(max(programs, 1), device="cuda", dtype=torch.float32)
    cnt = torch.zeros(1, device="cuda", dtype=torch.int32)
    y = torch.empty(1, device="cuda", dtype=torch.float32)
    share = triton.cdiv(W_ELEMENTS, programs)
    tile = min(MAX_TILE, triton.next_power_of_2(share))

    def call():
        _read_and_meet[(programs,)](w, x, part, cnt, y, W_ELEMENTS, SHARE=share, TILE=tile, P=programs, STAGES=4,
                                    num_warps=num_warps)  # fmt: skip

    call()
    torch.cuda.synchronize()
    want = float(w.float().sum() + x.float().sum() * programs)
    got = float(y)
    assert abs(got - want) <= 1e-3 * (abs(want) + W_ELEMENTS**0.5), f"P={programs}: {got} != {want}"
    assert int(cnt) == 0
    return {"programs": programs, "warps": num_warps, "cold": graph_us(call), "hot": hot_graph_us(call)}


def sweep() -> dict:
    floor = one_store_floor()
    layers = digits_layers()
    mlp = FusedMLP(layers)
    x1 = torch.randn(1, 64, device="cuda").to(torch.float16)
    mlp(x1)  # tunes batch 1
    ours = {"cold": graph_us(lambda: mlp(x1)), "hot": hot_graph_us(lambda: mlp(x1))}
    print(f"digits FusedMLP batch 1 (tuned), graph replay: cold {ours['cold']:.2f} us, hot {ours['hot']:.2f} us",
          flush=True)  # fmt: skip
    rows = []
    for programs in (1, 2, 4, 8, 16, 32, 64):
        for warps in (4, 8, 16):  # ptxas serializes a thread's loads past ~4 in flight: more warps, more in flight
            r = floor_case(programs, warps)
            rows.append(r)
            print(f"   read 172 KB over {programs:2d} programs ({warps} warps), meet once: cold {r['cold']:6.2f} us, "
                  f"hot {r['hot']:5.2f}", flush=True)  # fmt: skip
    best = min(rows, key=lambda r: r["cold"])
    print(f"floor of any such forward, cold: {best['cold']:.2f} us ({best['programs']} programs, "
          f"{best['warps']} warps); one-store kernel {floor['cold']:.2f}; digits FusedMLP {ours['cold']:.2f}",
          flush=True)  # fmt: skip
    return {"one_store": floor, "fused_mlp_batch1": ours, "floor": rows, "best": best}


if __name__ == "__main__":
    main("digits_floor", sweep)
