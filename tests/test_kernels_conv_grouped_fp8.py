"""kernels/conv_grouped_fp8.py (float8 grouped and depthwise convs) against the torch reference (kernels/reference.py's
conv2d_fp8 with groups: the same e4m3 operands, dequantized and multiplied in fp32, then one rounding), under the
interpreter on the CPU.

Shapes: depthwise 3x3 at stride 1 and 2, 5x5, 7x7 (its window rows looped at run time), channel multipliers 2 and 3,
an uneven window with dilation; groups of 2, 4, 8, 32 and 64 channels, groups straddling a tile, 'same' and no
padding; batch 1 and prime batches, prime channel counts and spatial sizes off every block edge. x e4m3, or fp16/fp32
quantized as it is loaded; y e4m3 (out_scale), fp16 or fp32; residual e4m3 (with residual_scale), fp16, fp32 or none;
every activation; x and y NCHW or channels_last. Each output starts as NaN, so an element left unwritten fails.

Tolerances as tests/test_kernels_fp8.py's (the products are exact in fp32 on both sides; only the order of the fp32 sums
differs): e4m3 outputs within one e4m3 step, on at most 1% of the elements; fp16 outputs RTOL[fp16], fp32 outputs
RTOL[fp32] (1e-5, anchored to rms). On a GPU the grouped GEMM's sums run on Hopper's fp8 MMA, which keeps fewer bits
than fp32 while it sums: tests/tolerances.py's assert_close_on_hopper there (the direct path's fp32 FMAs keep the
interpreter's bounds).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels.conv_grouped_fp8 as gfp8
from kernels import ACTIVATIONS, reference
from kernels.conv import conv_output_size
from kernels.conv_grouped_fp8 import fused_conv2d_grouped_fp8
from kernels.fp8 import E4M3, dequant_scale, quantize, quantize_weight, scale_of
from tests.test_kernels_fp8 import _unwritten, assert_e4m3_close
from tests.tolerances import FP8_MMA_ROUNDING, RTOL, abs_e4m3, assert_close_on_hopper, assert_close_to

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NCHW, NHWC = torch.contiguous_format, torch.channels_last
FP16, FP32 = torch.float16, torch.float32

# (N, C, H, W, OC, groups, kernel, stride, padding, dilation)
DEPTHWISE = [
    (1, 1, 7, 6, 1, 1, 3, 1, 1, 1),  # one channel, batch 1
    (3, 13, 7, 5, 13, 13, 3, 1, 1, 1),  # 3x3 'same', a prime batch, channel count and width
    (2, 7, 9, 8, 7, 7, 3, 2, 1, 1),  # 3x3 stride 2 (MobileNetV2's downsampling)
    (1, 19, 5, 7, 19, 19, 5, 1, 2, 1),  # 5x5 'same' (EfficientNet's), 19 channels: off every channel block's edge
    (1, 3, 7, 6, 3, 3, 7, 1, 3, 1),  # 7x7 'same': 49 taps, the window rows looped at run time
    (2, 3, 7, 7, 6, 3, 3, 2, 1, 1),  # channel multiplier 2
    (1, 4, 6, 7, 12, 4, (3, 5), (1, 2), (1, 2), (2, 1)),  # multiplier 3, uneven window, stride and dilation
]
GROUPED = [
    (2, 6, 5, 5, 6, 3, 3, 1, 1, 1),  # 2 channels a group: 8 groups a 16-wide tile in one 32-deep K step
    (3, 12, 6, 5, 12, 3, 3, 2, 1, 1),  # 4 a group (ResNeXt 32x4d's width), stride 2
    (1, 24, 5, 5, 24, 3, 3, 1, 1, 1),  # 8 a group
    (2, 20, 3, 5, 30, 5, 3, 1, 1, 1),  # 4 in, 6 out a group: groups that straddle the 16-wide tile
    (1, 64, 4, 5, 64, 2, 3, 1, 1, 1),  # 32 a group: one fp8 K step a tap
    (1, 128, 3, 3, 128, 2, 1, 1, 0, 1),  # 64 a group, 1x1: two K steps, four column tiles a group
    (1, 16, 6, 6, 32, 4, (2, 3), 2, (0, 1), (2, 1)),  # 4 in, 8 out, uneven window, dilation
]
CASES = DEPTHWISE + GROUPED

# (x dtype, y dtype, residual dtype, activation), taken in turn by the cases: every pairing of x and y dtypes, every
# residual dtype, and activations with either sign.
VARIANTS = [
    (E4M3, E4M3, None, "relu"),
    (FP16, E4M3, E4M3, "leaky_relu"),
    (E4M3, FP16, FP16, "silu"),
    (FP32, FP32, None, "hardswish"),
    (E4M3, FP32, FP32, "none"),
    (FP16, FP16, E4M3, "relu6"),
    (FP32, E4M3, FP16, "gelu_tanh"),
]


def _ids(case):
    return "-".join(str(v).replace(" ", "") for v in case)


def _out_shape(case) -> tuple[int, ...]:
    N, C, H, W, OC, G, *geometry = case
    k, s, p, d = (v if isinstance(v, tuple) else (v, v) for v in geometry)
    return (N, OC, *(conv_output_size(n, k[i], s[i], p[i], d[i]) for i, n in enumerate((H, W))))


def _inputs(case, x_dtype, x_format, bias=True):
    """x as the kernel takes it (e4m3 quantized with its scale, or fp16/fp32), its scale, the e4m3 weight, the
    dequantizing scale and the fp32 bias. Scaled so that outputs are O(1) whatever C / G * KH * KW is."""
    N, C, H, W, OC, G, k, *_ = case
    kh, kw = k if isinstance(k, tuple) else (k, k)
    x = torch.randn(N, C, H, W, device=DEVICE)
    w = torch.randn(OC, C // G, kh, kw, device=DEVICE) / (C // G * kh * kw) ** 0.5
    b = torch.randn(OC, device=DEVICE) if bias else None
    xs = scale_of(x.abs().max())
    x_in = (quantize(x, xs) if x_dtype == E4M3 else x.to(x_dtype)).contiguous(memory_format=x_format)
    wq, ws = quantize_weight(w)
    return x_in, xs, wq, dequant_scale(xs, ws), b


def _residual(shape, dtype, fmt):
    """A fresh residual of the output's shape: e4m3 with its scale, or fp16/fp32 (scale 1); (None, 1.0) for None."""
    if dtype is None:
        return None, 1.0
    r = torch.randn(shape, device=DEVICE)
    rs = scale_of(r.abs().max()) if dtype == E4M3 else 1.0
    return (quantize(r, rs) if dtype == E4M3 else r.to(dtype)).contiguous(memory_format=fmt), rs


