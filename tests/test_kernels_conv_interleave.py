"""fused_conv2d(interleave=, interleave_index=): a conv's output written to channels k::2 of a buffer of twice its
channels with another tensor's channels in the others, as a ShuffleNet unit's concat + channel shuffle (groups 2) ends.

Where the other tensor is a channel run of a buffer with the output's pixel strides (a split's first half) or dense
channels_last (the other branch's output), the kernel stores both in whole rows (INTERLEAVE, P_PIXEL); otherwise the
conv writes its channels and the other tensor is copied beside it. Each against the reference conv and the partner
exactly, over both k, 1x1 and 3x3 convs, awkward channel counts (odd, prime, past a block), batch 1 and primes, every
dtype and activations, split K; the buffer starts as NaN, so an element not written fails. The compiled path: the
`gpu` test at ShuffleNetV2's shapes, and the sm_90 compile here.
"""

from __future__ import annotations

import pytest
import torch

import kernels.conv as conv_mod
from kernels import reference
from kernels.conv import fused_conv2d, interleaved_buffer
from tests.tolerances import RTOL, assert_close_to

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NHWC = torch.channels_last
# (N, C, H, W, OC, kernel, padding): ShuffleNet's branch end (1x1) at batch 1, a prime batch and odd channel counts,
# 17 output channels across a 16-wide block, and a padded 3x3.
CASES = [(1, 6, 5, 5, 6, 1, 0), (3, 7, 4, 5, 5, 1, 0), (2, 9, 3, 6, 17, 1, 0), (2, 5, 5, 4, 3, 3, 1)]


def _ids(case):
    return "n{}_c{}_{}x{}_oc{}_k{}_p{}".format(*case)


def _layer(case, dtype, gen):
    N, C, H, W, OC, k, p = case
    x = torch.randn(N, C, H, W, generator=gen).to(DEVICE, dtype).contiguous(memory_format=NHWC)
    w = (torch.randn(OC, C, k, k, generator=gen) / (C * k * k) ** 0.5).to(DEVICE, dtype)
    b = (torch.randn(OC, generator=gen) * 0.1).to(DEVICE, dtype)
    return x, w, b


def _last_buffer(N, OC, H, W, dtype, gen):
    """A split's first half: channels 0:OC of a (N, 2 * OC, H, W) channels_last buffer, as the last unit leaves it."""
    last = torch.randn(N, 2 * OC, H, W, generator=gen).to(DEVICE, dtype).contiguous(memory_format=NHWC)
    return last[:, :OC]


def _run(case, dtype, k, partner_kind, activation="relu", gen=None):
    gen = gen or torch.Generator().manual_seed(hash((case, str(dtype), k, partner_kind)) % 2**31)
    N, C, H, W, OC, ks, p = case
    x, w, b = _layer(case, dtype, gen)
    if partner_kind == "run":  # the kernel's epilogue, at y's pixel strides (a stride-1 unit's x1)
        partner = _last_buffer(N, OC, H, W, dtype, gen)
    elif partner_kind == "dense":  # the kernel's epilogue, dense channels_last (a stride-2 unit's other branch)
        partner = torch.randn(N, OC, H, W, generator=gen).to(DEVICE, dtype).contiguous(memory_format=NHWC)
    else:  # NCHW: the copy path
        partner = torch.randn(N, OC, H, W, generator=gen).to(DEVICE, dtype)
    buffer = torch.full((N, 2 * OC, H, W), float("nan"), device=DEVICE, dtype=dtype).contiguous(memory_format=NHWC)
    out = buffer[:, k::2]
    got = fused_conv2d(
        x, w, b, padding=p, activation=activation, out=out, interleave=partner, interleave_index=k, allow_tf32=False
    )  # fp32 exact on a GPU too (TF32 by default there)
    assert got.data_ptr() == out.data_ptr() and got.stride() == out.stride()
    want = reference.conv2d(x.double(), w.double(), b.double(), padding=p, activation=activation)
    what = f"{_ids(case)} {dtype} k={k} {partner_kind} {activation}"
    assert not buffer.isnan().any(), f"{what}: {int(buffer.isnan().sum())} of {buffer.numel()} elements not written"
    assert_close_to(buffer[:, k::2], want, RTOL[dtype], what)
    assert torch.equal(buffer[:, 1 - k :: 2], partner), f"{what}: the partner's channels"


