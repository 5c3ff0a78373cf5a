"""fused_conv2d_grouped against the float64 reference: depthwise (3x3, 5x5, 7x7 at stride 1 and 2, 'same' padding, a
channel multiplier), groups of 2, 4, 8 and more channels, both kernels (direct and grouped GEMM), both memory
formats, every dtype and activation, with and without bias and residual, ordinary and awkward shapes.

Without CUDA these run through Triton's interpreter on small shapes and a representative subset; bf16 tiles are
multiplied as fp32 there (tiles.gemm_flags, DESIGN.md: the interpreter's bf16 tl.dot is wrong), so native bf16 on the
tensor cores is checked by the `gpu` tests, which also run the full cross product compiled.
"""

from __future__ import annotations

import pytest
import torch

import kernels.conv as conv_mod
import kernels.conv_grouped as grouped_mod
from kernels import ACTIVATIONS, reference
from kernels.conv import conv_output_size, fused_conv2d
from kernels.conv_grouped import fused_conv2d_grouped
from kernels.tiles import channels_last_alignment
from tests.tolerances import RTOL, assert_close_to

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NCHW, NHWC = torch.contiguous_format, torch.channels_last

# (N, C, H, W, OC, groups, kernel, stride, padding, dilation)
DEPTHWISE = [
    (1, 1, 7, 6, 1, 1, 3, 1, 1, 1),  # one channel, batch 1
    (3, 5, 6, 5, 5, 5, 3, 1, 1, 1),  # 3x3 'same', a prime batch and channel count
    (2, 7, 8, 9, 7, 7, 3, 2, 1, 1),  # 3x3 stride 2 (MobileNet's downsampling)
    (2, 19, 5, 6, 19, 19, 5, 1, 2, 1),  # 5x5 'same', 19 channels: off every channel block's edge
    (1, 6, 9, 8, 6, 6, 5, 2, 2, 1),  # 5x5 stride 2
    (1, 6, 7, 8, 6, 6, 7, 1, 3, 1),  # 7x7 'same' (ConvNeXt's)
    (2, 3, 8, 7, 6, 3, 3, 2, 1, 1),  # channel multiplier 2
    (1, 4, 6, 7, 12, 4, (3, 5), (1, 2), (1, 2), (2, 1)),  # multiplier 3, uneven window, stride and dilation
]
GROUPED = [
    (2, 6, 7, 7, 6, 3, 3, 1, 1, 1),  # 2 channels a group
    (3, 12, 6, 5, 12, 3, 3, 2, 1, 1),  # 4 a group (ResNeXt 32x4d's width), stride 2
    (1, 24, 5, 5, 24, 3, 3, 1, 1, 1),  # 8 a group
    (2, 20, 5, 6, 30, 5, 3, 1, 1, 1),  # 4 in, 6 out a group: groups that straddle the 16-wide tile
    (1, 34, 4, 5, 34, 2, 3, 1, 1, 1),  # 17 a group: past one 16-wide K step and one tile
    (2, 48, 4, 4, 48, 2, 1, 1, 0, 1),  # 24 a group, 1x1: two column tiles a group, the second one part-empty
    (1, 16, 6, 6, 32, 4, (2, 3), 2, (0, 1), (2, 1)),  # 4 in, 8 out, uneven window, dilation
]
CASES = DEPTHWISE + GROUPED


def _ids(case):
    return "-".join(str(v).replace(" ", "") for v in case)


def _group_width(case) -> int:
    return case[1] // case[5]


def _out_shape(case) -> tuple[int, ...]:
    N, C, H, W, OC, G, *geometry = case
    k, s, p, d = (v if isinstance(v, (tuple, list)) else (v, v) for v in geometry)
    return (N, OC, *(conv_output_size(n, k[i], s[i], p[i], d[i]) for i, n in enumerate((H, W))))


