"""The TMA conv kernel (kernels/conv_tma.py) through fused_conv2d, against the float64 reference: awkward shapes
(primes, channels off the K step, OC off the N block, boxes past the image's edge, dilation, padding 0 to 2, 1x1 and
5x3 windows), every dtype and activation, fused 2x2 / 1x2 / 4x4 pools, NHWC and NCHW outputs. Outputs start as NaN:
an element not written fails.

On the CPU through Triton's interpreter (kernels.conv.INTERPRETER's `tma` routes eligible calls to this kernel); on the
GPU every candidate the tuner may pick, forced; compiled for sm_90 here (TMA copies, warpgroup MMAs, no spills).
"""

from __future__ import annotations

import pytest
import torch

import kernels.conv as conv_mod
from kernels import ACTIVATIONS, conv_tma, reference
from kernels.conv import conv_output_size, fused_conv2d
from kernels.pool import pair
from tests.tolerances import NORMWISE_TF32, RTOL, assert_close_to, normwise_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NHWC = torch.channels_last

# (N, C, H, W, OC, kernel, padding, dilation): C a multiple of 8 (16-byte rows in every dtype) but not of the
# 16-wide K step (24, 40), OC prime or off the block (17, 20, 33), odd and prime image sides, 1x1 and 5x3 windows.
AWKWARD = [
    (1, 8, 8, 8, 16, 3, 1, 1),
    (3, 24, 7, 5, 17, 3, 1, 1),
    (2, 16, 9, 11, 20, 3, 2, 2),
    (5, 40, 5, 5, 33, 1, 0, 1),
    (2, 16, 6, 13, 8, (5, 3), (2, 1), 1),
    (7, 8, 3, 3, 24, 3, 1, 1),
]


# Strided, the stride a ninth entry (x read by parity, conv_tma's doc): 3x3/2 and 1x1/2 as ResNets have them, OC off
# the block, C a multiple of 16 but not of 32 (48: 16-channel K steps), 5x5/2 over padding 2, dilated, stride 3, and 2
# down the rows only.
STRIDED = [
    (2, 32, 8, 8, 24, 3, 1, 1, 2),
    (3, 16, 6, 10, 20, 1, 0, 1, 2),
    (1, 48, 10, 6, 32, 3, 1, 1, 2),
    (2, 16, 12, 12, 16, 5, 2, 1, 2),
    (2, 16, 8, 8, 16, 3, 2, 2, 2),
    (1, 32, 9, 9, 16, 3, 1, 1, 3),
    (5, 16, 4, 6, 8, 3, 1, 1, (2, 1)),
]


def _ids(case):
    return "-".join(str(v).replace(" ", "") for v in case)


@pytest.fixture
def tma_on(monkeypatch):
    """Eligible calls run conv_tma's kernel: interpreted, with a 32-pixel box, so that boxes cross image edges; on
    CUDA, the first TMA candidate the tuner is offered (whichever would be faster). Each launch is counted, so a test
    can tell that it did."""
    calls = []
    launch = conv_tma.launch

    def counted(*args, **kwargs):
        calls.append(args[-1])
        return launch(*args, **kwargs)

    def first_tma(scope, key, candidates, run, *args, **kwargs):
        candidates = list(candidates)
        return next((c for c in candidates if conv_tma.is_tma(c)), candidates[0])

    monkeypatch.setattr(conv_mod, "tune", first_tma)
    monkeypatch.setattr(conv_mod, "_configs", {})  # picks made without the fixture are not reused, nor kept after
    monkeypatch.setattr(conv_tma, "launch", counted)
    with conv_mod.INTERPRETER.override(tma=True, tile=(32, 16, 16)):
        yield calls


def _stride(case) -> tuple[int, int]:
    """A case's stride: its ninth entry, an int or a pair, where it has one; else 1."""
    s = case[8] if len(case) > 8 else 1
    return (s, s) if isinstance(s, int) else tuple(s)


def _inputs(case, dtype, device, bias=True):
    N, C, H, W, OC, k, *_ = case
    kh, kw = (k, k) if isinstance(k, int) else k
    x = torch.randn(N, C, H, W, device=device).to(dtype).contiguous(memory_format=NHWC)
    w = (torch.randn(OC, C, kh, kw, device=device) / (C * kh * kw) ** 0.5).to(dtype)
    b = torch.randn(OC, device=device).to(dtype) if bias else None
    return x, conv_tma.weight_for(w, _stride(case)), b