def _compare(got, want, what, *, mma=None):
    """got against the reference by its dtype (module docstring). mma: on a GPU, for the grouped GEMM, (the e4m3 x the
    kernel multiplied, weight, scale, geometry, out_scale, K): the slack of Hopper's fp8 MMA sums."""
    if mma is not None and DEVICE == "cuda":
        xq, wq, scale, geometry, out_scale, K = mma
        magnitude = reference.conv2d_fp8(abs_e4m3(xq), abs_e4m3(wq), scale, **geometry, out_dtype=FP32)
        magnitude = magnitude / (out_scale or 1.0)
        if got.dtype != FP32:
            return assert_close_on_hopper(got, want, magnitude, K, what)
        anchor = max(K / 32, 1.0) * FP8_MMA_ROUNDING * magnitude / RTOL[FP32]  # the slack, as rtol * anchor
        return assert_close_to(got, want, RTOL[FP32], what, anchor=anchor)
    if got.dtype == E4M3:
        return assert_e4m3_close(got, want, what)
    return assert_close_to(got, want, RTOL[got.dtype], what)


def _check(case, x_dtype, y_dtype, residual, activation, *, x_format, y_format=None, r_format=None, bias=True,
           slope=0.2):  # fmt: skip
    """fused_conv2d_grouped_fp8 on a fresh draw against reference.conv2d_fp8, into a NaN-filled `out` in y_format
    (None: x's), with a residual of `residual`'s dtype (None: none) in r_format (None: y's)."""
    x_in, xs, wq, scale, b = _inputs(case, x_dtype, x_format, bias)
    G, k, s, p, d = case[5:]
    shape = _out_shape(case)
    y_format = y_format or x_format
    r, rs = _residual(shape, residual, r_format or y_format)
    out_scale = 4.0 / 448 if y_dtype == E4M3 else None  # outputs of O(1): 4 is well above their max
    geometry = dict(stride=s, padding=p, dilation=d, groups=G)
    kw = dict(**geometry, negative_slope=slope, x_scale=xs, residual=r, residual_scale=rs, out_scale=out_scale)
    want = reference.conv2d_fp8(x_in, wq, scale, b, activation, **kw, out_dtype=y_dtype if out_scale is None else FP16)
    out = _unwritten(shape, y_dtype, y_format)
    got = fused_conv2d_grouped_fp8(x_in, wq, scale, b, activation, **kw, out_dtype=y_dtype, out=out)
    assert got is out
    what = f"{case} x={x_dtype} y={y_dtype} residual={residual} {activation} bias={bias} x={x_format} y={y_format}"
    xq = x_in if x_dtype == E4M3 else quantize(x_in, xs)
    K = case[1] // G * wq.shape[2] * wq.shape[3]
    _compare(got, want, what, mma=(xq, wq, scale, geometry, out_scale, K) if case[1] != G else None)


