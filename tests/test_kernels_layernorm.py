"""fused_layernorm_channels against the float64 reference (reference.layernorm_channels: F.layer_norm on the
channels-last view, as torchvision's LayerNorm2d runs): ordinary and awkward shapes (batch 1 and primes; 1, 3, 7, 96,
200 and 768 channels; prime and unit planes), (N, C) vectors, every dtype, both memory formats in and out, weight and
bias in x's dtype or fp32 or absent, activations fused. Inputs have a non-zero mean (randn * 3 + 2; one test at
mean 30 x std, where a one-pass E[x^2] - E[x]^2 in fp32 is off by 10x the fp32 bound), and every output is
pre-filled with NaN, so an element left unwritten fails (assert_close_to checks finiteness).

Without CUDA these run through Triton's interpreter (the same kernel code) on small shapes; the compiled path, every
candidate config the tuner may pick and ConvNeXt-T's real shapes are the `gpu` tests.
"""

from __future__ import annotations

import pytest
import torch

import kernels.layernorm as ln_mod
from kernels import ACTIVATIONS, reference
from kernels.layernorm import fused_layernorm_channels
from tests.tolerances import RTOL, assert_close_to

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NCHW, NHWC = torch.contiguous_format, torch.channels_last
FORMATS = {"nchw": NCHW, "nhwc": NHWC}

# (N, C, H, W): one pixel; 3 channels on a prime plane; a prime batch of one channel; unit H, unit W; ConvNeXt's
# 96 on an odd plane; 200 (not a power of two: 56 masked lanes of 256); 768 (ConvNeXt-T's widest); 1x1 planes.
CASES = [
    (1, 1, 1, 1),
    (1, 3, 5, 7),
    (7, 1, 3, 2),
    (2, 7, 1, 5),
    (3, 7, 5, 1),
    (2, 96, 3, 2),
    (1, 200, 1, 3),
    (1, 768, 2, 1),
    (5, 3, 1, 1),
]
VECTORS = [(1, 3), (7, 1), (5, 200), (3, 768)]


def _ids(shape):
    return "x".join(map(str, shape))


def _inputs(shape, dtype, device, fmt=NCHW, param_dtype=None, offset=2.0, scale=3.0):
    """x = randn * scale + offset in `fmt`; weight around 1, bias around 0, in param_dtype (None: x's)."""
    x = (torch.randn(*shape, device=device) * scale + offset).to(dtype)
    if x.dim() == 4:
        x = x.contiguous(memory_format=fmt)
    C = shape[1]
    param_dtype = param_dtype or dtype
    w = (torch.randn(C, device=device) * 0.5 + 1.0).to(param_dtype)
    b = torch.randn(C, device=device).to(param_dtype)
    return x, w, b


def _check(x, w, b, activation="none", eps=1e-6, out_fmt=None, what=""):
    """The launcher writing into a NaN-filled `out` (out_fmt; None: x's format) against the float64 reference."""
    f64 = [None if t is None else t.double() for t in (x, w, b)]
    want = reference.layernorm_channels(*f64, eps, activation)
    if out_fmt is None:
        out_fmt = NHWC if x.dim() == 4 and ln_mod.channels_last(x) else NCHW
    out = torch.full(x.shape, float("nan"), device=x.device, dtype=x.dtype)
    if x.dim() == 4:
        out = out.contiguous(memory_format=out_fmt)
    got = fused_layernorm_channels(x, w, b, eps, activation, out=out)
    assert got is out
    label = f"{what} {tuple(x.shape)} {x.dtype} w={None if w is None else w.dtype} {activation}"
    assert_close_to(got, want, RTOL[x.dtype], label)
    return got


@pytest.fixture
def small_tile():
    """4 pixels a program: awkward pixel counts end mid-block, per image (NCHW) and over the batch (NHWC)."""
    with ln_mod.INTERPRETER.override(block_p=ln_mod.SMALL_INTERPRETER_BLOCK_P):
        yield


