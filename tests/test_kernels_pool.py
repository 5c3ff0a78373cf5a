"""fused_pool2d against the float64 reference: both kinds, every dtype and activation, torch's argument
semantics (ceil_mode, count_include_pad, padding) on ordinary and awkward shapes, both layouts and kernels.

Without CUDA these run through Triton's interpreter (the same kernel code); the compiled path is checked by
the `gpu` tests on the lent GPU.
"""

from __future__ import annotations

import pytest
import torch

import kernels.pool as pool_mod
from kernels import ACTIVATIONS, reference
from kernels.pool import fused_pool2d
from tests.tolerances import RTOL, assert_close_to

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (N, C, H, W, kernel, stride, padding, ceil_mode): batch 1, primes, sizes off every tile edge, overlapping
# and gapped windows, uneven pairs, and ceil_mode edges: a partial last window that hangs past the padding
# (H=4, k3 s2 p1: the last window covers rows 3, 4 = padding and 5 = past it, so count_include_pad counts 2),
# and one that would start in the right padding, which torch drops (H=5, k2 s2 p1: 3 rows, not 4).
CASES = [
    (1, 1, 8, 8, 2, 2, 0, False),
    (2, 3, 7, 9, 3, 2, 1, True),
    (1, 5, 4, 4, 3, 2, 1, True),
    (3, 2, 5, 5, 2, 2, 1, True),
    (1, 1, 9, 11, 3, 1, 1, False),
    (1, 2, 11, 19, (2, 3), (3, 2), (1, 1), True),
    (1, 3, 17, 23, 8, 8, 0, True),
    (2, 1, 9, 31, (1, 4), (1, 4), (0, 2), False),
    (1, 2, 10, 37, (3, 2), (2, 4), (1, 0), True),
    (1, 1, 3, 3, 3, 3, 1, True),
    (5, 7, 1, 1, 1, 1, 0, False),
    # Windows past UNROLL_TAPS (64) elements, which loop at run time: a global pool over a prime-sized plane,
    # 66 rows of 2-wide non-overlapping windows (the rows kernel's contiguous path), padded overlapping 9x9 with a
    # ceil_mode window past the padding on both axes (11x8: 5x4 outputs, 15 rows, odd; 12x12's 5x5 cost 60% more).
    (2, 3, 13, 11, (13, 11), (13, 11), 0, False),
    ROWS_SPAN_LOOP := (1, 2, 70, 8, (66, 2), (2, 2), 0, False),
    (1, 3, 11, 8, 9, 3, 4, True),
]
# (layout, case) pairs of the awkward sweep: every case on both kernels, but ROWS_SPAN_LOOP on the rows kernel only.
# Its point is the rows kernel's contiguous span looping at run time (KH > 64); the channels kernel has no span path,
# and its run-time tap loop (KH * KW > 64) runs the same branch, with the same masks (padding 0, no ceil_mode, C
# short of BLOCK_C), on the global pool case before it: on the channels kernel it was 16 of the sweep's ~140 CPU-s.
LAYOUT_CASES = [(layout, case) for layout in ("rows", "channels") for case in CASES
                if not (layout == "channels" and case is ROWS_SPAN_LOOP)]  # fmt: skip


def _ids(case):
    return "-".join(str(v).replace(" ", "") for v in case)


def _check(shape, kind, k, s, p, ceil, dtype, activation, device, cip=True, slope=0.01, channels_last=False):
    x = torch.randn(*shape, device=device).to(dtype)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    want = reference.pool2d(
        x.double(), kind, k, s, p, ceil_mode=ceil, count_include_pad=cip, activation=activation, negative_slope=slope
    )
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    out = torch.full(want.shape, float("nan"), device=device, dtype=dtype).contiguous(memory_format=fmt)
    got = fused_pool2d(
        x, kind, k, s, p, ceil_mode=ceil, count_include_pad=cip, activation=activation, negative_slope=slope, out=out
    )
    assert got is out  # NaN left behind = an element not written (assert_close_to checks finiteness)
    assert_close_to(got, want, RTOL[dtype], f"{kind} {shape} k{k} s{s} p{p} ceil={ceil} cip={cip} {dtype} {activation}")
    return got


