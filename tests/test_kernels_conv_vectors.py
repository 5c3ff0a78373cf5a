"""Channel counts that are multiples of 8 but not of 16 (MobileNetV2's 24, EfficientNet's 40), which Triton, which
specializes integers only at multiples of 16, cannot see: the conv launchers say them (X_ALIGN, W_ALIGN, Y_ALIGN for
the channels_last strides, OC_ALIGN for the output channels' mask), and compiled for sm_90 the kernels then gather
and store in vectors instead of a byte (e4m3) or two (fp16) at a time."""

from __future__ import annotations

import pytest
import torch

import kernels.conv as conv
import kernels.conv_fp8 as conv_fp8
from kernels.fp8 import dequant_scale, quantize, quantize_weight


def _launched(monkeypatch, module) -> list[dict]:
    """The keyword arguments of each launch of `module`'s kernels (grid_launch wrapped)."""
    seen = []
    real = module.grid_launch

    def recording(kernel, grid):
        launch = real(kernel, grid)

        def call(*args, **kw):
            seen.append(kw)
            return launch(*args, **kw)

        return call

    monkeypatch.setattr(module, "grid_launch", recording)
    return seen


@pytest.mark.cpu_interpreter
def test_launchers_say_what_24_channels_are_multiples_of(monkeypatch):
    x = torch.randn(1, 24, 4, 5).contiguous(memory_format=torch.channels_last)
    w = torch.randn(24, 24, 1, 1).contiguous(memory_format=torch.channels_last)
    seen = _launched(monkeypatch, conv_fp8)
    wq, ws = quantize_weight(w)
    conv_fp8.fused_conv2d_fp8(quantize(x, 0.02), wq, dequant_scale(0.02, ws), out_scale=0.03)
    assert seen and {k: seen[-1][k] for k in ("X_ALIGN", "W_ALIGN", "Y_ALIGN", "OC_ALIGN")} == dict.fromkeys(
        ("X_ALIGN", "W_ALIGN", "Y_ALIGN", "OC_ALIGN"), 8
    )
    seen = _launched(monkeypatch, conv)
    conv.fused_conv2d(x, w, memory_format=torch.channels_last)
    assert seen and seen[-1]["OC_ALIGN"] == 8 and seen[-1]["Y_ALIGN"] == 8
    conv.fused_conv2d(x, torch.randn(32, 24, 1, 1))  # 32 channels: Triton sees 16 itself, nothing said
    assert "OC_ALIGN" not in seen[-1]


_COMPILE = r"""
import collections, json, re, sys
import kernels.conv as conv
import kernels.conv_fp8 as conv_fp8
from tests.sm90_compile import compile_sm90

C, OC, H = (int(v) for v in sys.argv[1].split(","))
align = lambda n: min(16, n & -n)
strides = ["stride_xn", "stride_xc", "stride_xh", "stride_xw", "stride_wo", "stride_wc", "stride_wh", "stride_ww",
           "stride_yn", "stride_yc", "stride_yh", "stride_yw"]
units = ["stride_xc", "stride_wc", "stride_yc"]  # channels_last x, weight and y
values = {"stride_xn": H * H * C, "stride_xh": H * C, "stride_xw": C, "stride_wo": C, "stride_wh": C, "stride_ww": C,
          "stride_yn": H * H * OC, "stride_yh": H * OC, "stride_yw": OC, "OC": OC}
divisible = tuple(n for n, v in values.items() if v % 16 == 0)
hints = dict(X_ALIGN=align(C), W_ALIGN=align(C), Y_ALIGN=align(OC), OC_ALIGN=align(OC))
shape = dict(C=C, H=H, W=H, OH=H, OW=H, KH=1, KW=1, SH=1, SW=1, PH=0, PW=0, DH=1, DW=1, HAS_BIAS=True,
             HAS_RESIDUAL=False, ACTIVATION="relu6", PDL=True, Y_PLANES=False, GROUP_M=8, **{u: 1 for u in units})
ints = {s: "i32" for s in strides if s not in units} | {"NB": "i32", "OC": "i32", "negative_slope": "fp32"}
# float8 (e4m3 in and out) as conv_fp8.cuda_configs offers it for this layer, and float16 as conv.cuda_configs does
fp8 = {"x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "b_ptr": "*fp32", "y_ptr": "*fp8e4nv",
       "r_ptr": "*fp8e4nv", "g_ptr": "*fp32", "stride_gn": "i32", "stride_gc": "i32", "x_inv_scale": "fp32",
       "r_scale": "fp32", "y_inv_scale": "fp32"} | ints
fp16 = {"x_ptr": "*fp16", "w_ptr": "*fp16", "b_ptr": "*fp16", "y_ptr": "*fp16", "r_ptr": "*fp16", "ws_ptr": "*fp32",
        "cnt_ptr": "*i32", "xs_ptr": "*fp16", "xb_ptr": "*fp16"} | ints
runs = [("float8", conv_fp8._conv2d_fp8_kernel, fp8, 7, conv_fp8.cuda_configs(H * H * 256, OC, C, C)[0],
         dict(QUANT_X=False, HAS_GATE=False, R_FP8=True, Y_FP8=True, ROUND_FP8=False)),
        ("float16", conv._conv2d_kernel, fp16, 5, conv.cuda_configs(H * H * 256, OC, C, C)[0],
         dict(POOL="none", PKH=1, PKW=1, PSH=1, PSW=1, INPUT_PRECISION="ieee", UPCAST_DOT=False, ROUND_BF16=False,
              CHANNELS_LAST=True))]
for name, kernel, runtime, pointers, cfg, extra in runs:
    meta = shape | extra | hints | dict(cfg.kwargs)
    ptx, usage = compile_sm90(kernel, runtime, meta, pointers, cfg.num_warps, cfg.num_stages, divisible)
    ops = collections.Counter(re.findall(r"\b((?:ld|st)\.global[\w.]*)", ptx))
    print(json.dumps({"kernel": name, "STACK": usage["STACK"], "ops": ops}))
"""


@pytest.mark.parametrize("layer", ["24,144,56", "96,24,56", "40,240,28"])
def test_24_and_40_channels_load_and_store_in_vectors_on_sm90(layer):
    """MobileNetV2's 24 -> 144 and 96 -> 24 1x1 convs at 56x56 and EfficientNet's 40 -> 240 at 28x28, each
    kernel's first candidate as the launchers describe the layer: no scalar stores of y, and at most 8 scalar loads
    (the fp16 kernel's 24-column weight tile of 96 -> 24 keeps its 8; before the hints x's gather was 48-96 of
    them: ld.global.b8 for e4m3, ld.global.b16 for fp16, and y's 16 st.global.b8 or .b16)."""
    from tests.test_kernels_compile import _compiled

    results = _compiled(_COMPILE, layer)
    assert {r["kernel"] for r in results} == {"float8", "float16"}
    for r in results:
        # one element an instruction: a byte (e4m3), two bytes (fp16); a 32-bit load of 4 e4m3 channels is a vector
        narrow = (".b8", ".u8") if r["kernel"] == "float8" else (".b8", ".u8", ".b16", ".u16")
        scalar = {op: n for op, n in r["ops"].items() if op.endswith(narrow) and ".v" not in op}
        loads = sum(n for op, n in scalar.items() if op.startswith("ld."))
        assert r["STACK"] == 0 and loads <= 8 and not any(op.startswith("st.") for op in scalar), r
