"""fused_conv2d with a per-image per-channel gate of x (`x_scale`, a squeeze-and-excitation block's x * s read by its
1x1 projection) against the reference: the SE projection's 1x1 convs and padded 3x3 / strided / dilated ones, both K
loops and both layouts, every dtype, bias or not, a residual, a fused pool, split K; the gate as (N, C) or
(N, C, 1, 1), in any float dtype. Gates are sigmoid(randn): in (0, 1) as an SE block's are, never 0.

The kernel multiplies in fp32 and rounds the product once to x's dtype before tl.dot, as eager torch's x * s does, so
the tight reference is the float64 conv of exactly that operand (`_operand`); each case is also checked against the
float64 product itself (RTOL_VS_UNFUSED: that rounding is the only difference). Outputs start as NaN: an element not
written fails. Under the interpreter bf16 tiles are multiplied as fp32 (tiles.gemm_flags); the compiled path and
native bf16 are the `gpu` tests.
"""

from __future__ import annotations

import pytest
import torch

import kernels.conv as conv_mod
from kernels import conv_tma, reference
from kernels.conv import fused_conv2d, input_norm_of
from kernels.runtime import interpreting
from tests.tolerances import RTOL, RTOL_VS_UNFUSED, assert_close_to

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NCHW, NHWC = torch.contiguous_format, torch.channels_last

# (N, C, H, W, OC, kernel, stride, padding, dilation): the SE projection (16 -> 8 at 7x7) at batch 1 and 3, a 1x1 over
# 17 channels (across a 16-wide K step) to 20, a 3x3 padding 1 at a prime batch, an uneven window / stride / padding /
# dilation, and a 3x3 stride 2 padding 2 over 17 channels: the padding, where the gate must not reach, at every edge.
SE = [(1, 16, 7, 7, 8, 1, 1, 0, 1), (3, 16, 7, 7, 8, 1, 1, 0, 1)]
CASES = SE + [
    (2, 17, 5, 6, 20, 1, 1, 0, 1),
    (3, 5, 6, 7, 9, 3, 1, 1, 1),
    (2, 3, 7, 9, 5, (3, 2), (2, 1), (1, 0), (1, 2)),
    (2, 17, 6, 5, 12, 3, 2, 2, 2),
]


def _ids(case):
    return "-".join(str(v).replace(" ", "") for v in case)


def _gate(N: int, C: int, dtype=torch.float32, squeezed: bool = False, device=DEVICE) -> torch.Tensor:
    """An SE block's gate: sigmoid of random logits, in (0, 1), as (N, C) or, `squeezed`, (N, C, 1, 1)."""
    s = torch.sigmoid(torch.randn(N, C, device=device)).to(dtype)
    return s.reshape(N, C, 1, 1) if squeezed else s


def _operand(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """What the kernel multiplies: x * s in fp32, rounded once to x's dtype (an fp16 or bf16 x times an fp32 gate is
    exact in fp32; a float64 gate is read as fp32)."""
    gate = s.reshape(x.shape[0], x.shape[1], 1, 1).float()
    return (x.float() * gate).to(x.dtype)


def _check(case, dtype, activation="relu", channels_last=False, bias=True, residual=None, pool=None,
           gate_dtype=torch.float32, squeezed=False, device=DEVICE):  # fmt: skip
    """residual: None, or the memory format of a fresh random residual added before the activation."""
    N, C, H, W, OC, k, s, p, d = case
    kh, kw = (k, k) if isinstance(k, int) else k
    x = torch.randn(N, C, H, W, device=device).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=NHWC)
    w = (torch.randn(OC, C, kh, kw, device=device) / (C * kh * kw) ** 0.5).to(dtype)
    b = torch.randn(OC, device=device).to(dtype) if bias else None
    gate = _gate(N, C, gate_dtype, squeezed, device)
    b64 = None if b is None else b.double()
    conv = reference.conv2d(_operand(x, gate).double(), w.double(), b64, stride=s, padding=p, dilation=d)
    exact = reference.conv2d(x.double(), w.double(), b64, stride=s, padding=p, dilation=d, x_scale=gate.double())
    r = None if residual is None else torch.randn(conv.shape, device=device).to(dtype)
    r = r if r is None else r.contiguous(memory_format=residual)
    wants = []
    for y in (conv, exact):
        y = reference.activation(y if r is None else y + r.double(), activation)
        wants.append(y if pool is None else reference.pool2d(y, pool[0], pool[1]))
    fmt = NHWC if channels_last else NCHW
    out = torch.full(wants[0].shape, float("nan"), device=device, dtype=dtype).contiguous(memory_format=fmt)
    got = fused_conv2d(x, w, b, stride=s, padding=p, dilation=d, activation=activation, allow_tf32=False, out=out,
                       residual=r, pool=pool, x_scale=gate)  # fmt: skip
    assert got is out  # NaN left behind = an element not written (assert_close_to checks finiteness)
    what = f"{case} {dtype} {activation} nhwc={channels_last} bias={bias} residual={residual} pool={pool}"
    what += f" gate={gate_dtype}{' (N, C, 1, 1)' if squeezed else ''}"
    assert_close_to(got, wants[0], RTOL[dtype], what)
    assert_close_to(got, wants[1], RTOL_VS_UNFUSED[dtype], what + " vs the float64 product")
    return got