@pytest.fixture
def untuned():
    """The first candidate, untimed: correctness sweeps take one config per shape; test_gpu_convnext_t_shapes runs
    through the tuner and test_gpu_every_candidate forces each candidate."""
    from kernels import tuning

    tuning.set_enabled(False)
    yield
    tuning.set_enabled(None)
    ln_mod._configs.clear()  # the untimed picks, so that no later tuned test reuses them


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS.keys())
@pytest.mark.parametrize("shape", CASES, ids=_ids)
def test_awkward_shapes(small_tile, shape, fmt):
    _check(*_inputs(shape, torch.float32, DEVICE, fmt), what=str(fmt))


@pytest.mark.parametrize("activation", ["none", "gelu", "relu"])
@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype(dtype, fmt, activation):
    """The serving tile (one program here) on a prime batch of a ConvNeXt width and of an odd one."""
    for shape in ((3, 96, 3, 5), (2, 7, 5, 3)):
        _check(*_inputs(shape, dtype, DEVICE, fmt), activation, what=str(fmt))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", VECTORS, ids=_ids)
def test_vectors(shape, dtype):
    """(N, C): the classifier's LayerNorm before its Linear; contiguous, and a transposed (column-major) view."""
    x, w, b = _inputs(shape, dtype, DEVICE)
    _check(x, w, b, "gelu")
    _check(x.t().contiguous().t(), w, b, "relu")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fp32_weight_and_bias_with_half_x(dtype):
    for fmt in (NCHW, NHWC):
        _check(*_inputs((2, 96, 3, 3), dtype, DEVICE, fmt, param_dtype=torch.float32), "gelu")
    _check(*_inputs((3, 200), dtype, DEVICE, param_dtype=torch.float32))


def test_without_weight_or_bias():
    x, w, b = _inputs((2, 7, 3, 5), torch.float32, DEVICE, NHWC)
    _check(x, w, None, what="no bias")
    _check(x, None, b, what="no weight")
    _check(x, None, None, "relu", what="neither")
    assert_close_to(fused_layernorm_channels(x, w), reference.layernorm_channels(x.double(), w.double()),
                    RTOL[torch.float32], "bias defaults to None")  # fmt: skip


@pytest.mark.parametrize("eps", [1e-6, 1e-5, 0.1])
def test_eps_and_constant_pixels(eps):
    """eps is added to the variance: where a pixel's channels are all equal, y = bias exactly (0 * rstd(eps));
    elsewhere eps shows at a small variance (std 0.01: eps 1e-5 moves y by 5%)."""
    x, w, b = _inputs((2, 7, 3, 3), torch.float32, DEVICE, NHWC, offset=0.0, scale=0.01)
    x[:, :, 1, 2] = 5.0
    got = _check(x, w, b, eps=eps, what=f"eps={eps}")
    assert torch.equal(got[:, :, 1, 2].cpu(), b.expand(2, 7).cpu())


def test_mean_far_from_zero_needs_two_passes():
    """At mean 30 x std (randn + 30, 96 channels) the two-pass variance is within the fp32 bound, where one pass,
    E[x^2] - E[x]^2 in fp32, is off by ~1e-4 of y (measured here: fails the same assert)."""
    x, w, b = _inputs((4, 96, 4, 4), torch.float32, DEVICE, NHWC, offset=30.0, scale=1.0)
    _check(x, w, b, what="mean 30")
    rows = x.permute(0, 2, 3, 1).reshape(-1, 96)
    mean = rows.mean(1, keepdim=True)
    var = (rows * rows).mean(1, keepdim=True) - mean * mean
    one_pass = ((rows - mean) * torch.rsqrt(var + 1e-6) * w + b).reshape(4, 4, 4, 96).permute(0, 3, 1, 2)
    want = reference.layernorm_channels(x.double(), w.double(), b.double())
    with pytest.raises(AssertionError, match="max error"):
        assert_close_to(one_pass, want, RTOL[torch.float32], "one pass")


