"""kernels/conv_tma_fp8.py (float8 convs on TMA boxes) against the torch reference (kernels/reference.py's
conv2d_fp8), under the interpreter: fused_conv2d_fp8 routes the calls conv_tma_fp8 can run to it
(conv_fp8.INTERPRETER's `tma`, with 32-pixel boxes so that boxes cross image edges), and the rest to its gathers.

Shapes: batch 1 and 3, primes off every block edge in M and OC, C of 16 to 64 (a multiple of 16: one e4m3 row of
channels is 16 bytes), 1x1, 3x3 and 5x5 at stride 1, 3x3/2 and 1x1/2 (x read by parity); outputs e4m3 or fp16,
channels_last (stored by TMA) or NCHW (with pointers); a residual e4m3, fp16 or none; every activation the fp8 layers
take. Tolerances as tests/test_kernels_fp8.py's (the same products, sums in another order): fp16 outputs
RTOL[fp16]; e4m3 outputs one e4m3 step, on at most 1% of the elements. On a GPU the same tests run the first TMA
candidate the tuner would time, with Hopper's tolerance (tests/tolerances.py, assert_close_on_hopper): its fp8 MMA
keeps fewer bits than fp32 while it sums.

Compiled for Hopper here, without a GPU (tests/sm90_compile.py): TMA copies, fp8 warpgroup MMAs, no spills.
"""

from __future__ import annotations

import pytest
import torch

import kernels.conv_fp8 as conv_fp8
import kernels.conv_tma as conv_tma
import kernels.conv_tma_fp8 as conv_tma_fp8
from kernels import reference
from kernels.conv import conv_output_size
from kernels.conv_fp8 import fused_conv2d_fp8
from kernels.fp8 import E4M3, dequant_scale, quantize, scale_of
from tests.test_kernels_fp8 import _conv_inputs, _unwritten, assert_e4m3_close
from tests.tolerances import RTOL, abs_e4m3, assert_close_on_hopper, assert_close_to

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NHWC = torch.channels_last

# (N, C, H, W, OC, kernel, stride, padding). OC a multiple of 16 (y's rows 16 bytes, for its TMA store) short of the
# channel block (48 of 64, 80 of 128, 144 of 2 x 128); with y NCHW (stored with pointers) OC + 1, a prime or odd count.
CASES = [
    (1, 32, 7, 9, 48, 3, 1, 1),
    (3, 16, 5, 6, 16, 1, 1, 0),
    (1, 48, 9, 7, 80, 5, 1, 2),
    (2, 64, 8, 6, 144, 3, 2, 1),
    (1, 32, 4, 6, 32, 1, 2, 0),
]


def _ids(case):
    return "-".join(map(str, case))


def _inputs(case, residual: str | None):
    """test_kernels_fp8's e4m3 x (channels_last) and weight, the dequantizing scale, the bias, and a residual of the
    output's shape (e4m3 with its scale, fp16, or None)."""
    N, C, H, W, OC, k, s, p = case
    _, _, b, xq, xs, wq, ws = _conv_inputs(case, x_fp8=True, channels_last=True)
    shape = (N, OC, conv_output_size(H, k, s, p, 1), conv_output_size(W, k, s, p, 1))
    r, rs = None, 1.0
    if residual is not None:
        r = torch.randn(shape, device=DEVICE)
        rs = scale_of(r.abs().max())
        r = (quantize(r, rs) if residual == "e4m3" else r.half()).contiguous(memory_format=NHWC)
    return xq, wq, dequant_scale(xs, ws), b, r, rs, shape


@pytest.fixture
def tma_launches(monkeypatch):
    """fused_conv2d_fp8 with conv_tma_fp8 chosen, counting its launches: under the interpreter by its switch; on a GPU
    the tuner's pick is the first TMA candidate (the tuner would time them all, and might pick a gather)."""
    calls = []
    launch = conv_tma_fp8.launch
    monkeypatch.setattr(conv_tma_fp8, "launch", lambda *a, **k: calls.append(1) or launch(*a, **k))
    monkeypatch.setattr(conv_fp8, "tune", lambda scope, key, candidates, run, *a, **k: next(
        (c for c in candidates if conv_tma.is_tma(c)), candidates[0]))  # fmt: skip
    conv_fp8._configs.clear()
    with conv_fp8.INTERPRETER.override(tma=True, tma_pixels=32):
        yield calls
    conv_fp8._configs.clear()


