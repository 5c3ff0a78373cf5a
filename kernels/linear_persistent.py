"""GEMM + bias + activation as a persistent kernel fed by TMA (Hopper's tensor memory accelerator).

For the big GEMMs, where the pointer-based kernel of linear.py trails cuBLAS. It has what cuBLAS has and
that kernel lacks: TMA copies (one instruction per tile, no address math in the main loop, no registers
held for in-flight loads) and a persistent grid (one program per SM walking the tiles, so the next tile's
loads overlap this tile's epilogue): 4096^3 fp16 in 200.6 us cold against 267.9 for linear.py's kernel
(docs/performance.md). With fewer tiles than SMs it is slower than linear.py's kernel (1024^3), so
FusedLinear offers its configs to the tuner only for GEMMs of at least one 128x128 tile per SM
(`offered`).

TMA needs 16-byte aligned row strides: K * element size and N * element size multiples of 16
(`tma_eligible`). Edges need no masks: TMA loads fill rows and columns past the tensor with zeros and
TMA stores drop them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .activations import DEFAULT_NEGATIVE_SLOPE, apply_activation, check_activation, round_to_bf16
from .launch import grid_launch
from .pdl import gdc_launch_dependents, gdc_wait
from .runtime import interpreting
from .tiles import HOPPER_SHARED_MEMORY, device_limits, gemm_flags, grouped_tile, launch_options
from .tuning import LaunchConfig


# M is never specialized: a prepared layer launches one compiled kernel for every batch size of a bucket.
@triton.jit(do_not_specialize=["M"])
def _linear_persistent_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    negative_slope,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,  # "ieee" or "tf32"; only fp32 operands care
    UPCAST_DOT: tl.constexpr,  # bf16 multiplied as fp32: the interpreter's numpy has no bf16
    ROUND_BF16: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent launch (pdl.py)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PROGRAMS: tl.constexpr,  # the grid: one program per SM, each walking tiles PROGRAMS apart
):  # fmt: skip
    if PDL:
        gdc_launch_dependents()
        # Before the descriptors too: they are written to scratch memory that the allocator may have taken
        # back from the previous kernel, which may still be running.
        gdc_wait()
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[stride_wn, 1], block_shape=[BLOCK_N, BLOCK_K])
    y_desc = tl.make_tensor_descriptor(y_ptr, shape=[M, N], strides=[stride_ym, 1], block_shape=[BLOCK_M, BLOCK_N])
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    # The epilogue recomputes its tile from a counter of its own, as tutorial 09 does: with flatten=True
    # the pipeliner may start the next tile's loads before this epilogue, and a shared counter would tie
    # the two together.
    tile_out = tl.program_id(0) - PROGRAMS
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, PROGRAMS, flatten=True):
        pid_m, pid_n = grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = x_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])
            b = w_desc.load([pid_n * BLOCK_N, ki * BLOCK_K])
            if UPCAST_DOT:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b.T, acc, input_precision=INPUT_PRECISION)

        tile_out += PROGRAMS
        pid_m, pid_n = grouped_tile(tile_out, num_pid_m, num_pid_n, GROUP_M)
        if HAS_BIAS:
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        acc = apply_activation(acc, ACTIVATION, negative_slope)
        if ROUND_BF16:
            acc = round_to_bf16(acc)
        y_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(y_ptr.dtype.element_ty))


# ---- the launcher ----


def tma_eligible(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> bool:
    """Whether TMA can address these tensors: rows contiguous, every base and row stride 16-byte aligned."""
    tensors = [x, weight] + ([out] if out is not None else [])
    return (
        all(
            t.dim() == 2 and t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
            for t in tensors
        )
        and (weight.shape[0] * x.element_size()) % 16 == 0
    )  # the output's row stride, when it is allocated here


def scratch(size: int, alignment: int, stream) -> torch.Tensor:
    # Device-side descriptors live in global memory that Triton asks the caller for: 3 x 128 B per program
    # (the sm_90 compile reports a global scratch of 384 B).
    return torch.empty(size, device="cuda", dtype=torch.int8)


def default_programs(device: torch.device) -> int:
    """The grid: one program per SM; 4 under the interpreter, so that programs walk several tiles there too."""
    return 4 if interpreting() else device_limits(device)[0]


def constexprs(fixed: dict, config: LaunchConfig, programs: int) -> dict:
    """The kernel's constexpr arguments and launch options for one config on `programs` programs."""
    return {**fixed, "PROGRAMS": programs, **{name: v for name, v in config.meta().items() if name != "PERSISTENT"}}


