"""fused_conv2d with a pre-activation prologue (`input_norm` + `input_activation`: a BatchNorm folded into a per-channel
scale and shift, then its ReLU, applied to x as the kernel gathers it, DenseNet's BN-ReLU-conv) against the reference:
every dtype, 1x1 and 3x3 with padding (which must stay 0 after the activation, as torch pads the activated tensor),
stride 2, awkward sizes across every block edge, both K loops, both layouts, x and y as channel slices of a wider
channels_last buffer (a concat's, written in place), split K, a residual and a fused pool. Every output starts as NaN,
so an element left unwritten fails.

The kernel rounds each activated element once to the weights' dtype before tl.dot, so the reference is the float64
conv of exactly that operand (`reference.affine_activation`, then widened); fp32 is also checked against float64
F.batch_norm + relu + conv2d, the eager model. Under the interpreter bf16 tiles are multiplied as fp32
(tiles.gemm_flags); the compiled path and native bf16 are the `gpu` tests.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels.conv as conv_mod
from kernels import conv_tma, reference
from kernels.conv import fused_conv2d
from tests.tolerances import RTOL, assert_close_to

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (N, C, H, W, O, kernel, stride, padding, dilation): DenseNet's 1x1 bottleneck (17 channels: across a 16-wide K step)
# and its 3x3 padding 1 at a prime batch, a 3x3 padding 1 at stride 2 on odd sizes, a dilated 3x3 padding 2 at stride
# 2, and an uneven window / stride / padding.
CASES = [
    (3, 17, 5, 7, 20, 1, 1, 0, 1),
    (5, 12, 6, 5, 4, 3, 1, 1, 1),
    (2, 9, 9, 7, 17, 3, 2, 1, 1),
    (2, 20, 8, 9, 6, 3, 2, 2, 2),
    (1, 5, 7, 6, 3, (3, 2), (2, 1), (1, 0), (1, 1)),
]


def _ids(case):
    return "-".join(str(v).replace(" ", "") for v in case)


def _batchnorm(C: int, seed: int = 0):
    """A BatchNorm's inference statistics (gamma of both signs) and its (scale, shift) in fp32, folded in float64."""
    g = torch.Generator().manual_seed(seed + C)
    gamma, beta = torch.randn(C, generator=g), torch.randn(C, generator=g) * 0.5
    mean, var = torch.randn(C, generator=g) * 0.5, torch.rand(C, generator=g) + 0.5
    scale = gamma.double() / torch.sqrt(var.double() + 1e-5)
    shift = beta.double() - mean.double() * scale
    return (gamma, beta, mean, var), (scale.float().to(DEVICE), shift.float().to(DEVICE))


def _slice_of_wider(shape, dtype, before: int, after: int) -> torch.Tensor:
    """A (N, C, H, W) NaN tensor that is channels [before, before + C) of a channels_last (N, before + C + after, H,
    W) buffer: strided, not dense, as a concat's producer writes its part."""
    N, C, H, W = shape
    buf = torch.full((N, before + C + after, H, W), float("nan"), dtype=dtype, device=DEVICE)
    return buf.contiguous(memory_format=torch.channels_last)[:, before : before + C]


def _check(case, dtype, activation="relu", layout="nchw", bias=True, residual=False, pool=None, slope=0.2,
           out_layout=None):  # fmt: skip
    N, C, H, W, OC, k, s, p, d = case
    kh, kw = (k, k) if isinstance(k, int) else k
    stats, (scale, shift) = _batchnorm(C)
    x = torch.randn(N, C, H, W, device=DEVICE).to(dtype)
    if layout == "nhwc":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "slice":  # channels 3 .. 3 + C of a wider channels_last buffer (a concat's prefix view)
        x = _slice_of_wider(x.shape, dtype, 3, 5).copy_(x)
    w = (torch.randn(OC, C, kh, kw, device=DEVICE) / (C * kh * kw) ** 0.5).to(dtype)
    b = torch.randn(OC, device=DEVICE).to(dtype) if bias else None
    geometry = dict(stride=s, padding=p, dilation=d)
    operand = reference.affine_activation(x, scale, shift, activation, dtype=dtype, negative_slope=slope).double()
    want = reference.conv2d(operand, w.double(), b if b is None else b.double(), **geometry)
    r = torch.randn(want.shape, device=DEVICE).to(dtype) if residual else None
    want = torch.relu(want + r.double()) if residual else reference.activation(want, "relu")
    if pool is not None:
        want = reference.pool2d(want, pool[0], pool[1])
    out_layout = out_layout or ("nchw" if layout == "nchw" else "nhwc")
    if out_layout == "slice":
        out = _slice_of_wider(want.shape, dtype, 4, 2)
    else:
        fmt = torch.channels_last if out_layout == "nhwc" else torch.contiguous_format
        out = torch.full(want.shape, float("nan"), device=DEVICE, dtype=dtype).contiguous(memory_format=fmt)
    got = fused_conv2d(x, w, b, **geometry, activation="relu", allow_tf32=False, out=out, residual=r, pool=pool,
                       input_norm=(scale, shift), input_activation=activation, input_negative_slope=slope)  # fmt: skip
    assert got is out  # NaN left behind = an element not written (assert_close_to checks finiteness)
    what = f"{case} {dtype} {activation} x={layout} y={out_layout} bias={bias} residual={residual} pool={pool}"
    assert_close_to(got, want, RTOL[dtype], what)
    if dtype == torch.float32 and not residual and pool is None and activation == "relu":
        gamma, beta, mean, var = (t.double().to(DEVICE) for t in stats)
        eager = F.relu(F.batch_norm(x.double(), mean, var, gamma, beta, training=False, eps=1e-5))
        eager = F.relu(F.conv2d(eager, w.double(), b if b is None else b.double(), **geometry))
        assert_close_to(got, eager, RTOL[dtype], what + " vs float64 batch_norm + relu + conv2d")
    return got


