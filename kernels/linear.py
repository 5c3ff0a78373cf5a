"""Fused linear layer: y = act(x @ W^T + b [+ residual]) in one Triton kernel.

Unfused, eager torch runs this as three kernels (mm, bias add, activation): the (M, N) result is
written to memory by the GEMM and read back twice. Here the bias and the activation are applied to
the fp32 accumulator tile while it is still in registers, so y is written once, in its final dtype:
3 launches -> 1, and 2*M*N fewer elements written plus 2*M*N fewer read. A residual (a skip connection,
added before the activation) is one more read of M*N in the same epilogue, where eager torch runs one
more add kernel: a write and two reads of M*N.

Shapes (PyTorch's nn.Linear layout): x (M, K), weight (N, K), bias (N,) or None, residual and y (M, N).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import linear_gemv as gemv
from . import linear_persistent as persistent
from .activations import DEFAULT_NEGATIVE_SLOPE, apply_activation, check_activation, round_to_bf16
from .interpreter import InterpreterSwitches
from .launch import DIRECT_LAUNCH, DirectLaunch, aligned, constexpr_tail, grid_launch, plain_rows
from .pdl import gdc_launch_dependents, gdc_wait
from .runtime import check_device, interpreting
from .tiles import (
    HOPPER_SHARED_MEMORY,
    SplitKWorkspace,
    device_limits,
    gemm_flags,
    grouped_tile,
    known_gemm_multiples,
    launch_options,
    pow2_alignment,
    residual_like,
    split_k_sum,
)
from .tuning import LaunchConfig, scope_for, tune
from .tuning_background import on_new_picks

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_FAST_BATCH_SIZES = 4096  # distinct batch sizes whose launch records a layer keeps


@triton.jit(do_not_specialize=["M", "M_BUCKET"])
def _linear_kernel(
    # pointers (r_ptr: the residual, with y's strides, unused without HAS_RESIDUAL; ws_ptr, cnt_ptr: split-K
    # workspace and per-tile arrival counters, unused when SPLIT_K == 1)
    x_ptr, w_ptr, b_ptr, y_ptr, r_ptr, ws_ptr, cnt_ptr,
    # sizes
    M, N, K,
    # strides
    stride_xm, stride_xk,
    stride_wn, stride_wk,
    stride_ym, stride_yn,
    # epilogue parameters
    negative_slope,
    # autotune key only: M rounded up to a power of two, so a new batch size reuses a tuned config
    M_BUCKET,
    # meta-parameters
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ACTIVATION: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,  # "ieee" or "tf32"; only fp32 operands care
    UPCAST_DOT: tl.constexpr,  # bf16 operands multiplied as fp32 (interpreter workaround, see launcher)
    ROUND_BF16: tl.constexpr,  # round to bf16 by hand before the store (interpreter workaround)
    PDL: tl.constexpr,  # launched as a programmatic dependent launch (pdl.py)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,  # programs per output tile, each summing 1/SPLIT_K of K (small batches, see below)
    K_ALIGN: tl.constexpr, N_ALIGN: tl.constexpr,  # powers of two that K and x's and W's row strides, N and y's divide
):  # fmt: skip
    if PDL:  # the next layer may start; this one waits for the previous layer (below) before reading x
        gdc_launch_dependents()
    # Triton proves a load aligned only from arguments it specialized as multiples of 16: say what else is known
    K, stride_xm, stride_wn, N, stride_ym = known_gemm_multiples(
        K, stride_xm, stride_wn, N, stride_ym, K_ALIGN, N_ALIGN
    )
    pid = tl.program_id(0) // SPLIT_K
    pid_k = tl.program_id(0) % SPLIT_K
    pid_m, pid_n = grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows and columns past the edge read the last one (clamped) so loads need no mask; they compute
    # throw-away values that the masked store below never writes. A clamp is one instruction, a `% M`
    # wrap an integer division per element: with the early bias load below, 1024^3 fp16 runs as fast as
    # a bare tile loop (docs/performance.md, "How each case is served").
    offs_m = tl.minimum(rows, M - 1)
    offs_n = tl.minimum(cols, N - 1)
    if HAS_BIAS:
        # Requested now, used after the K loop: cold, a load issued there would be one more trip to memory at
        # the very end. The bias is a weight, which no earlier kernel writes, so under PDL it goes before the wait.
        bias = tl.load(b_ptr + offs_n)
    if PDL:
        gdc_wait()
    k_tiles = tl.cdiv(K, BLOCK_K)
    k_tiles_per_split = tl.cdiv(k_tiles, SPLIT_K)
    k_first = pid_k * k_tiles_per_split
    k_end = min(k_first + k_tiles_per_split, k_tiles)
    offs_k = tl.arange(0, BLOCK_K)
    # Tile pointers stay fixed and each K step adds one scalar offset: incrementing the pointer tiles
    # (x_ptrs += ...) puts a 64-bit add per 16-byte copy in the loop, 204 SASS instructions per K step
    # against 117 (64x128x128 fp16, Triton 3.6, sm_90; tests/test_kernels_compile.py holds it).
    x_tile = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_tile = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn  # a (BLOCK_K, BLOCK_N) view of W^T

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_first, k_end):
        x_step = x_tile + k * BLOCK_K * stride_xk
        w_step = w_tile + k * BLOCK_K * stride_wk
        # The mask must read `arange < scalar`: Triton then sees it constant over 16-element runs (K % 16
        # == 0) and issues 16-byte cp.async copies. Written as `scalar - arange > 0` it cannot, and every
        # load becomes a 2-byte one with no pipelining: 4x slower than cuBLAS at 4096^3.
        k_left = K - k * BLOCK_K
        a = tl.load(x_step, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(w_step, mask=offs_k[:, None] < k_left, other=0.0)
        if UPCAST_DOT:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)

    if SPLIT_K > 1:
        # Split-K for small batches: at M = 1, N = 1024 a 32-wide tile gives 32 programs for 132 SMs;
        # SPLIT_K of them per tile stream the weights 4x faster.
        acc, last = split_k_sum(acc, ws_ptr, cnt_ptr, pid, pid_k, SPLIT_K, BLOCK_M, BLOCK_N)
    else:
        last = True

    # Epilogue on the fp32 accumulator: bias, residual, activation, one rounding to the output dtype.
    if HAS_BIAS:
        acc = acc + bias.to(tl.float32)[None, :]
    y_offs = rows[:, None] * stride_ym + cols[None, :] * stride_yn
    y_mask = (rows[:, None] < M) & (cols[None, :] < N) & last
    if HAS_RESIDUAL:  # before the activation, as relu(x @ W^T + b + identity); read by the storing program only
        acc = acc + tl.load(r_ptr + y_offs, mask=y_mask, other=0.0).to(tl.float32)
    acc = apply_activation(acc, ACTIVATION, negative_slope)

    if ROUND_BF16:
        acc = round_to_bf16(acc)
    tl.store(y_ptr + y_offs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)


# ---- the launcher ----


def m_bucket(m: int) -> int:
    """Batch sizes share tuned configs by power-of-two bucket: 1, 2, 4, ..., 4096 and above."""
    return min(1 << max(m - 1, 0).bit_length(), 4096)  # bit ops: 0.2 us, triton.next_power_of_2 6 us


def _check_tensor(t: torch.Tensor, name: str, like: torch.Tensor, like_name: str) -> None:
    """dtype, device, layout and size of one operand, against the operand it must match."""
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; fused_linear supports float32, float16, bfloat16")
    if t.dtype != like.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but {like_name} has {like.dtype}; cast them to one dtype")
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device} but {like_name} is on {like.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous()); got strides {t.stride()}")
    if t.numel() >= 2**31:
        raise ValueError(f"{name} has {t.numel()} elements; the kernel indexes with int32 (< 2**31)")


def _check_weights(weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (N, K); got shape {tuple(weight.shape)}")
    if weight.shape[0] < 1 or weight.shape[1] < 1:
        raise ValueError(f"weight must have N >= 1 and K >= 1; got shape {tuple(weight.shape)}")
    _check_tensor(weight, "weight", weight, "weight")
    check_device(weight, "weight")
    if bias is not None:
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must have shape ({weight.shape[0]},) to match weight; got {tuple(bias.shape)}")
        _check_tensor(bias, "bias", weight, "weight")


def _check_x(x: torch.Tensor, weight: torch.Tensor) -> None:
    """Per-call checks of the activations against already-checked weights (~2 us)."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (M, K); got shape {tuple(x.shape)}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"x has K={x.shape[1]} columns but weight (N, K) has K={weight.shape[1]}")
    _check_tensor(x, "x", weight, "weight")