def _inputs(case, dtype, device, bias=True, x_format=NCHW):
    N, C, H, W, OC, G, k, *_ = case
    kh, kw = (k, k) if isinstance(k, int) else k
    # Scaled so outputs are O(1) whatever C / G * KH * KW is: activations then see both signs and their curves.
    x = torch.randn(N, C, H, W, device=device).to(dtype).contiguous(memory_format=x_format)
    w = (torch.randn(OC, C // G, kh, kw, device=device) / (C // G * kh * kw) ** 0.5).to(dtype)
    b = torch.randn(OC, device=device).to(dtype) if bias else None
    return x, w, b


def _check(case, dtype, activation, device, *, bias=True, slope=0.01, x_format=NCHW, y_format=None, residual=None):
    """residual: None, or the memory format of a fresh random residual added before the activation. y_format: the
    output's (None: x's)."""
    x, w, b = _inputs(case, dtype, device, bias, x_format)
    G, k, s, p, d = case[5:]
    r = None if residual is None else torch.randn(_out_shape(case), device=device).to(dtype)
    r = r if r is None else r.contiguous(memory_format=residual)
    want = reference.conv2d_grouped(
        x.double(), w.double(), b.double() if b is not None else None, activation, stride=s, padding=p, dilation=d,
        groups=G, negative_slope=slope, residual=r if r is None else r.double(),
    )  # fmt: skip
    out = torch.full(want.shape, float("nan"), device=device, dtype=dtype)
    out = out.contiguous(memory_format=y_format or x_format)
    got = fused_conv2d_grouped(
        x, w, b, activation, stride=s, padding=p, dilation=d, groups=G, negative_slope=slope, residual=r, out=out,
        allow_tf32=False,
    )  # fmt: skip
    assert got is out  # NaN left behind = an element not written (assert_close_to checks finiteness)
    what = f"{case} {dtype} {activation} bias={bias} x={x_format} y={y_format} residual={residual}"
    assert_close_to(got, want, RTOL[dtype], what)
    return got, want


@pytest.fixture
def small_tiles():
    """The tests' small tiles: awkward shapes cross every block edge."""
    small = dict(direct_tile=grouped_mod.SMALL_DIRECT_TILE, gemm_tile=grouped_mod.SMALL_GEMM_TILE)
    with grouped_mod.INTERPRETER.override(**small):
        yield


@pytest.fixture(params=["direct", "gemm"])
def kernel(request):
    """Each kernel, with the launcher's own tiles (the residual and the stores still cross the tiles' edges)."""
    with grouped_mod.INTERPRETER.override(path=request.param):
        yield request.param


@pytest.fixture
def untuned():
    """Each layer's first candidate, untimed (tuning.set_enabled(False)): the correctness sweeps take one config per
    shape, and the tuner's candidates are checked by test_gpu_every_candidate."""
    from kernels import tuning

    tuning.set_enabled(False)
    yield
    tuning.set_enabled(None)
    grouped_mod._configs.clear()  # the untimed picks, so that no later tuned test reuses them


def _skip_depthwise_gemm(kernel, case):
    # The GEMM kernel computes depthwise right (one input channel a group: a block-diagonal tile 1/16 full) but the
    # launcher never picks it there: not worth the interpreter's time.
    if kernel == "gemm" and _group_width(case) == 1:
        pytest.skip("depthwise runs the direct kernel only")


# Depthwise on the direct kernel (its only one), in both layouts; groups on the GEMM in both layouts and on the direct
# kernel (the tuner's other candidate for small groups) in one, alternating.
AWKWARD = (
    [(case, "direct", fmt) for case in DEPTHWISE for fmt in (NCHW, NHWC)]
    + [(case, "gemm", fmt) for case in GROUPED for fmt in (NCHW, NHWC)]
    + [(case, "direct", (NCHW, NHWC)[i % 2]) for i, case in enumerate(GROUPED)]
)


@pytest.mark.parametrize(
    "case,kernel,x_format", AWKWARD, ids=[f"{_ids(c)}-{k}-{'nhwc' if f == NHWC else 'nchw'}" for c, k, f in AWKWARD]
)
def test_awkward_shapes_both_kernels_and_layouts(small_tiles, case, kernel, x_format):
    with grouped_mod.INTERPRETER.override(path=kernel):
        _check(case, torch.float32, "leaky_relu", DEVICE, slope=0.3, x_format=x_format)


# Each activation with a dtype in turn (every dtype with each activation: the `gpu` tests, compiled).
ACTIVATION_DTYPES = [(act, DTYPES[i % 3]) for i, act in enumerate(ACTIVATIONS)]


@pytest.mark.parametrize("activation,dtype", ACTIVATION_DTYPES, ids=[f"{a}-{d}" for a, d in ACTIVATION_DTYPES])
def test_every_activation(activation, dtype):
    """The launcher's own tiles and kernels: depthwise 3x3 (NHWC, direct) and 4-channel groups (NCHW, GEMM)."""
    _check(DEPTHWISE[1], dtype, activation, DEVICE, x_format=NHWC)
    _check(GROUPED[3], dtype, activation, DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", [DEPTHWISE[6], GROUPED[1]], ids=_ids)
def test_every_dtype_without_bias(kernel, case, dtype):
    _skip_depthwise_gemm(kernel, case)
    _check(case, dtype, "gelu", DEVICE, bias=False, x_format=NHWC)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_with_residual(kernel, dtype):
    _check(GROUPED[1], dtype, "hardswish", DEVICE, x_format=NCHW, residual=NCHW)


@pytest.mark.parametrize("r_format", [NCHW, NHWC], ids=["r_nchw", "r_nhwc"])
@pytest.mark.parametrize("x_format", [NCHW, NHWC], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("case", [DEPTHWISE[6], GROUPED[3]], ids=_ids)
def test_residual_both_kernels_and_layouts(kernel, case, x_format, r_format):
    """The residual in the output's layout and in the other one (copied into the output's first)."""
    _skip_depthwise_gemm(kernel, case)
    _check(case, torch.float32, "relu", DEVICE, x_format=x_format, residual=r_format)


@pytest.mark.parametrize("y_format", [NCHW, NHWC], ids=["y_nchw", "y_nhwc"])
@pytest.mark.parametrize("x_format", [NCHW, NHWC], ids=["x_nchw", "x_nhwc"])
def test_output_in_either_memory_format(kernel, x_format, y_format):
    """NCHW x to NHWC y and back, each right to the last element (`out` in that format)."""
    _check(GROUPED[2] if kernel == "gemm" else DEPTHWISE[1], torch.float16, "silu", DEVICE, x_format=x_format,
           y_format=y_format)  # fmt: skip


def test_memory_format_argument():
    """memory_format: the returned tensor's layout; None follows torch (channels_last when x or the weight is)."""
    case = (1, 4, 3, 3, 4, 2, 3, 1, 1, 1)
    for x_format in (NCHW, NHWC):
        x, w, b = _inputs(case, torch.float32, DEVICE, x_format=x_format)
        for weight in (w, w.to(memory_format=NHWC)):
            torch_y = torch.nn.functional.conv2d(x, weight, b, padding=1, groups=2)
            assert fused_conv2d_grouped(x, weight, b, padding=1, groups=2).stride() == torch_y.stride()
        for fmt in (NCHW, NHWC):
            y = fused_conv2d_grouped(x, w, b, padding=1, groups=2, memory_format=fmt)
            assert y.is_contiguous(memory_format=fmt)


def test_kernels_and_tiles_agree():
    """Direct and GEMM, small and default tiles: the same result up to the order of fp32 sums."""
    case = (2, 16, 6, 7, 16, 4, 3, 1, 1, 1)
    x, w, b = _inputs(case, torch.float32, DEVICE, x_format=NHWC)
    results = []
    for kernel in ("direct", "gemm"):
        for small in (False, True):
            tiles = dict(direct_tile=grouped_mod.SMALL_DIRECT_TILE, gemm_tile=grouped_mod.SMALL_GEMM_TILE)
            with grouped_mod.INTERPRETER.override(path=kernel, **(tiles if small else {})):
                results.append(fused_conv2d_grouped(x, w, b, "silu", padding=1, groups=4, allow_tf32=False))
    for r in results[1:]:
        assert_close_to(r, results[0].double(), RTOL[torch.float32], "kernel / tile")


def test_channels_last_alignment_says_what_the_pixel_strides_are_multiples_of():
    """The conv kernels' X_ALIGN/W_ALIGN/Y_ALIGN: 104 channels (RegNetY) in channels_last -> 8, 58 (ShuffleNetV2)
    -> 2, 64 -> 16; channels not contiguous -> 1; a 1x1 window's or image's unit strides left out."""

    def nhwc(*shape):
        return torch.empty(shape).contiguous(memory_format=NHWC)

    assert channels_last_alignment(nhwc(2, 104, 28, 28)) == 8 and channels_last_alignment(nhwc(3, 58, 7, 7)) == 2
    assert channels_last_alignment(nhwc(1, 64, 5, 5)) == 16 and channels_last_alignment(torch.empty(2, 104, 9, 9)) == 1
    assert channels_last_alignment(nhwc(104, 8, 1, 1)) == 8 and channels_last_alignment(torch.empty(2, 40, 1, 1)) == 8
    assert channels_last_alignment(nhwc(4, 1, 6, 6)) == 1  # one channel: its pixel stride is 1


@pytest.mark.skipif(DEVICE != "cpu", reason="spies on the interpreter's launch")
@pytest.mark.parametrize("kernel", ["direct", "gemm", "conv"])
def test_the_launchers_pass_the_alignment_and_stay_exact_with_it(monkeypatch, kernel):
    """Groups of 8 over 24 channels in channels_last (x, weight, y and residual: strides of 24 -> 8), as RegNetY's
    104: the launch says 8 for all three, and the output equals the reference's. `known_multiple` rounds a stride
    down to the hint, so a wrong hint would move every load and fail here."""
    module = conv_mod if kernel == "conv" else grouped_mod
    seen, real = [], module.grid_launch

    def spy(k, grid):
        launch = real(k, grid)

        def record(*args, **meta):
            seen.append((meta["X_ALIGN"], meta["W_ALIGN"], meta["Y_ALIGN"]))
            return launch(*args, **meta)

        return record

    monkeypatch.setattr(module, "grid_launch", spy)
    case = (2, 24, 5, 6, 24, 1 if kernel == "conv" else 24 if kernel == "direct" else 3, 3, 1, 1, 1)
    x, w, b = _inputs(case, torch.float32, DEVICE, x_format=NHWC)
    w = w.contiguous(memory_format=NHWC)
    r = torch.randn(_out_shape(case)).contiguous(memory_format=NHWC)
    if kernel == "conv":
        y = fused_conv2d(x, w, b, padding=1, activation="relu", residual=r, allow_tf32=False)
    else:
        with grouped_mod.INTERPRETER.override(path=kernel):
            y = fused_conv2d_grouped(x, w, b, "relu", padding=1, groups=case[5], residual=r, allow_tf32=False)
    want = reference.conv2d_grouped(x.double(), w.double(), b.double(), "relu", padding=1, groups=case[5],
                                    residual=r.double())  # fmt: skip
    assert seen and seen[-1] == (8, 8 if kernel != "direct" else 1, 8), seen
    assert_close_to(y, want, RTOL[torch.float32], f"{kernel} with the alignment said")


def test_default_kernel_and_interpreter_choice():
    assert grouped_mod.default_path(1) == "direct" and grouped_mod.default_path(4) == "gemm"
    assert grouped_mod.INTERPRETER.choice == grouped_mod.InterpreterChoice()  # no test left an override behind


def test_empty_batch_returns_empty():
    x, w, b = _inputs(DEPTHWISE[1], torch.float32, DEVICE)
    assert fused_conv2d_grouped(x[:0], w, b, groups=5, padding=1).shape == (0, 5, 6, 5)


def test_ints_or_pairs_are_taken():
    case = (2, 8, 9, 8, 8, 8, 3, 1, 1, 1)
    x, w, b = _inputs(case, torch.float32, DEVICE)
    want = reference.conv2d_grouped(x.double(), w.double(), b.double(), "tanh", stride=2, padding=(1, 0),
                                    dilation=[1, 2], groups=8)  # fmt: skip
    got = fused_conv2d_grouped(x, w, b, "tanh", stride=2, padding=(1, 0), dilation=[1, 2], groups=8)
    assert_close_to(got, want, RTOL[torch.float32], "int/list arguments")


BAD_INPUTS = [
    (lambda x, w, b: (x[0], w, b), {}, "x must be 4-D"),
    (lambda x, w, b: (x, w[0], b), {}, "weight must be 4-D"),
    (lambda x, w, b: (x, w, b), {"groups": 0}, "groups must be an int >= 1"),
    (lambda x, w, b: (x, w, b), {"groups": 2.0}, "groups must be an int >= 1"),
    (lambda x, w, b: (x, w, b), {"groups": 3}, "groups=3 must divide x's C=4 and weight's OC=8"),
    (lambda x, w, b: (x, w[:6], b[:6]), {"groups": 4}, "must divide"),
    (lambda x, w, b: (x, w, b), {"groups": 1}, "has 2 input channels a group; x's C=4 in 1 groups needs 4"),
    (lambda x, w, b: (x, w, b[:-1]), {}, r"bias must have shape \(8,\)"),
    (lambda x, w, b: (x.double(), w.double(), b.double()), {}, "float64"),
    (lambda x, w, b: (x, w.half(), b.half()), {}, "x has dtype torch.float32 but weight has torch.float16"),
    (lambda x, w, b: (x, w, b.half()), {}, "bias has dtype torch.float16"),
    (lambda x, w, b: (x, w, b), {"stride": 0}, "stride and dilation must be >= 1"),
    (lambda x, w, b: (x, w, b), {"padding": (1, 2, 3)}, "padding must be an int or a pair"),
    (lambda x, w, b: (x, w, b), {"dilation": 4}, "conv output is empty"),
    (lambda x, w, b: (x, w, b, "swish"), {}, "unknown activation 'swish'"),
    (lambda x, w, b: (x, w, b), {"residual": torch.zeros(2, 8, 4, 4)}, "residual must have the output's shape"),
    (lambda x, w, b: (x, w, b), {"out": torch.zeros(2, 8, 5, 5)}, r"out must be a \(2, 8, 6, 6\)"),
]


@pytest.mark.parametrize("make,kwargs,message", BAD_INPUTS, ids=[m for _, _, m in BAD_INPUTS])
def test_bad_inputs_are_named(make, kwargs, message):
    x, w, b = _inputs((2, 4, 6, 6, 8, 2, 3, 1, 1, 1), torch.float32, DEVICE)
    kwargs = {"groups": 2, "padding": 1, **kwargs}
    for key in ("residual", "out"):
        if key in kwargs:
            kwargs[key] = kwargs[key].to(DEVICE)
    with pytest.raises((ValueError, TypeError), match=message):
        fused_conv2d_grouped(*make(x, w, b), **kwargs)


def test_candidates():
    """Depthwise gets the direct kernel only, laid out by x's format; groups the GEMM only, every tile tl.dot-legal
    (>= 16), BLOCK_N the group's width where it fits and whole groups in a tile, narrow groups 16 or 32 wide."""
    dw = grouped_mod.cuda_configs(8 * 28 * 28, 96, 1, 1, True)
    assert dw and all(c["DIRECT"] == 1 and c["PC"] == 1 for c in dw)
    assert all(c["DIRECT"] == 1 and c["PC"] == 0 for c in grouped_mod.cuda_configs(64, 96, 1, 2, False))
    resnext = grouped_mod.cuda_configs(32 * 56 * 56, 128, 4, 4, True)
    regnet = grouped_mod.cuda_configs(32 * 28 * 28, 224, 16, 16, True, fma=True)
    wide = grouped_mod.cuda_configs(16, 1024, 32, 32, False)
    for configs in (resnext, regnet, wide):
        assert configs and all(c["DIRECT"] == 0 for c in configs)
        assert all(min(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]) >= 16 for c in configs)
    assert {c["BLOCK_N"] for c in resnext} == {16, 32} and {c["BLOCK_K"] for c in resnext} == {16, 32}  # whole groups
    assert {c["BLOCK_N"] for c in regnet} == {16} and max(c["BLOCK_K"] for c in regnet) <= 32  # fp32 FMA: K <= 32
    assert {c["BLOCK_N"] for c in wide} == {32} and max(c["BLOCK_M"] for c in wide) == 64  # 16 rows: no 128-row tile


# ---- compiled, on the lent GPU: the full cross product, every candidate, the tuner, CUDA graphs ----

GPU_CASES = CASES + [
    (8, 32, 28, 28, 32, 32, 3, 1, 1, 1),  # MobileNetV2 depthwise
    (8, 96, 28, 28, 96, 96, 3, 2, 1, 1),  # ... stride 2
    (4, 72, 14, 14, 72, 72, 5, 1, 2, 1),  # MobileNetV3's 5x5
    (2, 96, 14, 14, 96, 96, 7, 1, 3, 1),  # ConvNeXt's 7x7
    (8, 128, 28, 28, 128, 32, 3, 1, 1, 1),  # ResNeXt-50 32x4d, layer 1's width
    (4, 256, 14, 14, 256, 32, 3, 2, 1, 1),  # ... 8 a group, stride 2
    (4, 224, 14, 14, 224, 14, 3, 1, 1, 1),  # RegNet, 16 a group
    (2, 432, 7, 7, 432, 9, 3, 1, 1, 1),  # RegNet, 48 a group
]


@pytest.mark.gpu
@pytest.mark.parametrize("x_format", [NCHW, NHWC], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("case", GPU_CASES, ids=_ids)
def test_gpu_shapes_layouts_and_no_bias(untuned, case, x_format):
    _check(case, torch.float16, "relu", "cuda", x_format=x_format)
    _check(case, torch.bfloat16, "gelu_tanh", "cuda", bias=False, x_format=x_format, y_format=NHWC)
    _check(case, torch.float32, "silu", "cuda", x_format=x_format, y_format=NCHW, residual=x_format)


@pytest.mark.gpu
@pytest.mark.parametrize("residual", [None, NHWC], ids=["plain", "residual"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_every_dtype_and_activation(untuned, dtype, activation, residual):
    for case in (DEPTHWISE[3], GROUPED[3], GPU_CASES[-4]):  # depthwise, small groups, ResNeXt's
        for x_format in (NCHW, NHWC):
            _check(case, dtype, activation, "cuda", x_format=x_format, residual=residual)


SWEPT = [GPU_CASES[-8], GPU_CASES[-5], GPU_CASES[-4], GPU_CASES[-1], GROUPED[3], DEPTHWISE[7]]


@pytest.mark.gpu
@pytest.mark.parametrize("case", SWEPT, ids=_ids)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_every_candidate(monkeypatch, dtype, case):
    """Each config the tuner may pick, forced, on depthwise and grouped layers in both layouts, with a residual (fp32
    in full precision: the GEMM's CUDA-core candidates)."""
    N, C, H, W, OC, G = case[:6]
    M = N * _out_shape(case)[2] * _out_shape(case)[3]
    for x_format in (NCHW, NHWC):
        fma = dtype == torch.float32
        configs = grouped_mod.cuda_configs(grouped_mod.m_bucket(M), OC, C // G, OC // G, x_format == NHWC, fma)
        for config in configs:
            monkeypatch.setattr(grouped_mod, "tune", lambda *a, config=config, **kw: config)
            grouped_mod._configs.clear()
            _check(case, dtype, "relu", "cuda", x_format=x_format, residual=x_format)
    grouped_mod._configs.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3, 64])
def test_gpu_tuned(batch):
    """The CUDA path as the service runs it: tuned (every candidate compiled and timed), then the pick reused."""
    for case in (GPU_CASES[-8], GPU_CASES[-4], GPU_CASES[-2]):
        case = (batch, *case[1:])
        for _ in range(2):
            _check(case, torch.float16, "relu", "cuda", x_format=NHWC)
    grouped_mod._configs.clear()


@pytest.mark.gpu
def test_gpu_graph_capture():
    """The launcher is capturable: after a warm-up (which tunes) a CUDA graph replays it on new inputs."""
    from kernels.graph_capture import capture

    for case in (GPU_CASES[-8], GPU_CASES[-4]):
        x, w, b = _inputs(case, torch.float16, "cuda", x_format=NHWC)
        G = case[5]
        graph, y = capture(lambda: fused_conv2d_grouped(x, w, b, "relu", padding=1, groups=G), warmups=2)  # noqa: B023
        x.copy_(torch.randn_like(x))
        y.fill_(float("nan"))
        graph.replay()
        want = reference.conv2d_grouped(x.double(), w.double(), b.double(), "relu", padding=1, groups=G)
        assert_close_to(y, want, RTOL[torch.float16], f"graph replay {case}")