@pytest.fixture
def small_tile():
    with conv_mod.INTERPRETER.override(tile=conv_mod.SMALL_INTERPRETER_TILE):
        yield


@pytest.fixture(params=[True, False], ids=["flat_k", "taps"])
def k_loop(request):
    with conv_mod.INTERPRETER.override(flat_k=request.param):
        yield request.param


@pytest.mark.parametrize("layout", ["nchw", "nhwc", "slice"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_awkward_shapes_both_k_loops_and_layouts(small_tile, k_loop, case, layout):
    got = _check(case, torch.float32, layout=layout)
    if layout == "nhwc":
        assert got.is_contiguous(memory_format=torch.channels_last)


# Every dtype on both shapes, each (dtype, shape) on one K loop, the loops taken in turn so that each dtype and each
# shape meets both: the loop decides which elements are gathered (every awkward shape on both:
# test_awkward_shapes_both_k_loops_and_layouts), the dtype how they are loaded, normalized and stored. The full product
# (12 cases, ~0.9 CPU-s each under the interpreter, issue 51) ran each twice; compiled (a GPU) it still does.
DTYPE_CASES = [(c, d, f) for j, c in enumerate([CASES[0], CASES[2]]) for i, d in enumerate(DTYPES)
               for f in (True, False) if DEVICE != "cpu" or f == ((i + j) % 2 == 0)]  # fmt: skip


@pytest.mark.parametrize(("case", "dtype", "flat_k"), DTYPE_CASES,
                         ids=[f"{'flat_k' if f else 'taps'}-{_ids(c)}-{d}" for c, d, f in DTYPE_CASES])  # fmt: skip
def test_every_dtype(small_tile, case, dtype, flat_k):
    with conv_mod.INTERPRETER.override(flat_k=flat_k):
        got = _check(case, dtype, layout="nhwc", bias=dtype != torch.float16)
    assert got.dtype == dtype


@pytest.mark.parametrize("activation", ["none", "leaky_relu", "sigmoid", "relu6"])
def test_other_activations_and_none(small_tile, activation):
    """sigmoid(0) = 0.5: a padding activated with the image would show at every border."""
    _check(CASES[1], torch.float32, activation=activation, layout="nhwc")


def test_output_into_a_channel_slice_of_a_wider_buffer(small_tile, k_loop):
    """y as buffer[:, 4:4 + OC] of a channels_last buffer (a concat's producer): only that run of channels is written,
    the buffer's other channels keep their NaN."""
    case = CASES[1]
    got = _check(case, torch.float16, layout="slice", out_layout="slice")
    buf = got._base
    OC = case[4]
    assert buf.shape[1] == OC + 6
    assert torch.isnan(buf[:, :4]).all() and torch.isnan(buf[:, 4 + OC :]).all()


def test_split_k_residual_and_pool(small_tile):
    with conv_mod.INTERPRETER.override(split_k=3, flat_k=False):
        _check(CASES[3], torch.float16, layout="nhwc")
    _check(CASES[1], torch.float32, residual=True, layout="nhwc")
    _check((3, 12, 8, 10, 16, 1, 1, 0, 1), torch.float16, pool=("avg", 2), layout="nhwc")  # DenseNet's transition
    with conv_mod.INTERPRETER.override(pool_apart=True):
        _check((3, 12, 8, 10, 16, 1, 1, 0, 1), torch.float32, pool=("avg", 2), layout="slice")


def test_never_the_tma_kernel(monkeypatch):
    """x and weight channels_last with 16-byte rows, as the TMA kernel takes them: with the prologue the pointer kernel
    runs (TMA copies x's boxes as they are, unnormalized)."""

    def refuse(*a, **kw):
        raise AssertionError("the TMA kernel ran a conv with an input prologue")

    monkeypatch.setattr(conv_tma, "launch", refuse)
    x = torch.randn(2, 16, 8, 8, device=DEVICE).contiguous(memory_format=torch.channels_last)
    w = torch.randn(16, 16, 3, 3, device=DEVICE).contiguous(memory_format=torch.channels_last)
    assert conv_tma.eligible(x, w, (1, 1), None, torch.empty_like(x))
    _, (scale, shift) = _batchnorm(16)
    with conv_mod.INTERPRETER.override(tma=True):
        y = fused_conv2d(x, w, padding=1, allow_tf32=False, input_norm=(scale, shift), input_activation="relu")
    want = F.conv2d(torch.relu(x * scale.reshape(1, -1, 1, 1) + shift.reshape(1, -1, 1, 1)), w, padding=1)
    assert_close_to(y, want, RTOL[torch.float32], "prologue with TMA eligible")


def test_padding_is_zero_after_the_activation():
    """x = 0 everywhere and shift = 1: relu(0 * scale + 1) = 1 inside the image, 0 in the padding, so a 3x3 of ones
    sums the in-image taps: 4 at a corner, 6 on an edge, 9 inside (exact in every dtype)."""
    scale, shift = torch.ones(2, device=DEVICE), torch.ones(2, device=DEVICE)
    for dtype in DTYPES:
        x = torch.zeros(1, 2, 4, 5, device=DEVICE, dtype=dtype)
        w = torch.ones(1, 2, 3, 3, device=DEVICE, dtype=dtype) / 2
        y = fused_conv2d(x, w, padding=1, input_norm=(scale, shift), input_activation="relu")
        taps = F.conv2d(torch.ones(1, 1, 4, 5), torch.ones(1, 1, 3, 3), padding=1).to(device=DEVICE, dtype=dtype)
        assert torch.equal(y, taps), dtype


def test_input_activation_needs_input_norm():
    x = torch.randn(1, 2, 4, 4, device=DEVICE)
    w = torch.randn(3, 2, 1, 1, device=DEVICE)
    with pytest.raises(ValueError, match="input_activation 'relu' applies to the normalized x"):
        fused_conv2d(x, w, input_activation="relu")
    with pytest.raises(ValueError, match="unknown activation 'relu7'"):
        fused_conv2d(x, w, input_norm=(torch.ones(2, device=DEVICE), torch.zeros(2, device=DEVICE)),
                     input_activation="relu7")  # fmt: skip
    with pytest.raises(ValueError, match="give input_norm too"):
        reference.conv2d(x, w, input_activation="relu")


# ---- compiled path, on the lent GPU ----


@pytest.fixture
def untuned():
    from kernels import tuning

    tuning.set_enabled(False)
    yield
    tuning.set_enabled(None)
    conv_mod._configs.clear()


# DenseNet-121's: a 1x1 bottleneck over 256 channels at 28x28 (its second block), a 3x3 of 128 -> 32 at 56x56, the
# transition 1x1 of 512 -> 256 at 28x28, and a 3x3 at stride 2
GPU_CASES = CASES + [(8, 256, 28, 28, 128, 1, 1, 0, 1), (4, 128, 56, 56, 32, 3, 1, 1, 1),
                     (2, 512, 28, 28, 256, 1, 1, 0, 1), (3, 64, 30, 30, 64, 3, 2, 1, 1)]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["nchw", "nhwc", "slice"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_dtypes_shapes_and_layouts(untuned, dtype, layout):
    for case in GPU_CASES:
        _check(case, dtype, layout=layout, out_layout="slice" if layout == "slice" else None)
    _check(GPU_CASES[-3], dtype, layout=layout, pool=("avg", 2))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_gpu_every_candidate(monkeypatch, dtype):
    """Each config the tuner may pick for a DenseNet 3x3 and a 1x1, forced, x and y channel slices of concat buffers."""
    for case in [(3, 128, 14, 14, 32, 3, 1, 1, 1), (5, 96, 7, 7, 128, 1, 1, 0, 1)]:
        N, C, H, W, OC, k = case[:6]
        for config in conv_mod.cuda_configs(conv_mod.m_bucket(N * H * W), OC, C, C * k * k, dtype == torch.float32,
                                            element_size=dtype.itemsize, norm=True):  # fmt: skip
            monkeypatch.setattr(conv_mod, "tune", lambda *a, config=config, **kw: config)
            conv_mod._configs.clear()
            _check(case, dtype, layout="slice", out_layout="slice")
    conv_mod._configs.clear()


@pytest.mark.gpu
def test_gpu_tuned_apart_from_the_plain_and_the_normalizing_conv():
    """The prologue's activation is its own kernel variant, tuned under its own key."""
    keys = []
    real = conv_mod.tune
    conv_mod._configs.clear()
    try:
        conv_mod.tune = lambda scope, key, *a, **kw: keys.append(key) or real(scope, key, *a, **kw)
        x = torch.randn(17, 32, 16, 16, device="cuda").half().contiguous(memory_format=torch.channels_last)
        w = torch.randn(64, 32, 3, 3, device="cuda").half()
        _, norm = _batchnorm(32)
        fused_conv2d(x, w, padding=1, input_norm=norm, input_activation="relu")
        fused_conv2d(x, w, padding=1, input_norm=norm)
        fused_conv2d(x, w, padding=1)
    finally:
        conv_mod.tune = real
        conv_mod._configs.clear()
    assert len(set(keys)) == 3 and keys[0].endswith("|norm|x=torch.float16|relu"), keys
