"""fused_conv2d(interleave=, interleave_index=): a conv's output written to channels k::2 of a buffer of twice its
channels with another tensor's channels in the others, as a ShuffleNet unit's concat + channel shuffle (groups 2) ends.

Where the other tensor is a channel run of a buffer with the output's pixel strides (a split's first half), the kernel
stores both in whole rows (INTERLEAVE); otherwise the conv writes its channels and the other tensor is copied beside
it. Both against the reference conv and the partner exactly, over both k, 1x1 and 3x3 convs, awkward channel counts
(odd, prime, past a block), batch 1 and primes, every dtype and activations, split K; the buffer starts as NaN, so an
element not written fails. The compiled path is the `gpu` test at ShuffleNetV2's shapes.
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
    if partner_kind == "run":  # the kernel's epilogue path
        partner = _last_buffer(N, OC, H, W, dtype, gen)
    else:  # a tensor of its own (NCHW): the copy path
        partner = torch.randn(N, OC, H, W, generator=gen).to(DEVICE, dtype)
    buffer = torch.full((N, 2 * OC, H, W), float("nan"), device=DEVICE, dtype=dtype).contiguous(memory_format=NHWC)
    out = buffer[:, k::2]
    got = fused_conv2d(x, w, b, padding=p, activation=activation, out=out, interleave=partner, interleave_index=k)
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
@pytest.mark.parametrize("partner_kind", ["run", "own"])
def test_both_halves_every_element(k_loop, case, k, partner_kind):
    _run(case, torch.float32, k, partner_kind)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("activation", ["none", "relu", "silu"])
def test_dtypes_and_activations(dtype, activation):
    _run(CASES[2], dtype, 1, "run", activation)


def test_split_k():
    with conv_mod.INTERPRETER.override(tile=conv_mod.SMALL_INTERPRETER_TILE, split_k=3, flat_k=False):
        _run((2, 40, 3, 5, 17, 1, 0), torch.float32, 1, "run")


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
def test_gpu_shufflenet_branch_ends(channels, size, batch):
    _run((batch, channels, size, size, channels, 1, 0), torch.float16, 1, "run")
