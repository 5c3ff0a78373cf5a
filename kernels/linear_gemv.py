"""GEMV + bias [+ residual] + activation for one-row batches, on CUDA cores: y = act(x @ W^T + b [+ r]), M = 1.

At M = 1 a layer is a weight stream (4096x4096 fp16: 32 MB read for 16 MFLOP), so what counts is bytes
in flight, not FLOPs. linear.py's kernel pads the row to a 16-row MMA tile (tl.dot needs 16), so this
one drops the MMA: each program multiplies a (BLOCK_N, BLOCK_K) tile of W by a BLOCK_K slice of x
elementwise into an fp32 tile and reduces it once, at the end, so its registers hold loads in flight
rather than an MMA tile that is 15/16 padding; split-K (shared with linear.py) spreads K over more
programs so every SM streams. 1x4096x4096 fp16 takes 14.0 us cold against 16.7 for cuBLASLt's epilogue
(docs/performance.md). Each program loads its first W tile before it reads x: launched with PDL (pdl.py)
that load is in flight while the previous layer finishes.

Its launch signature is linear.py's kernel's, argument for argument (BLOCK_M is always 1; GROUP_M,
INPUT_PRECISION and UPCAST_DOT are accepted and unused: products are formed in fp32 whatever the dtype),
so FusedLinear runs it through the same launch paths. It is correct for any M (one program per row and
column block, W read once per row), but offered to the tuner only for the one-row bucket.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .activations import apply_activation, round_to_bf16
from .pdl import gdc_launch_dependents, gdc_wait
from .tiles import known_gemm_multiples, split_k_sum
from .tuning import LaunchConfig


@triton.jit(do_not_specialize=["M", "M_BUCKET"])
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, r_ptr, ws_ptr, cnt_ptr,
    M, N, K,
    stride_xm, stride_xk,
    stride_wn, stride_wk,
    stride_ym, stride_yn,
    negative_slope,
    M_BUCKET,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,  # r_ptr: the residual, with y's strides, added before the activation
    ACTIVATION: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,  # unused: no MMA here
    UPCAST_DOT: tl.constexpr,  # unused: every product is formed in fp32
    ROUND_BF16: tl.constexpr,  # round to bf16 by hand before the store (interpreter workaround)
    PDL: tl.constexpr,  # launched as a programmatic dependent launch (pdl.py)
    BLOCK_M: tl.constexpr,  # 1: one row per program
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,  # unused: programs of one row block share nothing to group for
    SPLIT_K: tl.constexpr,
    K_ALIGN: tl.constexpr, N_ALIGN: tl.constexpr,  # as in linear.py: what K, N and the row strides are multiples of
):  # fmt: skip
    if PDL:
        gdc_launch_dependents()  # the next layer may start (it waits for this one before reading y)
    # so that rows of 1000 fp16 elements get 16-byte loads
    K, stride_xm, stride_wn, N, stride_ym = known_gemm_multiples(
        K, stride_xm, stride_wn, N, stride_ym, K_ALIGN, N_ALIGN
    )
    pid = tl.program_id(0) // SPLIT_K
    pid_k = tl.program_id(0) % SPLIT_K
    num_pid_n = tl.cdiv(N, BLOCK_N)
    row = pid // num_pid_n
    pid_n = pid % num_pid_n
    # Columns past the edge read the last one (clamped) so loads need no N mask; the store below masks them.
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = tl.minimum(cols, N - 1)
    k_tiles = tl.cdiv(K, BLOCK_K)
    k_tiles_per_split = tl.cdiv(k_tiles, SPLIT_K)
    k_first = pid_k * k_tiles_per_split
    k_end = min(k_first + k_tiles_per_split, k_tiles)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + row * stride_xm + (k_first * BLOCK_K + offs_k) * stride_xk
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + (k_first * BLOCK_K + offs_k)[None, :] * stride_wk

    # The first W tile is loaded before x: weights never depend on the previous layer, so under PDL it is in
    # flight while that layer finishes. (A program whose K range is empty, the last of an uneven split,
    # has k_left <= 0 here: every load masked, a zero partial.) `arange < scalar` masks, as in linear.py:
    # constant over 16-element runs, so 16-byte loads.
    k_left = K - k_first * BLOCK_K
    w_first = tl.load(w_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
    if HAS_BIAS:  # a weight too, requested now rather than as one more trip to memory after the loop
        bias = tl.load(b_ptr + offs_n)
    if PDL:
        gdc_wait()  # the previous kernel has completed and its writes (x) are visible
    xv = tl.load(x_ptrs, mask=offs_k < k_left, other=0.0).to(tl.float32)
    acc = w_first.to(tl.float32) * xv[None, :]
    for k in range(k_first + 1, k_end):
        # an offset from fixed pointer tiles, not `ptrs += ...`: no 64-bit address adds in the loop
        # (180 instructions per K step instead of 212; 8x1024 fp16, Triton 3.6, sm_90)
        step = (k - k_first) * BLOCK_K
        k_left = K - k * BLOCK_K
        xv = tl.load(x_ptrs + step * stride_xk, mask=offs_k < k_left, other=0.0).to(tl.float32)
        wv = tl.load(w_ptrs + step * stride_wk, mask=offs_k[None, :] < k_left, other=0.0).to(tl.float32)
        acc += wv * xv[None, :]
    total = tl.sum(acc, axis=1)[None, :]  # (1, BLOCK_N): the layout split_k_sum and the store take

    if SPLIT_K > 1:
        total, last = split_k_sum(total, ws_ptr, cnt_ptr, pid, pid_k, SPLIT_K, 1, BLOCK_N)
    else:
        last = True

    if HAS_BIAS:
        total += bias.to(tl.float32)[None, :]
    y_offs = row * stride_ym + cols[None, :] * stride_yn
    y_mask = (cols[None, :] < N) & last
    if HAS_RESIDUAL:
        total += tl.load(r_ptr + y_offs, mask=y_mask, other=0.0).to(tl.float32)
    total = apply_activation(total, ACTIVATION, negative_slope)
    if ROUND_BF16:
        total = round_to_bf16(total)
    tl.store(y_ptr + y_offs, total.to(y_ptr.dtype.element_ty), mask=y_mask)


# ---- the launcher ----


def kernel_meta(config: LaunchConfig) -> dict:
    """The kernel's meta-parameters and launch options: the config without its GEMV marker."""
    return {name: v for name, v in config.meta().items() if name != "GEMV"}


