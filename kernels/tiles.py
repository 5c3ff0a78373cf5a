"""What the GEMM kernels share: the order in which output tiles are computed (linear.py, linear_persistent.py),
the split-K reduction and its workspace (linear.py, linear_gemv.py, mlp.py, conv.py), their common constexpr
flags, the residual their epilogues read (linear.py, conv.py, conv_tma.py), Hopper's shared-memory limit for
their pipelines, and the device limits they are sized by."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import use_pdl
from .runtime import bf16_on_interpreter

HOPPER_SHARED_MEMORY = 232_448  # bytes per block (opt-in) on sm_90, as Triton reports it


_limits: dict[torch.device, tuple[int, int]] = {}


def device_limits(device: torch.device) -> tuple[int, int]:
    """(multiprocessors, shared memory per block in bytes) of a CUDA device, looked up once."""
    if device not in _limits:
        props = torch.cuda.get_device_properties(device)
        _limits[device] = (
            props.multi_processor_count,
            getattr(props, "shared_memory_per_block_optin", HOPPER_SHARED_MEMORY),
        )
    return _limits[device]


def gemm_flags(has_bias: bool, activation: str, dtype: torch.dtype, allow_tf32: bool, device: torch.device) -> dict:
    """HAS_BIAS, ACTIVATION, INPUT_PRECISION, UPCAST_DOT, ROUND_BF16 and PDL, as every GEMM kernel here takes
    them. Under the interpreter bf16 tiles are multiplied as fp32 (exact: bf16 * bf16 fits fp32) and the
    result is rounded to bf16 by hand (runtime.bf16_on_interpreter); compiled kernels use native bf16. PDL:
    launched as a programmatic dependent launch on sm_90+ (pdl.py; pass launch_options(flags) too)."""
    upcast = bf16_on_interpreter(dtype)
    return dict(
        HAS_BIAS=has_bias,
        ACTIVATION=activation,
        INPUT_PRECISION="tf32" if (allow_tf32 and not upcast) else "ieee",
        UPCAST_DOT=upcast,
        ROUND_BF16=upcast,
        PDL=use_pdl(device),
    )


def residual_like(residual: torch.Tensor, out: torch.Tensor, any_dtype: bool = False) -> torch.Tensor:
    """`residual` as an epilogue reads it: at y's offsets, so with out's shape, dtype, device and strides (any dtype
    with `any_dtype`: the fp8 kernels read an e4m3 residual with its scale beside an fp16 y, or the reverse). One in
    another layout (NCHW for an NHWC output, a transposed view, ...) is copied into out's layout first: one more
    kernel, which a model avoids by keeping its skip connections in its outputs' layout. One in out's own memory
    is refused: the first call of a shape runs the kernel once per tuned candidate, and each run would add the
    last one's output again."""
    if tuple(residual.shape) != tuple(out.shape):
        raise ValueError(f"residual must have the output's shape {tuple(out.shape)}; got {tuple(residual.shape)}")
    if residual.dtype != out.dtype and not any_dtype:
        raise TypeError(f"residual has dtype {residual.dtype} but the output is {out.dtype}; cast it to one dtype")
    if residual.device != out.device:
        raise ValueError(f"residual is on {residual.device} but the output is on {out.device}")
    if residual.numel() and residual.untyped_storage().data_ptr() == out.untyped_storage().data_ptr():
        raise ValueError("residual shares memory with out: tuning runs the kernel more than once; pass another tensor")
    same = all(a == b for n, a, b in zip(out.shape, residual.stride(), out.stride(), strict=True) if n > 1)
    if not same:
        copy = torch.empty_strided(out.shape, out.stride(), dtype=residual.dtype, device=out.device)
        residual = copy.copy_(residual)
    return residual


def launch_options(flags: dict) -> dict:
    """The launch option that goes with gemm_flags' PDL: a kernel that waits (gdc_wait) must be launched
    with launch_pdl for the early start, and one launched so must wait. Empty without PDL (older Triton
    has no such option)."""
    return {"launch_pdl": True} if flags["PDL"] else {}


def pow2_alignment(*sizes: int) -> int:
    """The largest power of two, at most 16, that divides every one of `sizes` (elements): what a kernel may
    say of sizes and row strides that Triton, which specializes only multiples of 16, knows nothing of."""
    align = 16
    while align > 1 and any(s % align for s in sizes):
        align //= 2
    return align


def channels_last_alignment(t: torch.Tensor) -> int:
    """What a conv kernel may say of a 4-D tensor's pixel strides (its ALIGN constexprs, for known_multiple): with the
    channels contiguous (stride(1) == 1), the largest power of two, at most 16, dividing the strides of its other
    dimensions (height or width of size 1: only ever indexed at 0, so left out); else 1, nothing said. 104 channels in
    channels_last (RegNetY) give 8: Triton, which specializes only multiples of 16, saw 2-byte loads there. The
    image stride counts at any batch, so one layer's batches share one value (and one compiled kernel)."""
    if t.stride(1) != 1:
        return 1
    sizes, strides = t.shape, t.stride()
    return pow2_alignment(strides[0], *(strides[i] for i in (2, 3) if sizes[i] != 1))