@pytest.fixture
def small_tiles():
    """The tests' small tiles: awkward shapes cross every block edge (channels, pixels, groups, K steps)."""
    with gfp8.INTERPRETER.override(direct_tile=gfp8.SMALL_DIRECT_TILE, gemm_tile=gfp8.SMALL_GEMM_TILE):
        yield


# Each case in both layouts, the variants in turn; every third case without a bias.
EVERY_CASE = [(i, case, fmt) for i, case in enumerate(CASES) for fmt in (NCHW, NHWC)]


@pytest.mark.parametrize(
    "i,case,x_format", EVERY_CASE, ids=[f"{_ids(c)}-{'nhwc' if f == NHWC else 'nchw'}" for _, c, f in EVERY_CASE]
)
def test_every_case_both_layouts(small_tiles, i, case, x_format):
    variant = VARIANTS[(2 * i + (x_format == NHWC)) % len(VARIANTS)]
    _check(case, *variant, x_format=x_format, bias=i % 3 != 2)


@pytest.mark.parametrize("i,activation", list(enumerate(ACTIVATIONS)), ids=ACTIVATIONS)
def test_every_activation(i, activation):
    """One epilogue serves both paths, so each activation runs on one of them in turn, on the launcher's own tiles:
    depthwise 3x3 (NHWC, e4m3 in and out) or 4-channel groups that straddle a tile (NCHW, fp16 in and out, an e4m3
    residual)."""
    if i % 2 == 0:
        _check(DEPTHWISE[1], E4M3, E4M3, None, activation, x_format=NHWC)
    else:
        _check(GROUPED[3], FP16, FP16, E4M3, activation, x_format=NCHW)


@pytest.mark.parametrize("case", [DEPTHWISE[5], GROUPED[1]], ids=_ids)
def test_residual_and_output_in_other_layouts(case):
    """x NHWC into an NCHW y with an NHWC residual (copied into y's layout first), and the reverse."""
    _check(case, E4M3, E4M3, E4M3, "relu", x_format=NHWC, y_format=NCHW, r_format=NHWC)
    _check(case, FP16, FP16, FP16, "silu", x_format=NCHW, y_format=NHWC, r_format=NCHW)


def test_memory_format_argument():
    """memory_format: the returned tensor's layout; None: channels_last, whatever x's (conv_fp8's rule)."""
    case = DEPTHWISE[1]
    x_in, xs, wq, scale, b = _inputs(case, E4M3, NCHW)
    y = fused_conv2d_grouped_fp8(x_in, wq, scale, b, padding=1, groups=13, out_scale=1.0)
    assert y.dtype == E4M3 and y.is_contiguous(memory_format=NHWC) and not y.is_contiguous()
    y = fused_conv2d_grouped_fp8(x_in, wq, scale, b, padding=1, groups=13, memory_format=NCHW, out_dtype=FP32)
    assert y.dtype == FP32 and y.is_contiguous()