# ---- candidate configs (the tuner times them on CUDA) ----


def cuda_configs(N: int, K: int, sms: int) -> list[LaunchConfig]:
    """Candidates for one-row batches: W tiles of 16 KB (fp16) per K step in three shapes over 4 warps and
    one of 32 KB over 8, each split along K until about two programs per SM: the four fastest of a sweep of
    GEMV tiles (docs/performance.md). Splitting for four programs per SM is slower everywhere (21.8 against
    19.5 us for 16x512; docs/performance.md, "Tried and lost"). One stage: Triton pipelines only loads that
    feed an MMA, so stages change nothing here (sm_90 compile: the same code). GEMV=1 marks these among the
    tuner's candidates (and in its cache file)."""
    configs = []
    for bn, bk, warps in ((8, 1024, 4), (16, 512, 4), (32, 256, 4), (8, 2048, 8)):
        tiles, split = triton.cdiv(N, bn), 1
        while tiles * split < 2 * sms and split < 32 and triton.cdiv(K, bk) >= 2 * split:  # >= 1 K step each
            split *= 2
        configs.append(LaunchConfig.of(warps, 1, GEMV=1, BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, SPLIT_K=split))
    return configs


def is_gemv(config: LaunchConfig) -> bool:
    return ("GEMV", 1) in config.kwargs
