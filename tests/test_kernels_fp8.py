"""fused_conv2d_fp8 and fused_linear_fp8 against their torch references (kernels/reference.py: the same e4m3
operands, dequantized and multiplied in fp32, then one rounding), under the interpreter on the CPU.

The interpreter runs tl.dot on float8e4nv operands exactly, so the kernels' own fp8 dot, indexing, scales and
epilogue are all checked here; only its fp32 -> e4m3 cast is wrong there, and the kernels round by hand before it
under the interpreter (kernels/fp8.py). The compiled cast and the tensor cores' fp8 MMA: tests/test_fp8_gpu.py.

Tolerances. Kernel and reference multiply the same e4m3 values, whose products are exact in fp32; they differ only
in the order of the fp32 sums (~K * 2**-24 of the sum of |terms|: 6e-5 at K = 1000) and in FMA contractions.
- fp16 outputs: one fp16 rounding (half-ulp 4.9e-4) after that: tolerances.RTOL[fp16] (1e-3, anchored to rms).
- e4m3 outputs: those tiny differences move a value across an e4m3 rounding boundary only where it lies within
  ~1e-6 of one; an element may then differ by one e4m3 step (2**-3 of its magnitude, or 2**-9 below 2**-6), and
  such elements are rare: at most 1% allowed, seen 0 in these shapes.
And against float64 with unquantized inputs: each operand is off by at most half a step (2**-4) and on average
by ~2**-5.5 / sqrt 3 relative; summed over K with random signs the output's normwise error is ~3%: < 6% asserted.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import kernels.conv_fp8 as conv_fp8
import kernels.linear_fp8 as linear_fp8
from kernels import reference
from kernels.conv import conv_output_size
from kernels.conv_fp8 import fused_conv2d_fp8
from kernels.fp8 import E4M3, dequant_scale, quantize, quantize_weight, scale_of
from kernels.linear_fp8 import fused_linear_fp8
from tests.tolerances import RTOL, assert_close_to, binade_step

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (N, C, H, W, OC, kernel, stride, padding): batch 1, primes off every block edge in M, OC and C, 1x1 and 3x3 at
# stride 1 and 2, few channels (FLAT_K: C < 32) and a 7x7/2 stem-like window.
CONV_CASES = [
    (1, 37, 7, 9, 33, 3, 1, 1),
    (2, 64, 5, 5, 31, 1, 1, 0),
    (3, 97, 4, 6, 17, 1, 2, 0),
    (1, 41, 9, 7, 64, 3, 2, 1),
    (2, 5, 6, 5, 20, 3, 1, 1),
    (1, 3, 11, 13, 16, 7, 2, 3),
]


def _ids(case):
    return "-".join(map(str, case))


def e4m3_steps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of one e4m3 step at want (2**(exponent - 3); 2**-9 below the normal range)."""
    g, w = got.double(), want.double()
    return (g - w).abs() / binade_step(w.abs().clamp_min(2.0**-6), 3)