@pytest.fixture(params=[False, True], ids=["channel-k", "flat-k"])
def k_loop(request):
    with conv_mod.INTERPRETER.override(tile=conv_mod.SMALL_INTERPRETER_TILE, flat_k=request.param):
        yield


@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize("k", [0, 1])
@pytest.mark.parametrize("partner_kind", ["run", "dense", "nchw"])
def test_both_halves_every_element(k_loop, case, k, partner_kind):
    _run(case, torch.float32, k, partner_kind)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("activation", ["none", "relu", "silu"])
def test_dtypes_and_activations(dtype, activation):
    _run(CASES[2], dtype, 1, "run", activation)


@pytest.mark.parametrize("partner_kind", ["run", "dense"])
def test_split_k(partner_kind):
    with conv_mod.INTERPRETER.override(tile=conv_mod.SMALL_INTERPRETER_TILE, split_k=3, flat_k=False):
        _run((2, 40, 3, 5, 17, 1, 0), torch.float32, 0, partner_kind)


def test_interleaved_buffer_finds_the_whole_buffer():
    buffer = torch.randn(2, 10, 3, 4).contiguous(memory_format=NHWC)
    for k in (0, 1):
        whole = interleaved_buffer(buffer[:, k::2], k)
        assert whole is not None and whole.data_ptr() == buffer.data_ptr() and torch.equal(whole, buffer)
    assert interleaved_buffer(buffer[:, :5], 0) is None  # a channel run, not every other channel
    assert interleaved_buffer(torch.randn(2, 5, 3, 4)[:, ::1], 0) is None  # NCHW


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(interleave_index=2), "interleave_index must be 0 or 1"),
        (dict(out=None), "interleave needs out="),
        (dict(pool=("max", 2)), "interleave needs out="),
        (dict(partner_shape=(2, 4, 4, 4)), r"interleave must be a \(2, 5, 4, 4\)"),
    ],
)
def test_bad_interleaves_are_named(kw, message):
    x = torch.randn(2, 3, 4, 4, device=DEVICE)
    w = torch.randn(5, 3, 1, 1, device=DEVICE)
    buffer = torch.empty(2, 10, 4, 4, device=DEVICE).contiguous(memory_format=NHWC)
    partner = torch.randn(*kw.pop("partner_shape", (2, 5, 4, 4)), device=DEVICE)
    args = dict(out=buffer[:, 0::2], interleave=partner) | kw
    with pytest.raises(ValueError, match=message):
        fused_conv2d(x, w, **args)


# ---- GPU: the compiled epilogue at ShuffleNetV2 x1.0's shapes, tuned ----

SHUFFLENET = [(58, 28), (116, 14), (232, 7)]


@pytest.mark.gpu
@pytest.mark.parametrize("channels, size", SHUFFLENET)
@pytest.mark.parametrize("batch", [1, 256])
@pytest.mark.parametrize("partner_kind", ["run", "dense"])
def test_gpu_shufflenet_branch_ends(channels, size, batch, partner_kind):
    _run((batch, channels, size, size, channels, 1, 0), torch.float16, 1, partner_kind)


# ---- compiled for Hopper here, without a GPU (tests/sm90_compile.py; what the interpreter cannot check) ----