@pytest.mark.parametrize("x_fmt,y_fmt", [(NHWC, NCHW), (NCHW, NHWC)], ids=["nhwc-to-nchw", "nchw-to-nhwc"])
def test_output_in_the_other_memory_format(x_fmt, y_fmt):
    x, w, b = _inputs((3, 7, 3, 5), torch.float16, DEVICE, x_fmt)
    _check(x, w, b, "gelu", out_fmt=y_fmt)
    y = fused_layernorm_channels(x, w, b, memory_format=y_fmt)
    assert y.is_contiguous(memory_format=y_fmt) and not y.is_contiguous(memory_format=x_fmt)
    assert_close_to(y, reference.layernorm_channels(x.double(), w.double(), b.double()), RTOL[torch.float16], "fmt")


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS.keys())
def test_output_takes_x_memory_format_by_default(fmt):
    x, w, b = _inputs((2, 5, 3, 4), torch.float32, DEVICE, fmt)
    y = fused_layernorm_channels(x, w, b, activation="relu")
    assert y.is_contiguous(memory_format=fmt) and y.shape == x.shape and y.dtype == x.dtype
    assert_close_to(y, reference.layernorm_channels(x.double(), w.double(), b.double(), 1e-6, "relu"),
                    RTOL[torch.float32], "default format")  # fmt: skip


def test_strided_views():
    """A crop of a wider plane (h and w do not merge: copied once) and a channel slice of channels_last x (pixel
    stride 12, channel stride 1)."""
    big, w, b = _inputs((2, 12, 5, 9), torch.float32, DEVICE)
    _check(big[:, 2:9, :, 1:6], w[2:9], b[2:9], "gelu", out_fmt=NCHW, what="crop")
    big_cl = big.contiguous(memory_format=NHWC)
    _check(big_cl[:, 3:10], w[3:10], b[3:10], out_fmt=NHWC, what="channel slice")


def test_tiles_agree():
    """The small and the serving tile agree exactly: each pixel's sums are over its own row whatever BLOCK_P."""
    x, w, b = _inputs((2, 7, 3, 3), torch.float32, DEVICE, NHWC)
    big = fused_layernorm_channels(x, w, b, activation="gelu")
    with ln_mod.INTERPRETER.override(block_p=ln_mod.SMALL_INTERPRETER_BLOCK_P):
        small = fused_layernorm_channels(x, w, b, activation="gelu")
    assert torch.equal(big, small)


def test_empty_batch():
    x = torch.randn(0, 7, 3, 3, device=DEVICE)
    assert fused_layernorm_channels(x, torch.ones(7, device=DEVICE)).shape == (0, 7, 3, 3)


BAD_INPUTS = [
    (lambda x, w: (x[0], w), {}, r"x must be \(N, C, H, W\) or \(N, C\)"),
    (lambda x, w: (x.double(), w.double()), {}, "float64"),
    (lambda x, w: (x, w[:3]), {}, r"weight must have shape \(7,\)"),
    (lambda x, w: (x, w, w[:1]), {}, r"bias must have shape \(7,\)"),
    (lambda x, w: (x, w.half()), {}, "weight has dtype torch.float16; it must be x's"),
    (lambda x, w: (x, w), {"activation": "swish"}, "unknown activation 'swish'"),
    (lambda x, w: (x, w), {"memory_format": torch.preserve_format}, "memory_format must be"),
    (lambda x, w: (x[:, :, 0, 0], w), {"memory_format": NHWC}, "channels_last needs a 4-D x"),
    (lambda x, w: (x, w), {"out": torch.empty(1)}, r"out must be a \(2, 7, 3, 4\)"),
    (lambda x, w: (torch.empty(1, ln_mod.MAX_C + 1, device=x.device), None), {}, "channels in registers"),
]


@pytest.mark.parametrize("make,kwargs,message", BAD_INPUTS, ids=[m for _, _, m in BAD_INPUTS])
def test_bad_inputs_are_named(make, kwargs, message):
    x, w, _ = _inputs((2, 7, 3, 4), torch.float32, DEVICE)
    if "out" in kwargs:
        kwargs = {"out": kwargs["out"].to(DEVICE)}
    with pytest.raises((ValueError, TypeError), match=message):
        fused_layernorm_channels(*make(x, w), **kwargs)


def test_candidates():
    """Every candidate holds the whole row (BLOCK_C >= C) in 64 fp32 values a thread or fewer, and never more
    pixels than the input has; each list is non-empty and free of duplicates."""
    for pixels in (1, 7, 49, 3136, 802816):
        for C in (1, 3, 96, 200, 768, 2048, ln_mod.MAX_C):
            configs = ln_mod.cuda_configs(pixels, C)
            assert configs and len(set(configs)) == len(configs)
            for c in configs:
                assert C <= c["BLOCK_C"] < 2 * C and c["BLOCK_P"] <= max(1, 2 * pixels)
                assert c["BLOCK_P"] * c["BLOCK_C"] <= 64 * 32 * c.num_warps