def assert_e4m3_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Both e4m3 (same scale): each element within one e4m3 step, at most 1% of them off at all (module docstring)."""
    assert got.dtype == E4M3 and want.dtype == E4M3, what
    g, w = got.float(), want.float()
    assert not g.isnan().any(), f"{what}: NaN in the output (an element not written?)"
    steps = e4m3_steps(g, w)
    off = (steps > 0).float().mean().item()
    assert steps.max() <= 1.0, f"{what}: {steps.max().item():.6g} e4m3 steps off at worst"
    assert off <= 0.01, f"{what}: {off:.2%} of the elements off by a step"


def _unwritten(shape, dtype, fmt=torch.contiguous_format) -> torch.Tensor:
    """An output buffer full of NaN (e4m3's 0x7F too): an element the kernel does not write stays NaN."""
    return torch.full(shape, float("nan"), device=DEVICE, dtype=torch.float32).to(dtype).contiguous(memory_format=fmt)


def _conv_inputs(case, x_fp8: bool, channels_last: bool):
    N, C, H, W, OC, k, *_ = case
    x = torch.randn(N, C, H, W, device=DEVICE)
    w = torch.randn(OC, C, k, k, device=DEVICE) / (C * k * k) ** 0.5
    b = torch.randn(OC, device=DEVICE)
    xs = scale_of(x.abs().max())
    x_in = quantize(x, xs) if x_fp8 else x.half()
    if channels_last:
        x_in = x_in.contiguous(memory_format=torch.channels_last)
    wq, ws = quantize_weight(w)
    return x, w, b, x_in, xs, wq, ws


@pytest.mark.parametrize("case", CONV_CASES, ids=_ids)
@pytest.mark.parametrize(
    "x_fp8,out_fp8,residual,activation",
    [
        (True, True, None, "relu"),
        (False, False, None, "none"),
        (True, False, "e4m3", "relu"),
        (False, True, "fp16", "silu"),
    ],
    ids=["fp8-fp8", "fp16-fp16", "fp8-fp16-r8", "fp16-fp8-r16"],
)
def test_conv_matches_reference(case, x_fp8, out_fp8, residual, activation):
    N, C, H, W, OC, k, s, p = case
    x, w, b, x_in, xs, wq, ws = _conv_inputs(case, x_fp8, channels_last=True)
    shape = (N, OC, conv_output_size(H, k, s, p, 1), conv_output_size(W, k, s, p, 1))
    r, rs = None, 1.0
    if residual is not None:
        r = torch.randn(shape, device=DEVICE)
        rs = scale_of(r.abs().max())
        r = (quantize(r, rs) if residual == "e4m3" else r.half()).contiguous(memory_format=torch.channels_last)
    scale = dequant_scale(xs, ws)
    out_scale = 4.0 / 448 if out_fp8 else None  # outputs of O(1): 4 is well above their max
    kw = dict(stride=s, padding=p, x_scale=xs, residual=r, residual_scale=rs, out_scale=out_scale)
    want = reference.conv2d_fp8(x_in, wq, scale, b, activation, **kw)
    out = _unwritten(shape, E4M3 if out_fp8 else torch.float16, torch.channels_last)
    with conv_fp8.INTERPRETER.override(tile=conv_fp8.SMALL_INTERPRETER_TILE):
        got = fused_conv2d_fp8(x_in, wq, scale, b, activation=activation, out=out, **kw)
    assert got is out
    what = f"{case} x_fp8={x_fp8} residual={residual} {activation}"
    if out_fp8:
        assert_e4m3_close(got, want, what)
    else:
        assert_close_to(got, want, RTOL[torch.float16], what)


@pytest.mark.parametrize("case", CONV_CASES[:2], ids=_ids)
@pytest.mark.parametrize("flat_k", [False, True])
def test_conv_nchw_x_and_both_k_loops(case, flat_k):
    """x in NCHW (strided channels) through either K loop, y NCHW: the same result as channels_last."""
    N, C, H, W, OC, k, s, p = case
    x, w, b, x_in, xs, wq, ws = _conv_inputs(case, True, channels_last=False)
    scale = dequant_scale(xs, ws)
    want = reference.conv2d_fp8(x_in, wq, scale, b, "relu", stride=s, padding=p)
    with conv_fp8.INTERPRETER.override(tile=(16, 32, 32), flat_k=flat_k):
        got = fused_conv2d_fp8(x_in, wq, scale, b, stride=s, padding=p, activation="relu",
                               memory_format=torch.contiguous_format)  # fmt: skip
    assert got.is_contiguous()
    assert_close_to(got, want, RTOL[torch.float16], f"{case} nchw flat_k={flat_k}")


@pytest.mark.parametrize("case", [CONV_CASES[1], CONV_CASES[4], CONV_CASES[3]], ids=_ids)
@pytest.mark.parametrize("flat_k", [False, True])
def test_gated_conv_quantizes_x_times_its_gate_as_it_reads(case, flat_k):
    """EfficientNet's project conv: x (fp16 or fp32) times a per-image, per-channel gate in (0, 1), quantized with the
    scale of that product as it is gathered (never written), through either K loop, x NHWC and NCHW, the gate as
    (N, C) or (N, C, 1, 1) in another dtype, a residual; against the reference, which quantizes x * gate in fp32.
    e4m3 out: within one e4m3 step; fp16 out: fp16's tolerance."""
    N, C, H, W, OC, k, s, p = case
    x = torch.randn(N, C, H, W, device=DEVICE)
    gate = torch.sigmoid(torch.randn(N, C, 1, 1, device=DEVICE))
    w = torch.randn(OC, C, k, k, device=DEVICE) / (C * k * k) ** 0.5
    b = torch.randn(OC, device=DEVICE)
    xs = scale_of((x * gate).abs().max())  # the product's range, as calibration measures it
    wq, ws = quantize_weight(w)
    scale = dequant_scale(xs, ws)
    shape = (N, OC, conv_output_size(H, k, s, p, 1), conv_output_size(W, k, s, p, 1))
    for x_in, g, out_fp8, fmt in ((x.half().contiguous(memory_format=torch.channels_last), gate.half(), True, "nhwc"),
                                  (x, gate.reshape(N, C).float(), False, "nchw")):  # fmt: skip
        r = torch.randn(shape, device=DEVICE).half()
        kw = dict(stride=s, padding=p, x_scale=xs, residual=r, out_scale=4.0 / 448 if out_fp8 else None)
        want = reference.conv2d_fp8(x_in, wq, scale, b, "silu", gate=g, **kw)
        out = _unwritten(shape, E4M3 if out_fp8 else torch.float16, torch.channels_last)
        with conv_fp8.INTERPRETER.override(tile=conv_fp8.SMALL_INTERPRETER_TILE, flat_k=flat_k):
            got = fused_conv2d_fp8(x_in, wq, scale, b, activation="silu", out=out, gate=g, **kw)
        what = f"{case} gated {fmt} flat_k={flat_k}"
        if out_fp8:
            assert_e4m3_close(got, want, what)
        else:
            assert_close_to(got, want, RTOL[torch.float16], what)
        ungated = reference.conv2d_fp8(x_in, wq, scale, b, "silu", **kw)
        assert not torch.equal(got.float(), ungated.float()), f"{what}: the gate changed nothing"


def test_a_gate_is_refused_with_an_e4m3_x_or_the_wrong_shape():
    x, w, b, x_in, xs, wq, ws = _conv_inputs(CONV_CASES[1], True, channels_last=True)
    scale = dequant_scale(xs, ws)
    N, C = x.shape[:2]
    with pytest.raises(TypeError, match="a gate needs x in float16 or float32"):
        fused_conv2d_fp8(x_in, wq, scale, b, gate=torch.rand(N, C, device=DEVICE))
    with pytest.raises(ValueError, match=r"gate must be \(N, C\) = \(2, 64\) or \(N, C, 1, 1\); got \(2, 63\)"):
        fused_conv2d_fp8(x.half(), wq, scale, b, gate=torch.rand(N, C - 1, device=DEVICE))


def test_a_residual_in_the_outputs_own_memory_is_refused():
    """The tuner runs the kernel once per candidate on a layer's first call, so a residual read from `out` would be
    added again each time (tiles.residual_like, as every conv launcher checks)."""
    x, w, b, x_in, xs, wq, ws = _conv_inputs(CONV_CASES[1], True, channels_last=True)
    out = torch.randn(2, 31, 5, 5, device=DEVICE).half().contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="residual shares memory with out"):
        fused_conv2d_fp8(x_in, wq, dequant_scale(xs, ws), b, out=out, residual=out, out_dtype=torch.float16)


