"""fused_conv2d with input normalization (`input_norm`, a model's first conv reading pixels as the client sent them)
against the reference: uint8 and float x, every weight dtype, both K loops and both layouts, padding that must stay
0 after the normalization (ResNet's 7x7 stride-2 stem pads 3), split K and a fused pool.

The kernel rounds each normalized element once to the weights' dtype before tl.dot, so the reference is the float64
conv of exactly that operand (`reference.normalize_input` in the weights' dtype, then widened); fp32 is also checked
against the float64 normalization itself. Under the interpreter bf16 tiles are multiplied as fp32 (tiles.gemm_flags);
the compiled path and native bf16 are the `gpu` tests.
"""

from __future__ import annotations

import pytest
import torch

import kernels.conv as conv_mod
from kernels import reference
from kernels.conv import fused_conv2d, input_norm_of
from kernels.runtime import interpreting
from tests.tolerances import RTOL, assert_close_to

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MEAN = (123.675, 116.28, 103.53)  # torchvision's ImageNet mean and std, in 0-255 pixels
STD = (58.395, 57.12, 57.375)

# (N, C, H, W, O, kernel, stride, padding, dilation): ResNet's stem on a small image (7x7/2, padding 3) at batch 1,
# a 3x3 padding 1 at a prime batch, an uneven window / stride / padding / dilation, 17 channels (across a 16-wide K
# step) with padding 2 at stride 2, and a 1x1 without padding. The stem's 11x13 (primes) gives 6x7 = 42 outputs: 3
# of the small tile's 16-row M blocks, the last partial, with windows in the padding on every side and some wholly
# inside; 19x23 (120 outputs, 8 blocks) took 2.7 times the interpreter's time in the 22 runs that take it.
CASES = [
    (1, 3, 11, 13, 16, 7, 2, 3, 1),
    (3, 3, 8, 9, 5, 3, 1, 1, 1),
    (2, 3, 7, 9, 17, (3, 2), (2, 1), (1, 0), (1, 2)),
    (5, 17, 6, 5, 20, 3, 2, 2, 2),
    (2, 3, 5, 5, 7, 1, 1, 0, 1),
]


def _ids(case):
    return "-".join(str(v).replace(" ", "") for v in case)


def _stats(C: int) -> tuple[list[float], list[float]]:
    """MEAN and STD for three channels; for more, random ones of the same scale (std > 0)."""
    if C == 3:
        return list(MEAN), list(STD)
    g = torch.Generator().manual_seed(C)
    return (torch.rand(C, generator=g) * 255).tolist(), (torch.rand(C, generator=g) * 60 + 20).tolist()


def _pixels(shape, x_dtype, device):
    """Random pixels 0-255 (never all zeros): uint8 as sent, or the same values as floats, with fractions for fp32."""
    x = torch.randint(0, 256, shape, dtype=torch.uint8, device=device)
    if x_dtype == torch.uint8:
        return x
    if x_dtype == torch.float32:
        return x.float() + torch.rand(shape, device=device)  # fractions too: a float model's pixels need not be ints
    return x.to(x_dtype)  # 0-255 integers are exact in fp16 and bf16 (8 significant bits)


def _check(case, dtype, x_dtype=torch.uint8, activation="relu", channels_last=False, bias=True, residual=False,
           pool=None):  # fmt: skip
    N, C, H, W, OC, k, s, p, d = case
    kh, kw = (k, k) if isinstance(k, int) else k
    mean, std = _stats(C)
    x = _pixels((N, C, H, W), x_dtype, DEVICE)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    w = (torch.randn(OC, C, kh, kw, device=DEVICE) / (C * kh * kw) ** 0.5).to(dtype)
    b = torch.randn(OC, device=DEVICE).to(dtype) if bias else None
    operand = reference.normalize_input(x, mean, std, dtype=dtype).double()  # what the kernel multiplies
    want = reference.conv2d(operand, w.double(), b if b is None else b.double(), stride=s, padding=p, dilation=d)
    r = torch.randn(want.shape, device=DEVICE).to(dtype) if residual else None
    want = torch.relu(want + r.double()) if residual else reference.activation(want, activation)
    if pool is not None:
        want = reference.pool2d(want, pool[0], pool[1])
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    out = torch.full(want.shape, float("nan"), device=DEVICE, dtype=dtype).contiguous(memory_format=fmt)
    got = fused_conv2d(
        x, w, b, stride=s, padding=p, dilation=d, activation="relu" if residual else activation, allow_tf32=False,
        out=out, residual=r, pool=pool, input_norm=input_norm_of(mean, std, DEVICE),
    )  # fmt: skip
    assert got is out  # NaN left behind = an element not written (assert_close_to checks finiteness)
    what = f"{case} {dtype} x={x_dtype} nhwc={channels_last} bias={bias} residual={residual} pool={pool}"
    assert_close_to(got, want, RTOL[dtype], what)
    if dtype == torch.float32 and not residual and pool is None:  # and against the exact normalization
        exact = reference.conv2d(x.double(), w.double(), b if b is None else b.double(), activation, stride=s,
                                 padding=p, dilation=d, normalize=(mean, std))  # fmt: skip
        assert_close_to(got, exact, RTOL[dtype], what + " vs float64 normalization")
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
def test_uint8_awkward_shapes_both_k_loops_and_layouts(small_tile, k_loop, case, channels_last):
    got = _check(case, torch.float32, channels_last=channels_last)
    assert got.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