@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize(
    "out_fp8, residual, activation, y_layout",
    [
        (True, None, "relu", NHWC),
        (False, "e4m3", "relu", NHWC),
        (True, "fp16", "silu", NHWC),
        (False, None, "none", torch.contiguous_format),
        (True, "e4m3", "gelu_tanh", torch.contiguous_format),
    ],
    ids=["fp8-nhwc", "fp16-r8-nhwc", "fp8-r16-silu-nhwc", "fp16-nchw", "fp8-r8-gelu-nchw"],
)
def test_tma_conv_matches_reference(tma_launches, case, out_fp8, residual, activation, y_layout):
    if y_layout != NHWC:
        case = (*case[:4], case[4] + 1, *case[5:])
    N, C, H, W, OC, k, s, p = case
    xq, wq, scale, b, r, rs, shape = _inputs(case, residual)
    if r is not None and y_layout != NHWC:
        r = r.contiguous()
    out_scale = 4.0 / 448 if out_fp8 else None
    kw = dict(stride=s, padding=p, residual=r, residual_scale=rs, out_scale=out_scale)
    want = reference.conv2d_fp8(xq, wq, scale, b, activation, **kw)
    out = _unwritten(shape, E4M3 if out_fp8 else torch.float16, y_layout)
    got = fused_conv2d_fp8(xq, wq, scale, b, activation=activation, out=out, **kw)
    assert got is out and tma_launches == [1], "the call did not run conv_tma_fp8's kernel"
    what = f"{case} out_fp8={out_fp8} residual={residual} {activation} {y_layout}"
    if DEVICE == "cuda":  # Hopper's fp8 MMA keeps fewer bits than fp32 while it sums (tests/tolerances.py)
        magnitude = reference.conv2d_fp8(
            abs_e4m3(xq), abs_e4m3(wq), scale, stride=s, padding=p, out_dtype=torch.float32
        )
        assert_close_on_hopper(got, want, magnitude / (out_scale or 1.0), C * k * k, what)
    elif out_fp8:
        assert_e4m3_close(got, want, what)
    else:
        assert_close_to(got, want, RTOL[torch.float16], what)


@pytest.mark.parametrize(
    "why, case, x_dtype",
    [
        ("C not a multiple of 16", (1, 37, 5, 5, 16, 3, 1, 1), E4M3),
        ("an fp16 x is quantized as gathered", (1, 32, 5, 5, 16, 3, 1, 1), torch.float16),
        ("strided, H odd", (1, 32, 7, 8, 16, 3, 2, 1), E4M3),
        ("strided, C not a multiple of e4m3's 32-channel K step", (1, 16, 8, 8, 16, 3, 2, 1), E4M3),
    ],
    ids=["c37", "fp16-x", "odd-h", "strided-c16"],
)
def test_what_tma_cannot_run_goes_to_the_gathers(tma_launches, why, case, x_dtype):
    N, C, H, W, OC, k, s, p = case
    xq, wq, scale, b, _, _, _ = _inputs(case, None)
    xs = 1.0
    x_in = xq if x_dtype == E4M3 else (xq.float() * 0.5).half().contiguous(memory_format=NHWC)
    want = reference.conv2d_fp8(x_in, wq, scale, b, "relu", stride=s, padding=p, x_scale=xs)
    got = fused_conv2d_fp8(x_in, wq, scale, b, stride=s, padding=p, activation="relu", x_scale=xs)
    assert tma_launches == [], why
    if DEVICE == "cuda":
        x8 = x_in if x_dtype == E4M3 else quantize(x_in.float(), 1.0)
        magnitude = reference.conv2d_fp8(
            abs_e4m3(x8), abs_e4m3(wq), scale, stride=s, padding=p, out_dtype=torch.float32
        )
        assert_close_on_hopper(got, want, magnitude, C * k * k, why)
    else:
        assert_close_to(got, want, RTOL[torch.float16], why)


def test_k_steps_are_64_and_128_e4m3_channels():
    """The same bytes per K step as fp16's 32 and 64 channels; strided, only steps that divide C."""
    from kernels.conv_tma import k_steps

    assert k_steps(256, 1) == [64, 128] and k_steps(256, 2) == [32, 64] and k_steps(256, 4) == [32]
    assert k_steps(48, 1) == [64] and k_steps(96, 1, strided=True) == [32] and k_steps(192, 1, strided=True) == [64]
    # e4m3's narrowest step is 32 channels (an fp8 tl.dot takes K >= 32): none strided where 32 does not divide C
    assert k_steps(16, 1) == [32] and k_steps(16, 1, strided=True) == [] and k_steps(16, 2, strided=True) == [16]


# ---- compiled for Hopper here, without a GPU (tests/sm90_compile.py) ----