_COMPILE_INTERLEAVED = r"""
import json, sys
import torch
import kernels.conv as conv
from tests.sm90_compile import compile_sm90, sample

ptr = sys.argv[1]
size = 4 if ptr == "*fp32" else 2
# ShuffleNetV2 x1.0's branch ends over 256 images: 58 -> 58 at 28x28 and 232 -> 232 at 7x7, 1x1, x a split's half
# (channels C:2C of a 2C-channel channels_last buffer), y the whole 2C-channel buffer, the partner (r_ptr) x1 at 28x28
# (P_PIXEL 0: y's pixel strides) and the other branch's dense output at 7x7 (P_PIXEL = C)
for C, HW, pixel in [(58, 28, 0), (232, 7, 232)]:
    images, OC = 256, C
    buf = torch.empty((images, 2 * C, HW, HW), device="meta", memory_format=torch.channels_last).stride()
    w = torch.empty((OC, C, 1, 1), device="meta", memory_format=torch.channels_last).stride()
    strides = dict(stride_xn=buf[0], stride_xh=buf[2], stride_xw=buf[3], stride_wo=w[0], stride_wh=w[2],
                   stride_ww=w[3], stride_yn=buf[0], stride_yh=buf[2], stride_yw=buf[3])
    runtime = dict(x_ptr=ptr, w_ptr=ptr, b_ptr=ptr, y_ptr=ptr, r_ptr=ptr, ws_ptr="*fp32", cnt_ptr="*i32", xs_ptr=ptr,
                   xb_ptr=ptr, NB="i32", OC="i32", negative_slope="fp32", **{n: "i32" for n in strides})
    divisible = tuple(n for n, v in strides.items() if v % 16 == 0)
    align = conv.channels_last_alignment(torch.empty((2, 2 * C, HW, HW), memory_format=torch.channels_last))
    fma = size == 4
    offered = conv.interleave_candidates(
        conv.cuda_configs(conv.m_bucket(images * HW * HW), OC, C, C, fma, element_size=size), size)
    for cfg in sample(offered):
        meta = dict(C=C, H=HW, W=HW, OH=HW, OW=HW, KH=1, KW=1, SH=1, SW=1, PH=0, PW=0, DH=1, DW=1, POOL="none", PKH=1,
                    PKW=1, PSH=1, PSW=1, HAS_BIAS=True, HAS_RESIDUAL=False, ACTIVATION="relu",
                    INPUT_PRECISION="ieee", UPCAST_DOT=False, ROUND_BF16=False, PDL=True, CHANNELS_LAST=True,
                    Y_PLANES=False, HAS_INPUT_NORM=False, stride_xc=1, stride_wc=1, stride_yc=1, X_ALIGN=align,
                    W_ALIGN=1, Y_ALIGN=align, INTERLEAVE=2, P_PIXEL=pixel, **dict(cfg.kwargs))
        ptx, usage = compile_sm90(conv._conv2d_kernel, runtime, meta, 5, cfg.num_warps, cfg.num_stages, divisible)
        kinds = sorted({line.split("st.global")[1].split()[0] for line in ptx.splitlines() if "st.global" in line})
        print(json.dumps({"layer": [C, HW], "config": cfg.meta(), "STACK": usage["STACK"], "stores": kinds}),
              flush=True)
"""


@pytest.mark.parametrize("ptr", ["*fp16", "*fp32"])
def test_interleaved_candidates_compile_for_sm90_without_spills(ptr):
    """The candidates offered at ShuffleNetV2's branch ends, interleaved, compile for sm_90 without spills, and store
    whole words (the point of storing rows whole: 2-byte stores of every other channel ran 6.7x the dense store's
    time): fp16 as .b32 (a channel and its partner's), never .b16."""
    from tests.test_kernels_compile import _compiled

    results = _compiled(_COMPILE_INTERLEAVED, ptr)
    assert len(results) >= 4
    for r in results:
        assert r["STACK"] == 0, f"spills: {r}"
        assert r["stores"] and ".b16" not in r["stores"], f"2-byte stores: {r}"


def test_interleave_candidates_keep_fp32_tiles_small():
    from kernels.tuning import LaunchConfig

    big = [LaunchConfig.of(8, 3, BLOCK_M=128, BLOCK_N=128, BLOCK_K=32), LaunchConfig.of(4, 4, BLOCK_M=64, BLOCK_N=128)]
    small = [LaunchConfig.of(4, 4, BLOCK_M=64, BLOCK_N=32, BLOCK_K=32), LaunchConfig.of(8, 3, BLOCK_M=64, BLOCK_N=64)]
    spills = LaunchConfig.of(4, 4, BLOCK_M=64, BLOCK_N=64, BLOCK_K=32)  # 24 bytes of stack under Triton 3.6
    assert conv_mod.interleave_candidates(big + small + [spills], 2) == big + small + [spills]  # fp16: every one
    assert conv_mod.interleave_candidates(big + small + [spills], 4) == small
    cut = conv_mod.interleave_candidates(big, 4)  # none small: cut to 64x64 over 8 warps
    assert [(c["BLOCK_M"], c["BLOCK_N"], c.num_warps, c.num_stages) for c in cut] == [(64, 64, 8, 3), (64, 64, 8, 4)]
    assert cut[0]["BLOCK_K"] == 32
