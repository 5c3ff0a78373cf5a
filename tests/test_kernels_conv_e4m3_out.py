"""fused_conv2d with out_scale: a float16 (or float32) conv that writes e4m3 for float8 layers to read (the stem
before MobileNetV2's first depthwise conv), against reference.conv2d(out_scale=): the same conv in the compute dtype,
then quantized. Both round to the compute dtype first, so they differ only where the fp32 sums' order moves that
rounding across an e4m3 boundary: at most one e4m3 step, in at most 1% of the elements (tests/test_kernels_fp8.py)."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.conv import fused_conv2d, input_norm_of
from kernels.fp8 import E4M3, scale_of
from tests.test_kernels_fp8 import _unwritten, assert_e4m3_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (N, C, H, W, OC, kernel, stride, padding): a stem (3 channels, 3x3 stride 2), batch 1 with prime sizes, a 1x1
CASES = [(2, 3, 11, 13, 32, 3, 2, 1), (1, 5, 7, 9, 17, 3, 1, 1), (3, 16, 6, 5, 24, 1, 1, 0)]


def _ids(case):
    return "-".join(map(str, case))


def _scale(y: torch.Tensor) -> float:
    """A calibrated scale as calibrate.py makes one: the tensor's largest |value| / 448, here 0.9 of it, so that
    the top of the range saturates as it may in service."""
    return scale_of(0.9 * float(y.abs().max()))


@pytest.mark.parametrize("case", CASES, ids=_ids)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("activation", ["relu6", "silu", "none"])
@pytest.mark.parametrize("nhwc", [True, False], ids=["nhwc", "nchw"])
def test_e4m3_output_matches_the_quantized_reference(case, dtype, activation, nhwc):
    N, C, H, W, OC, k, s, p = case
    fmt = torch.channels_last if nhwc else torch.contiguous_format
    x = torch.randn(N, C, H, W, device=DEVICE).to(dtype).contiguous(memory_format=fmt)
    w = (torch.randn(OC, C, k, k, device=DEVICE) / (C * k * k) ** 0.5).to(dtype).contiguous(memory_format=fmt)
    b = (0.1 * torch.randn(OC, device=DEVICE)).to(dtype)
    conv = {"stride": s, "padding": p, "activation": activation}
    scale = _scale(reference.conv2d(x.float(), w.float(), b.float(), **conv))
    want = reference.conv2d(x, w, b, **conv, out_scale=scale)
    OH, OW = want.shape[2:]
    out = _unwritten((N, OC, OH, OW), E4M3, fmt)
    got = fused_conv2d(x, w, b, **conv, out=out, out_scale=scale)
    assert got is out and got.dtype == E4M3
    assert_e4m3_close(got, want.contiguous(memory_format=fmt), f"{case} {dtype} {activation}")


def test_uint8_stem_with_its_normalization():
    """The stem as the service runs it on uint8 pixels: the normalization folded into the conv's reads."""
    x = torch.randint(0, 256, (2, 3, 9, 10), dtype=torch.uint8, device=DEVICE)
    w = (0.2 * torch.randn(16, 3, 3, 3, device=DEVICE)).half()
    b = (0.1 * torch.randn(16, device=DEVICE)).half()
    mean, std = (123.7, 116.3, 103.5), (58.4, 57.1, 57.4)
    conv = {"stride": 2, "padding": 1, "activation": "relu6"}
    want16 = reference.conv2d(x, w, b, **conv, normalize=(torch.tensor(mean), torch.tensor(std)))
    scale = _scale(want16.float())
    want = reference.conv2d(x, w, b, **conv, normalize=(torch.tensor(mean), torch.tensor(std)), out_scale=scale)
    got = fused_conv2d(x, w, b, **conv, input_norm=input_norm_of(mean, std, DEVICE), out_scale=scale,
                       memory_format=torch.channels_last)  # fmt: skip
    assert got.dtype == E4M3 and got.is_contiguous(memory_format=torch.channels_last)
    assert_e4m3_close(got, want.contiguous(memory_format=torch.channels_last), "uint8 stem")


