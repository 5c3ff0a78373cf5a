"""Fused linear layer: y = act(x @ W^T + b) in one Triton kernel.

Unfused, eager torch runs this as three kernels (mm, bias add, activation): the (M, N) result is
written to memory by the GEMM and read back twice. Here the bias and the activation are applied to
the fp32 accumulator tile while it is still in registers, so y is written once, in its final dtype:
3 launches -> 1, and 2*M*N fewer elements written plus 2*M*N fewer read.

Shapes (PyTorch's nn.Linear layout): x (M, K), weight (N, K), bias (N,) or None, y (M, N).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .activations import DEFAULT_NEGATIVE_SLOPE, apply_activation, check_activation, round_to_bf16
from .runtime import bf16_on_interpreter, check_device, interpreting

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit(do_not_specialize=["M", "M_BUCKET"])
def _linear_kernel(
    # pointers
    x_ptr, w_ptr, b_ptr, y_ptr,
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
    ACTIVATION: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,  # "ieee" or "tf32"; only fp32 operands care
    UPCAST_DOT: tl.constexpr,  # bf16 operands multiplied as fp32 (interpreter workaround, see launcher)
    ROUND_BF16: tl.constexpr,  # round to bf16 by hand before the store (interpreter workaround)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    # Grouped tile order (Triton tutorial 03): GROUP_M row-blocks share each column of W tiles
    # while they are in L2, instead of sweeping all of W once per row-block.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    # Rows and columns past the edge wrap around (% M, % N) so loads need no mask; they compute
    # throw-away values that the masked store below never writes.
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn  # a (BLOCK_K, BLOCK_N) view of W^T

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if UPCAST_DOT:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    # Epilogue on the fp32 accumulator: bias, activation, one rounding to the output dtype.
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n).to(tl.float32)
        acc = acc + bias[None, :]
    acc = apply_activation(acc, ACTIVATION, negative_slope)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn
    if ROUND_BF16:
        acc = round_to_bf16(acc)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def _config(bm: int, bn: int, bk: int, warps: int, stages: int) -> triton.Config:
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=warps, num_stages=stages
    )


def cuda_configs() -> list[triton.Config]:
    """Candidates for the autotuner: large tiles for big batches, BLOCK_M 16/32 with wide N for serving
    batches of 1-32 rows (a 128-row tile at M=1 would waste 127/128 of every MMA)."""
    return [
        _config(128, 128, 64, 8, 3),
        _config(128, 64, 64, 4, 4),
        _config(64, 128, 64, 4, 4),
        _config(64, 64, 64, 4, 4),
        _config(32, 128, 64, 4, 4),
        _config(32, 64, 128, 4, 3),
        _config(16, 128, 128, 4, 3),
        _config(16, 64, 128, 4, 4),
        _config(16, 64, 256, 4, 3),
    ]


def _prune_configs(configs, named_args, **kwargs):
    # A tile taller than twice the batch is mostly padding; drop it so tuning a small batch is quick.
    limit = max(16, 2 * named_args["M_BUCKET"])
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= limit]
    return kept or configs


# Interpreter (CPU): no autotuning: the autotuner needs a GPU driver to time configs ("0 active
# drivers" under the interpreter), and timing the interpreter would measure numpy, not the kernel.
# Its cost is per program and per K step, not per element (64x256x128: 900 ms with 16x32x32 tiles,
# 27 ms with 64x256x128), so it takes the largest tile the problem fills. Tests force the small
# tile too (`interpreter_tile`) so that awkward shapes cross block edges in every dimension.
SMALL_INTERPRETER_TILE = (16, 32, 32)
interpreter_tile: tuple[int, int, int] | None = None  # (BLOCK_M, BLOCK_N, BLOCK_K) override, for tests


def _interpreter_config(M: int, N: int, K: int) -> dict[str, int]:
    def fit(n: int, hi: int) -> int:
        return max(16, min(hi, triton.next_power_of_2(n)))  # tl.dot needs every block dim >= 16

    bm, bn, bk = interpreter_tile or (fit(M, 64), fit(N, 256), fit(K, 128))
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 4}


_linear_kernel_tuned = triton.autotune(
    configs=cuda_configs(),
    key=["M_BUCKET", "N", "K"],  # dtypes of the tensor arguments are added to the key by Triton
    prune_configs_by={"early_config_prune": _prune_configs},
)(_linear_kernel)


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


class FusedLinear:
    """y = act(x @ weight.T + bias) as a layer prepared for many calls, as a server makes them.

    The weights are checked once here; a call checks only x. On CUDA the config the autotuner picks
    for each batch bucket is remembered, so later calls in that bucket launch the kernel directly
    instead of going through the autotuner's Python (key building and cache lookup on every call).
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
        self.configs: dict[tuple[int, str], triton.Config] = {}  # (M bucket, input precision) -> tuned config

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        _check_x(x, self.weight)
        return _launch(
            x, self.weight, self.bias, self.activation, self.negative_slope, out, self.allow_tf32, self.configs
        )


def fused_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    *,
    negative_slope: float = DEFAULT_NEGATIVE_SLOPE,
    out: torch.Tensor | None = None,
    allow_tf32: bool | None = None,
) -> torch.Tensor:
    """act(x @ weight.T + bias) in one kernel; returns y (M, N) in x's dtype.

    allow_tf32: for float32 operands, multiply in TF32 (about 8x the fp32 rate on Hopper, ~1e-3
    relative error) or in full fp32. None follows `torch.backends.cuda.matmul.allow_tf32`, so the
    fused and the torch paths use the same setting.
    """
    _check_weights(weight, bias)
    _check_x(x, weight)
    check_activation(activation)
    return _launch(x, weight, bias, activation, float(negative_slope), out, allow_tf32, None)


def _launch(x, weight, bias, activation, negative_slope, out, allow_tf32, configs):
    M, K = x.shape
    N = weight.shape[0]
    if out is None:
        out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    else:
        _check_out(out, x, N)
    if M == 0:
        return out
    if allow_tf32 is None:
        allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    interp = interpreting()
    # Under the interpreter bf16 tiles are multiplied as fp32 (exact: bf16 * bf16 fits fp32) and the
    # result is rounded to bf16 by hand; see runtime.bf16_on_interpreter. Compiled kernels use native bf16.
    upcast = bf16_on_interpreter(x.dtype)
    precision = "tf32" if (allow_tf32 and not upcast) else "ieee"
    bucket = m_bucket(M)
    args = (
        x, weight, bias if bias is not None else x, out,
        M, N, K,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        negative_slope,
        bucket,
    )  # fmt: skip
    meta = dict(
        HAS_BIAS=bias is not None,
        ACTIVATION=activation,
        INPUT_PRECISION=precision,
        UPCAST_DOT=upcast,
        ROUND_BF16=upcast,
    )
    if interp:
        cfg = _interpreter_config(M, N, K)
        grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
        _linear_kernel[grid](*args, **meta, **cfg)
        return out
    best = configs.get((bucket, precision)) if configs is not None else None
    if best is not None:
        kw = best.all_kwargs()
        grid = (triton.cdiv(M, kw["BLOCK_M"]) * triton.cdiv(N, kw["BLOCK_N"]),)
        _linear_kernel[grid](*args, **meta, **kw)
        return out

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    _linear_kernel_tuned[grid](*args, **meta)
    if configs is not None and getattr(_linear_kernel_tuned, "best_config", None) is not None:
        configs[(bucket, precision)] = _linear_kernel_tuned.best_config
    return out