def test_conv_close_to_float64_of_unquantized_inputs():
    """The whole fp8 path (activation and weight quantization, fp16 output) against float64 on the inputs as they
    were: normwise error under 6% (module docstring)."""
    case = (2, 64, 6, 6, 48, 3, 1, 1)
    x, w, b, x_in, xs, wq, ws = _conv_inputs(case, False, channels_last=True)
    got = fused_conv2d_fp8(x_in, wq, dequant_scale(xs, ws), b, padding=1, x_scale=xs)
    want = F.conv2d(x.double(), w.double(), b.double(), padding=1)
    err = ((got.double() - want).norm() / want.norm()).item()
    assert err < 0.06, err


@pytest.mark.parametrize("M,N,K", [(1, 10, 64), (37, 33, 97), (64, 128, 256), (5, 7, 3)])
@pytest.mark.parametrize(
    "x_fp8,out_fp8,residual", [(True, True, None), (False, False, "fp16"), (True, False, "e4m3")],
    ids=["fp8-fp8", "fp16-fp16-r16", "fp8-fp16-r8"],
)  # fmt: skip
def test_linear_matches_reference(M, N, K, x_fp8, out_fp8, residual):
    x = torch.randn(M, K, device=DEVICE)
    w = torch.randn(N, K, device=DEVICE) / K**0.5
    b = torch.randn(N, device=DEVICE)
    xs = scale_of(x.abs().max())
    x_in = quantize(x, xs) if x_fp8 else x.half()
    wq, ws = quantize_weight(w)
    r, rs = None, 1.0
    if residual is not None:
        r = torch.randn(M, N, device=DEVICE)
        rs = scale_of(r.abs().max())
        r = quantize(r, rs) if residual == "e4m3" else r.half()
    scale = dequant_scale(xs, ws)
    kw = dict(x_scale=xs, residual=r, residual_scale=rs, out_scale=4.0 / 448 if out_fp8 else None)
    want = reference.linear_fp8(x_in, wq, scale, b, "relu", **kw)
    out = _unwritten((M, N), E4M3 if out_fp8 else torch.float16)
    with linear_fp8.INTERPRETER.override(tile=linear_fp8.SMALL_INTERPRETER_TILE):
        got = fused_linear_fp8(x_in, wq, scale, b, "relu", out=out, **kw)
    assert got is out
    if out_fp8:
        assert_e4m3_close(got, want, f"{M}x{N}x{K}")
    else:
        assert_close_to(got, want, RTOL[torch.float16], f"{M}x{N}x{K}")