_COMPILE_TMA_FP8 = r"""
import json, sys
import kernels.conv_tma as ct
import kernels.conv_tma_fp8 as ctf
from tests.sm90_compile import compile_sm90, pdl_order, sample

# ResNet-50's convs at 256 images, with a residual: a 3x3 at 56 and a 3x3/2 at 28 -> 14 writing e4m3 for the next fp8
# layer, a 1x1 expansion at 28 and the 1x1/2 beside the 3x3/2 writing fp16 (y NCHW in the last: stored with pointers)
layers = [(64, 56, 64, 3, 1, True, "fp8e4nv"), (128, 28, 512, 1, 1, True, "fp16"),
          (256, 28, 256, 3, 2, True, "fp8e4nv"), (512, 28, 1024, 1, 2, False, "fp16")]
for i, (C, H, OC, k, s, y_nhwc, out_name) in enumerate(layers):
    runtime = dict(s_ptr="*fp32", b_ptr="*fp32", r_ptr="*" + out_name, NB="i32", stride_yn="i32", stride_yc="i32",
                   stride_yh="i32", stride_yw="i32", r_scale="fp32", y_inv_scale="fp32", negative_slope="fp32")
    fixed = dict(HAS_BIAS=True, HAS_RESIDUAL=True, ACTIVATION="relu", R_FP8=out_name == "fp8e4nv",
                 Y_FP8=out_name == "fp8e4nv", ROUND_FP8=False, PDL=True)
    OH = H // s
    out_size = 1 if out_name == "fp8e4nv" else 2
    for cfg in sample(ct.cuda_configs(256 * OH * OH, OC, C, OH, OH, (1, 1), 1, strided=s > 1, out_size=out_size), i):
        meta = dict(C=C, H=H, W=H, KH=k, KW=k, PH=k // 2, PW=k // 2, DH=1, DW=1, SH=s, SW=s, OH=OH, OW=OH, OC=OC,
                    **fixed, Y_NHWC=y_nhwc, **{k: v for k, v in cfg.meta().items() if k != "TMA"})
        img, bh, bw, bn, bk = (cfg[k] for k in ("IMG", "BH", "BW", "BLOCK_N", "BLOCK_K"))
        x_box = f"{img}, {bh}, {bw}, {bk}" if s == 1 else f"{img}, {bh}, 1, {bw}, {bk}"
        descs = dict(x_desc=f"tensordesc<fp8e4nv[{x_box}]>", w_desc=f"tensordesc<fp8e4nv[{bn}, {bk}]>",
                     y=f"tensordesc<{out_name}[{img}, {bh}, {bw}, {bn}]>" if y_nhwc else "*" + out_name)
        aligned = ("s_ptr", "b_ptr", "r_ptr") if y_nhwc else ("s_ptr", "b_ptr", "r_ptr", "y")
        ptx, usage = compile_sm90(ctf._conv2d_tma_fp8_kernel, {**runtime, **descs}, meta, 0, cfg.num_warps,
                                  cfg.num_stages, divisible=aligned)  # fmt: skip
        print(json.dumps({"layer": [C, H, OC, k, s, y_nhwc, out_name], "config": cfg.meta(),
                          "tma_loads": ptx.count(f"cp.async.bulk.tensor.{4 if s == 1 else 5}d.shared"),
                          "tma_stores": ptx.count("cp.async.bulk.tensor.4d.global"),
                          "wgmma_e4m3": ptx.count(".e4m3.e4m3"), **pdl_order(ptx), **usage}))
"""


def test_tma_fp8_conv_compiles_for_sm90_without_spills():
    from tests.sm90_compile import every_candidate
    from tests.test_kernels_compile import _compiled

    results = _compiled(_COMPILE_TMA_FP8, "")
    assert len(results) >= (40 if every_candidate() else 4), results
    assert {r["layer"][6] for r in results} == {"fp8e4nv", "fp16"} and {r["layer"][4] for r in results} == {1, 2}
    for got in results:
        # TMA copies of x (4-D, 5-D strided), e4m3 warpgroup MMAs, a TMA store where y is NHWC
        assert got["tma_loads"] > 0 and got["wgmma_e4m3"] > 0, got
        assert (got["tma_stores"] > 0) == got["layer"][5], got
        assert got["STACK"] == 0 and got["LOCAL"] == 0, f"registers spill to local memory: {got}"
        # one wait, before anything is written; the next layer let in after the main loop
        assert got["waits"] == 1 and got["launches"] == 1 and got["wait_at"] < got["first_store"], got
        assert got["launch_at"] > got["wait_at"], got
