"""Development probe (issue 3): where the digits MLP's forward time goes, and whether a different kernel
shape could reach 6 us of device time. Not the benchmark.

The shipped whole-MLP kernel (kernels/mlp.py) streams the weights chunk by chunk through a pipelined loop
and, at small batches, shares the first layer pair among SPLIT programs that meet through an atomic
counter. This probe times, cold (L2 flushed, as the benchmark) and hot (back-to-back graph replays), on the
packed digits weights (64-256-256-10, fp16):

- `loads`: one program per row block loads every weight tile up front and stores one sum: the cost of
  bringing 168 KB into one SM, with no math.
- `flat`: the same loads, then the three GEMMs straight through (no chunk loop, no pipelining): every
  weight byte is requested before the first MMA waits.
- `flat_tma`: as flat, the weights fetched by TMA (one bulk copy per layer).
- `nsplit`: SPLIT programs per row block each compute all of layer 1, 1/SPLIT of layer 2's outputs and
  that slice's share of layer 3's pre-activation; the last to arrive sums the (BLOCK_M, 16) shares. Less
  weight per program than `flat`, and only a 16-wide sum after the programs meet.
- the shipped kernel, tuned, and a kernel that stores one float (the floor of any graph replay).

Also prints which cuBLAS kernels torch runs at the published shapes (torch.profiler), to say what the
1024^3 cuBLASLt epilogue does that the Triton kernels do not.

    python -m bench.probe_hopper --only mlp-flat --out $OUT
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.linear_persistent import scratch
from kernels.mlp import FusedMLP

# The digits MLP's input and output widths. The kernels name its padded widths (64 -> 256 -> 256 -> 16) and the
# packed layout (FusedMLP._pack: W1, W2, W3 end to end; biases likewise) as literals.
K0, OUT = 64, 10


@triton.jit
def _weight_views(w_ptr):
    """The packed digits weights as (K, N) views of W1, W2, W3: (64, 256), (256, 256), (256, 16), loaded whole."""
    k0 = tl.arange(0, 64)
    h = tl.arange(0, 256)
    o = tl.arange(0, 16)
    w1 = tl.load(w_ptr + h[None, :] * 64 + k0[:, None])
    w2 = tl.load(w_ptr + 64 * 256 + h[None, :] * 256 + h[:, None])
    w3 = tl.load(w_ptr + 64 * 256 + 256 * 256 + o[None, :] * 256 + h[:, None])
    return w1, w2, w3


@triton.jit(do_not_specialize=["M"])
def _loads(x_ptr, w_ptr, b_ptr, y_ptr, M, BLOCK_M: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    w1, w2, w3 = _weight_views(w_ptr)
    x = tl.load(x_ptr + rows[:, None] * 64 + tl.arange(0, 64)[None, :], mask=rows[:, None] < M, other=0.0)
    s = tl.sum(tl.sum(w1.to(tl.float32), 1), 0) + tl.sum(tl.sum(w2.to(tl.float32), 1), 0)
    s += tl.sum(tl.sum(w3.to(tl.float32), 1), 0) + tl.sum(tl.sum(x.to(tl.float32), 1), 0)
    s += tl.sum(tl.load(b_ptr + tl.arange(0, 512)).to(tl.float32), 0)
    tl.store(y_ptr + tl.program_id(0), s.to(y_ptr.dtype.element_ty))


@triton.jit
def _three_layers(x_ptr, b_ptr, y_ptr, M, rows, w1, w2, w3):
    """What _flat and _flat_tma share once their weights are requested: the biases and x, then
    relu(relu(x W1^T + b1) W2^T + b2) W3^T + b3 straight through, stored. w1, w2, w3: (K, N) views."""
    k0 = tl.arange(0, 64)
    h = tl.arange(0, 256)
    o = tl.arange(0, 16)
    dtype = y_ptr.dtype.element_ty
    b1 = tl.load(b_ptr + h).to(tl.float32)
    b2 = tl.load(b_ptr + 256 + h).to(tl.float32)
    b3 = tl.load(b_ptr + 512 + o).to(tl.float32)
    x = tl.load(x_ptr + rows[:, None] * 64 + k0[None, :], mask=rows[:, None] < M, other=0.0)
    a = tl.maximum(tl.dot(x, w1) + b1[None, :], 0.0).to(dtype)
    a = tl.maximum(tl.dot(a, w2) + b2[None, :], 0.0).to(dtype)
    a = tl.dot(a, w3) + b3[None, :]
    tl.store(y_ptr + rows[:, None] * 10 + o[None, :], a.to(dtype), mask=(rows[:, None] < M) & (o[None, :] < 10))


@triton.jit(do_not_specialize=["M"])
def _flat(x_ptr, w_ptr, b_ptr, y_ptr, M, BLOCK_M: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    w1, w2, w3 = _weight_views(w_ptr)
    _three_layers(x_ptr, b_ptr, y_ptr, M, rows, w1, w2, w3)


@triton.jit(do_not_specialize=["M"])
def _flat_tma(x_ptr, w_ptr, b_ptr, y_ptr, M, BLOCK_M: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d1 = tl.make_tensor_descriptor(w_ptr, shape=[256, 64], strides=[64, 1], block_shape=[256, 64])
    d2 = tl.make_tensor_descriptor(w_ptr + 64 * 256, shape=[256, 256], strides=[256, 1], block_shape=[256, 256])
    d3 = tl.make_tensor_descriptor(w_ptr + 64 * 256 + 256 * 256, shape=[16, 256], strides=[256, 1],
                                   block_shape=[16, 256])  # fmt: skip
    _three_layers(x_ptr, b_ptr, y_ptr, M, rows, d1.load([0, 0]).T, d2.load([0, 0]).T, d3.load([0, 0]).T)


@triton.jit(do_not_specialize=["M"])
def _nsplit(x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, BLOCK_M: tl.constexpr, SPLIT: tl.constexpr):
    pid_m = tl.program_id(0) // SPLIT
    part = tl.program_id(0) % SPLIT
    HS: tl.constexpr = 256 // SPLIT
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    k0 = tl.arange(0, 64)
    h = tl.arange(0, 256)
    n = part * HS + tl.arange(0, HS)  # this program's slice of layer 2's outputs
    o = tl.arange(0, 16)
    dtype = w_ptr.dtype.element_ty
    w1 = tl.load(w_ptr + h[None, :] * 64 + k0[:, None])  # (64, 256)
    w2 = tl.load(w_ptr + 64 * 256 + n[None, :] * 256 + h[:, None])  # (256, HS): rows n of W2
    w3 = tl.load(w_ptr + 64 * 256 + 256 * 256 + o[None, :] * 256 + n[:, None])  # (HS, 16): columns n of W3
    b1 = tl.load(b_ptr + h).to(tl.float32)
    b2 = tl.load(b_ptr + 256 + n).to(tl.float32)
    b3 = tl.load(b_ptr + 512 + o).to(tl.float32)
    x = tl.load(x_ptr + rows[:, None] * 64 + k0[None, :], mask=rows[:, None] < M, other=0.0)
    a = tl.maximum(tl.dot(x, w1) + b1[None, :], 0.0).to(dtype)
    a = tl.maximum(tl.dot(a, w2) + b2[None, :], 0.0).to(dtype)
    share = tl.dot(a, w3, tl.zeros((BLOCK_M, 16), dtype=tl.float32))
    tile = tl.arange(0, BLOCK_M)[:, None] * 16 + o[None, :]
    tl.store(ws_ptr + tl.program_id(0) * (BLOCK_M * 16) + tile, share)
    tl.debug_barrier()
    if tl.atomic_add(cnt_ptr + pid_m, 1, sem="acq_rel") == SPLIT - 1:
        acc = tl.zeros((BLOCK_M, 16), dtype=tl.float32)
        for s in range(SPLIT):
            acc += tl.load(ws_ptr + (pid_m * SPLIT + s) * (BLOCK_M * 16) + tile, cache_modifier=".cg")
        tl.atomic_xchg(cnt_ptr + pid_m, 0)
        acc += b3[None, :]
        mask = (rows[:, None] < M) & (o[None, :] < 10)
        tl.store(y_ptr + rows[:, None] * 10 + o[None, :], acc.to(dtype), mask=mask)


def cublas_kernel_names() -> list[dict]:
    """The CUDA kernels torch runs for the cuBLASLt epilogue and F.linear at the published shapes."""
    rows = []
    for (M, K, N), dtype in [((1024, 1024, 1024), d) for d in (torch.float16, torch.bfloat16, torch.float32)] + [
        ((64, 256, 128), torch.float16),
        ((128, 256, 256), torch.float16),
    ]:
        x = torch.randn(M, K, device="cuda").to(dtype)
        w = torch.randn(N, K, device="cuda").to(dtype)
        b = torch.randn(N, device="cuda").to(dtype)
        for name, fn in (
            ("cublaslt", lambda x=x, w=w, b=b: torch._addmm_activation(b, x, w.t(), use_gelu=False)),
            ("F.linear", lambda x=x, w=w, b=b: F.linear(x, w, b)),
        ):
            fn()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            kernels = sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
            print(f"{M}x{K}x{N} {str(dtype)[6:]} {name}: {kernels}", flush=True)
            rows.append({"shape": [M, K, N], "dtype": str(dtype), "provider": name, "kernels": kernels})
    return rows


def variants(weights, biases, x, y, ws, cnt):
    """(name, callable) for every probe kernel at this batch size."""
    M = x.shape[0]
    out = []
    for bm in (16, 32, 64):
        if bm > max(16, 2 * M):
            continue
        grid = triton.cdiv(M, bm)
        for warps in (4, 8):
            out.append(
                (
                    f"loads BM={bm} w{warps}",
                    lambda bm=bm, g=grid, w=warps: _loads[(g,)](x, weights, biases, y, M, bm, num_warps=w),
                )
            )
            out.append(
                (
                    f"flat BM={bm} w{warps}",
                    lambda bm=bm, g=grid, w=warps: _flat[(g,)](x, weights, biases, y, M, bm, num_warps=w),
                )
            )
            out.append(
                (
                    f"flat_tma BM={bm} w{warps}",
                    lambda bm=bm, g=grid, w=warps: _flat_tma[(g,)](x, weights, biases, y, M, bm, num_warps=w),
                )
            )
        for split in (2, 4, 8):
            for warps in (4, 8):
                out.append((f"nsplit BM={bm} S={split} w{warps}",
                            lambda bm=bm, g=grid, s=split, w=warps: _nsplit[(g * s,)](
                                x, weights, biases, y, ws, cnt, M, bm, s, num_warps=w)))  # fmt: skip
    return out


def mlp_flat_sweep(digits_layers, graph_us, hot_graph_us, one_store_floor) -> dict:
    """Every variant at batch 1, 8, 32, 256: cold and hot graph-replay device time and its error against
    the shipped kernel's output (the probe kernels compute the same function)."""
    triton.set_allocator(scratch)
    res = {"cublas": cublas_kernel_names(), "floor": one_store_floor(), "rows": []}
    layers = digits_layers()
    shipped = FusedMLP(layers)
    weights, biases = shipped.weights, shipped.biases
    ws = torch.empty(64 * 8 * 64 * 16, device="cuda", dtype=torch.float32)
    cnt = torch.zeros(64, device="cuda", dtype=torch.int32)
    for M in (1, 8, 32, 256):
        x = torch.randn(M, K0, device="cuda").to(torch.float16) * 4
        ref = shipped(x).float()
        y = torch.empty(M, OUT, device="cuda", dtype=torch.float16)

        def call(x=x):
            return shipped(x)

        rows = [("shipped (tuned)", graph_us(call), hot_graph_us(call), 0.0)]
        for name, fn in variants(weights, biases, x, y, ws, cnt):
            try:
                y.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                err = float("nan") if name.startswith("loads") else float((y.float() - ref).norm() / ref.norm())
                rows.append((name, graph_us(fn), hot_graph_us(fn), err))
            except Exception as e:  # a variant that fails to compile is a finding, not the end of the probe
                rows.append((name, float("nan"), float("nan"), f"{type(e).__name__}: {str(e)[:160]}"))
        print(f"digits MLP M={M}:", flush=True)
        for name, cold, hot, err in sorted(rows, key=lambda r: (r[1] != r[1], r[1])):
            e = f"{err:.1e}" if isinstance(err, float) else err
            print(f"   cold {cold:6.2f} us  hot {hot:6.2f} us  err {e}  {name}", flush=True)
        res["rows"].append({"M": M, "variants": rows})
    return res
