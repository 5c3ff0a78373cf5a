"""The persistent TMA GEMM + bias + activation kernel (kernels/linear_persistent.py) against the float64
reference: every dtype and activation, shapes that cross tile edges, programs that walk several tiles.
Interpreted on the CPU; compiled on the lent GPU (`gpu`); its sm_90 compile is in test_kernels_compile.py.
"""

from __future__ import annotations

import pytest
import torch

from kernels import ACTIVATIONS, reference
from kernels.linear_persistent import cuda_configs, linear_persistent, shared_memory_bytes, tma_eligible
from kernels.tuning import LaunchConfig
from tests.tolerances import RTOL, assert_close_to

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Small tiles under the interpreter, so the shapes below cross every edge and 4 programs walk 2-12 tiles.
SMALL = LaunchConfig.of(4, 2, BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2)
# (M, N, K): TMA needs row strides of 16 bytes, so N and K are multiples of 8 (fp16) or 4 (fp32): one row,
# a prime number of rows, and N and K just past a tile edge.
SHAPES = [(1, 8, 8), (37, 56, 72), (100, 96, 64), (33, 40, 136)]


def _check(M, N, K, dtype, activation, config, *, bias=True, device=DEVICE, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(device=device, dtype=dtype)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(device=device, dtype=dtype)
    b = torch.randn(N, generator=gen).to(device=device, dtype=dtype) if bias else None
    out = torch.full((M, N), float("nan"), device=device, dtype=dtype)  # NaN left behind = not written
    got = linear_persistent(x, w, b, activation, config, allow_tf32=False, out=out)
    assert got is out
    want = reference.linear(x.double(), w.double(), b.double() if bias else None, activation)
    assert_close_to(got, want, RTOL[dtype], f"persistent {M}x{N}x{K} {dtype} {activation} {config.meta()}")


@pytest.mark.parametrize("M,N,K", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_and_edge(M, N, K, dtype):
    _check(M, N, K, dtype, "relu", SMALL)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_every_activation(activation):
    _check(37, 56, 72, torch.float32, activation, SMALL)


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
        for c in configs:
            assert shared_memory_bytes(c, element_size) <= 232_448, c
    # fp16 128x256x64 at 4 stages would need 262,144 B: left out
    assert {(c["BLOCK_N"], c.num_stages) for c in cuda_configs(2)} == {(128, 3), (128, 4), (256, 3)}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M,N,K", [(1, 1024, 1024), (300, 1000, 1032), (1024, 1024, 1024), (4096, 512, 4096)], ids=str)
def test_gpu_every_config(M, N, K, dtype):
    for config in cuda_configs(torch.tensor([], dtype=dtype).element_size()):
        _check(M, N, K, dtype, "gelu_tanh", config)