# Every (weight dtype, x dtype) pair, each on one K loop, the loops taken in turn so that each sees every weight dtype
# and every x dtype: the loop decides which elements are gathered and where they are padding, and both loops hand them
# to one helper (conv.py's _normalized) that converts x and rounds to the weights' dtype. The full product (18 cases,
# ~1.45 CPU-s each under the interpreter, issue 51) ran every pair through both loops; compiled (a GPU) it still does.
X_DTYPES = [torch.uint8, torch.float32, torch.float16]
DTYPE_CASES = [(d, x, f) for i, d in enumerate(DTYPES) for j, x in enumerate(X_DTYPES) for f in (True, False)
               if DEVICE != "cpu" or f == ((i + j) % 2 == 0)]  # fmt: skip


@pytest.mark.parametrize(("dtype", "x_dtype", "flat_k"), DTYPE_CASES,
                         ids=[f"{d}-{x}-{'flat_k' if f else 'taps'}" for d, x, f in DTYPE_CASES])  # fmt: skip
def test_every_weight_dtype_and_input_dtype(small_tile, dtype, x_dtype, flat_k):
    """The stem: uint8 pixels, or float ones (fp32 with fractions, fp16 x with bf16 weights too: x need not be in
    the weights' dtype); y in the weights' dtype."""
    with conv_mod.INTERPRETER.override(flat_k=flat_k):
        got = _check(CASES[0], dtype, x_dtype, activation="gelu", bias=dtype != torch.float16)
    assert got.dtype == dtype


def test_split_k_residual_and_pool(small_tile):
    with conv_mod.INTERPRETER.override(split_k=3, flat_k=False):
        _check(CASES[3], torch.float16, channels_last=True)
    _check(CASES[1], torch.float32, residual=True)
    _check((3, 3, 12, 13, 16, 7, 2, 3, 1), torch.float16, pool=("max", 2))
    with conv_mod.INTERPRETER.override(pool_apart=True):
        _check((3, 3, 12, 13, 16, 7, 2, 3, 1), torch.float32, pool=("avg", 2))


def test_padding_is_zero_after_normalization():
    """A constant image of the mean normalizes to 0 everywhere, so a conv of it is its bias alone, at the borders
    too; had the padding been normalized (0 -> -mean / std) the border pixels would differ. (Powers of two for std:
    x * scale + shift is then exact, with or without a fused multiply-add.)"""
    mean, std = [96.0, 48.0, 160.0], [8.0, 16.0, 32.0]
    device = "cpu" if interpreting() else "cuda"
    x = torch.tensor(mean, dtype=torch.float32).reshape(1, 3, 1, 1).expand(2, 3, 9, 11).to(torch.uint8).contiguous()
    w = torch.randn(4, 3, 7, 7)
    b = torch.randn(4)
    x, w, b = x.to(device), w.to(device), b.to(device)
    y = fused_conv2d(x, w, b, stride=2, padding=3, allow_tf32=False, input_norm=input_norm_of(mean, std, device))
    assert torch.equal(y, b.reshape(1, 4, 1, 1).expand_as(y))


BAD = [
    (lambda x, w, n: (x.float(), w, None), "x has dtype torch.float32 but weight has torch.float16"),
    (lambda x, w, n: (x.to(torch.int32), w, n), "x has dtype torch.int32; .* \\(and uint8 x with input_norm\\)"),
    (lambda x, w, n: (x, w, None), "x has dtype torch.uint8"),
    (lambda x, w, n: (x, w, (n[0],)), "input_norm must be \\(scale, shift\\)"),
    (lambda x, w, n: (x, w, (n[0].half(), n[1])), "scale must be a float32 tensor of shape \\(3,\\)"),
    (lambda x, w, n: (x, w, (n[0], n[1][:2])), "shift must be a float32 tensor of shape \\(3,\\)"),
]


@pytest.mark.parametrize("make,message", BAD, ids=[m for _, m in BAD])
def test_bad_inputs_are_named(make, message):
    x = torch.randint(0, 256, (2, 3, 6, 6), dtype=torch.uint8, device=DEVICE)
    w = torch.randn(4, 3, 3, 3, device=DEVICE).half()
    x, w, norm = make(x, w, input_norm_of(MEAN, STD, DEVICE))
    with pytest.raises((ValueError, TypeError), match=message):
        fused_conv2d(x, w, input_norm=norm)


def test_input_norm_of_is_the_inverse_std_and_shifted_mean():
    scale, shift = input_norm_of([2.0, 4.0], [0.5, 8.0])
    assert scale.dtype == torch.float32 and scale.tolist() == [2.0, 0.125] and shift.tolist() == [-4.0, -0.5]


# ---- compiled path, on the lent GPU ----


@pytest.fixture
def untuned():
    from kernels import tuning

    tuning.set_enabled(False)
    yield
    tuning.set_enabled(None)
    conv_mod._configs.clear()