def test_prepared_weight_is_kept_and_any_layout_gives_the_same_result():
    """prepare_weight: depthwise with the output channels contiguous ((KH, KW, OC) in memory), groups channels_last,
    each returned as it is once prepared; the launcher takes torch's layout too, with the same result."""
    dw = torch.randn(6, 1, 3, 5).to(E4M3)
    prepared = gfp8.prepare_weight(dw)
    assert prepared.stride() == (1, 6, 30, 6) and torch.equal(prepared.float(), dw.float())
    assert gfp8.prepare_weight(prepared) is prepared
    grouped = gfp8.prepare_weight(torch.randn(8, 4, 3, 3).to(E4M3))
    assert grouped.is_contiguous(memory_format=NHWC) and gfp8.prepare_weight(grouped) is grouped
    for case in (DEPTHWISE[5], GROUPED[2]):
        x_in, xs, wq, scale, b = _inputs(case, E4M3, NHWC)
        kw = dict(stride=case[7], padding=case[8], groups=case[5], out_dtype=FP32)
        got = [fused_conv2d_grouped_fp8(x_in, w, scale, b, "relu", **kw) for w in (wq, gfp8.prepare_weight(wq))]
        assert torch.equal(got[0], got[1]), case


@pytest.mark.skipif(DEVICE != "cpu", reason="chooses the interpreter's paths and tiles")
def test_paths_and_tiles_agree():
    """Depthwise through the direct path and the grouped GEMM (which computes it too: one channel a group), and groups
    of 8 on small and default tiles: the same fp32 result up to the order of the sums."""
    for case, runs in ((DEPTHWISE[1], ({"path": "direct"}, {"path": "gemm"})),
                       (GROUPED[2], ({}, {"gemm_tile": gfp8.SMALL_GEMM_TILE}))):  # fmt: skip
        x_in, xs, wq, scale, b = _inputs(case, E4M3, NHWC)
        results = []
        for choice in runs:
            with gfp8.INTERPRETER.override(**choice):
                results.append(fused_conv2d_grouped_fp8(x_in, wq, scale, b, "silu", padding=1, groups=case[5],
                                                        out_dtype=FP32))  # fmt: skip
        assert_close_to(results[1], results[0].double(), RTOL[FP32], f"{case} {runs}")


def test_close_to_float64_of_unquantized_inputs():
    """The whole float8 path (fp16 x quantized as loaded, the e4m3 weight, an fp16 output) against float64 on the
    inputs as they were: normwise error under 6%, as tests/test_kernels_fp8.py's conv (each operand off by at most
    half an e4m3 step, 2**-4, ~2**-5.5 / sqrt 3 on average: ~3% summed with random signs)."""
    case = (2, 32, 6, 6, 32, 8, 3, 1, 1, 1)
    x = torch.randn(2, 32, 6, 6, device=DEVICE)
    w = torch.randn(32, 4, 3, 3, device=DEVICE) / 6
    b = torch.randn(32, device=DEVICE)
    xs = scale_of(x.abs().max())
    wq, ws = quantize_weight(w)
    got = fused_conv2d_grouped_fp8(x.half(), wq, dequant_scale(xs, ws), b, padding=1, groups=case[5], x_scale=xs)
    want = F.conv2d(x.double(), w.double(), b.double(), padding=1, groups=case[5])
    err = ((got.double() - want).norm() / want.norm()).item()
    assert err < 0.06, err


def test_empty_batch_returns_empty():
    x_in, xs, wq, scale, b = _inputs(DEPTHWISE[1], E4M3, NHWC)
    assert fused_conv2d_grouped_fp8(x_in[:0], wq, scale, b, padding=1, groups=13).shape == (0, 13, 7, 5)


def _bad(**change):
    """Arguments for groups of 2 over x (2, 4, 6, 6) e4m3 and weight (8, 2, 3, 3), with `change` applied: a
    callable value is applied to the good one."""
    x_in, xs, wq, scale, b = _inputs((2, 4, 6, 6, 8, 2, 3, 1, 1, 1), E4M3, NHWC)
    args = dict(x=x_in, weight=wq, scale=scale, bias=b, groups=2, padding=1)
    for key, value in change.items():
        args[key] = value(args[key]) if callable(value) else value
    return args