def launch(x, weight, bias, out, negative_slope: float, fixed: dict, config: LaunchConfig, programs: int):
    """One launch on `programs` programs (any number: those past the last tile do nothing, so a prepared
    layer launches one compiled kernel, PROGRAMS = the SMs, for every batch size); returns the compiled
    kernel. `fixed`: gemm_flags' HAS_BIAS .. PDL, as linear.py passes them."""
    M, K = x.shape
    N = weight.shape[0]
    triton.set_allocator(scratch)  # a context variable: set in the calling thread, every time
    return grid_launch(_linear_persistent_kernel, (programs,))(
        x, weight, bias if bias is not None else x, out,
        M, N, K,
        x.stride(0), weight.stride(0), out.stride(0),
        negative_slope,
        **constexprs(fixed, config, programs), **launch_options(fixed),
    )  # fmt: skip


def linear_persistent(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    config: LaunchConfig,
    *,
    negative_slope: float = DEFAULT_NEGATIVE_SLOPE,
    allow_tf32: bool | None = None,
    programs: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """act(x @ weight^T + bias) with the given config; `programs`: the persistent grid (default: the
    device's SMs; 4 under the interpreter, so that programs walk several tiles there too)."""
    check_activation(activation)
    M, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K or x.dtype != weight.dtype:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not match weight {tuple(weight.shape)} {weight.dtype}")
    if out is None:
        out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if not tma_eligible(x, weight, out):
        raise ValueError("TMA needs contiguous rows with 16-byte aligned bases and row strides")
    if M == 0:
        return out
    if allow_tf32 is None:
        allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    if programs is None:
        programs = default_programs(x.device)
    fixed = gemm_flags(bias is not None, activation, x.dtype, allow_tf32, x.device)
    launch(x, weight, bias, out, negative_slope, fixed, config, programs)
    return out


# ---- candidate configs (the tuner times them on CUDA) ----


def offered(bucket: int, N: int, sms: int) -> bool:
    """Whether the tuner should time this kernel for a GEMM: at least one 128x128 output tile per SM. Below
    that a persistent grid has nothing to overlap, and it is slower (see the module's doc)."""
    return triton.cdiv(bucket, 128) * triton.cdiv(N, 128) >= sms


def cuda_configs(element_size: int = 2, shared_memory: int = HOPPER_SHARED_MEMORY) -> list[LaunchConfig]:
    """Tutorial 09's space for Hopper: 128-row tiles, 128 or 256 wide, 64-deep K steps (32 for fp32, whose
    64-deep stages do not fit), 3-4 stages, 4 or 8 warps (8 for 256-wide), each kept where its stages and
    the epilogue's output tile fit in shared memory. PERSISTENT=1 marks them as this kernel's among the
    tuner's candidates (and in its cache file)."""
    configs = []
    bk = 64 if element_size <= 2 else 32
    for bn in (128, 256):
        for stages in (3, 4):
            # 128x256 over 4 warps spilled (sm_90 compile: 255 registers and 1,848 B of stack per thread)
            for warps in (4, 8) if bn == 128 else (8,):
                c = LaunchConfig.of(warps, stages, BLOCK_M=128, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, PERSISTENT=1)
                if shared_memory_bytes(c, element_size) <= shared_memory:
                    configs.append(c)
    return configs


def is_persistent(config: LaunchConfig) -> bool:
    return ("PERSISTENT", 1) in config.kwargs


def shared_memory_bytes(config: LaunchConfig, element_size: int) -> int:
    """The A and B stages plus the output tile staged for the TMA store."""
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    return config.num_stages * (bm + bn) * bk * element_size + bm * bn * element_size