def test_e4m3_output_refuses_what_it_does_not_fuse():
    x = torch.randn(1, 4, 6, 6, device=DEVICE)
    w = torch.randn(8, 4, 3, 3, device=DEVICE)
    for extra in ({"pool": ("max", 2)}, {"residual": torch.randn(1, 8, 4, 4, device=DEVICE)}):
        with pytest.raises(ValueError, match="out_scale"):
            fused_conv2d(x, w, out_scale=0.01, **extra)
    with pytest.raises(ValueError, match="float8_e4m3fn"):  # an `out` of the compute dtype for an e4m3 output
        fused_conv2d(x, w, out=torch.empty(1, 8, 4, 4, device=DEVICE), out_scale=0.01)


_COMPILE_E4M3_OUT = r"""
import json
import kernels.conv as conv
from tests.sm90_compile import compile_sm90, sample

# MobileNetV2's stem as the service runs it in float8: uint8 NCHW x normalized as it is gathered, 3 -> 32 channels,
# 3x3 stride 2 at 224x224, y channels_last e4m3 (256 images)
strides = ["stride_xn", "stride_xc", "stride_xh", "stride_xw", "stride_wo", "stride_wc", "stride_wh", "stride_ww",
           "stride_yn", "stride_yc", "stride_yh", "stride_yw"]
units = ["stride_xw", "stride_yc"]
runtime = {"x_ptr": "*u8", "w_ptr": "*fp16", "b_ptr": "*fp16", "y_ptr": "*fp8e4nv", "r_ptr": "*fp8e4nv",
           "ws_ptr": "*fp32", "cnt_ptr": "*i32", "xs_ptr": "*fp32", "xb_ptr": "*fp32", "NB": "i32", "OC": "i32",
           "negative_slope": "fp32"}
runtime.update({s: "i32" for s in strides if s not in units})
configs = conv.cuda_configs(conv.m_bucket(256 * 112 * 112), 32, 3, 27, norm=True)
for cfg in sample(configs):
    meta = dict(C=3, H=224, W=224, OH=112, OW=112, KH=3, KW=3, SH=2, SW=2, PH=1, PW=1, DH=1, DW=1, POOL="none",
                PKH=1, PKW=1, PSH=1, PSW=1, HAS_BIAS=True, HAS_RESIDUAL=False, ACTIVATION="relu6",
                INPUT_PRECISION="ieee", UPCAST_DOT=False, ROUND_BF16=False, PDL=True, CHANNELS_LAST=False,
                Y_PLANES=False, HAS_INPUT_NORM=True, Y_ALIGN=16, Y_FP8=True, Y_INV_SCALE=74.5, ROUND_FP8=False,
                **{u: 1 for u in units}, **dict(cfg.kwargs))
    ptx, usage = compile_sm90(conv._conv2d_kernel, runtime, meta, 5, cfg.num_warps, cfg.num_stages, ("OC",))
    print(json.dumps({"config": cfg.meta(), "STACK": usage["STACK"], "e4m3": "cvt.rn.satfinite.e4m3x2.f32" in ptx,
                      "byte_stores": "st.global.b8" in ptx or "st.global.v2.b8" in ptx or "st.global.v4.b8" in ptx}))
"""


def test_e4m3_output_compiles_for_sm90_without_spills():
    """The stem's candidates with the e4m3 epilogue compile for sm_90 without spills and convert to e4m3 in PTX
    (cvt.rn.satfinite: saturating, as quantize_e4m3 clamps first), storing bytes."""
    from tests.test_kernels_compile import _compiled

    results = _compiled(_COMPILE_E4M3_OUT, "*fp16")
    assert results
    for r in results:
        assert r["STACK"] == 0 and r["e4m3"] and r["byte_stores"], r
