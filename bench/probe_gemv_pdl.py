"""Development probe (issue 3): the wide MLP at batch 1 (1024 -> 4096 -> 4096 -> 1024, fp16, 48 MB of
weights) is three GEMV launches in one CUDA graph, 29.4 us cold where the weights alone take 11.8 us at
copy bandwidth. Two things could close part of that gap, and this probe times both. Not the benchmark.

- DB (double buffering by hand): kernels/linear_gemv.py loads a W tile and multiplies it before loading
  the next, so each program has one 16 KB tile in flight. Triton pipelines only loads that feed an MMA, so
  here the next tile's load is written before the current tile's products.
- PDL (programmatic dependent launch, sm_90): each layer is launched with `launch_pdl=True`, so its
  programs start while the previous layer is still running; they load their first W tile (weights do not
  depend on the previous layer) and only then `gdc_wait()` for the previous layer's output. The previous
  layer calls `gdc_launch_dependents()` as it starts.

The kernel below is linear_gemv.py's, ReLU or none, with those two switches. Timed cold (graph replay, L2
flushed, as the benchmark): each layer alone, then the chain of three, against the tuned FusedLinear
chain (what the service runs today).

    python -m bench.probe_hopper --only gemv-pdl --out $OUT

What it found (H200, triton 3.6; bench/results/probe_gemv_pdl_h200.txt):
- PDL: the chain went from 30.1 us (tuned FusedLinear x3; 29.9 for this kernel without PDL) to 26.0. Adopted
  (kernels/pdl.py).
- DB: nothing alone (1x4096x4096: 17.3 against 17.5 us), and it lost under PDL (28.8 against 26.0): more
  registers per program, fewer programs per SM. Not adopted.
- What a weight stream can reach under this method: a kernel that only reads 32 MB took 16.2 us cold, 48
  MB 21.1 us, 8 MB 8.3 us (a torch copy of 32 MB: 21.9). The GEMV's 17.4 us at 1x4096x4096 is 93% of the
  pure read. So the wide MLP at batch 1 cannot go below about 21 us cold here, even as one kernel, where
  75% of the copy-bandwidth floor would be 15.7. do_bench flushes L2 by writing 256 MB before every rep,
  so the weights are read while L2 is full of dirty lines, which probably explains reads at ~3 TB/s.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import FusedLinear
from kernels.pdl import AVAILABLE as HAS_GDC
from kernels.pdl import gdc_launch_dependents, gdc_wait
from kernels.tiles import split_k_sum


@triton.jit
def _gemv_probe(x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, N, K,
                RELU: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                DB: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    # K % BLOCK_K == 0 and N % BLOCK_N == 0 at every shape probed: no masks.
    pid = tl.program_id(0) // SPLIT_K
    pid_k = tl.program_id(0) % SPLIT_K
    if PDL:
        gdc_launch_dependents()  # the next layer may start now; it waits for this one before reading y
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    k_tiles = K // BLOCK_K
    per = tl.cdiv(k_tiles, SPLIT_K)
    k_first = pid_k * per
    k_end = min(k_first + per, k_tiles)
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + cols[:, None] * K + offs_k[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if DB:
        w_next = tl.load(w_base + k_first * BLOCK_K)
        if PDL:
            gdc_wait()
        for k in range(k_first, k_end):
            w_cur = w_next
            # The last step reloads its own tile (an L1 hit) rather than masking: no branch in the loop.
            w_next = tl.load(w_base + min(k + 1, k_end - 1) * BLOCK_K)
            xv = tl.load(x_ptr + k * BLOCK_K + offs_k).to(tl.float32)
            acc += w_cur.to(tl.float32) * xv[None, :]
    else:
        if PDL:
            w_first = tl.load(w_base + k_first * BLOCK_K)
            gdc_wait()
            xv = tl.load(x_ptr + k_first * BLOCK_K + offs_k).to(tl.float32)
            acc += w_first.to(tl.float32) * xv[None, :]
            k_first += 1
        for k in range(k_first, k_end):
            xv = tl.load(x_ptr + k * BLOCK_K + offs_k).to(tl.float32)
            wv = tl.load(w_base + k * BLOCK_K).to(tl.float32)
            acc += wv * xv[None, :]
    total = tl.sum(acc, axis=1)[None, :]
    if SPLIT_K > 1:
        total, last = split_k_sum(total, ws_ptr, cnt_ptr, pid, pid_k, SPLIT_K, 1, BLOCK_N)
    else:
        last = True
    total += tl.load(b_ptr + cols).to(tl.float32)[None, :]
    if RELU:
        total = tl.maximum(total, 0.0)
    tl.store(y_ptr + cols[None, :], total.to(y_ptr.dtype.element_ty), mask=last)


# (BLOCK_N, BLOCK_K, warps, SPLIT_K) per layer shape (K, N): linear_gemv.cuda_configs' picks and neighbours,
# some with fewer, fatter programs (room on each SM for the next layer's programs under PDL).
CONFIGS = {
    (1024, 4096): [(8, 1024, 4, 1), (4, 1024, 4, 1), (16, 1024, 8, 1), (8, 512, 4, 2), (16, 512, 4, 2),
                   (32, 256, 4, 4), (16, 1024, 4, 1)],
    (4096, 4096): [(8, 1024, 4, 1), (8, 1024, 4, 2), (4, 1024, 4, 1), (16, 512, 4, 2), (16, 1024, 8, 1),
                   (8, 2048, 8, 1), (32, 256, 4, 4), (16, 512, 4, 1), (8, 512, 4, 1), (32, 512, 8, 2)],
    (4096, 1024): [(8, 1024, 4, 4), (8, 1024, 4, 2), (4, 1024, 4, 4), (16, 512, 4, 4), (8, 512, 4, 8),
                   (16, 1024, 8, 2), (8, 2048, 8, 2), (32, 256, 4, 8)],
}  # fmt: skip
DIMS = (1024, 4096, 4096, 1024)


class Layer:
    """One GEMV layer's tensors and split-K scratch (its own, so layers never share counters)."""

    def __init__(self, K, N, relu, dtype):
        self.K, self.N, self.relu = K, N, relu
        self.w = (torch.randn(N, K, device="cuda") * (2.0 / K) ** 0.5).to(dtype)
        self.b = (torch.randn(N, device="cuda") * 0.1).to(dtype)
        self.y = torch.empty(1, N, device="cuda", dtype=dtype)
        self.ws = torch.empty(N * 32, device="cuda", dtype=torch.float32)
        self.cnt = torch.zeros(N, device="cuda", dtype=torch.int32)

    def launch(self, x, cfg, db, pdl):
        bn, bk, warps, split = cfg
        extra = {"launch_pdl": True} if pdl else {}
        _gemv_probe[(self.N // bn * split,)](x, self.w, self.b, self.y, self.ws, self.cnt, self.N, self.K,
                                             RELU=self.relu, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, DB=db,
                                             PDL=pdl, num_warps=warps, num_stages=1, **extra)  # fmt: skip
        return self.y

    def ref(self, x):
        y = F.linear(x.double(), self.w.double(), self.b.double())
        return torch.relu(y) if self.relu else y


@triton.jit
def _stream_sum(w_ptr, out_ptr, n, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    """Reads STEPS blocks of BLOCK fp16 values and stores one sum: what a pure weight stream costs."""
    base = tl.program_id(0) * BLOCK * STEPS
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(STEPS):
        acc += tl.load(w_ptr + base + s * BLOCK + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


def stream_floor(graph_us, nbytes=32 << 20) -> dict:
    """Cold graph replay of reading nbytes of fp16 and nothing else (Triton, several tile shapes), and of a
    torch copy of the same (reads and writes them): the most a weight stream can do under this method."""
    w = torch.randn(nbytes // 2, device="cuda").to(torch.float16)
    out = torch.empty(1 << 16, device="cuda")
    dst = torch.empty_like(w)
    res = {"copy": graph_us(lambda: dst.copy_(w))}
    for block, steps, warps in ((8192, 1, 4), (8192, 4, 4), (4096, 8, 4), (16384, 2, 8), (2048, 16, 4)):
        grid = (w.numel() // (block * steps),)
        res[f"read {block}x{steps} w{warps}"] = graph_us(
            lambda block=block, steps=steps, warps=warps, grid=grid: _stream_sum[grid](
                w, out, w.numel(), BLOCK=block, STEPS=steps, num_warps=warps
            )
        )
    print(f"stream {nbytes >> 20} MB cold: " + ", ".join(f"{k} {v:.2f} us" for k, v in res.items()), flush=True)
    return res


def _err(y, ref) -> float:
    return float((y.double() - ref).norm() / ref.norm())


def sweep(graph_us, one_store_floor) -> dict:
    dtype = torch.float16
    floor = one_store_floor()
    print(f"gdc available: {HAS_GDC}", flush=True)
    torch.manual_seed(0)
    layers = [Layer(k, n, i < 2, dtype) for i, (k, n) in enumerate(zip(DIMS[:-1], DIMS[1:], strict=True))]
    x0 = torch.randn(1, DIMS[0], device="cuda").to(dtype)
    ins = [x0, layers[0].y, layers[1].y]
    res = {"floor": floor, "gdc": HAS_GDC, "layers": [], "chains": []}
    res["stream"] = [stream_floor(graph_us, mb << 20) for mb in (32, 48, 8)]
    best = []
    for layer, x in zip(layers, ins, strict=True):
        ref = layer.ref(x)
        rows = []
        for cfg, db in itertools.product(CONFIGS[(layer.K, layer.N)], (False, True)):
            try:
                err = _err(layer.launch(x, cfg, db, False), ref)
                us = graph_us(lambda layer=layer, x=x, cfg=cfg, db=db: layer.launch(x, cfg, db, False))
            except Exception as e:  # noqa: BLE001
                us, err = float("inf"), str(e)[:120]
            rows.append((us, err, cfg, db))
        rows.sort(key=lambda r: r[0])
        fl = FusedLinear(layer.w, layer.b, "relu" if layer.relu else "none")
        tuned = graph_us(lambda fl=fl, x=x: fl(x))
        lt = graph_us(lambda layer=layer, x=x: torch._addmm_activation(layer.b, x, layer.w.t()))
        wfloor = layer.w.numel() * 2 / 4.25e12 * 1e6
        print(f"layer 1x{layer.K}x{layer.N}: weights at copy bandwidth {wfloor:.1f} us, FusedLinear tuned "
              f"{tuned:.1f}, cublaslt {lt:.1f}", flush=True)  # fmt: skip
        for us, err, cfg, db in rows[:8]:
            print(f"   {us:7.2f} us  err {err}  (BN, BK, warps, split)={cfg} DB={int(db)}", flush=True)
        res["layers"].append({"K": layer.K, "N": layer.N, "tuned": tuned, "cublaslt": lt, "rows": rows})
        best.append(rows)

    # The chain: three launches in one graph. Per variant, the three best single-layer configs of that variant
    # in every combination (27), so PDL is not judged on configs picked without it.
    fls = [FusedLinear(la.w, la.b, "relu" if la.relu else "none") for la in layers]

    def tuned_chain():
        h = x0
        for fl in fls:
            h = fl(h)
        return h

    ref = x0.double()
    for la in layers:
        ref = la.ref(ref)
    base = graph_us(tuned_chain)
    print(f"chain: FusedLinear tuned x3 {base:.2f} us (err {_err(tuned_chain(), ref):.1e}); "
          f"one-store floor {floor['cold']:.2f}", flush=True)  # fmt: skip
    res["chains"].append({"variant": "tuned", "us": base})
    variants = [(False, False), (True, False)] + ([(False, True), (True, True)] if HAS_GDC else [])
    for db, pdl in variants:
        tops = [[r[2] for r in rows if r[3] == db and r[0] != float("inf")][:3] for rows in best]
        found = []
        for cfgs in itertools.product(*tops):

            def chain(cfgs=cfgs, db=db, pdl=pdl):
                h = x0
                for la, cfg in zip(layers, cfgs, strict=True):
                    h = la.launch(h, cfg, db, pdl)
                return h

            try:
                err = _err(chain(), ref)
                us = graph_us(chain)
            except Exception as e:  # noqa: BLE001
                us, err = float("inf"), str(e)[:120]
            found.append((us, err, cfgs))
        found.sort(key=lambda r: r[0])
        print(f"chain DB={int(db)} PDL={int(pdl)}:", flush=True)
        for us, err, cfgs in found[:4]:
            print(f"   {us:7.2f} us  err {err}  {cfgs}", flush=True)
        res["chains"].append({"variant": f"DB={int(db)} PDL={int(pdl)}", "rows": found})
    return res