@pytest.fixture
def small_tile():
    with conv_mod.INTERPRETER.override(tile=conv_mod.SMALL_INTERPRETER_TILE):
        yield


@pytest.fixture(params=[True, False], ids=["flat_k", "taps"])
def k_loop(request):
    with conv_mod.INTERPRETER.override(flat_k=request.param):
        yield request.param


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_awkward_shapes_both_k_loops_and_layouts(small_tile, k_loop, case, channels_last):
    got = _check(case, torch.float32, "leaky_relu", channels_last=channels_last, squeezed=case[0] == 3)
    assert got.is_contiguous(memory_format=NHWC if channels_last else NCHW)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SE + [CASES[3]], ids=_ids)
def test_se_projection_every_dtype_with_and_without_bias(case, dtype, channels_last):
    """The launcher's own tile; the projection is linear (BatchNorm folded into it): no activation."""
    _check(case, dtype, "none", channels_last=channels_last)
    _check(case, dtype, "none", channels_last=channels_last, bias=False, squeezed=True)


# Each activation once, fp32 and fp16 in turn (each with two): the epilogue applies it to the fp32 sum whatever the
# dtype, which decides only the final rounding, checked for every dtype in the tests above and below. Both dtypes
# for every activation (8 cases, ~3 CPU-s more under the interpreter, issue 51) ran the same epilogue twice.
@pytest.mark.parametrize(
    ("dtype", "activation"),
    [(torch.float32, "relu"), (torch.float16, "silu"), (torch.float32, "hardswish"), (torch.float16, "gelu")],
    ids=str,
)
def test_activations(small_tile, dtype, activation):
    _check(CASES[3], dtype, activation)


# Every dtype in both layouts, the K loop taken in turn (each loop three times, each layout and dtype with both): the
# residual is read in the epilogue, after the K loop, which decides only how the sum was made (both loops, gated, on
# every awkward shape: test_awkward_shapes_both_k_loops_and_layouts). Both loops for every dtype and layout (twice
# these 6 cases, ~12 CPU-s under the interpreter, issue 51) ran the same epilogue again.
RESIDUAL_CASES = [(d, cl, (i + j) % 2 == 0) for i, d in enumerate(DTYPES) for j, cl in enumerate([False, True])]


@pytest.mark.parametrize(
    ("dtype", "channels_last", "flat_k"),
    RESIDUAL_CASES,
    ids=[f"{'flat_k' if f else 'taps'}-{d}-{'nhwc' if cl else 'nchw'}" for d, cl, f in RESIDUAL_CASES],
)
def test_residual_both_layouts(small_tile, dtype, channels_last, flat_k):
    """An MBConv block's projection adds the block's input: act(conv(x * s) + b + identity); the residual in the
    output's layout and in the other one (copied into it first)."""
    fmt = NHWC if channels_last else NCHW
    with conv_mod.INTERPRETER.override(flat_k=flat_k):
        _check(SE[1], dtype, "none", channels_last=channels_last, residual=fmt)
        _check(CASES[3], dtype, "relu", channels_last=channels_last, residual=NCHW, bias=False)