@pytest.fixture
def small_tile():
    with pool_mod.INTERPRETER.override(tile=pool_mod.SMALL_INTERPRETER_TILE):
        yield


@pytest.fixture
def untuned():
    """The first candidate, untimed: the window, kind and activation are compile-time, so a tuned call compiles
    every candidate; correctness sweeps take one, and the tuner's picks are checked by test_gpu_large."""
    from kernels import tuning

    tuning.set_enabled(False)
    yield
    tuning.set_enabled(None)
    pool_mod._configs.clear()  # the untimed picks, so that no later tuned test reuses them


@pytest.mark.parametrize("kind,cip", [("avg", True), ("avg", False), ("max", True)], ids=["avg", "avg-nocip", "max"])
@pytest.mark.parametrize(("layout", "case"), LAYOUT_CASES, ids=[f"{lay}-{_ids(c)}" for lay, c in LAYOUT_CASES])
def test_torch_semantics_on_awkward_shapes(small_tile, layout, case, kind, cip):
    """Both kernels on the same inputs (each takes any strides; on CUDA the memory format picks)."""
    N, C, H, W, k, s, p, ceil = case
    with pool_mod.INTERPRETER.override(layout=layout):
        _check((N, C, H, W), kind, k, s, p, ceil, torch.float32, "leaky_relu", DEVICE, cip=cip, slope=0.3)


# e4m3 output (out_scale: a float8 layer reads it): a max pool writes exactly the quantized max (quantizing is
# monotone), an average one the quantized average within one e4m3 step (fp32 sums in another order); both layouts,
# x in each dtype, a scale that saturates the largest values (|x| up to ~4 against 2.5 at 448).
E4M3_CASES = [CASES[1], CASES[2], CASES[5], CASES[8]]


@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize("layout", ["rows", "channels"])
@pytest.mark.parametrize("case", E4M3_CASES, ids=_ids)
def test_e4m3_output_is_the_quantized_pool(small_tile, case, layout, kind):
    from kernels.fp8 import E4M3
    from tests.test_kernels_fp8 import assert_e4m3_close

    N, C, H, W, k, s, p, ceil = case
    dtype = DTYPES[(CASES.index(case) + (kind == "avg")) % len(DTYPES)]
    x = torch.randn(N, C, H, W, device=DEVICE).to(dtype)
    scale = 2.5 / 448
    want = reference.pool2d(x.float(), kind, k, s, p, ceil_mode=ceil, activation="relu", out_scale=scale)
    out = torch.full(want.shape, float("nan"), device=DEVICE).to(E4M3)  # e4m3's NaN: an element not written stays
    with pool_mod.INTERPRETER.override(layout=layout):
        got = fused_pool2d(x, kind, k, s, p, ceil_mode=ceil, activation="relu", out=out, out_scale=scale)
    assert got is out and got.dtype == E4M3
    what = f"{kind} {case} {layout} {dtype}"
    if kind == "max":
        assert torch.equal(got.float(), want.float()), what
    else:
        assert_e4m3_close(got, want, what)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fused_pool2d(x, kind, k, s, p, ceil_mode=ceil, out=torch.empty_like(want, dtype=dtype), out_scale=scale)


# Every activation after each kind of pool, the dtypes taken in turn (each kind sees all three): the activation is the
# shared epilogue (kernels/activations.py, checked in every dtype by test_kernels_linear), the pool's dtype handling
# is its loads and stores. The full product (66 cases) took ~90 CPU-s under the interpreter for what these 22 check.
# One image: the dtype and the activation meet no index that depends on the batch (the awkward cases take N up to 5).
POOL_ACT_CASES = [(kind, DTYPES[(i + k) % len(DTYPES)], a) for k, kind in enumerate(("avg", "max"))
                  for i, a in enumerate(ACTIVATIONS)]  # fmt: skip