# ---- compiled path, on the lent GPU ----


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_awkward_shapes(untuned, dtype):
    for fmt in (NCHW, NHWC):
        for shape in CASES:
            _check(*_inputs(shape, dtype, "cuda", fmt), "gelu", what=str(fmt))
    for shape in VECTORS:
        _check(*_inputs(shape, dtype, "cuda", param_dtype=torch.float32), "relu")


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_every_dtype_and_activation(untuned, dtype, activation):
    _check(*_inputs((5, 200, 7, 11), dtype, "cuda", NHWC), activation, what="nhwc")
    _check(*_inputs((3, 768, 7, 7), dtype, "cuda", NCHW), activation, what="nchw")
    _check(*_inputs((5, 200), dtype, "cuda"), activation, what="vectors")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_formats_views_and_params(untuned, dtype):
    for x_fmt, y_fmt in ((NHWC, NCHW), (NCHW, NHWC)):
        _check(*_inputs((3, 96, 13, 7), dtype, "cuda", x_fmt), "gelu", out_fmt=y_fmt)
    big, w, b = _inputs((2, 300, 9, 17), dtype, "cuda", param_dtype=torch.float32)
    _check(big[:, 2:202, :, 1:12], w[2:202], b[2:202], out_fmt=NCHW, what="crop")
    _check(big.contiguous(memory_format=NHWC)[:, 4:196], w[4:196], None, out_fmt=NHWC, what="channel slice")
    x, w, b = _inputs((4, 96, 8, 8), dtype, "cuda", NHWC, offset=30.0 if dtype == torch.float32 else 2.0, scale=1.0)
    _check(x, None, b, what="mean far from zero, no weight")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS.keys())
def test_gpu_convnext_t_shapes(fmt, dtype):
    """ConvNeXt-T at 256 images through the tuner: the stem's and each stage's LayerNorm2d (96, 192, 384, 768
    channels on 56, 28, 14, 7 squared), gelu after the last to check the fused epilogue at size, and the head's
    LayerNorm on (256, 768)."""
    for C, S in ((96, 56), (192, 28), (384, 14), (768, 7)):
        activation = "gelu" if C == 768 else "none"
        _check(*_inputs((256, C, S, S), dtype, "cuda", fmt), activation, what=f"ConvNeXt-T {fmt}")
    _check(*_inputs((256, 768), dtype, "cuda"), what="ConvNeXt-T head")


@pytest.mark.gpu
def test_gpu_every_candidate(monkeypatch):
    """Each config the tuner may pick, forced, on both formats, at widths of one program per pixel (768) and of
    many (3, 96), on pixel counts off every block edge."""
    for C, shape in ((3, (3, 3, 37, 41)), (96, (5, 96, 13, 11)), (768, (3, 768, 7, 7))):
        for fmt in (NCHW, NHWC):
            x, w, b = _inputs(shape, torch.float16, "cuda", fmt)
            N, _, H, W = shape
            pixels = N * H * W if fmt == NHWC else H * W
            for config in ln_mod.cuda_configs(pixels, C):
                monkeypatch.setattr(ln_mod, "tune", lambda *a, config=config, **kw: config)
                ln_mod._configs.clear()
                _check(x, w, b, "silu", what=f"{config} {fmt}")
    ln_mod._configs.clear()


@pytest.mark.gpu
def test_gpu_graph_capture():
    """The launcher is capturable: after a warm-up (which tunes) a CUDA graph replays it on new inputs."""
    from kernels.graph_capture import capture

    x, w, b = _inputs((8, 96, 14, 14), torch.float16, "cuda", NHWC)
    graph, y = capture(lambda: fused_layernorm_channels(x, w, b, activation="gelu"), warmups=2)
    x.copy_(torch.randn_like(x) * 3 + 2)
    y.fill_(float("nan"))
    graph.replay()
    want = reference.layernorm_channels(x.double(), w.double(), b.double(), 1e-6, "gelu")
    assert_close_to(y, want, RTOL[torch.float16], "graph")
