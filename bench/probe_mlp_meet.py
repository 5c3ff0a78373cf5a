"""Development probe (issue 3): how much of the digits MLP's 8.8 us (cold graph replay, batch 1) is moving its
data, with no arithmetic at all? The goal is 6 us; one graph replay of a kernel that stores one float
costs about 4.

The kernel below does only the memory work of the whole-MLP kernel's LEAD schedule (kernels/mlp.py) at the
digits shape (64 -> 256 -> 256 -> 10, fp16, a 16-row block): each of SPLIT programs loads x, the whole first
layer (32 KB), its 1/SPLIT of the second layer's rows and its share of the last layer's columns, sums
them (so no load is dead code) into a 16x16 partial, and the programs meet as the real kernel's do
(tiles.split_k_sum: store, barrier, acq_rel atomic, the last one reloads every partial and stores the
output). No MMA, bias or activation. Timed cold (L2 flushed, as the benchmark) and hot, beside the tuned
FusedMLP and the one-store kernel in the same run.

    python -m bench.probe_hopper --only mlp-meet --out $OUT
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.mlp import FusedMLP, MLPLayer
from kernels.tiles import split_k_sum

H0, H1, H2, OUT, OUT_PAD, ROWS = 64, 256, 256, 10, 16, 16


@triton.jit
def _lead_loads(x_ptr, w1_ptr, w2_ptr, w3_ptr, ws_ptr, cnt_ptr, y_ptr, M,
                H0: tl.constexpr, H1: tl.constexpr, H2: tl.constexpr, OUT: tl.constexpr, OUT_PAD: tl.constexpr,
                ROWS: tl.constexpr, SPLIT: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    rows = tl.arange(0, ROWS)
    k0 = tl.arange(0, H0)
    k1 = tl.arange(0, H1)
    part: tl.constexpr = H2 // SPLIT
    mine = pid * part + tl.arange(0, part)
    outs = tl.arange(0, OUT_PAD)
    x = tl.load(x_ptr + rows[:, None] * H0 + k0[None, :], mask=rows[:, None] < M, other=0.0)
    w1 = tl.load(w1_ptr + k1[:, None] * H0 + k0[None, :])  # (H1, H0): all of layer 1
    w2 = tl.load(w2_ptr + mine[:, None] * H1 + k1[None, :])  # (H2 / SPLIT, H1): this program's rows of layer 2
    w3 = tl.load(w3_ptr + outs[:, None] * H2 + mine[None, :], mask=outs[:, None] < OUT, other=0.0)
    s = tl.sum(tl.sum(x.to(tl.float32), 1), 0) + tl.sum(tl.sum(w1.to(tl.float32), 1), 0)
    s += tl.sum(tl.sum(w2.to(tl.float32), 1), 0) + tl.sum(tl.sum(w3.to(tl.float32), 1), 0)
    acc = tl.zeros((ROWS, OUT_PAD), dtype=tl.float32) + s
    total, last = split_k_sum(acc, ws_ptr, cnt_ptr, 0, pid, SPLIT, ROWS, OUT_PAD)
    y_ptrs = y_ptr + rows[:, None] * OUT + outs[None, :]
    tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (outs[None, :] < OUT) & last)


def sweep(graph_us, hot_graph_us, one_store_floor) -> dict:
    dtype = torch.float16
    floor = one_store_floor()
    x = torch.randn(1, H0, device="cuda").to(dtype)
    ws = [(torch.randn(n, k, device="cuda") / k**0.5).to(dtype) for k, n in ((H0, H1), (H1, H2), (H2, OUT))]
    bs = [torch.randn(n, device="cuda").to(dtype) for n in (H1, H2, OUT)]
    mlp = FusedMLP([MLPLayer(w, b, a) for w, b, a in zip(ws, bs, ("relu", "relu", "none"), strict=True)])
    mlp(x)  # tune
    res = {"floor": floor, "fused": {"cold": graph_us(lambda: mlp(x)), "hot": hot_graph_us(lambda: mlp(x))}}
    print(f"digits FusedMLP batch 1 (tuned): cold {res['fused']['cold']:.2f} us, hot {res['fused']['hot']:.2f}",
          flush=True)  # fmt: skip
    y = torch.empty(1, OUT, device="cuda", dtype=dtype)
    cnt = torch.zeros(1, device="cuda", dtype=torch.int32)
    for split in (4, 8):
        scratch = torch.empty(split * ROWS * OUT_PAD, device="cuda", dtype=torch.float32)

        def call(split=split, scratch=scratch):
            _lead_loads[(split,)](x, ws[0], ws[1], ws[2], scratch, cnt, y, 1, H0=H0, H1=H1, H2=H2, OUT=OUT,
                                  OUT_PAD=OUT_PAD, ROWS=ROWS, SPLIT=split, num_warps=4, num_stages=1)  # fmt: skip

        call()
        assert int(cnt.item()) == 0, "the counter must be back at 0 after the meet"
        res[f"split{split}"] = {"cold": graph_us(call), "hot": hot_graph_us(call)}
        print(f"loads and meet only, SPLIT={split}: cold {res[f'split{split}']['cold']:.2f} us, "
              f"hot {res[f'split{split}']['hot']:.2f}", flush=True)  # fmt: skip
    return res
