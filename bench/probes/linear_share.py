"""Is the 1024^3 GEMM's gap to cuBLASLt the operand traffic from L2 into the SMs, which cuBLAS's
1x2-cluster kernel halves for one operand with TMA multicast (`nvjet_sm90_hsh_128x64_64x8_1x2_h_bz_relubias_TNT`;
Triton 3.6 has no clusters or multicast)?

It times linear.py's tile loop (fp16, relu, no masks: 1024 is a multiple of every tile) three ways, cold
graph replays as the benchmark:
    SHARE=0  every program loads its A and B tiles every K step (what our kernel does)
    SHARE=1  programs with an odd column block load their A tile once and reuse it: of each pair of
             neighbours along N, one reads A from L2, as if the pair shared it through multicast
    SHARE=2  the same for B, along M
SHARE=1 and 2 compute the wrong product (a timing emulation only, never a kernel to ship): the MMAs, the
B (or A) loads and the epilogue are unchanged, so the time they save is what the skipped L2 -> SM traffic
costs.

    python -m bench.probes.linear_share --out DIR

What it finds (H200, triton 3.6; bench/results/h200/probe_linear_share_h200.txt): the emulation does not
answer the question. Sharing makes every tile slower (64x128: 11.65 us with all loads, 13.2 and 13.0 with
A or B shared): the reused operand then sits in registers or is stored to shared memory once, and the
MMAs lose their pipelined operand path. And 64x64 tiles (a third more L2 -> SM traffic than 64x128) run
as fast (11.74 us), 128x128 (a third less) slower (14.66).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import FusedLinear

from .common import graph_us, main


@triton.jit
def _tiles(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SHARE: tl.constexpr):  # fmt: skip
    num_pid_n = N // BLOCK_N
    pid_m = tl.program_id(0) // num_pid_n
    pid_n = tl.program_id(0) % num_pid_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * K + offs_k[None, :]
    w_ptrs = w_ptr + offs_k[:, None] + offs_n[None, :] * K  # (BLOCK_K, BLOCK_N) view of W^T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SHARE == 1 and pid_n % 2 == 1:
        a = tl.load(x_ptrs)
        for k in range(0, K // BLOCK_K):
            acc = tl.dot(a, tl.load(w_ptrs + k * BLOCK_K), acc)
    elif SHARE == 2 and pid_m % 2 == 1:
        b = tl.load(w_ptrs)
        for k in range(0, K // BLOCK_K):
            acc = tl.dot(tl.load(x_ptrs + k * BLOCK_K), b, acc)
    else:
        for k in range(0, K // BLOCK_K):
            acc = tl.dot(tl.load(x_ptrs + k * BLOCK_K), tl.load(w_ptrs + k * BLOCK_K), acc)
    acc = tl.maximum(acc + tl.load(b_ptr + offs_n).to(tl.float32)[None, :], 0.0)
    tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(y_ptr.dtype.element_ty))


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): our tuned 1024^3 pick (64x128), its neighbours, and cuBLAS's
# 128x64 tile with a 64-deep K step.
TILES = [(64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (128, 64, 64, 8, 4), (64, 64, 64, 4, 4), (128, 128, 64, 8, 3)]


def sweep(graph_us, M=1024, K=1024, N=1024, dtype=torch.float16) -> dict:
    x = torch.randn(M, K, device="cuda").to(dtype)
    w = (torch.randn(N, K, device="cuda") / K**0.5).to(dtype)
    b = torch.randn(N, device="cuda").to(dtype)
    y = torch.empty(M, N, device="cuda", dtype=dtype)
    want = torch.relu(torch.nn.functional.linear(x.double(), w.double(), b.double()))
    lt = graph_us(lambda: torch._addmm_activation(b, x, w.t()))
    layer = FusedLinear(w, b, "relu")
    tuned = graph_us(lambda: layer(x))
    print(f"linear-share {M}x{K}x{N} {dtype}, cold graph replay: cublaslt {lt:.2f} us, FusedLinear tuned "
          f"{tuned:.2f}", flush=True)  # fmt: skip
    rows = []
    for bm, bn, bk, warps, stages in TILES:
        grid = (M // bm * (N // bn),)
        times = {}
        for share in (0, 1, 2):

            def call(bm=bm, bn=bn, bk=bk, warps=warps, stages=stages, share=share, grid=grid):
                _tiles[grid](x, w, b, y, M, N, K, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SHARE=share,
                             num_warps=warps, num_stages=stages)  # fmt: skip

            call()
            if share == 0:  # the honest kernel must be right, or its time means nothing
                err = float((y.double() - want).norm() / want.norm())
                assert err < 1e-3, f"{(bm, bn, bk, warps, stages)}: error {err:.1e}"
            times[share] = graph_us(call)
        rows.append(
            {"tile": (bm, bn, bk, warps, stages), "programs": grid[0], **{f"share{s}": t for s, t in times.items()}}
        )
        print(f"   {bm}x{bn}x{bk} w{warps} s{stages} ({grid[0]} programs): all loads {times[0]:.2f} us, A shared by "
              f"pairs along N {times[1]:.2f}, B shared by pairs along M {times[2]:.2f}", flush=True)  # fmt: skip
    return {"shape": (M, K, N), "dtype": str(dtype), "cublaslt": lt, "tuned": tuned, "rows": rows}


if __name__ == "__main__":
    main("linear_share", lambda: sweep(graph_us))