BAD_INPUTS = [
    ({"x": lambda x: x[0]}, ValueError, "x and weight must be 4-D"),
    ({"groups": 3}, ValueError, "groups=3 must divide x's C=4 and weight's OC=8"),
    ({"groups": 0}, ValueError, "groups must be an int >= 1"),
    ({"groups": 2.0}, ValueError, "groups must be an int >= 1"),
    ({"groups": 1}, ValueError, r"weight \(OC, C / groups, KH, KW\) has 2 input channels a group; x's C=4 in 1 groups"),
    ({"weight": lambda w: w.half()}, TypeError, "weight is torch.float16; fused_conv2d_grouped_fp8 takes float8_e4m3"),
    ({"x": lambda x: x.to(torch.bfloat16)}, TypeError, "x is torch.bfloat16; fused_conv2d_grouped_fp8 takes"),
    ({"out_dtype": torch.bfloat16}, TypeError, "out_dtype is torch.bfloat16"),
    ({"scale": lambda s: s[:-1]}, ValueError, r"scale must be a float32 tensor of shape \(8,\)"),
    ({"scale": lambda s: s.double()}, ValueError, "scale must be a float32 tensor"),
    ({"bias": lambda b: b[:-1]}, ValueError, r"bias must be a contiguous float32 tensor of shape \(8,\)"),
    ({"bias": lambda b: b.half()}, ValueError, "bias must be a contiguous float32 tensor"),
    ({"stride": 0}, ValueError, "stride and dilation must be >= 1"),
    ({"padding": (1, 2, 3)}, ValueError, "padding must be an int or a pair"),
    ({"dilation": 4}, ValueError, "conv output is empty"),
    ({"activation": "swish"}, ValueError, "unknown activation 'swish'"),
    ({"residual": torch.zeros(2, 8, 4, 4)}, ValueError, "residual must have the output's shape"),
    ({"residual": torch.zeros(2, 8, 6, 6, dtype=torch.bfloat16)}, TypeError, "residual is torch.bfloat16"),
    ({"out": torch.zeros(2, 8, 6, 6)}, ValueError, r"out must be a \(2, 8, 6, 6\) torch.float16 tensor"),
]


@pytest.mark.parametrize("change,error,message", BAD_INPUTS, ids=[m for _, _, m in BAD_INPUTS])
def test_bad_inputs_are_named(change, error, message):
    change = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in change.items()}
    with pytest.raises(error, match=message):
        fused_conv2d_grouped_fp8(**_bad(**change))


def test_residual_sharing_out_is_refused():
    args = _bad(out_dtype=FP32)
    out = torch.zeros(2, 8, 6, 6, device=DEVICE).contiguous(memory_format=NHWC)
    with pytest.raises(ValueError, match="residual shares memory with out"):
        fused_conv2d_grouped_fp8(**args, out=out, residual=out)


def test_candidates():
    """Depthwise: the direct path only, 32-128 e4m3 channels a program channels_last (the bytes of fp16's 16-64) and
    conv_grouped's NCHW tiles; groups: the GEMM only, every K step at least the fp8 dot's 32 and no deeper than the
    tile's K a tap needs beyond that; no list repeats a config."""
    dw = gfp8.cuda_configs(256 * 56 * 56, 144, 1, 1, True)
    assert {c["BLOCK_N"] for c in dw} == {32, 64, 128} and all(c["DIRECT"] == 1 for c in dw)
    assert all(1024 <= c["BLOCK_M"] * c["BLOCK_N"] <= 4096 for c in dw)  # conv_grouped's outputs a program
    assert {c["BLOCK_N"] for c in gfp8.cuda_configs(64, 24, 1, 1, True)} == {32}  # 24 channels: one 32-wide block
    nchw = gfp8.cuda_configs(64, 96, 1, 2, False)
    assert all(c["DIRECT"] == 1 and c["BLOCK_N"] <= 16 for c in nchw)
    resnext = gfp8.cuda_configs(32 * 56 * 56, 128, 4, 4, True)  # 4 a group: 16 (32) wide tiles hold 4 (8) groups
    pairs = gfp8.cuda_configs(64, 64, 2, 2, True)  # 2 a group: a 16-wide tile's K is 16, half a step
    wide = gfp8.cuda_configs(16, 1024, 64, 64, False)  # 64 a group
    for configs in (dw, nchw, resnext, pairs, wide):
        assert configs and len(set(configs)) == len(configs)
    for configs in (resnext, pairs, wide):
        assert all(c["DIRECT"] == 0 and c["BLOCK_K"] >= gfp8.FP8_DOT_MIN_K for c in configs)
    assert {(c["BLOCK_N"], c["BLOCK_K"]) for c in resnext} == {(16, 32), (32, 32)}
    assert {c["BLOCK_K"] for c in pairs} == {32} and {c["BLOCK_K"] for c in wide} == {64}  # a tap's K: 64
    assert max(c["BLOCK_M"] for c in wide) == 64  # 16 rows: no 128-row tile


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's choice")
def test_default_interpreter_choice_and_direct_path_for_depthwise_only():
    assert gfp8.INTERPRETER.choice == gfp8.InterpreterChoice()  # no test left an override behind
    with gfp8.INTERPRETER.override(path="direct"), pytest.raises(ValueError, match="'direct' \\(depthwise only\\)"):
        fused_conv2d_grouped_fp8(**_bad())