@pytest.mark.parametrize("gate_dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_gate_in_any_float_dtype(small_tile, gate_dtype):
    """Read in fp32 whatever its dtype: fp16 and bf16 gates exactly, a float64 one rounded to fp32 first."""
    _check(SE[1], torch.float32, "none", gate_dtype=gate_dtype)
    _check(CASES[3], torch.float16, "relu", channels_last=True, gate_dtype=gate_dtype, squeezed=True)


def test_split_k_and_pool(small_tile):
    with conv_mod.INTERPRETER.override(split_k=3, flat_k=False):
        _check(CASES[2], torch.float16, "relu", channels_last=True, residual=NHWC)
    with conv_mod.INTERPRETER.override(split_k=2, flat_k=True):
        _check(CASES[5], torch.float32, "silu")
    _check((3, 5, 8, 9, 16, 3, 1, 1, 1), torch.float16, "relu", pool=("max", 2))
    with conv_mod.INTERPRETER.override(pool_apart=True):
        _check((3, 5, 8, 9, 16, 3, 1, 1, 1), torch.float32, "relu", channels_last=True, pool=("avg", 2))
    _check((2, 3, 8, 8, 4, 3, 1, 1, 1), torch.float32, "relu", pool=("avg", 4))  # > MAX_POOL_WINDOW: conv, then pool


def test_never_the_tma_kernel():
    """A layer conv_tma could run (NHWC x and weight, 16-byte rows) runs conv.py's gathers with a gate: the TMA
    kernel copies x's boxes as they are, ungated."""
    x = torch.randn(2, 16, 7, 7, device=DEVICE).contiguous(memory_format=NHWC)
    w = conv_tma.weight_for(torch.randn(8, 16, 1, 1, device=DEVICE) / 4, (1, 1))
    out = torch.empty(2, 8, 7, 7, device=DEVICE).contiguous(memory_format=NHWC)
    assert conv_tma.eligible(x, w, (1, 1), None, out)
    gate = _gate(2, 16)
    with conv_mod.INTERPRETER.override(tma=True):
        got = fused_conv2d(x, w, allow_tf32=False, out=out, x_scale=gate)
    want = reference.conv2d(_operand(x, gate).double(), w.double())
    assert_close_to(got, want, RTOL[torch.float32], "eligible for TMA, gated")


def test_a_gate_of_ones_is_the_plain_conv():
    """x * 1 is x exactly: under the interpreter the gated conv is the ungated one bit for bit (same tile, same sums);
    compiled, each is tuned under its own key and may sum in another order."""
    x = torch.randn(3, 16, 7, 7, device=DEVICE).half()
    w = (torch.randn(8, 16, 1, 1, device=DEVICE) / 4).half()
    b = torch.randn(8, device=DEVICE).half()
    plain = fused_conv2d(x, w, b)
    gated = fused_conv2d(x, w, b, x_scale=torch.ones(3, 16, device=DEVICE))
    if interpreting():
        assert torch.equal(gated, plain)
    assert_close_to(gated, plain.double(), RTOL[torch.float16], "a gate of ones")


def test_reference_multiplies_first():
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    w = torch.randn(4, 3, 3, 3, dtype=torch.float64)
    s = torch.rand(2, 3, 1, 1, dtype=torch.float64)
    want = torch.nn.functional.conv2d(x * s, w, padding=1)
    assert torch.equal(reference.conv2d(x, w, padding=1, x_scale=s), want)
    assert torch.equal(reference.conv2d(x, w, padding=1, x_scale=s.reshape(2, 3)), want)
    with pytest.raises(ValueError, match="x_scale and normalize"):
        reference.conv2d(x, w, x_scale=s, normalize=([0.0] * 3, [1.0] * 3))


SHAPE = r"x_scale must have shape \(2, 3\) or \(2, 3, 1, 1\), one gate per image and channel of x; got "
BAD = [
    (lambda x, s: dict(x_scale=s, input_norm=input_norm_of([0.0] * 3, [1.0] * 3, x.device)),
     ValueError, "x_scale and input_norm cannot both be given"),
    (lambda x, s: dict(x_scale=s[:, :2]), ValueError, SHAPE + r"\(2, 2\)"),
    (lambda x, s: dict(x_scale=s[0]), ValueError, SHAPE + r"\(3,\)"),
    (lambda x, s: dict(x_scale=s.reshape(2, 3, 1).expand(2, 3, 4)), ValueError, SHAPE + r"\(2, 3, 4\)"),
    (lambda x, s: dict(x_scale=s.tolist()), ValueError, SHAPE + r"\[\["),
    (lambda x, s: dict(x_scale=(s > 0.5).to(torch.int32)), TypeError, "x_scale has dtype torch.int32"),
    (lambda x, s: dict(x_scale=s.t().contiguous().t()), ValueError, "x_scale must be contiguous"),
]  # fmt: skip


@pytest.mark.parametrize("make,error,message", BAD, ids=[m for *_, m in BAD])
def test_bad_gates_are_named(make, error, message):
    x = torch.randn(2, 3, 6, 6, device=DEVICE)
    w = torch.randn(4, 3, 3, 3, device=DEVICE)
    with pytest.raises(error, match=message):
        fused_conv2d(x, w, padding=1, **make(x, _gate(2, 3)))


# ---- compiled path, on the lent GPU ----


@pytest.fixture
def untuned():
    from kernels import tuning

    tuning.set_enabled(False)
    yield
    tuning.set_enabled(None)
    conv_mod._configs.clear()


# EfficientNet-B0's SE projections at 256 images, (C, OC, H = W): each MBConv block's gated expansion C projected to
# its output OC (1x1, BatchNorm folded), from the first stage's 32 -> 16 at 112x112 to the last's 1152 -> 320 at 7x7.
# Blocks that keep their width (C = 6 * OC, stride 1) add their input: `residual`.
EFFICIENTNET_B0 = [
    (32, 16, 112),
    (96, 24, 56),
    (144, 24, 56),
    (144, 40, 28),
    (240, 40, 28),
    (240, 80, 14),
    (480, 80, 14),
    (480, 112, 14),
    (672, 112, 14),
    (672, 192, 7),
    (1152, 192, 7),
    (1152, 320, 7),
]


@pytest.mark.gpu
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layer", EFFICIENTNET_B0, ids=lambda layer: "x".join(map(str, layer)))
def test_gpu_efficientnet_b0_projections(untuned, layer, dtype, channels_last):
    C, OC, HW = layer
    case = (256, C, HW, HW, OC, 1, 1, 0, 1)
    residual = (NHWC if channels_last else NCHW) if C == 6 * OC else None
    _check(case, dtype, "none", channels_last=channels_last, residual=residual, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_gpu_every_candidate(monkeypatch, dtype):
    """Each config the tuner may pick, forced, on a wide and a narrow SE projection and a padded 3x3, both layouts
    (fp32 in full precision: its CUDA-core candidates)."""
    fma = dtype == torch.float32
    for case in [(3, 1152, 7, 7, 320, 1, 1, 0, 1), (5, 96, 12, 12, 24, 1, 1, 0, 1), (3, 40, 9, 11, 36, 3, 1, 1, 1)]:
        N, C, H, W, OC, k = case[:6]
        for config in conv_mod.cuda_configs(conv_mod.m_bucket(N * H * W), OC, C, C * k * k, fma,
                                            element_size=dtype.itemsize, gated=True):  # fmt: skip
            monkeypatch.setattr(conv_mod, "tune", lambda *a, config=config, **kw: config)
            conv_mod._configs.clear()
            for channels_last in (False, True):
                _check(case, dtype, "none", channels_last=channels_last, device="cuda")
    conv_mod._configs.clear()


@pytest.mark.gpu
def test_gpu_tuned_apart_from_the_plain_conv():
    """A gated conv is tuned under its own key (another kernel variant), never the plain conv's pick, and never
    offered TMA candidates."""
    keys, offered = [], []
    real = conv_mod.tune

    def tune(scope, key, candidates, *args, **kwargs):
        keys.append(key)
        offered.append(candidates)
        return real(scope, key, candidates, *args, **kwargs)

    conv_mod._configs.clear()
    try:
        conv_mod.tune = tune
        x = torch.randn(64, 96, 14, 14, device="cuda").half().contiguous(memory_format=NHWC)
        w = conv_tma.weight_for(torch.randn(24, 96, 1, 1, device="cuda").half() / 10, (1, 1))
        gate = _gate(64, 96, device="cuda")
        got = fused_conv2d(x, w, x_scale=gate)
        fused_conv2d(x, w)
    finally:
        conv_mod.tune = real
        conv_mod._configs.clear()
    assert len(keys) == 2 and keys[0] != keys[1] and keys[0].endswith("|xscale") and "|tma" not in keys[0], keys
    assert "|tma" in keys[1] and not any(conv_tma.is_tma(c) for c in offered[0])
    assert_close_to(got, reference.conv2d(_operand(x, gate).double(), w.double()), RTOL[torch.float16], "tuned pick")


# ---- compiled for Hopper here, without a GPU (tests/sm90_compile.py; what the interpreter cannot check) ----

_COMPILE_GATED = r"""
import json, sys
import torch
import kernels.conv as conv
from tests.sm90_compile import compile_sm90, sample

ptr = sys.argv[1]
# EfficientNet-B0's SE projections: the widest, 1152 -> 320 at 7x7 over 256 images, NHWC x and y with a channels_last
# weight; 144 -> 24 at 56x56 with NCHW x, weight and y; 672 -> 192 at 7x7 for one image (32-row tiles, split K). The
# gate an fp32 (N, C) tensor (xs_ptr), xb_ptr None.
fma, size = ptr == "*fp32", 4 if ptr == "*fp32" else 2  # fp32 in full precision: its CUDA-core candidates
for i, (C, OC, HW, nhwc, images) in enumerate([(1152, 320, 7, True, 256), (144, 24, 56, False, 256),
                                                (672, 192, 7, True, 1)]):
    fmt = torch.channels_last if nhwc else torch.contiguous_format
    shapes = {"x": (images, C, HW, HW), "w": (OC, C, 1, 1), "y": (images, OC, HW, HW)}
    strides = {}
    for t, shape in shapes.items():
        for d, v in zip("nchw" if t != "w" else "ochw", torch.empty(shape, device="meta", memory_format=fmt).stride()):
            strides[f"stride_{t}{d}"] = v
    units = {n: 1 for n, v in strides.items() if v == 1}  # Triton makes a stride of 1 a constant
    runtime = dict(x_ptr=ptr, w_ptr=ptr, b_ptr=ptr, y_ptr=ptr, r_ptr=ptr, ws_ptr="*fp32", cnt_ptr="*i32",
                   xs_ptr="*fp32", NB="i32", OC="i32", negative_slope="fp32",
                   **{n: "i32" for n in strides if n not in units})
    divisible = ("OC",) + tuple(n for n, v in strides.items() if v % 16 == 0 and n not in units)
    offered = conv.cuda_configs(conv.m_bucket(images * HW * HW), OC, C, C, fma, element_size=size, gated=True)
    for cfg in sample(offered, i):
        meta = dict(C=C, H=HW, W=HW, OH=HW, OW=HW, KH=1, KW=1, SH=1, SW=1, PH=0, PW=0, DH=1, DW=1, POOL="none", PKH=1,
                    PKW=1, PSH=1, PSW=1, HAS_BIAS=True, HAS_RESIDUAL=False, ACTIVATION="none", INPUT_PRECISION="ieee",
                    UPCAST_DOT=False, ROUND_BF16=False, PDL=True, CHANNELS_LAST=nhwc, Y_PLANES=not nhwc,
                    HAS_INPUT_NORM=False, xb_ptr=None, **units, **dict(cfg.kwargs))
        ptx, usage = compile_sm90(conv._conv2d_kernel, runtime, meta, 5, cfg.num_warps, cfg.num_stages, divisible)
        print(json.dumps({"layer": [C, OC, HW, nhwc, images], "config": cfg.meta(), "STACK": usage["STACK"],
                          "wgmma": "wgmma.mma_async" in ptx, "mma": "mma.sync.aligned" in ptx}), flush=True)
"""


@pytest.mark.parametrize("ptr", ["*fp16", "*fp32"])
def test_gated_candidates_compile_for_sm90_without_spills(ptr):
    """Every candidate of three SE projections (a sample of them without a GPU: tests/sm90_compile.py), gated,
    compiles for sm_90 without spills: fp16 on tensor cores, fp32 in full precision on the CUDA cores (bf16 takes
    fp16's candidates)."""
    from tests.sm90_compile import every_candidate
    from tests.test_kernels_compile import _compiled

    results = _compiled(_COMPILE_GATED, ptr)
    assert len(results) > (10 if every_candidate() else 4), results
    for r in results:
        assert r["STACK"] == 0, f"spills: {r}"
        if ptr != "*fp32":  # fp32 ieee: FMA
            assert r["wgmma"] if r["config"]["BLOCK_M"] >= 64 else r["mma"], r