@pytest.mark.parametrize(("kind", "dtype", "activation"), POOL_ACT_CASES, ids=str)
def test_every_dtype_and_activation(small_tile, kind, dtype, activation):
    _check((1, 3, 7, 9), kind, 3, 2, 1, True, dtype, activation, DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "case", [(2, 3, 16, 16, 2, 2, 0, False), (1, 4, 24, 40, 8, 8, 0, False), (3, 5, 9, 14, 3, 1, 1, True)], ids=_ids
)
def test_serving_tile_both_layouts(case, dtype):
    """The tile the launcher picks by itself, on NCHW (row kernel) and channels_last (channel kernel) x."""
    N, C, H, W, k, s, p, ceil = case
    for kind in ("avg", "max"):
        for channels_last in (False, True):
            got = _check((N, C, H, W), kind, k, s, p, ceil, dtype, "relu", DEVICE, channels_last=channels_last)
            assert got.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def test_default_stride_is_the_kernel_size_and_ints_or_pairs_are_taken():
    x = torch.randn(2, 3, 12, 10, device=DEVICE)
    want = reference.pool2d(x.double(), "avg", (3, 2), activation="tanh")
    assert_close_to(fused_pool2d(x, "avg", (3, 2), activation="tanh"), want, RTOL[torch.float32], "default stride")
    want = reference.pool2d(x.double(), "max", 2, [1, 2], 1)
    assert_close_to(fused_pool2d(x, "max", 2, [1, 2], 1), want, RTOL[torch.float32], "int/list arguments")


def test_max_propagates_nan_as_torch_does():
    x = torch.randn(1, 2, 8, 8, device=DEVICE)
    x[0, 1, 3, 4] = float("nan")
    got = fused_pool2d(x, "max", 2, activation="sigmoid").cpu()  # (relu's tl.maximum drops NaN, unlike torch's)
    want = reference.pool2d(x.cpu().double(), "max", 2, activation="sigmoid")
    assert torch.equal(got.isnan(), want.isnan()) and int(got.isnan().sum()) == 1
    assert_close_to(got.nan_to_num(), want.nan_to_num(), RTOL[torch.float32], "NaN elsewhere")


def test_tiles_agree():
    """The small and the serving tile agree exactly: tiling changes no sum's order in pooling. (9x13: 3 planes of
    5x7 outputs, so the small tile's 2-row blocks straddle planes and its 4-column blocks the rows' ends; 19x21 took
    5 times the interpreter's time for no other path.)"""
    x = torch.randn(1, 3, 9, 13, device=DEVICE)
    big = fused_pool2d(x, "avg", 3, 2, 1, ceil_mode=True)
    with pool_mod.INTERPRETER.override(tile=pool_mod.SMALL_INTERPRETER_TILE):
        small = fused_pool2d(x, "avg", 3, 2, 1, ceil_mode=True)
    assert torch.equal(big, small)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("shape", [(2, 3, 7, 7), (3, 5, 1, 1), (2, 4, 5, 9)], ids=lambda s: "x".join(map(str, s)))
def test_global_average_pool_is_an_avg_pool_over_the_whole_plane(shape, channels_last):
    """ONNX's GlobalAveragePool (a ResNet's head, torch's adaptive_avg_pool2d(x, 1)): kernel_size (H, W), the
    stride the same, one window per plane: (N, C, 1, 1), the activation fused. A 1x1 plane comes back unchanged."""
    N, C, H, W = shape
    for dtype in DTYPES:
        got = _check(shape, "avg", (H, W), None, 0, False, dtype, "relu6", DEVICE, channels_last=channels_last)
        assert got.shape == (N, C, 1, 1)
    x = torch.randn(*shape, device=DEVICE)
    x = x.to(memory_format=torch.channels_last) if channels_last else x
    got = fused_pool2d(x, "avg", (H, W))
    assert_close_to(got, torch.nn.functional.adaptive_avg_pool2d(x.double(), 1), RTOL[torch.float32], "global mean")
    if H == W == 1:
        assert torch.equal(got, x)