# ---- compiled for Hopper here, without a GPU (tests/sm90_compile.py) ----

_COMPILE_GROUPED_FP8 = r"""
import json
import torch
import kernels.conv_grouped_fp8 as g
from kernels.tiles import channels_last_alignment, pow2_alignment
from tests.sm90_compile import compile_sm90, every_candidate, pdl_order

STRIDES = [f"stride_{t}{d}" for t in "xwy" for d in ("nchw" if t != "w" else "ochw")]
# At 256 images: MobileNetV2's depthwise 3x3 at 56 (e4m3 in and out) and its 3x3/2 at 28 on NCHW x and y, EfficientNet's
# 5x5 from fp16 (an x the kernel quantizes), ResNeXt's 4-channel groups. (C, H, groups, k, s, x, y, channels_last)
layers = [(144, 56, 144, 3, 1, "fp8e4nv", "fp8e4nv", True), (192, 28, 192, 3, 2, "fp8e4nv", "fp16", False),
          (240, 28, 240, 5, 1, "fp16", "fp8e4nv", True), (128, 28, 32, 3, 1, "fp8e4nv", "fp8e4nv", True)]
for C, H, G, k, s, x, y, nhwc in layers:
    CG, OH = C // G, (H - 1) // s + 1
    fmt = torch.channels_last if nhwc else torch.contiguous_format
    xt = torch.empty(256, C, H, H, device="meta").contiguous(memory_format=fmt)
    yt = torch.empty(256, C, OH, OH, device="meta").contiguous(memory_format=fmt)
    wt = g.prepare_weight(torch.empty(C, CG, k, k, device="meta"))
    strides = dict(zip(STRIDES, (*xt.stride(), *wt.stride(), *yt.stride())))
    unit = {n: 1 for n, v in strides.items() if v == 1}  # constants, as Triton specializes a stride of 1
    runtime = dict(x_ptr="*" + x, w_ptr="*fp8e4nv", s_ptr="*fp32", b_ptr="*fp32", y_ptr="*" + y, r_ptr="*" + y,
                   NB="i32", x_inv_scale="fp32", r_scale="fp32", y_inv_scale="fp32", negative_slope="fp32",
                   **{n: "i32" for n in strides if n not in unit})
    meta = dict(G=G, CG=CG, OCG=CG, H=H, W=H, OH=OH, OW=OH, KH=k, KW=k, SH=s, SW=s, PH=k // 2, PW=k // 2, DH=1, DW=1,
                HAS_BIAS=True, HAS_RESIDUAL=True, ACTIVATION="relu6", PDL=True, QUANT_X=x != "fp8e4nv",
                R_FP8=y == "fp8e4nv", Y_FP8=y == "fp8e4nv", ROUND_FP8=False, CHANNELS_LAST=nhwc, Y_PLANES=not nhwc,
                X_ALIGN=channels_last_alignment(xt), Y_ALIGN=channels_last_alignment(yt),
                W_ALIGN=pow2_alignment(*wt.stride()[2:]) if CG == 1 else channels_last_alignment(wt), **unit)
    divisible = [n for n, v in strides.items() if v != 1 and v % 16 == 0]
    configs = g.cuda_configs(g.m_bucket(256 * OH * OH), C, CG, CG, nhwc)
    # Without a GPU two a layer: the untimed pick and the one with the most fp32 accumulators a thread (the likeliest
    # to spill); a GPU host compiles all
    heaviest = max(configs, key=lambda c: c["BLOCK_M"] * c["BLOCK_N"] / c.num_warps)
    for cfg in configs if every_candidate() else dict.fromkeys([configs[0], heaviest]):
        ptx, usage = compile_sm90(g._conv2d_grouped_fp8_kernel, runtime, {**meta, **dict(cfg.kwargs)}, 6,
                                  cfg.num_warps, cfg.num_stages, divisible=divisible)
        print(json.dumps({"layer": [C, H, G, k, s, x, y, nhwc], "config": cfg.meta(),
                          "byte_loads": ptx.count("ld.global.b8"), "vector_loads": ptx.count("ld.global.v"),
                          "wgmma_e4m3": ptx.count(".e4m3.e4m3"), **pdl_order(ptx), **usage}))
"""


