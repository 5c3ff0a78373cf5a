"""Float8 on the GPU (issue 52): the compiled fp8 kernels (Hopper's e4m3 tensor cores, the hardware's e4m3 cast) against
their torch references for every candidate config, and float8 models against float16: the digits models' held-out
accuracy and a ResNet-50's logits.

Skipped without CUDA (conftest) and where the GPU has no fp8 tensor cores (compute capability < 8.9). fp16 outputs:
one fp16 step, e4m3 outputs one e4m3 step, plus what Hopper's fp8 MMA loses in its sums
(assert_close_on_hopper): unlike the interpreter's exact dot (tests/test_kernels_fp8.py: one step on at most 1%),
it keeps fewer bits than fp32 while it accumulates, which near zero is many e4m3 steps (61 at K = 576, H200).

    pytest -m gpu tests/test_fp8_gpu.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kernels.conv_fp8 as conv_fp8
import kernels.conv_tma as conv_tma
import kernels.conv_tma_fp8 as conv_tma_fp8
import kernels.linear_fp8 as linear_fp8
from kernels import reference, tuning
from kernels.conv import conv_output_size
from kernels.fp8 import E4M3, dequant_scale, fp8_capable, quantize, quantize_weight, scale_of
from tests.tolerances import abs_e4m3, assert_close_on_hopper

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and fp8_capable("cuda")),
        reason="needs a GPU with fp8 tensor cores (compute capability 8.9+)",
    ),
]
DEVICE = "cuda"

# ResNet-50's conv shapes at small batches (the bottleneck's 1x1 down, 3x3, 1x1 up with its residual, the strided
# 3x3 and the 1x1/2 shortcut, the last stage's 7x7 maps) and an awkward one (primes, FLAT_K below 32 channels).
CONV_CASES = [
    (2, 64, 56, 56, 64, 1, 1, 0),
    (2, 64, 56, 56, 64, 3, 1, 1),
    (2, 64, 56, 56, 256, 1, 1, 0),
    (2, 128, 56, 56, 128, 3, 2, 1),
    (2, 256, 56, 56, 512, 1, 2, 0),
    (1, 512, 7, 7, 2048, 1, 1, 0),
    (3, 37, 9, 11, 33, 3, 1, 1),
    (2, 5, 13, 7, 20, 3, 2, 1),
]


@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("residual", [None, "e4m3"])
def test_conv_every_candidate(case, residual, monkeypatch):
    N, C, H, W, OC, k, s, p = case
    x = torch.randn(N, C, H, W, device=DEVICE)
    w = torch.randn(OC, C, k, k, device=DEVICE) / (C * k * k) ** 0.5
    b = torch.randn(OC, device=DEVICE)
    xs = scale_of(x.abs().max())
    xq = quantize(x, xs).contiguous(memory_format=torch.channels_last)
    wq, ws = quantize_weight(w)
    scale = dequant_scale(xs, ws)
    shape = (N, OC, conv_output_size(H, k, s, p, 1), conv_output_size(W, k, s, p, 1))
    r, rs = None, 1.0
    if residual:
        r = torch.randn(shape, device=DEVICE)
        rs = scale_of(r.abs().max())
        r = quantize(r, rs).contiguous(memory_format=torch.channels_last)
    from kernels.tiles import device_limits

    m = N * shape[2] * shape[3]
    candidates = conv_fp8.cuda_configs(conv_fp8.m_bucket(m), OC, C, C * k * k, device_limits(torch.device(DEVICE))[0])
    # conv_tma_fp8's boxes too where they run (x e4m3 channels_last with 16-byte rows; y NHWC with 16-byte rows)
    y = torch.empty(shape, device=DEVICE, dtype=E4M3, memory_format=torch.channels_last)
    if conv_tma_fp8.eligible(xq, wq.contiguous(memory_format=torch.channels_last), (s, s), y):
        candidates += conv_tma.cuda_configs(conv_fp8.m_bucket(m), OC, C, *shape[2:], (1, 1), 1, strided=s > 1)
    for out_scale in (4.0 / 448, None):
        kw = dict(stride=s, padding=p, residual=r, residual_scale=rs, out_scale=out_scale)
        want = reference.conv2d_fp8(xq, wq, scale, b, "relu", **kw)
        magnitude = reference.conv2d_fp8(
            abs_e4m3(xq), abs_e4m3(wq), scale, stride=s, padding=p, out_dtype=torch.float32
        )
        magnitude = magnitude / (out_scale or 1.0)
        for config in candidates:
            conv_fp8._configs.clear()
            monkeypatch.setattr(conv_fp8, "tune", lambda *a, config=config, **k: config)
            got = conv_fp8.fused_conv2d_fp8(xq, wq, scale, b, activation="relu", **kw)
            what = f"{case} residual={residual} out_scale={out_scale} {config}"
            assert_close_on_hopper(got, want, magnitude, C * k * k, what)
    conv_fp8._configs.clear()


@pytest.mark.parametrize("M,N,K", [(1, 1000, 2048), (256, 1000, 2048), (37, 33, 97), (64, 256, 64)])
def test_linear_every_candidate(M, N, K, monkeypatch):
    x = torch.randn(M, K, device=DEVICE)
    w = torch.randn(N, K, device=DEVICE) / K**0.5
    b = torch.randn(N, device=DEVICE)
    xs = scale_of(x.abs().max())
    wq, ws = quantize_weight(w)
    scale = dequant_scale(xs, ws)
    for x_in, out_scale in ((quantize(x, xs), 4.0 / 448), (x.half(), None)):
        want = reference.linear_fp8(x_in, wq, scale, b, "relu", x_scale=xs, out_scale=out_scale)
        xq = x_in if out_scale is not None else quantize(x, xs)  # what the kernel multiplies: x_in quantized
        magnitude = reference.linear_fp8(abs_e4m3(xq), abs_e4m3(wq), scale, out_dtype=torch.float32) / (
            out_scale or 1.0
        )
        for config in linear_fp8.cuda_configs(linear_fp8.m_bucket(M), N, K):
            linear_fp8._configs.clear()
            monkeypatch.setattr(linear_fp8, "tune", lambda *a, config=config, **k: config)
            got = linear_fp8.fused_linear_fp8(x_in, wq, scale, b, "relu", x_scale=xs, out_scale=out_scale)
            assert_close_on_hopper(got, want, magnitude, K, f"{M}x{N}x{K} {config}")
    linear_fp8._configs.clear()


def test_hardware_cast_rounds_as_torch():
    """The compiled quantizer (cvt.rn.satfinite) on every e4m3 value, tie and near-tie: as torch's cast."""
    from tests.test_kernels_fp8 import test_quantization_rounds_as_torch as check_rounding

    check_rounding(1.0)
    check_rounding(0.37)


