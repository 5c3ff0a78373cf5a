"""The persistent TMA GEMM + bias + activation kernel (kernels/linear_persistent.py) against the float64
reference: every dtype and activation, shapes that cross tile edges, programs that walk several tiles.
Interpreted on the CPU; compiled on the lent GPU (`gpu`); its sm_90 compile is in test_kernels_compile.py.
"""

from __future__ import annotations

import pytest
import torch

from kernels import ACTIVATIONS, reference
from kernels.linear_persistent import (
    cuda_configs,
    linear_persistent,
    shared_memory_bytes,
    stream_k_configs,
    tma_eligible,
)
from kernels.tiles import SplitKWorkspace
from kernels.tuning import LaunchConfig
from tests.tolerances import RTOL, assert_close_to

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Small tiles under the interpreter, so the shapes below cross every edge and 4 programs walk 2-12 tiles.
SMALL = LaunchConfig.of(4, 2, BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2)
# The same tiles with their K steps shared out (stream-K): (37, 56, 72) is 6 tiles of 3 K steps, 18 steps for 4
# programs, so tiles are cut between programs; (1, 8, 8) one step, so 3 of 4 programs have none.
SMALL_STREAM_K = LaunchConfig.of(4, 2, BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, PERSISTENT=1, STREAM_K=1)
# (M, N, K): TMA needs row strides of 16 bytes, so N and K are multiples of 8 (fp16) or 4 (fp32): one row,
# a prime number of rows, and N and K just past a tile edge.
SHAPES = [(1, 8, 8), (37, 56, 72), (100, 96, 64), (33, 40, 136)]


def _check(M, N, K, dtype, activation, config, *, bias=True, device=DEVICE, seed=0, programs=None, launches=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(device=device, dtype=dtype)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(device=device, dtype=dtype)
    b = torch.randn(N, generator=gen).to(device=device, dtype=dtype) if bias else None
    want = reference.linear(x.double(), w.double(), b.double() if bias else None, activation)
    workspace = SplitKWorkspace(torch.device(device))
    for launch in range(launches):  # the stream-K counters are back at 0 for the next launch
        out = torch.full((M, N), float("nan"), device=device, dtype=dtype)  # NaN left behind = not written
        got = linear_persistent(x, w, b, activation, config, allow_tf32=False, out=out, programs=programs,
                                workspace=workspace)  # fmt: skip
        assert got is out
        what = f"persistent {M}x{N}x{K} {dtype} {activation} {config.meta()} programs={programs} launch {launch}"
        assert_close_to(got, want, RTOL[dtype], what)
        assert not workspace.counters.any(), f"{what}: a tile's arrival counter was left at {workspace.counters}"


@pytest.mark.parametrize("M,N,K", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_and_edge(M, N, K, dtype):
    _check(M, N, K, dtype, "relu", SMALL)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("config", [SMALL, SMALL_STREAM_K], ids=["tiles", "stream_k"])
def test_every_activation(activation, config):
    _check(37, 56, 72, torch.float32, activation, config)


@pytest.mark.parametrize("M,N,K", [*SHAPES, (64, 64, 320)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_stream_k_every_dtype_and_edge(M, N, K, dtype):
    """Twice on one workspace: a counter left behind would make the second launch sum a tile too early."""
    _check(M, N, K, dtype, "gelu", SMALL_STREAM_K, launches=2)


@pytest.mark.parametrize("programs", [1, 3, 7, 40])
def test_stream_k_any_number_of_programs(programs):
    """One program (no tile is cut), runs that cut tiles unevenly (3, 7), and more programs than K steps (40 for
    (33, 40, 136)'s 3 x 2 tiles of 5 steps: 30), where some runs are empty."""
    _check(33, 40, 136, torch.float16, "silu", SMALL_STREAM_K, programs=programs, launches=2)


def test_without_bias():
    _check(37, 56, 72, torch.float16, "gelu_tanh", SMALL, bias=False)


def test_tma_eligibility_names_alignment():
    x, w = torch.randn(4, 8), torch.randn(16, 8)
    assert tma_eligible(x, w)
    assert not tma_eligible(torch.randn(4, 9)[:, :8], w)  # row stride 36 B: not 16-byte aligned
    assert not tma_eligible(x, torch.randn(16, 8).t().contiguous().t())  # columns not contiguous
    with pytest.raises(ValueError, match="16-byte aligned"):
        linear_persistent(torch.randn(4, 9)[:, :8], w, None, "relu", SMALL)


def test_configs_fit_hopper_shared_memory():
    for element_size in (2, 4):
        configs = cuda_configs(element_size)
        assert len(configs) >= 4
        for c in configs + stream_k_configs(element_size):
            assert shared_memory_bytes(c, element_size) <= 232_448, c
    # stream-K stages the fp32 part too: 128x128 fp32 at 4 stages would need 262,144 B
    assert [c.num_stages for c in stream_k_configs(2)] == [3, 4] and [c.num_stages for c in stream_k_configs(4)] == [3]
    # fp16 128x256x64 at 4 stages would need 262,144 B: left out
    assert {(c["BLOCK_N"], c.num_stages) for c in cuda_configs(2)} == {(128, 3), (128, 4), (256, 3)}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "M,N,K", [(1, 1024, 1024), (300, 1000, 1032), (1024, 1024, 1024), (4096, 512, 4096), (2048, 768, 3072)], ids=str
)
def test_gpu_every_config(M, N, K, dtype):
    size = torch.tensor([], dtype=dtype).element_size()
    for config in cuda_configs(size) + stream_k_configs(size):
        _check(M, N, K, dtype, "gelu_tanh", config, launches=2)