def test_grouped_fp8_conv_compiles_for_sm90_without_spills():
    """The candidates offered compile (all of them on a GPU host, two a layer without a GPU): the GEMM into e4m3
    warpgroup MMAs, the direct path's channels_last taps in vector loads of x and weight alike (a tap's loads in the
    code: all 9 of a 3x3 unrolled, a 5x5's row of 5 in a loop), no spills, the scales and bias requested before the
    PDL wait and nothing written before it."""
    from tests.sm90_compile import every_candidate
    from tests.test_kernels_compile import _compiled

    results = _compiled(_COMPILE_GROUPED_FP8, "")
    assert len({tuple(r["layer"]) for r in results}) == 4 and len(results) >= (30 if every_candidate() else 7)
    for got in results:
        C, H, G, k, s, x, y, nhwc = got["layer"]
        taps = k * k if k * k <= gfp8.UNROLL else k
        if C != G:
            assert got["wgmma_e4m3"] > 0, got
        elif nhwc:  # a thread's channels of a tap in one load; byte loads only where a thread holds one channel
            assert got["vector_loads"] >= taps and got["byte_loads"] <= taps, got
        assert got["STACK"] == 0 and got["LOCAL"] == 0, f"registers spill to local memory: {got}"
        assert got["waits"] == 1 and got["launches"] == 1, got
        assert got["first_load"] < got["wait_at"] < got["first_store"], got


# ---- compiled, on the lent GPU ----


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(4, 96, 28, 28, 96, 96, 3, 2, 1, 1), (2, 128, 14, 14, 128, 32, 3, 1, 1, 1),
                                  DEPTHWISE[6], GROUPED[3], GROUPED[5]], ids=_ids)  # fmt: skip
def test_gpu_every_candidate(monkeypatch, case):
    """Each config the tuner may pick, forced, on depthwise and grouped layers in both layouts, e4m3 and fp16 in and
    out with a residual."""
    N, C, H, W, OC, G = case[:6]
    M = N * _out_shape(case)[2] * _out_shape(case)[3]
    for x_format in (NCHW, NHWC):
        for config in gfp8.cuda_configs(gfp8.m_bucket(M), OC, C // G, OC // G, x_format == NHWC):
            monkeypatch.setattr(gfp8, "tune", lambda *a, config=config, **kw: config)
            gfp8._configs.clear()
            _check(case, E4M3, E4M3, E4M3, "relu", x_format=x_format)
            _check(case, FP16, FP16, FP16, "silu", x_format=x_format)
    gfp8._configs.clear()


# MobileNetV2's depthwise 3x3 layers (channels, input size, stride) at batch 2
MOBILENET_V2 = [(96, 112, 2), (144, 56, 1), (144, 56, 2), (192, 28, 1), (192, 28, 2), (384, 14, 1), (576, 14, 1),
                (576, 14, 2), (960, 7, 1)]  # fmt: skip


@pytest.mark.gpu
def test_gpu_mobilenet_v2_depthwise():
    """The service's float8 path for these layers: fp16 x quantized as loaded (the boundary from an fp16 step), e4m3
    out for the next fp8 layer, channels_last, tuned as the service tunes (every candidate timed, the pick reused)."""
    for C, size, s in MOBILENET_V2:
        case = (2, C, size, size, C, C, 3, s, 1, 1)
        for _ in range(2):
            _check(case, FP16, E4M3, None, "relu6", x_format=NHWC)
    gfp8._configs.clear()