def _e4m3_grid() -> torch.Tensor:
    """Every finite e4m3 value, the midpoints between neighbours (ties, which round to the even one), points a
    quarter step either side of them, and values past 448 (saturated): fp32."""
    values = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    values = values[values.isfinite()].unique()
    mids = (values[1:] + values[:-1]) / 2
    quarter = (values[1:] - values[:-1]) / 4
    return torch.cat([values, mids, mids - quarter, mids + quarter, torch.tensor([460.0, 470.0, -500.0, 1e4])])


@pytest.mark.parametrize("x_scale", [1.0, 0.37])
def test_quantization_rounds_as_torch(x_scale):
    """The kernels' quantizer (here on an fp32 x read by fused_linear_fp8 through an identity weight, with an fp32
    output) rounds every e4m3 value, tie and near-tie as torch's cast does after the same saturation: nearest,
    ties to even."""
    v = _e4m3_grid() * x_scale
    K = 32
    x = torch.zeros(math.ceil(v.numel() / K) * K).index_copy_(0, torch.arange(v.numel()), v).reshape(-1, K)
    eye = torch.eye(K).to(E4M3)
    got = fused_linear_fp8(x.to(DEVICE), eye.to(DEVICE), torch.full((K,), x_scale, device=DEVICE), x_scale=x_scale,
                           out_dtype=torch.float32)  # fmt: skip
    want = quantize(x, x_scale).float() * x_scale
    assert torch.equal(got.cpu(), want), (got.cpu() - want).abs().max()