GPU_CASES = CASES + [(64, 3, 224, 224, 64, 7, 2, 3, 1), (17, 3, 32, 32, 64, 3, 1, 1, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("x_dtype", [torch.uint8, torch.float16], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_dtypes_shapes_and_layouts(untuned, dtype, x_dtype, channels_last):
    for case in GPU_CASES:
        _check(case, dtype, x_dtype, channels_last=channels_last)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_gpu_every_candidate(monkeypatch, dtype):
    """Each config the tuner may pick for the stem, forced, NCHW uint8 pixels in (as the service sends them)."""
    case = (5, 3, 32, 32, 64, 7, 2, 3, 1)
    N, C, H, W, OC = case[:5]
    m = N * 16 * 16
    for config in conv_mod.cuda_configs(conv_mod.m_bucket(m), OC, C, C * 49, dtype == torch.float32,
                                        element_size=dtype.itemsize, norm=True):  # fmt: skip
        monkeypatch.setattr(conv_mod, "tune", lambda *a, config=config, **kw: config)
        conv_mod._configs.clear()
        _check(case, dtype)
    conv_mod._configs.clear()


@pytest.mark.gpu
def test_gpu_tuned_apart_from_the_plain_conv():
    """A normalized conv is tuned under its own key (another kernel variant), never the plain conv's pick."""
    keys = []
    real = conv_mod.tune
    conv_mod._configs.clear()
    try:
        conv_mod.tune = lambda scope, key, *a, **kw: keys.append(key) or real(scope, key, *a, **kw)
        _check(GPU_CASES[-1], torch.float16)
        x = torch.randn(17, 3, 32, 32, device="cuda").half()
        w = torch.randn(64, 3, 3, 3, device="cuda").half()
        fused_conv2d(x, w, padding=1)
    finally:
        conv_mod.tune = real
        conv_mod._configs.clear()
    assert len(keys) == 2 and keys[0] != keys[1] and "|norm|x=torch.uint8" in keys[0], keys


# ---- compiled for Hopper here, without a GPU (tests/sm90_compile.py; what the interpreter cannot check) ----

_COMPILE_STEM = r"""
import json, sys
import kernels.conv as conv
from tests.sm90_compile import compile_sm90

ptr = sys.argv[1]
# ResNet's stem at 224x224, 64 images: uint8 NCHW pixels in (as the service sends them), NCHW weight, NHWC y
strides = ["stride_xn", "stride_xc", "stride_xh", "stride_wo", "stride_wc", "stride_wh", "stride_yn", "stride_yh",
           "stride_yw"]
runtime = dict(x_ptr="*u8", w_ptr=ptr, b_ptr=ptr, y_ptr=ptr, r_ptr=ptr, ws_ptr="*fp32", cnt_ptr="*i32",
               xs_ptr="*fp32", xb_ptr="*fp32", NB="i32", OC="i32", negative_slope="fp32", **{s: "i32" for s in strides})
fma, size = ptr == "*fp32", 4 if ptr == "*fp32" else 2  # fp32 in full precision: its CUDA-core candidates
for cfg in conv.cuda_configs(conv.m_bucket(64 * 112 * 112), 64, 3, 147, fma, element_size=size, norm=True):
    meta = dict(C=3, H=224, W=224, OH=112, OW=112, KH=7, KW=7, SH=2, SW=2, PH=3, PW=3, DH=1, DW=1, POOL="none", PKH=1,
                PKW=1, PSH=1, PSW=1, HAS_BIAS=True, HAS_RESIDUAL=False, ACTIVATION="relu", INPUT_PRECISION="ieee",
                UPCAST_DOT=False, ROUND_BF16=False, PDL=True, CHANNELS_LAST=False, Y_PLANES=False, HAS_INPUT_NORM=True,
                stride_xw=1, stride_ww=1, stride_yc=1, **dict(cfg.kwargs))
    divisible = ("OC", "stride_xn", "stride_xc", "stride_xh", "stride_yn", "stride_yh", "stride_yw")
    ptx, usage = compile_sm90(conv._conv2d_kernel, runtime, meta, 5, cfg.num_warps, cfg.num_stages, divisible)
    print(json.dumps({"config": cfg.meta(), "STACK": usage["STACK"], "wgmma": "wgmma.mma_async" in ptx,
                      "mma": "mma.sync.aligned" in ptx}))
"""


@pytest.mark.parametrize("ptr", ["*fp16", "*bf16", "*fp32"])
def test_stem_candidates_compile_for_sm90_without_spills(ptr):
    """Every candidate of the normalizing stem (uint8 x; fp16 and bf16 weights on tensor cores, fp32 in full
    precision on the CUDA cores) compiles for sm_90 without spills."""
    from tests.test_kernels_compile import _compiled

    results = _compiled(_COMPILE_STEM, ptr)
    assert results
    for r in results:
        assert r["STACK"] == 0, f"spills: {r}"
        if ptr != "*fp32":  # fp32 ieee: FMA
            assert r["wgmma"] if r["config"]["BLOCK_M"] >= 64 else r["mma"], r