def _conv_out(case) -> tuple[int, int]:
    """The conv's output rows and columns (before any pool)."""
    _, _, H, W, _, k, p, d = case[:8]
    (kh, kw), (ph, pw), (dh, dw), (sh, sw) = pair(k, "k"), pair(p, "p"), pair(d, "d"), _stride(case)
    return conv_output_size(H, kh, sh, ph, dh), conv_output_size(W, kw, sw, pw, dw)


def _check(
    case, dtype, activation, device, pool=None, y_format=NHWC, bias=True, allow_tf32=False, rtol=None, inputs=None,
    residual=None,
):  # fmt: skip
    """Returns the output and the inputs (x, w, b), which a second call may take again. residual: None, or the
    memory format of a fresh random residual added before the activation (no pool)."""
    x, w, b = inputs or _inputs(case, dtype, device, bias)
    p, d, s = case[6], case[7], _stride(case)
    r = None
    if residual is not None:
        shape = reference.conv2d(x[:1].double(), w.double(), stride=s, padding=p, dilation=d).shape
        r = torch.randn(x.shape[0], *shape[1:], device=device).to(dtype).contiguous(memory_format=residual)
    want = reference.conv2d(x.double(), w.double(), b.double() if b is not None else None, activation,
                            stride=s, padding=p, dilation=d, residual=r if r is None else r.double())  # fmt: skip
    if pool is not None:
        want = reference.pool2d(want, pool[0], pool[1])
    out = torch.full(want.shape, float("nan"), device=device, dtype=dtype).contiguous(memory_format=y_format)
    got = fused_conv2d(x, w, b, stride=s, padding=p, dilation=d, activation=activation, pool=pool,
                       allow_tf32=allow_tf32, out=out, residual=r)  # fmt: skip
    assert got is out
    what = f"{case} {dtype} {activation} pool={pool} y={y_format} bias={bias} residual={residual}"
    assert_close_to(got, want, rtol or RTOL[dtype], what)
    return got, (x, w, b)


@pytest.mark.parametrize("y_format", [NHWC, torch.contiguous_format], ids=["y_nhwc", "y_nchw"])
@pytest.mark.parametrize("case", AWKWARD + STRIDED, ids=_ids)
def test_awkward_shapes(tma_on, case, y_format):
    _check(case, torch.float32, "leaky_relu", DEVICE, y_format=y_format)
    nhwc_rows_ok = (case[4] * 4) % 16 == 0  # an NHWC y needs 16-byte rows of OC: else the pointer kernel runs
    assert len(tma_on) == (1 if y_format is not NHWC or nhwc_rows_ok else 0)


# Every activation in every dtype at stride 1, and at stride 2 each activation once, the dtypes in turn: the stride
# decides how x is read (the main loop), the activation only the epilogue, which is the same code at either stride.
# The full product at stride 2 too (33 more cases, ~13 CPU-s under the interpreter, issue 51) checked nothing more
# than these 11; the GPU sweeps run every candidate at both strides.
EVERY_DTYPE_AND_ACTIVATION = [(d, a, "stride1") for d in DTYPES for a in ACTIVATIONS] + [
    (DTYPES[i % len(DTYPES)], a, "stride2") for i, a in enumerate(ACTIVATIONS)
]


@pytest.mark.parametrize(("dtype", "activation", "case"), EVERY_DTYPE_AND_ACTIVATION, ids=str)
def test_every_dtype_and_activation(tma_on, dtype, activation, case):
    _check({"stride1": AWKWARD[4], "stride2": STRIDED[0]}[case], dtype, activation, DEVICE)
    assert len(tma_on) == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_without_bias(tma_on, dtype):
    _check(AWKWARD[1], dtype, "gelu", DEVICE, bias=False, y_format=torch.contiguous_format)
    assert len(tma_on) == 1