def _check_out(out: torch.Tensor, x: torch.Tensor, N: int) -> None:
    M = x.shape[0]
    if out.shape != (M, N) or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous ({M}, {N}) {x.dtype} tensor on {x.device}; "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )


class LaunchRecord(NamedTuple):
    """Everything a direct launch of one batch size needs, kept per size by FusedLinear (its fast path).
    Addresses are ints (launch.py); ws/cnt are 0 for the persistent kernel, which has no split-K buffers."""

    launch: DirectLaunch
    grid: int
    w_ptr: int
    b_ptr: int
    ws_ptr: int
    cnt_ptr: int
    bucket: int
    persistent: bool


class FusedLinear:
    """y = act(x @ weight.T + bias) as a layer prepared for many calls, as a server makes them.

    The weights are checked once here; a call checks only x. On CUDA the config tuned for each batch
    bucket is remembered with its compiled kernel, so later calls in that bucket launch it straight
    through Triton's C launcher (launch.py): no tuner lookup, no JITFunction.run.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        activation: str = "none",
        *,
        negative_slope: float = DEFAULT_NEGATIVE_SLOPE,
        allow_tf32: bool | None = None,
    ):
        _check_weights(weight, bias)
        check_activation(activation)
        self.weight, self.bias = weight, bias
        self.activation = activation
        self.negative_slope = float(negative_slope)
        self.allow_tf32 = allow_tf32
        # (M bucket, input precision, TMA candidates offered, with a residual) -> tuned config
        self.configs: dict[tuple[int, str, bool, bool], LaunchConfig] = {}
        # (M bucket, input precision) -> the compiled kernel of aligned calls without a residual, and its config
        self.direct: dict[tuple[int, str], tuple[DirectLaunch, LaunchConfig]] = {}
        self.workspace = SplitKWorkspace(weight.device)
        # (rows, TF32 on) -> what a call of that size needs, filled on the first direct launch of each size
        # (__call__'s fast path).
        self._fast: dict[tuple[int, bool], LaunchRecord] = {}
        self._bias_arg = bias if bias is not None else weight  # any pointer when HAS_BIAS is off; never read
        on_new_picks(self.forget_picks)

    def forget_picks(self) -> None:
        """Drop the remembered configs and their compiled kernels: the next call of each bucket asks the tuner again
        (a pick timed in the background replaced an untimed one, kernels/tuning_background.py)."""
        self.configs.clear()
        self.direct.clear()
        self._fast.clear()

    def __call__(
        self, x: torch.Tensor, out: torch.Tensor | None = None, *, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """act(x @ weight.T + bias [+ residual]); `residual` as in fused_linear. Calls with a residual take the
        checked path (the direct one keeps the kernel without it)."""
        w = self.weight
        N, K = w.shape
        tf32 = torch.backends.cuda.matmul.allow_tf32 if self.allow_tf32 is None else self.allow_tf32
        # Direct path, once this bucket's kernel is compiled: one cheap test for everything _check_x would
        # reject (it runs, and names the problem, whenever this test fails), one lookup of the batch size's
        # launch record, the output, the launch. The Python around a launch is most of a small layer's
        # wall time (64x256x128 fp16: 9.3 us per call on this path, for ~3 us of GPU work; docs/performance.md).
        direct = self.direct and residual is None
        if direct and plain_rows(x, w.dtype, w.device, K) and (x_ptr := x.data_ptr()) % 16 == 0:
            M = x.shape[0]
            fast = None
            if M > 0 and M * K < 2**31:
                fast = self._fast.get((M, tf32)) or self._record(M, tf32)
            if fast is not None:
                if out is None:
                    # x's dtype and device, as checked; new_empty skips torch.empty's keyword parsing (0.5 us a
                    # call). Allocator blocks are 512-byte aligned.
                    out = x.new_empty((M, N))
                else:
                    _check_out(out, x, N)
                if (out_ptr := out.data_ptr()) % 16 == 0:
                    # Pointers go as ints (launch.py: no driver call per pointer); the record holds the fixed ones.
                    launch, grid, w_ptr, b_ptr, ws_ptr, cnt_ptr, bucket, is_persistent = fast
                    if is_persistent:
                        triton.set_allocator(persistent.scratch)  # per thread: TMA descriptors' scratch
                        launch(grid, x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, K, K, N, self.negative_slope)
                    else:
                        # out again as the (unread) residual, as _launch passes it without one
                        launch(grid, x_ptr, w_ptr, b_ptr, out_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, K, 1, K, 1, N, 1,
                               self.negative_slope, bucket)  # fmt: skip
                    return out
        _check_x(x, w)
        return _launch(
            x,
            self.weight,
            self.bias,
            self.activation,
            self.negative_slope,
            out,
            self.allow_tf32,
            self.configs,
            self.workspace,
            self.direct,
            residual,
        )

    def _record(self, M: int, tf32: bool) -> LaunchRecord | None:
        """The launch record of M rows, kept for the next call of that size; None while the bucket has no
        compiled kernel. Its addresses stay valid: the layer holds its weights for life, and the workspace
        keeps outgrown buffers (SplitKWorkspace)."""
        bucket = m_bucket(M)
        entry = self.direct.get((bucket, "tf32" if tf32 else "ieee"))
        if entry is None:
            return None
        launch, config = entry
        w_ptr, b_ptr = self.weight.data_ptr(), self._bias_arg.data_ptr()
        if persistent.is_persistent(config):
            programs = persistent.default_programs(self.weight.device)
            record = LaunchRecord(launch, programs, w_ptr, b_ptr, 0, 0, bucket, True)
        else:
            bm, bn, split = config["BLOCK_M"], config["BLOCK_N"], config["SPLIT_K"]
            tiles = triton.cdiv(M, bm) * triton.cdiv(self.weight.shape[0], bn)
            ws, cnt = self.workspace.get(tiles, bm * bn, split)
            record = LaunchRecord(launch, tiles * split, w_ptr, b_ptr, ws.data_ptr(), cnt.data_ptr(), bucket, False)
        if len(self._fast) < MAX_FAST_BATCH_SIZES:
            self._fast[(M, tf32)] = record
        return record


def fused_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    *,
    negative_slope: float = DEFAULT_NEGATIVE_SLOPE,
    out: torch.Tensor | None = None,
    allow_tf32: bool | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """act(x @ weight.T + bias + residual) in one kernel; returns y (M, N) in x's dtype.

    allow_tf32: for float32 operands, multiply in TF32 (about 8x the fp32 rate on Hopper, ~1e-3
    relative error) or in full fp32. None follows `torch.backends.cuda.matmul.allow_tf32`, so the
    fused and the torch paths use the same setting.

    residual: None, or an (M, N) tensor of x's dtype added before the activation (a skip connection:
    relu(x @ W^T + b + identity)); read once in the epilogue. One that is not contiguous is copied first,
    and one that shares memory with `out` is refused (tiles.residual_like).
    """
    _check_weights(weight, bias)
    _check_x(x, weight)
    check_activation(activation)
    return _launch(x, weight, bias, activation, float(negative_slope), out, allow_tf32, None, None, None, residual)


def _launch(x, weight, bias, activation, negative_slope, out, allow_tf32, configs, workspace, direct, residual=None):
    M, K = x.shape
    N = weight.shape[0]
    if out is None:
        out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    else:
        _check_out(out, x, N)
    has_residual = residual is not None
    if has_residual:
        residual = residual_like(residual, out)  # out is contiguous: so is the residual the kernel reads
    if M == 0:
        return out
    if allow_tf32 is None:
        allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    fixed = gemm_flags(bias is not None, activation, x.dtype, allow_tf32, x.device)
    # The pointer kernels' alignment hints; fixed for a layer, whose x and out are contiguous (FusedLinear's direct
    # path reuses its compiled kernel for every call).
    align = dict(K_ALIGN=pow2_alignment(K, x.stride(0), weight.stride(0)), N_ALIGN=pow2_alignment(N, out.stride(0)))
    precision = fixed["INPUT_PRECISION"]
    bucket = m_bucket(M)
    workspace = workspace or SplitKWorkspace(x.device)

    # The persistent kernel's epilogue has no residual: calls with one run the pointer and GEMV kernels only.
    tma = not has_residual and persistent.tma_eligible(x, weight, out)
    programs = persistent.default_programs(x.device) if tma else 0

    def run(config: LaunchConfig):
        if persistent.is_persistent(config):
            return persistent.launch(x, weight, bias, out, negative_slope, fixed, config, programs)
        kernel = _pointer_kernel(config)
        meta = gemv.kernel_meta(config)
        tiles = triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])
        ws, cnt = workspace.get(tiles, meta["BLOCK_M"] * meta["BLOCK_N"], meta["SPLIT_K"])
        return grid_launch(kernel, (tiles * meta["SPLIT_K"],))(
            x, weight, bias if bias is not None else x, out, residual if has_residual else out, ws, cnt,
            M, N, K,
            x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
            negative_slope,
            bucket,
            HAS_RESIDUAL=has_residual, **fixed, **meta, **align, **launch_options(fixed),
        )  # fmt: skip

    if interpreting():
        config = INTERPRETER.choice.config or _interpreter_config(M, N, K)
        run(_interpreter_config(M, N, K) if persistent.is_persistent(config) and not tma else config)
        return out
    sms, shared_memory = device_limits(x.device)
    # Calls that cannot use TMA (an unaligned x or out) are tuned and kept apart from those that can.
    tma = tma and persistent.offered(bucket, N, sms)
    config = configs.get((bucket, precision, tma, has_residual)) if configs is not None else None
    if config is None:
        key = f"N{N}|K{K}|{x.dtype}|{activation}|bias={bias is not None}|{precision}|m{bucket}"
        key += "|tma" if tma else ""
        key += "|residual" if has_residual else ""  # one more read in the epilogue: timed apart
        kernels = (_linear_kernel, gemv._gemv_kernel, persistent._linear_persistent_kernel)
        scope = scope_for("linear", *kernels)  # with every helper they call (tuning.source_hash)
        candidates = cuda_configs(bucket, N, K, sms, x.element_size(), shared_memory, tma, has_residual)
        config = tune(scope, key, candidates, run)
        if configs is not None:
            configs[(bucket, precision, tma, has_residual)] = config
    compiled = run(config)
    if direct is not None and not has_residual and DIRECT_LAUNCH and aligned(x, out):
        if persistent.is_persistent(config):
            kernel, constexprs = persistent._linear_persistent_kernel, persistent.constexprs(fixed, config, programs)
        else:
            kernel, constexprs = (
                _pointer_kernel(config),
                {**fixed, "HAS_RESIDUAL": False, **gemv.kernel_meta(config), **align},
            )
        direct[(bucket, precision)] = (DirectLaunch(compiled, constexpr_tail(kernel, constexprs)), config)
    return out


def _pointer_kernel(config: LaunchConfig):
    """The kernel of a non-persistent config: the GEMV one or the MMA one (they take the same arguments)."""
    return gemv._gemv_kernel if gemv.is_gemv(config) else _linear_kernel


# ---- candidate configs (the tuner times them on CUDA) ----


def pipeline_shared_memory(config: LaunchConfig, element_size: int) -> int:
    """Shared memory the software pipeline takes for the x and W tiles. Tiles of 64+ rows run Hopper's
    warpgroup MMA, whose pipeline keeps num_stages buffers of each; smaller ones keep num_stages - 1.
    Both as Triton's compile for sm_90 asks: 128x256x64 fp32 at 3 stages for 294,912 B = 3 x (128*64 + 64*256) x 4;
    16x64x256 fp32 at 4 stages for 245,760 B = 3 x (16*256 + 256*64) x 4."""
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    buffers = config.num_stages if bm >= 64 else max(1, config.num_stages - 1)
    return buffers * (bm * bk + bk * bn) * element_size


def cuda_configs(
    bucket: int,
    N: int,
    K: int,
    sms: int,
    element_size: int = 2,
    shared_memory: int = HOPPER_SHARED_MEMORY,
    tma: bool = False,
    residual: bool = False,
) -> list[LaunchConfig]:
    """Candidates the tuner times for one (batch bucket, N, K) on a GPU with `sms` multiprocessors, for
    elements of `element_size` bytes; a candidate whose pipeline would not fit `shared_memory` is left out
    (the tuner would skip it anyway, after a failed compile). `tma`: the operands suit TMA, so the
    persistent kernel's configs (linear_persistent.py) join where it can win (`persistent.offered`).
    `residual`: the epilogue reads one, which 128x256 tiles cannot hold beside their accumulator (compiled
    for sm_90, fp16: 128 bytes of stack a thread), so they are left out.

    Batches of 1-16 rows are weight-streaming problems (M=1, 4096x4096 fp16: 32 MB read for 32 kFLOP):
    a 16-row MMA tile, narrow N tiles and split-K so that every SM streams weights, and deep pipelines
    for bytes in flight. Bigger batches get the usual square-ish tiles.
    """

    def split_for(bn: int, bk: int, bm: int = 16) -> int:
        tiles = triton.cdiv(N, bn) * triton.cdiv(bucket, bm)
        split = 1
        while tiles * split < sms and split < 8 and triton.cdiv(K, bk) >= 4 * split:  # >= 2 K steps per split
            split *= 2
        return split

    def wave_split(tiles: int) -> int:
        """Splits along K (a power of two) for `tiles` output tiles of a big batch: as many as keep every
        program in one wave of the SMs and 16+ K steps of 64 long."""
        split = 1
        while tiles * split * 2 <= sms and triton.cdiv(K, 64) >= 16 * split * 2:
            split *= 2
        return split

    def cfg(bm, bn, bk, warps, stages, split=1):
        return LaunchConfig.of(warps, stages, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SPLIT_K=split)

    # Each candidate is a compile (~1 s) and a timing the first time a shape is tuned, so the lists are
    # short: the winners of wider sweeps (docs/performance.md) and their neighbours.
    configs = []
    if bucket <= 16:
        for bn in (32, 64):
            for bk in (128, 256):
                configs.append(cfg(16, bn, bk, 4, 4))
                if split_for(bn, bk) > 1:
                    configs.append(cfg(16, bn, bk, 4, 4, split_for(bn, bk)))
    elif bucket <= 64:
        for bm in (32, 64):
            for bn in (64, 128):
                configs.append(cfg(bm, bn, 64, 4, 4))
                if split_for(bn, 64) > 1:
                    configs.append(cfg(bm, bn, 64, 4, 4, split_for(bn, 64)))
        # Still weight streams (32x4096x4096 fp16: 32 MB for 1 GFLOP), which the 64-deep K steps above feed in
        # small loads: 32-row tiles with 128- and 256-deep steps, split so that every SM streams, as the
        # 16-row tiles of smaller batches do (without them the wide MLP's 4096x4096 layer took longer at batch
        # 32 than at 16: docs/performance.md).
        for bn in (32, 64):
            for bk in (128, 256):
                configs.append(cfg(32, bn, bk, 4, 3, split_for(bn, bk, 32)))
    else:
        configs += [
            cfg(128, 256, 64, 8, 3),
            cfg(128, 128, 64, 8, 3),
            cfg(128, 128, 64, 4, 4),
            cfg(64, 128, 64, 4, 4),
            cfg(64, 64, 64, 4, 4),  # small GEMMs (64x256x128: 4 tiles of 32x64) want more programs
            # Deeper pipelines for 64x128, the 1024^3 tile (128 programs): the fastest of a sweep of depths and
            # K steps at 1024^3 (docs/performance.md). Each is left out below where its stages do not fit in
            # shared memory (fp32 for the first two).
            cfg(64, 128, 128, 4, 4),
            cfg(64, 128, 64, 4, 6),
            # And a shallower one: 72 KB of stages (fp16), so three programs share an SM and one's epilogue runs
            # beside the others' MMAs. 1024x768 -> 3072 with the erf GELU: 13.7 us hot against 16.4 at 4 stages
            # (two programs an SM); cuBLASLt's tanh-GELU epilogue 11.7 (H100, probe_wide_layers_mlp768_h100.txt).
            cfg(64, 128, 64, 4, 3),
        ]
        if element_size == 4:
            configs.append(cfg(64, 128, 32, 4, 6))
        # 128x128 tiles split along K to fill one wave: only with 16+ K steps per split (256x4096x4096: 64
        # tiles for 132 SMs), where each program streams long enough to pay for the partials' round trip.
        # With 8 (1024^3) they lose: 17.4 us against 11.6 for 64x128x64 (docs/performance.md, "Tried and lost").
        split = wave_split(triton.cdiv(bucket, 128) * triton.cdiv(N, 128))
        if split > 1:
            configs += [cfg(128, 128, 64, 8, 3, split), cfg(128, 128, 64, 4, 4, split)]
        # The same for 64x128 tiles: 256x1024x4096 (the wide MLP's last layer at batch 256) has 32 of them, each
        # 64 K steps long; unsplit, the best candidate took 14.2 us hot for 2.1 GFLOP (docs/performance.md).
        split = wave_split(triton.cdiv(bucket, 64) * triton.cdiv(N, 128))
        if split > 1:
            configs += [cfg(64, 128, 64, 4, 4, split), cfg(64, 128, 128, 4, 4, split)]
        # And for 64x64 tiles: twice the tiles, so half the split (that last layer: 64 tiles split 2 ways, 16 K
        # steps of 128 each). The fastest hot in a sweep of every tile, depth and split: 10.4 us against 11.8 for
        # 64x128 split 4 (docs/performance.md, "The wide MLP's last layer at batch 256").
        split = wave_split(triton.cdiv(bucket, 64) * triton.cdiv(N, 64))
        if split > 1:
            configs.append(cfg(64, 64, 128, 4, 4, split))
    if triton.cdiv(bucket, 64) * triton.cdiv(N, 64) < sms and bucket > 16:
        # A GEMM of fewer 64x64 tiles than SMs: 16x32 tiles, one program per 512 outputs, so loads go out
        # from many SMs at once (64x256x128 fp16: 6.7 us cold against 7.1 for 64x64 tiles; docs/performance.md).
        configs += [cfg(16, 32, 64, 4, 4), cfg(16, 32, 256, 4, 2), cfg(16, 64, 256, 4, 2)]
    if bucket == 1:
        configs += gemv.cuda_configs(N, K, sms)  # CUDA cores, no 16-row padding: see linear_gemv.py
    configs = [c for c in configs if pipeline_shared_memory(c, element_size) <= shared_memory]
    if residual:
        configs = [c for c in configs if c["BLOCK_M"] * c["BLOCK_N"] < 128 * 256]
    if tma and persistent.offered(bucket, N, sms):
        configs += persistent.cuda_configs(element_size, shared_memory)
    return configs


# ---- under the interpreter: one config, from choices that tests change (interpreter.py) ----


SMALL_INTERPRETER_TILE = (16, 32, 32)  # tests' tile: awkward shapes cross block edges in every dimension


@dataclass(frozen=True)
class InterpreterChoice:
    """What fused_linear and FusedLinear run under the interpreter. Its cost is per program and per K step, not
    per element (64x256x128: 900 ms with 16x32x32 tiles, 27 ms with 64x256x128), so by default the largest tile
    the problem fills."""

    tile: tuple[int, int, int] | None = None  # (BLOCK_M, BLOCK_N, BLOCK_K); None: the largest the problem fills
    split_k: int = 1  # > 1: programs per tile, so that the split-K reduction runs
    config: LaunchConfig | None = None  # any candidate instead, GEMV or persistent (that one only where TMA can)


INTERPRETER = InterpreterSwitches(InterpreterChoice())


def _interpreter_config(M: int, N: int, K: int) -> LaunchConfig:
    def fit(n: int, hi: int) -> int:
        return max(16, min(hi, triton.next_power_of_2(n)))  # tl.dot needs every block dim >= 16

    choice = INTERPRETER.choice
    bm, bn, bk = choice.tile or (fit(M, 64), fit(N, 256), fit(K, 128))
    return LaunchConfig.of(4, 1, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=4, SPLIT_K=choice.split_k)
