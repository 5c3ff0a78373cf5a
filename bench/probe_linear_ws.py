"""Development probe (issue 3): does Triton's warp specialization (`tl.range(..., warp_specialize=True)`,
a producer warp issuing the TMA loads while the other warps run the MMAs, as cuBLAS's sm90 kernels do)
move the persistent TMA kernel at the shapes where cuBLASLt leads? Not the benchmark.

The kernel below is kernels/linear_persistent.py's, with the tile loop warp-specialized when WS is set
(not flattened then: tutorial 09 flattens only without it on Hopper). Timed cold (graph replay, L2 flushed,
as the benchmark) beside cuBLASLt's epilogue and the tuned FusedLinear, fp16 relu.

    python -m bench.probe_hopper --only linear-ws --out $OUT

What it found (H200, triton 3.6; bench/results/probe_linear_ws_h200.txt): no config reached cuBLASLt at
1024^3 (best 13.7 us against 9.9) or 256x4096x4096 (32.4 against 24.5). Triton specializes warps only at
4 warps: an sm_90 compile of this kernel has `setmaxnreg` (the producer/consumer register split) at
128x128 over 4 warps and none at 8 warps, so the 8-warp "WS=1" rows differ from "WS=0" only in the loop
not being flattened. Where specialization did apply (128x128x64, 4 warps, 4 stages) it lost at 4096^3
(218.5 against 207.9 us). The one gain, 128x256 over 8 warps at 4096^3 (192.8 against 197.4 us, cuBLASLt
193.9), is the unflattened loop, from one run; not adopted.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import FusedLinear
from kernels.linear_persistent import scratch
from kernels.tiles import grouped_tile


@triton.jit(do_not_specialize=["M"])
def _persistent_ws(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   PROGRAMS: tl.constexpr, WS: tl.constexpr):  # fmt: skip
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    y_desc = tl.make_tensor_descriptor(y_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, PROGRAMS, flatten=not WS, warp_specialize=WS):
        pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = x_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])
            b = w_desc.load([pid_n * BLOCK_N, ki * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        acc = tl.maximum(acc, 0.0)
        y_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(y_ptr.dtype.element_ty))


TILES = [
    (128, 128, 4, 3),
    (128, 128, 4, 4),
    (128, 128, 8, 3),
    (128, 64, 4, 4),
    (128, 64, 8, 4),
    (64, 128, 4, 4),
    (128, 256, 8, 3),
]  # fmt: skip  (BLOCK_M, BLOCK_N, warps, stages), BLOCK_K 64


def sweep(graph_us) -> list[dict]:
    triton.set_allocator(scratch)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = []
    for M, K, N in ((1024, 1024, 1024), (256, 4096, 4096), (4096, 4096, 4096)):
        x = torch.randn(M, K, device="cuda").half()
        w = (torch.randn(N, K, device="cuda") / K**0.5).half()
        b = torch.randn(N, device="cuda").half()
        ref = torch.relu(torch.nn.functional.linear(x.float(), w.float(), b.float()))
        lt = graph_us(lambda x=x, w=w, b=b: torch._addmm_activation(b, x, w.t()))
        layer = FusedLinear(w, b, "relu")
        layer(x)
        tuned = graph_us(lambda x=x, layer=layer: layer(x))
        rows = []
        for bm, bn, warps, stages in TILES:
            programs = min(sms, triton.cdiv(M, bm) * triton.cdiv(N, bn))
            for ws in (False, True):
                y = torch.full((M, N), float("nan"), device="cuda", dtype=torch.float16)

                def run(x=x, w=w, b=b, y=y, bm=bm, bn=bn, warps=warps, stages=stages, ws=ws, p=programs):
                    m, k, n = x.shape[0], x.shape[1], w.shape[0]
                    _persistent_ws[(p,)](x, w, b, y, m, n, k, bm, bn, 64, 8, p, ws, num_warps=warps, num_stages=stages)

                name = f"{bm}x{bn}x64 w{warps} s{stages} programs={programs} WS={int(ws)}"
                try:
                    run()
                    torch.cuda.synchronize()
                    err = float((y.float() - ref).norm() / ref.norm())
                    rows.append((graph_us(run), err, name))
                except Exception as e:  # a config that fails to compile is a finding
                    rows.append((float("inf"), float("nan"), f"{name}: {type(e).__name__} {str(e)[:120]}"))
        rows.sort(key=lambda r: r[0])
        print(f"{M}x{K}x{N} fp16 relu, graph replay cold: cublaslt {lt:.1f} us, FusedLinear tuned {tuned:.1f} us",
              flush=True)  # fmt: skip
        for us, err, name in rows:
            print(f"   {us:7.1f} us  {us / lt:5.2f}x cublaslt  err {err:.1e}  {name}", flush=True)
        res.append({"shape": [M, K, N], "cublaslt": lt, "tuned": tuned, "rows": rows})
    return res