# Each case into both layouts of y, the residual in y's layout for one and in the other for the other, swapped case
# by case: a residual in the other layout is copied into y's before the launch (tiles.residual_like), so the kernel
# reads the same tensor either way. Both residual layouts for every y (twice these 4, ~3 CPU-s, issue 51) ran the
# same kernels again.
LAYOUTS = {"nhwc": NHWC, "nchw": torch.contiguous_format}
RESIDUAL_CASES = [(c, y, [y, x][(i + j) % 2]) for i, c in enumerate([AWKWARD[1], AWKWARD[4]])
                  for j, (y, x) in enumerate([("nhwc", "nchw"), ("nchw", "nhwc")])]  # fmt: skip


@pytest.mark.parametrize("case,y,r", RESIDUAL_CASES, ids=[f"{_ids(c)}-y_{y}-r_{r}" for c, y, r in RESIDUAL_CASES])
def test_residual(tma_on, case, y, r):
    """Read with pointers at y's offsets, NHWC y (stored by TMA) or NCHW; a residual in the other layout is copied
    into y's first."""
    y_format = LAYOUTS[y]
    _check(case, torch.float32, "leaky_relu", DEVICE, y_format=y_format, residual=LAYOUTS[r])
    nhwc_rows_ok = (case[4] * 4) % 16 == 0  # an NHWC y needs 16-byte rows of OC: else the pointer kernel runs
    assert len(tma_on) == (1 if y_format is not NHWC or nhwc_rows_ok else 0)