@triton.jit
def known_strides(stride_n, stride_h, stride_w, ALIGN: tl.constexpr):
    """known_multiple for a channels-last tensor's image, row and pixel strides (channels_last_alignment)."""
    return known_multiple(stride_n, ALIGN), known_multiple(stride_h, ALIGN), known_multiple(stride_w, ALIGN)


@triton.jit
def known_multiple(value, ALIGN: tl.constexpr):
    """`value`, which the launcher checked is a multiple of ALIGN, written so that Triton's alignment analysis
    can see it: (value // ALIGN) * ALIGN is a multiple of ALIGN by construction. For ALIGN 2-8; at 16 Triton
    specialized the argument itself, at 1 there is nothing to say."""
    if ALIGN > 1 and ALIGN < 16:
        value = value // ALIGN * ALIGN
    return value


@triton.jit
def known_gemm_multiples(K, stride_xm, stride_wn, N, stride_ym, K_ALIGN: tl.constexpr, N_ALIGN: tl.constexpr):
    """known_multiple for a GEMM's sizes and row strides (linear.py's and linear_gemv.py's kernels): K and x's
    and W's row strides are multiples of K_ALIGN, N and y's of N_ALIGN, as the launcher found them
    (pow2_alignment). Rows of 1000 fp16 elements then get 16-byte loads: unsaid, every load is a 2-byte one
    without cp.async, 385 instructions per K step against 80 (64x64x64 fp16, sm_90)."""
    return (
        known_multiple(K, K_ALIGN),
        known_multiple(stride_xm, K_ALIGN),
        known_multiple(stride_wn, K_ALIGN),
        known_multiple(N, N_ALIGN),
        known_multiple(stride_ym, N_ALIGN),
    )


@triton.jit
def grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(row block, column block) of output tile number `tile` in grouped order (Triton tutorial 03):
    GROUP_M row blocks share each column of W tiles while they are in L2, instead of sweeping all of W
    once per row block."""
    in_group = GROUP_M * num_pid_n
    first_m = (tile // in_group) * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % in_group) % size_m, (tile % in_group) // size_m


@triton.jit
def split_k_sum(acc, ws_ptr, cnt_ptr, tile, pid_k, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Split-K: SPLIT_K programs each hold a (BLOCK_M, BLOCK_N) fp32 partial of output tile `tile`; returns
    (the full sum, a mask that is true only in the last program to arrive). Each program writes its partial
    to the workspace; the last to arrive (per-tile counter) sums all SPLIT_K partials in a fixed order
    (deterministic, unlike atomic adds) and resets the counter to 0, so the next launch (or CUDA-graph
    replay) needs no memset. The barrier + acq_rel atomic is CUTLASS's semaphore: every thread's partial
    is stored before the arrival is published."""
    tile_offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tl.store(ws_ptr + (tile * SPLIT_K + pid_k) * (BLOCK_M * BLOCK_N) + tile_offs, acc)
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
    # Only the last program loads (masked loads of the others issue no memory requests) and stores.
    last = (tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32) + arrived) == SPLIT_K - 1  # as a tile: a mask
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(SPLIT_K):
        part = ws_ptr + (tile * SPLIT_K + s) * (BLOCK_M * BLOCK_N) + tile_offs
        total += tl.load(part, mask=last, other=0.0, cache_modifier=".cg")  # .cg: from L2, never a stale L1 line
    tl.atomic_add(cnt_ptr + tile, tl.where(arrived == SPLIT_K - 1, -SPLIT_K, 0))  # back to 0 for the next call
    return total, last


class SplitKWorkspace:
    """fp32 partial tiles and zeroed per-tile counters for split-K launches, grown on demand and kept:
    the kernel leaves every counter at 0, so the buffers can be reused, and captured in a CUDA graph."""

    def __init__(self, device: torch.device):
        self.device = device
        self.partials = torch.empty(0, dtype=torch.float32, device=device)
        self.counters = torch.zeros(0, dtype=torch.int32, device=device)
        self._outgrown: list[torch.Tensor] = []

    def get(self, tiles: int, tile_elems: int, split: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffers for `tiles` output tiles of `tile_elems` each, `split` partials per tile. split == 1
        launches never touch them but still need real pointers: one element each. (Sized by the tiles, a
        4096x4096 output asked for 64 MB it never used, and twice that kept across the batch buckets.)"""
        if split == 1:
            tiles = tile_elems = 1
        # Outgrown buffers are kept, never freed: a CUDA graph captured earlier still writes to them, and
        # freed memory would be handed to other tensors. Split-K runs at small batches: a few KB per layer.
        if self.partials.numel() < tiles * split * tile_elems:
            self._outgrown.append(self.partials)
            self.partials = torch.empty(tiles * split * tile_elems, dtype=torch.float32, device=self.device)
        if self.counters.numel() < tiles:
            self._outgrown.append(self.counters)
            self.counters = torch.zeros(tiles, dtype=torch.int32, device=self.device)
        return self.partials, self.counters
