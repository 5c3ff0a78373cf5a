"""fused_conv2d's full matrix of the three switches a layer can combine (issue 37): bias or none, NCHW or NHWC
input, and both K loops (FLAT_K=1: k over all C * KH * KW; FLAT_K=0: one tap at a time), each with and without
a fused pool, through the public launcher, against the float64 reference.

Why a matrix: on an H100 the compiled kernel without a bias gave wrong outputs for NHWC input with the per-tap
K loop only; every other corner was right (bench/results/h100/gpu_tests_h100.txt). The older tests covered those
switches in pairs, never all three at once.

How the K loop is forced: under the interpreter (CPU), `kernels.conv.INTERPRETER`'s `flat_k` and the small
`tile` (16x16x16, so every shape crosses block edges); compiled (the `gpu` tests), the tuner is
replaced by one config with the wanted FLAT_K, as tests/test_kernels_conv.py's every-candidate test does. On the
GPU a layer without a bias runs with a zero bias (kernels/conv.py, _zeros_for), so there the no-bias cases check
that the launcher keeps doing so.

Shapes are small (each CPU case takes well under a second in the interpreter): a few channels (where the
launcher would pick FLAT_K itself), 17 channels (one full 16-channel K step and a partial one), the H100's
failing case (3, 17, 6, 5 -> 20, 3x3, stride 2, padding 2, dilation 2) among them.
"""

from __future__ import annotations

import pytest
import torch

import kernels.conv as conv_mod
from kernels import reference
from kernels.conv import fused_conv2d
from kernels.tuning import LaunchConfig
from tests.test_kernels_conv import _inputs
from tests.tolerances import RTOL, assert_close_to

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (N, C, H, W, O, kernel, stride, padding, dilation)
CASES = [
    (2, 3, 7, 9, 5, (3, 2), (2, 1), (1, 0), (1, 2)),  # few channels, uneven everything
    (3, 17, 6, 5, 20, 3, 2, 2, 2),  # the H100's failing no-bias NHWC FLAT_K=0 case
]
POOLED_CASE = ((1, 17, 5, 5, 20, 3, 1, 1, 1), ("max", 2))  # 2x2 over a 5x5 conv output: the last row dropped


def _ids(case) -> str:
    return "-".join(str(v).replace(" ", "") for v in case)


@pytest.fixture(params=[True, False], ids=["flat_k", "taps"])
def flat_k(request, monkeypatch):
    """Forces the K loop: the interpreter's switch on the CPU, a single forced config on a GPU."""
    flat = request.param
    if DEVICE == "cpu":
        with conv_mod.INTERPRETER.override(flat_k=flat, tile=conv_mod.SMALL_INTERPRETER_TILE):
            yield flat
        return
    # 64x32x16 on 4 warps: a tile every candidate list has a variant of; split-K off (the pool forbids it)
    config = LaunchConfig.of(4, 3, BLOCK_M=64, BLOCK_N=32, BLOCK_K=16, GROUP_M=8, FLAT_K=int(flat), SPLIT_K=1)
    monkeypatch.setattr(conv_mod, "tune", lambda *a, **kw: config)
    conv_mod._configs.clear()
    yield flat
    conv_mod._configs.clear()  # no later test may reuse a forced pick


def _run(case, dtype, bias, channels_last, pool=None, activation="gelu_tanh", device=DEVICE):
    _, C, *_, s, p, d = case
    x, w, b = _inputs(case, dtype, device, bias=bias, channels_last=channels_last)
    want = reference.conv2d(
        x.double(), w.double(), b.double() if b is not None else None, activation, stride=s, padding=p, dilation=d
    )
    if pool is not None:
        want = reference.pool2d(want, pool[0], pool[1], pool[2] if len(pool) > 2 else None)
    # The output in x's layout, NaN-filled: an element the kernel never wrote fails assert_close_to.
    fmt = torch.channels_last if channels_last and C > 1 else torch.contiguous_format
    out = torch.full(want.shape, float("nan"), device=device, dtype=dtype).contiguous(memory_format=fmt)
    got = fused_conv2d(
        x, w, b, stride=s, padding=p, dilation=d, activation=activation, pool=pool, allow_tf32=False, out=out
    )
    assert got is out
    layout = "nhwc" if channels_last else "nchw"
    assert_close_to(got, want, RTOL[dtype], f"{case} pool={pool} {dtype} bias={bias} {layout}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_bias_layout_and_k_loop(flat_k, case, bias, channels_last, dtype):
    _run(case, dtype, bias, channels_last)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_bias_layout_and_k_loop_with_a_fused_pool(flat_k, bias, channels_last):
    case, pool = POOLED_CASE
    _run(case, torch.float16, bias, channels_last, pool=pool, activation="relu")


@pytest.mark.gpu
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_gpu_bf16_bias_layout_and_k_loop(flat_k, bias, channels_last):
    """Native bf16 tl.dot, which the interpreter cannot check (DESIGN.md): the fault of the H100 showed in bf16."""
    for case in CASES:
        _run(case, torch.bfloat16, bias, channels_last)