@pytest.mark.parametrize("activation", ["relu", "hardswish"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_residual_every_dtype(tma_on, dtype, activation):
    _check(AWKWARD[4], dtype, activation, DEVICE, bias=False, residual=NHWC)
    assert len(tma_on) == 1


# (case, pool): 2x2 over even and odd conv outputs (floor mode drops the last row and column), a 1x2 window,
# 4x4 over a 9x9 output; max and avg.
POOLED = [
    ((2, 16, 8, 8, 16, 3, 1, 1), ("max", 2)),
    ((3, 8, 7, 9, 24, 3, 1, 1), ("avg", 2)),
    ((1, 24, 5, 6, 16, 3, 1, 1), ("max", (1, 2))),
    ((2, 8, 9, 9, 8, 3, 1, 1), ("avg", 4)),
]


# Each pooled case into both layouts of y (a TMA store, NHWC, or a pointer one, NCHW), fp32 with silu into one and
# bf16 with relu into the other, the pairing swapped case by case, so that each dtype is stored both ways at every
# window. Both dtypes into both layouts of every case (twice the launches, ~6 CPU-s under the interpreter, issue
# 51) ran the same pool epilogue: the dtype changes only the final rounding, the layout only the store after it.
POOL_CASES = [(c, p, y, (torch.float32, "silu") if (i + j) % 2 == 0 else (torch.bfloat16, "relu"))
              for i, (c, p) in enumerate(POOLED) for j, y in enumerate([NHWC, torch.contiguous_format])]  # fmt: skip


@pytest.mark.parametrize(
    "case,pool,y_format,dtype_activation",
    POOL_CASES,
    ids=[_ids(c) + f"-{p}-{'y_nhwc' if y is NHWC else 'y_nchw'}-{str(d)[6:]}" for c, p, y, (d, _) in POOL_CASES],
)
def test_pool_fused(tma_on, case, pool, y_format, dtype_activation):
    _check(case, *dtype_activation, DEVICE, pool=pool, y_format=y_format)
    assert len(tma_on) == 1


def test_max_pool_propagates_nan(tma_on):
    """A NaN in a window makes its max NaN, as torch's max_pool2d does, and leaves the other windows alone."""
    x, w, b = _inputs((1, 8, 4, 4, 16, 1, 0, 1), torch.float32, DEVICE)
    x[0, :, 0, 0] = float("nan")
    got = fused_conv2d(x, w, b, activation="none", pool=("max", 2), allow_tf32=False)
    want = reference.pool2d(reference.conv2d(x.double(), w.double(), b.double(), "none"), "max", 2)
    assert len(tma_on) == 1
    assert got[0, :, 0, 0].isnan().all() and not got[0, :, 1:, :].isnan().any() and not got[0, :, :, 1:].isnan().any()
    assert_close_to(got[..., 1:], want[..., 1:], RTOL[torch.float32], "windows without the NaN")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_residual_and_pool(tma_on, dtype):
    """A ResNet downsampling block's 3x3/2 with its skip added, and a strided conv with a 2x2 pool fused after it."""
    _check(STRIDED[0], dtype, "relu", DEVICE, residual=NHWC)
    _check(STRIDED[3], dtype, "silu", DEVICE, pool=("max", 2), y_format=torch.contiguous_format)
    assert len(tma_on) == 2


def test_strided_not_eligible_goes_to_the_gathers(tma_on):
    """Sides that are not multiples of the stride, or C of no K step: conv.py's kernel, still right."""
    for case in [(2, 16, 7, 8, 16, 3, 1, 1, 2), (2, 16, 8, 9, 16, 1, 0, 1, 2), (1, 24, 8, 8, 16, 3, 1, 1, 2)]:
        _check(case, torch.float32, "relu", DEVICE)
    assert tma_on == []


def test_eligibility():
    """Stride 1, channels_last x and weight with 16-byte rows of channels, non-overlapping power-of-two pools;
    anything else goes to conv.py's kernel."""
    x = torch.randn(2, 16, 8, 8).contiguous(memory_format=NHWC)
    w = torch.randn(32, 16, 3, 3).contiguous(memory_format=NHWC)
    y = torch.empty(2, 32, 8, 8).contiguous(memory_format=NHWC)
    assert conv_tma.eligible(x, w, (1, 1), None, y)
    assert conv_tma.eligible(x, w, (1, 1), ("max", (2, 2), (2, 2)), y)
    assert conv_tma.eligible(x, w, (1, 1), None, torch.empty(2, 32, 8, 8))  # NCHW y: stored with pointers
    y2 = torch.empty(2, 32, 4, 4).contiguous(memory_format=NHWC)
    assert conv_tma.eligible(x, w, (2, 2), None, y2)  # strided: 8x8 by 2, 16 channels = one K step
    assert not conv_tma.eligible(x, w, (3, 3), None, y2)  # 8 rows do not split into threes
    x24 = torch.randn(2, 24, 8, 8).contiguous(memory_format=NHWC)
    w24 = torch.randn(32, 24, 3, 3).contiguous(memory_format=NHWC)
    assert conv_tma.eligible(x24, w24, (1, 1), None, y)
    assert not conv_tma.eligible(x24, w24, (2, 2), None, y2)  # 24 channels: no 16- or 32-wide step divides them
    assert not conv_tma.eligible(x.contiguous(), w, (1, 1), None, y)
    assert not conv_tma.eligible(x, w.contiguous(), (1, 1), None, y)
    assert not conv_tma.eligible(x, w, (1, 1), ("max", (3, 3), (2, 2)), y)  # overlapping
    assert not conv_tma.eligible(x, w, (1, 1), ("avg", (3, 3), (3, 3)), y)  # not a power of two
    x3 = torch.randn(2, 3, 8, 8).contiguous(memory_format=NHWC)
    assert not conv_tma.eligible(x3, torch.randn(32, 3, 3, 3).contiguous(memory_format=NHWC), (1, 1), None, y)
    y_odd = torch.empty(2, 17, 8, 8).contiguous(memory_format=NHWC)  # 17 channels: 68-byte rows
    assert not conv_tma.eligible(x, w[:17].contiguous(memory_format=NHWC), (1, 1), None, y_odd)
    # the weight as a model keeps it: channels_last only where the kernel can run the layer
    assert conv_tma.weight_for(torch.randn(32, 16, 3, 3), (1, 1)).is_contiguous(memory_format=NHWC)
    assert conv_tma.weight_for(torch.randn(32, 16, 3, 3), (2, 2)).is_contiguous(memory_format=NHWC)
    assert conv_tma.weight_for(torch.randn(32, 24, 3, 3), (2, 2)).is_contiguous()
    assert conv_tma.weight_for(torch.randn(32, 3, 3, 3), (1, 1)).is_contiguous()


def test_boxes_and_candidates():
    """Boxes of whole rows where they fit, multiples of the pool window; every candidate fits in shared memory."""
    assert conv_tma.box_shape(128, 32, 32) == (1, 4, 32)
    assert conv_tma.box_shape(128, 16, 16) == (1, 8, 16)
    assert conv_tma.box_shape(128, 8, 8) == (2, 8, 8)
    assert conv_tma.box_shape(64, 5, 7) == (1, 8, 8)  # one box per image: 4 + 1 rows would take two
    assert conv_tma.box_shape(64, 1, 1) == (64, 1, 1)
    assert conv_tma.box_shape(16, 1, 3, (2, 2)) == (2, 2, 4)
    for C, H, OC, pool, size in [(64, 32, 64, (1, 1), 2), (64, 16, 128, (2, 2), 2), (128, 8, 128, (2, 2), 4),
                                 (16, 8, 16, (2, 2), 2)]:  # fmt: skip
        for bucket in (64, 1 << 18):
            configs = conv_tma.cuda_configs(bucket, OC, C, H, H, pool, size)
            assert configs and all(conv_tma.is_tma(c) for c in configs)
            for c in configs:
                assert conv_tma.shared_memory_bytes(c, size) <= conv_tma.HOPPER_SHARED_MEMORY
                assert c["BH"] % pool[0] == 0 and c["BW"] % pool[1] == 0
                assert c["BLOCK_K"] <= max(16, C) and c["BLOCK_N"] in {min(max(OC, 16), 128), 64}
                bm = c["IMG"] * c["BH"] * c["BW"]
                racy = max(bm, c["BLOCK_N"]) == 128 and c["BLOCK_K"] * size == 128  # see conv_tma.cuda_configs
                assert racy == conv_tma.racy_stages(bm, c["BLOCK_N"], c["BLOCK_K"], size)
                assert c.num_stages == 2 if racy else c.num_stages in (3, 4)
            assert (bucket <= 64) == all(c["IMG"] * c["BH"] * c["BW"] == 64 for c in configs)


# ---- on the GPU ----

# The wider CNN's convs (NHWC in and out; pooled as the model runs them) and the digits CNN's second (y NCHW before
# its flatten), plus an awkward one, at batches whose grids run several waves over the SMs (a race that showed only
# then: conv_tma.cuda_configs) and end in a partly filled box.
GPU_LAYERS = [
    ((129, 64, 32, 32, 64, 3, 1, 1), None, NHWC),
    ((257, 64, 16, 16, 128, 3, 1, 1), ("max", 2), NHWC),
    ((257, 64, 16, 16, 128, 3, 1, 1), None, NHWC),
    ((1025, 128, 8, 8, 128, 3, 1, 1), ("max", 2), torch.contiguous_format),
    ((1025, 16, 8, 8, 16, 3, 1, 1), ("max", 2), torch.contiguous_format),
    ((65, 40, 9, 11, 24, (5, 3), (2, 1), 1), ("avg", 2), NHWC),
    # ResNet's strided convs: 3x3/2 at 56 -> 28 and 14 -> 7, 1x1/2 (the downsampling skip) at 28 -> 14
    ((33, 64, 56, 56, 128, 3, 1, 1, 2), None, NHWC),
    ((129, 256, 14, 14, 512, 3, 1, 1, 2), None, NHWC),
    ((65, 256, 28, 28, 512, 1, 0, 1, 2), None, NHWC),
]


def _candidates(case, window, itemsize):
    N, C, _, _, OC = case[:5]
    OH, OW = _conv_out(case)
    strided = _stride(case) != (1, 1)
    return conv_tma.cuda_configs(conv_mod.m_bucket(N * OH * OW), OC, C, OH, OW, window, itemsize, strided=strided)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_every_candidate(monkeypatch, dtype):
    """Each TMA config the tuner may pick, forced, on every layer above, twice: right both times and bitwise the
    same (fp32 in TF32 too)."""
    for case, pool, y_format in GPU_LAYERS:
        window = (pool[1], pool[1]) if pool else (1, 1)
        for config in _candidates(case, window, dtype.itemsize):
            monkeypatch.setattr(conv_mod, "tune", lambda *a, config=config, **kw: config)
            conv_mod._configs.clear()
            first = _check(case, dtype, "silu", "cuda", pool=pool, y_format=y_format)
            again = _check(case, dtype, "silu", "cuda", pool=pool, y_format=y_format, inputs=first[1])
            assert torch.equal(first[0], again[0]), f"{case} {config}: two runs differ"
            if dtype == torch.float32:
                # TF32 judged normwise, as test_kernels_conv.test_gpu_tf32: elementwise at 3e-3 of the output's scale
                # one of 8.4 million outputs missed (error 4.1e-3; 64 -> 64 at 32x32, 576 truncated products each)
                got, (x, w, b) = _check(case, dtype, "relu", "cuda", pool=pool, y_format=y_format, allow_tf32=True,
                                        rtol=2e-2)  # fmt: skip
                want = reference.conv2d(x.double(), w.double(), b.double(), "relu", stride=_stride(case),
                                        padding=case[6], dilation=case[7])  # fmt: skip
                want = reference.pool2d(want, pool[0], pool[1]) if pool else want
                assert normwise_error(got, want) <= NORMWISE_TF32, f"{case} {config}: TF32 normwise error"
    conv_mod._configs.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_every_candidate_with_residual(monkeypatch, dtype):
    """Each TMA config, forced, with a residual in y's layout, on the unpooled layers above (NHWC y) and one into
    NCHW y, at several waves: right, and bitwise the same twice."""
    layers = [(case, y_format) for case, pool, y_format in GPU_LAYERS if pool is None]
    layers.append(((1025, 128, 8, 8, 128, 3, 1, 1), torch.contiguous_format))
    for case, y_format in layers:
        for config in _candidates(case, (1, 1), dtype.itemsize):
            monkeypatch.setattr(conv_mod, "tune", lambda *a, config=config, **kw: config)
            conv_mod._configs.clear()
            first = _check(case, dtype, "relu", "cuda", y_format=y_format, residual=y_format)
            x, w, b = first[1]
            r = torch.randn_like(first[0])  # y's layout
            again = [fused_conv2d(x, w, b, stride=_stride(case), padding=case[6], dilation=case[7], activation="relu",
                                  residual=r, memory_format=y_format, allow_tf32=False) for _ in range(2)]  # fmt: skip
            assert torch.equal(again[0], again[1]), f"{case} {config}: two runs differ"
    conv_mod._configs.clear()


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gpu_every_activation_tuned(activation):
    """The tuner's pick (TMA among the candidates) for every activation, bf16."""
    for case, pool, y_format in GPU_LAYERS[2:4]:
        _check(case, torch.bfloat16, activation, "cuda", pool=pool, y_format=y_format)


@pytest.mark.gpu
def test_gpu_graph_capture():
    """A CUDA graph of the TMA kernel (its descriptors made on the host at capture, kernel parameters the graph
    keeps) replays right on new inputs written into the same tensors."""
    from kernels.graph_capture import capture

    x, w, b = _inputs((16, 64, 16, 16, 128, 3, 1, 1), torch.float16, "cuda")
    config = conv_tma.cuda_configs(4096, 128, 64, 16, 16)[0]
    conv_mod._configs.clear()
    original = conv_mod.tune
    conv_mod.tune = lambda *a, **kw: config
    try:
        graph, y = capture(lambda: fused_conv2d(x, w, b, padding=1, activation="relu", memory_format=NHWC), warmups=2)
    finally:
        conv_mod.tune = original
        conv_mod._configs.clear()
    x.copy_(torch.randn_like(x))
    y.fill_(float("nan"))
    graph.replay()
    want = reference.conv2d(x.double(), w.double(), b.double(), "relu", padding=1)
    assert_close_to(y, want, RTOL[torch.float16], "graph replay")


# ---- compiled for Hopper here, without a GPU (tests/sm90_compile.py) ----

_COMPILE_TMA = r"""
import json, sys, torch
import kernels.conv_tma as ct
from tests.sm90_compile import compile_sm90, pdl_order, sample

dtype = getattr(torch, sys.argv[1])
ptr = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}[dtype]
name = ptr[1:]
runtime = dict(b_ptr=ptr, r_ptr=ptr, NB="i32", stride_yn="i32", stride_yc="i32", stride_yh="i32", stride_yw="i32",
               negative_slope="fp32")
fixed = dict(HAS_BIAS=True, ACTIVATION="relu", INPUT_PRECISION="tf32" if dtype == torch.float32 else "ieee",
             UPCAST_DOT=False, ROUND_BF16=False, PDL=True)  # as launched on sm_90
# the wider CNN's convs as the model runs them (pooled but the first; the last before the flatten: y NCHW) and the
# digits CNN's second, at 256 images (with a residual: test_kernels_compile.py)
# and ResNet's strided ones (3x3/2 at 56 -> 28 and 14 -> 7, 1x1/2 at 28 -> 14: x read by parity, 5-D boxes)
layers = [(64, 32, 64, "none", True, 3, 1), (64, 32, 64, "max", True, 3, 1), (64, 16, 128, "max", True, 3, 1),
          (128, 8, 128, "max", False, 3, 1), (16, 8, 16, "max", False, 3, 1), (64, 56, 128, "none", True, 3, 2),
          (256, 14, 512, "none", True, 3, 2), (256, 28, 512, "none", True, 1, 2)]
for i, (C, H, OC, pool, y_nhwc, k, s) in enumerate(layers):
    pk = 2 if pool != "none" else 1
    OH = H // s
    for cfg in sample(ct.cuda_configs(256 * OH * OH, OC, C, OH, OH, (pk, pk), dtype.itemsize, strided=s > 1), i):
        meta = dict(C=C, H=H, W=H, KH=k, KW=k, PH=k // 2, PW=k // 2, DH=1, DW=1, SH=s, SW=s, OH=OH, OW=OH, OC=OC,
                    POOL=pool, PKH=pk, PKW=pk, **fixed, HAS_RESIDUAL=False, Y_NHWC=y_nhwc,
                    **{k: v for k, v in cfg.meta().items() if k != "TMA"})
        img, bh, bw, bn, bk = (cfg[k] for k in ("IMG", "BH", "BW", "BLOCK_N", "BLOCK_K"))
        x_box = f"{img}, {bh}, {bw}, {bk}" if s == 1 else f"{img}, {bh}, 1, {bw}, {bk}"
        descs = dict(x_desc=f"tensordesc<{name}[{x_box}]>", w_desc=f"tensordesc<{name}[{bn}, {bk}]>",
                     y=f"tensordesc<{name}[{img}, {bh // pk}, {bw // pk}, {bn}]>" if y_nhwc else ptr)
        aligned = ("b_ptr", "r_ptr") if y_nhwc else ("b_ptr", "r_ptr", "y")  # as the allocator's pointers are
        ptx, usage = compile_sm90(ct._conv2d_tma_kernel, {**runtime, **descs}, meta, 0, cfg.num_warps, cfg.num_stages,
                                  divisible=aligned)  # fmt: skip
        print(json.dumps({"layer": [C, H, OC, pool, y_nhwc, k, s], "config": cfg.meta(),
                          "tma_loads": ptx.count(f"cp.async.bulk.tensor.{4 if s == 1 else 5}d.shared"),
                          "tma_stores": ptx.count("cp.async.bulk.tensor.4d.global"),
                          "wgmma": ptx.count("wgmma.mma_async"), **pdl_order(ptx), **usage}))
"""


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_tma_conv_compiles_for_sm90_without_spills(dtype):
    from tests.sm90_compile import every_candidate
    from tests.test_kernels_compile import _compiled

    results = _compiled(_COMPILE_TMA, dtype)
    assert len(results) >= (30 if every_candidate() else 10), results
    assert {tuple(r["layer"][5:]) for r in results} == {(3, 1), (3, 2), (1, 2)}, results
    for got in results:
        # TMA copies of x (4-D, 5-D strided), warpgroup MMAs, a TMA store where y is NHWC, or it is not this kernel
        assert got["tma_loads"] > 0 and got["wgmma"] > 0, got
        assert (got["tma_stores"] > 0) == got["layer"][4], got
        assert got["STACK"] == 0 and got["LOCAL"] == 0, f"registers spill to local memory: {got}"
        # one wait, before anything is written; the next layer let in after the main loop
        assert got["waits"] == 1 and got["launches"] == 1 and got["wait_at"] < got["first_store"], got
        assert got["launch_at"] > got["wait_at"], got