def test_output_size_matches_torch():
    for size in range(1, 10):
        for k in range(1, 5):
            for s in range(1, 4):
                for p in range(0, k // 2 + 1):
                    for ceil in (False, True):
                        got = pool_mod.pool_output_size(size, k, s, p, ceil)
                        if size + 2 * p < k:
                            continue
                        want = torch.nn.functional.avg_pool2d(torch.zeros(1, 1, 1, size), (1, k), (1, s), (0, p),
                                                              ceil_mode=ceil).shape[-1]  # fmt: skip
                        assert got == want, (size, k, s, p, ceil)


BAD_INPUTS = [
    (lambda x: (x[0], "avg", 2), {}, "x must be 4-D"),
    (lambda x: (x, "sum", 2), {}, "unknown pooling kind 'sum'"),
    (lambda x: (x.double(), "avg", 2), {}, "float64"),
    (lambda x: (x, "avg", 2, 1, 2), {}, "padding .* at most half"),
    (lambda x: (x, "avg", 0), {}, "kernel_size and stride must be >= 1"),
    (lambda x: (x, "max", (2, 2, 2)), {}, "kernel_size must be an int or a pair"),
    (lambda x: (x, "avg", 9), {}, "is empty"),
    (lambda x: (x, "avg", 2), {"activation": "swish"}, "unknown activation 'swish'"),
    (lambda x: (x, "avg", 2), {"out": torch.empty(1)}, r"out must be a \(2, 3, 4, 4\)"),
]


@pytest.mark.parametrize("make,kwargs,message", BAD_INPUTS, ids=[m for _, _, m in BAD_INPUTS])
def test_bad_inputs_are_named(make, kwargs, message):
    x = torch.randn(2, 3, 8, 8, device=DEVICE)
    if "out" in kwargs:
        kwargs = {"out": kwargs["out"].to(DEVICE)}
    with pytest.raises((ValueError, TypeError), match=message):
        fused_pool2d(*make(x), **kwargs)


# ---- compiled path, on the lent GPU ----


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["avg", "max"])
def test_gpu_every_dtype_and_activation(untuned, kind, dtype, activation):
    for case in (CASES[1], CASES[6]):
        N, C, H, W, k, s, p, ceil = case
        _check((N, C, H, W), kind, k, s, p, ceil, dtype, activation, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("cip", [True, False], ids=["cip", "nocip"])
@pytest.mark.parametrize("kind", ["avg", "max"])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_gpu_torch_semantics(untuned, case, kind, cip, channels_last):
    N, C, H, W, k, s, p, ceil = case
    _check((N, C, H, W), kind, k, s, p, ceil, torch.float16, "relu", "cuda", cip=cip, channels_last=channels_last)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize(
    "shape,k", [((1, 1, 4096, 4096), 2), ((1, 1, 4096, 4096), 8), ((4, 3, 1000, 1030), 2)], ids=str
)
def test_gpu_large(shape, k, dtype):
    """The bench's sizes (and an odd one) through the tuner: avg (the bench's) on NCHW and channels_last, max
    on NCHW. (Every candidate is compiled for its window, kind, dtype and layout: a few seconds each time.)"""
    _check(shape, "avg", k, k, 0, True, dtype, "relu", "cuda")
    _check(shape, "avg", k, k, 0, True, dtype, "relu", "cuda", channels_last=True)
    _check(shape, "max", k, k, 0, True, dtype, "relu", "cuda")


@pytest.mark.gpu
@pytest.mark.timeout(900)  # 45 configs compiled; with 12 workers on the H100 it failed about 300 s in (cut log)
def test_gpu_every_candidate(monkeypatch):
    """Each config the tuner may pick, forced, on both kernels and on windows with and without the
    contiguous-span path."""
    for layout, channels_last in (("rows", False), ("channels", True)):
        for k, s in ((2, 2), (3, 2), (8, 8)):
            x = torch.randn(3, 5, 67, 133, device="cuda", dtype=torch.float16)
            count, inner = (3 * 5 * pool_mod.pool_output_size(67, k, s, 0, True), 133) if layout == "rows" else (
                3 * 34 * 67, 5)  # fmt: skip
            for config in pool_mod.cuda_configs(layout, count, inner, s, k <= s):
                monkeypatch.setattr(pool_mod, "tune", lambda *a, config=config, **kw: config)
                pool_mod._configs.clear()
                _check(tuple(x.shape), "avg", k, s, 0, True, torch.float16, "silu", "cuda", channels_last=channels_last)
    pool_mod._configs.clear()


@pytest.mark.gpu
def test_gpu_graph_capture():
    """The launcher is capturable: after a warm-up (which tunes) a CUDA graph replays it on new inputs."""
    from kernels.graph_capture import capture

    x = torch.randn(8, 16, 32, 32, device="cuda", dtype=torch.float16)
    graph, y = capture(lambda: fused_pool2d(x, "max", 2, activation="relu"), warmups=2)
    x.copy_(torch.randn_like(x))
    y.fill_(float("nan"))
    graph.replay()
    assert_close_to(y, reference.pool2d(x.double(), "max", 2, activation="relu"), RTOL[torch.float16], "graph")


# ---- compiled for Hopper here, without a GPU (tests/sm90_compile.py) ----

_COMPILE_POOL = r"""
import json, sys
import kernels.pool as pool
from tests.sm90_compile import compile_sm90, sample

ptr = sys.argv[1]
runtime = dict(x_ptr=ptr, y_ptr=ptr, R="i32", C="i32", H="i32", W="i32", OH="i32", OW="i32", stride_xn="i32",
               stride_xc="i32", stride_xh="i32", stride_yn="i32", stride_yc="i32", stride_yh="i32")
runtime["negative_slope"] = runtime["y_inv_scale"] = "fp32"
# the third window also writes e4m3 (Y_FP8: the max pool before a float8 layer)
for i, (k, s, y_fp8) in enumerate([(2, 2, False), (8, 8, False), (3, 2, False), (3, 2, True)]):
    span = k <= s
    for cfg in sample(pool.cuda_configs("rows", 4096, 4096 // s, s, span), i):
        meta = dict(stride_xw=1, stride_yw=1, IS_MAX=y_fp8, KH=k, KW=k, SH=s, SW=s, PH=0, PW=0,
                    COUNT_INCLUDE_PAD=True, SPAN=span, ACTIVATION="relu", ROUND_BF16=False, Y_FP8=y_fp8,
                    ROUND_FP8=False, PDL=True, **dict(cfg.kwargs))
        divisible = ("W", "OW", "stride_xn", "stride_yn", "stride_xh", "stride_yh", "stride_xc", "stride_yc")
        types = {**runtime, "y_ptr": "*fp8e4nv"} if y_fp8 else runtime
        ptx, usage = compile_sm90(pool._pool_rows_kernel, types, meta, 2, cfg.num_warps, 1, divisible)
        print(json.dumps({"k": k, "span": span, "y_fp8": y_fp8, "config": cfg.meta(), "STACK": usage["STACK"],
                          "ld_v4": "ld.global.v4" in ptx, "scalar_ld": ptx.count("ld.global.b"),
                          "waits": ptx.count("griddepcontrol.wait"), "e4m3_cvt": "e4m3" in ptx}))
"""


@pytest.mark.parametrize("ptr", ["*fp32", "*fp16"])
def test_pool_candidates_compile_for_sm90(ptr):
    """Every row-kernel candidate (a sample of them without a GPU: tests/sm90_compile.py) compiles for sm_90.
    Non-overlapping windows (k2 s2, k8 s8) over rows that are multiples of 16 load only vectors (16 bytes, or 8
    where a tile has fewer elements than 8 per thread) and never spill. (Overlapping windows, a scalar load per
    window element, spill 0-56 bytes at some tiles with Triton 3.9's ptxas: left to the tuner.)"""
    from tests.sm90_compile import every_candidate
    from tests.test_kernels_compile import _compiled

    results = _compiled(_COMPILE_POOL, ptr)
    assert len(results) > (10 if every_candidate() else 4), results
    assert any(r["y_fp8"] for r in results), results
    for r in results:
        assert r["waits"] == 1, r
        assert r["e4m3_cvt"] == r["y_fp8"], f"the e4m3 store (a cvt to e4m3) where y is e4m3, and only there: {r}"
        if r["span"]:
            assert r["STACK"] == 0 and r["scalar_ld"] == 0, f"spilled or not vectorized: {r}"
    four_warps = [r for r in results if r["span"] and r["config"]["num_warps"] == 4]
    assert four_warps and all(r["ld_v4"] for r in four_warps), results