def _digits_splits():
    from tests.digits import split

    X_train, X_test, _, y_test = split()
    return X_train.astype(np.float32), X_test.astype(np.float32), y_test


@pytest.fixture
def untuned():
    previous = tuning.enabled()
    tuning.set_enabled(False)  # each kernel's first candidate: correctness here, speed in the probe
    yield
    tuning.set_enabled(previous)


@pytest.mark.parametrize("name", ["digits-cnn", "digits-resnet"])
def test_digits_held_out_accuracy_within_half_a_point(name, untuned):
    """Calibrated on the 1437 training digits, checked on the 360 held-out ones: float8's accuracy within 0.5 points
    of float16's (both fused)."""
    from service.model.calibrate import measure
    from service.model.executors import Executor
    from service.model.float8 import Calibration
    from service.model.loader import load_model
    from tests.server import REPO

    model = load_model(REPO / "model_weights" / name)
    X_train, X_test, y_test = _digits_splits()
    dev = torch.device(DEVICE)
    ranges, seen = measure(model, iter([X_train.reshape(-1, *model.input_shape)]), dev)
    cal = Calibration(ranges, seen, "train-split")
    x = torch.from_numpy(X_test.reshape(-1, *model.input_shape)).to(dev)
    acc = {}
    for precision in ("float16", "float8"):
        ex = Executor(model, "fused", dev, torch.float16, precision=precision, calibration=cal)
        with torch.no_grad():
            out = ex.forward(x.to(ex.input_dtype)).float().cpu()
        acc[precision] = float((out.argmax(1).numpy() == y_test).mean())
        if precision == "float8":
            assert ex.fp8, f"{name}: no step runs in float8"
    assert abs(acc["float8"] - acc["float16"]) <= 0.005, acc


def test_resnet50_logits_close_to_float16(tmp_path, untuned):
    """A ResNet-50 (random weights, 64x64 images to keep it short) calibrated on 32 random images: on 64 others, the
    logits' cosine similarity with float16's at least 0.99 on average, and top-1 agreement reported."""
    from bench.probes.fp8_resnet50 import agreement, build_model, calibration_on, random_images
    from service.model.executors import Executor

    image = (3, 64, 64)
    dev = torch.device(DEVICE)
    model = build_model(image, tmp_path)
    cal = calibration_on(model, random_images(32, image, 1, dev), dev)
    x = random_images(64, image, 2, dev).half()
    outs = {}
    for precision in ("float16", "float8"):
        ex = Executor(model, "fused", dev, torch.float16, precision=precision, calibration=cal)
        with torch.no_grad():
            outs[precision] = ex.forward(x).float()
    a = agreement(outs["float8"], outs["float16"])
    print("resnet50 float8 vs float16:", a)
    assert a["cosine_mean"] >= 0.99, a
