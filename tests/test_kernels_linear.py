"""fused_linear against the float64 reference: every dtype and activation, ordinary and awkward shapes.

Without CUDA these run through Triton's interpreter: the same kernel code, so its logic is checked
here and in CI; the compiled path is checked by the `gpu` tests on the lent GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

import kernels.linear as linear_mod
from kernels import ACTIVATIONS, FusedLinear, fused_activation, fused_linear, reference
from kernels.runtime import bf16_on_interpreter
from tests.interpreted_launch import InterpretedLaunch
from tests.tolerances import NORMWISE_TF32, RTOL, RTOL_TF32, assert_close_to, gemm_anchor, normwise_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (M, N, K): ones, primes, and sizes just past a block edge in each dimension for the 16x32x32 tile. The last has 5
# row blocks, more than GROUP_M (4): a second, partial group of the tile order (grouped_tile). It was 67x130x257,
# the same remainders past 4 and 8 blocks (3, 2, 1), and 225 block steps to these 20: ~1.5 CPU-s a case (issue 51).
AWKWARD = [(1, 1, 1), (1, 10, 64), (5, 3, 7), (17, 33, 33), (37, 53, 71), (67, 34, 33)]


def _inputs(M, N, K, dtype, device, bias=True):
    # Scaled so outputs are O(1) whatever K is: activations then see both signs and their curved parts.
    x = torch.randn(M, K, device=device).to(dtype)
    w = (torch.randn(N, K, device=device) / K**0.5).to(dtype)
    b = torch.randn(N, device=device).to(dtype) if bias else None
    return x, w, b


def _check(M, N, K, dtype, activation, device, bias=True, slope=0.01, allow_tf32=False, rtol=None, residual=False):
    """residual: add a fresh random (M, N) one before the activation."""
    x, w, b = _inputs(M, N, K, dtype, device, bias)
    r = torch.randn(M, N, device=device).to(dtype) if residual else None
    out = torch.full((M, N), float("nan"), device=device, dtype=dtype)  # NaN left behind = not written
    got = fused_linear(x, w, b, activation, negative_slope=slope, out=out, allow_tf32=allow_tf32, residual=r)
    assert got is out
    want = reference.linear(
        x.double(), w.double(), b.double() if b is not None else None, activation, negative_slope=slope,
        residual=r.double() if residual else None,
    )  # fmt: skip
    what = f"{M}x{N}x{K} {dtype} {activation} bias={bias} residual={residual}"
    # The anchor is the pre-activation's: every activation's slope is at most 1.13 (gelu's), so it carries over.
    anchor = gemm_anchor(x, w, b)
    if residual:  # one more term of the sum
        anchor = (anchor.pow(2) + r.double().cpu().pow(2)).sqrt()
    assert_close_to(got, want, rtol or RTOL[dtype], what, anchor=anchor)
    return got, want


@pytest.fixture
def small_tile():
    with linear_mod.INTERPRETER.override(tile=linear_mod.SMALL_INTERPRETER_TILE):
        yield


# Every activation in every dtype on a shape past the small tile's edge in all three dimensions, and every awkward
# shape in every dtype with the activations taken in turn: the shape decides the masks and the activation only the
# epilogue, so the full product (198 cases, ~75 CPU-s under the interpreter, issue 51) checked nothing more than these
# 51 (the GPU test below keeps the full product, compiled).
EDGE = (17, 33, 33)
AWKWARD_CASES = sorted(
    {(EDGE, d, a) for d in DTYPES for a in ACTIVATIONS}
    | {(s, d, ACTIVATIONS[(i * len(DTYPES) + j) % len(ACTIVATIONS)]) for i, s in enumerate(AWKWARD)
       for j, d in enumerate(DTYPES)},
    key=lambda c: (AWKWARD.index(c[0]), DTYPES.index(c[1]), ACTIVATIONS.index(c[2])),
)  # fmt: skip


@pytest.mark.parametrize(
    ("shape", "dtype", "activation"),
    AWKWARD_CASES,
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v),
)
def test_every_dtype_and_activation_on_awkward_shapes(small_tile, shape, dtype, activation):
    _check(*shape, dtype, activation, DEVICE)


# (M, N, K) whose K and N are multiples of 8, 4 or 2 but not of 16, as in a 1000-2000-500-10 MLP: the launcher tells
# the kernel what they are multiples of (K_ALIGN, N_ALIGN), and a hint larger than the truth would drop columns.
NOT_SIXTEEN = [(9, 500, 1000), (5, 250, 500), (3, 10, 500), (17, 36, 1000)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", NOT_SIXTEEN, ids=lambda s: "x".join(map(str, s)))
def test_sizes_that_are_not_multiples_of_16(shape, dtype):
    _check(*shape, dtype, "relu", DEVICE)


@pytest.mark.skipif(DEVICE != "cpu", reason="spies on the interpreter's launch")
@pytest.mark.parametrize("config", [None, "gemv"])
def test_the_launcher_tells_the_kernel_what_k_and_n_are_multiples_of(monkeypatch, config):
    """K_ALIGN and N_ALIGN as the largest power of two (at most 16) that divides the size and its row strides:
    1000 -> 8, 500 -> 4, 250 -> 2, 37 -> 1, 2048 -> 16 (a smaller hint is right but slow: 2-byte loads)."""
    seen = []

    # The spy records and stops there: nothing here reads the output, and running the kernel took ~5 CPU-s (the
    # GEMV's 16x32 blocks over 500x1000, issue 51); what the hints compute is checked where outputs are (the
    # hints' own sizes: test_sizes_that_are_not_multiples_of_16; the GEMV's: its tests below).
    def spy(kernel, grid):
        def record(*args, **meta):
            seen.append((meta["K_ALIGN"], meta["N_ALIGN"]))

        return record

    monkeypatch.setattr(linear_mod, "grid_launch", spy)
    choice = dict(config=_gemv_small(1)) if config else {}
    with linear_mod.INTERPRETER.override(**choice):
        for (N, K), want in {(500, 1000): (8, 4), (250, 500): (4, 2), (37, 2048): (16, 1), (1000, 250): (2, 8)}.items():
            x, w, b = _inputs(1, N, K, torch.float16, DEVICE)
            fused_linear(x, w, b, "relu")
            assert seen[-1] == want, (N, K, seen[-1])
    assert linear_mod.pow2_alignment(1000, 3000) == 8 and linear_mod.pow2_alignment(64, 4096) == 16
    assert linear_mod.pow2_alignment(7) == 1 and linear_mod.pow2_alignment(6, 12) == 2


# One, awkward, and an ordinary shape: whole blocks, two in each dimension (was 64x256x128: 4x8x4 blocks, ~1.3
# CPU-s a dtype for no other mask or branch, issue 51).
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 1), (37, 53, 71), (32, 64, 64)], ids=lambda s: "x".join(map(str, s)))
def test_without_bias(small_tile, shape, dtype):
    _check(*shape, dtype, "gelu", DEVICE, bias=False)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_a_nan_input_gives_nan_where_torch_does(small_tile, activation):
    # A NaN in a request's row makes every output of that row NaN in torch, relu included (torch.relu keeps
    # NaN; a plain max(x, 0) would answer 0 and hide the bad input). Other rows stay finite and right.
    M, N, K = 5, 37, 23
    x, w, b = _inputs(M, N, K, torch.float32, DEVICE)
    x[2, 4] = float("nan")
    got = fused_linear(x, w, b, activation)
    want = reference.linear(x.double(), w.double(), b.double(), activation)
    assert torch.isnan(got[2]).all() and torch.isnan(want[2]).all(), got[2]
    finite = [0, 1, 3, 4]
    assert_close_to(got[finite], want[finite], RTOL[torch.float32], f"{activation}, rows without NaN")


@pytest.mark.parametrize("slope", [0.2, -0.5, 3.0])
def test_leaky_relu_slope_is_honoured(small_tile, slope):
    _check(19, 40, 23, torch.float32, "leaky_relu", DEVICE, slope=slope)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape", [(1, 256, 64), (32, 256, 256), (256, 10, 256), (300, 257, 129)], ids=lambda s: "x".join(map(str, s))
)
def test_serving_tile(shape, dtype):
    """The tile the service uses (chosen per shape) on the digits model's layer shapes and beyond."""
    _check(*shape, dtype, "relu", DEVICE)


def test_empty_batch_returns_empty():
    x, w, b = _inputs(1, 4, 3, torch.float32, DEVICE)
    y = fused_linear(x[:0], w, b, "relu")
    assert y.shape == (0, 4)


def test_outputs_do_not_depend_on_tile():
    """The small and the serving tile agree to rounding: tiling changes nothing but the order of sums."""
    x, w, b = _inputs(45, 70, 150, torch.float32, DEVICE)
    big = fused_linear(x, w, b, "silu")
    with linear_mod.INTERPRETER.override(tile=linear_mod.SMALL_INTERPRETER_TILE):
        small = fused_linear(x, w, b, "silu")
    assert_close_to(small, big.double(), RTOL[torch.float32], "small vs serving tile")


BAD_INPUTS = [
    (lambda x, w, b: (x[0], w, b), "x must be 2-D"),
    (lambda x, w, b: (x, w[0], b), "weight must be 2-D"),
    (lambda x, w, b: (x[:, :-1].contiguous(), w, b), "K=6 columns but weight"),
    (lambda x, w, b: (x, w, b[:-1]), r"bias must have shape \(5,\)"),
    (lambda x, w, b: (x.double(), w.double(), b.double()), "float64"),
    (lambda x, w, b: (x, w.half(), b.half()), "x has dtype torch.float32 but weight has torch.float16"),
    (lambda x, w, b: (x, w, b.half()), "bias has dtype torch.float16 but weight has torch.float32"),
    (lambda x, w, b: (x.t().contiguous().t(), w, b), "x must be contiguous"),
    (lambda x, w, b: (x, w[:0], b[:0]), "N >= 1"),
]


@pytest.mark.parametrize("make,message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_inputs_are_named(make, message):
    x, w, b = _inputs(4, 5, 7, torch.float32, DEVICE)
    with pytest.raises((ValueError, TypeError), match=message):
        fused_linear(*make(x, w, b), "relu")


def test_unknown_activation_is_named():
    x, w, b = _inputs(2, 3, 4, torch.float32, DEVICE)
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        fused_linear(x, w, b, "swish")


def test_wrong_out_is_named():
    x, w, b = _inputs(2, 3, 4, torch.float32, DEVICE)
    with pytest.raises(ValueError, match=r"out must be a contiguous \(2, 3\)"):
        fused_linear(x, w, b, out=torch.empty(3, 2, device=DEVICE))


@pytest.mark.skipif(DEVICE != "cuda" or linear_mod.interpreting(), reason="needs compiled CUDA kernels")
def test_cpu_tensor_with_compiled_kernels_is_named():
    x, w, b = _inputs(2, 3, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="weight is on the CPU, but Triton kernels here are compiled for CUDA"):
        fused_linear(x, w, b)


# ---- compiled path, on the lent GPU ----


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape",
    [(1, 1, 1), (3, 5, 7), (37, 53, 71), (64, 256, 128), (128, 256, 256), (1000, 1000, 1000), (1, 4096, 4096)],
    ids=lambda s: "x".join(map(str, s)),
)
def test_gpu_every_dtype_and_activation(shape, dtype, activation):
    _check(*shape, dtype, activation, "cuda")


# Widths that are not multiples of 64 (issue 34's MLPs: 784 in, 1000 classes, 1536 and 3072 hidden): (N, K) pairs.
ODD_WIDTHS = [(1000, 784), (1536, 1000), (3072, 1536), (784, 3072)]
# Under the interpreter, each pair's stand-in: the same default tile (16x256x128), the same alignment hints (N_ALIGN,
# K_ALIGN: 8/16, 16/8, 16/16, 16/16) and the same remainders past the last full block (N % 256: 232, 0, 0, 16;
# K % 128: 16, 104, 0, 0), so the same kernel specialization and the same masks, at 2x2 blocks instead of up to
# 12x12 (the real widths took ~25 of the module's ~120 CPU-s, issue 51; the GPU test below runs them).
ODD_WIDTHS_INTERPRETED = [(488, 144), (512, 232), (512, 256), (272, 256)]


@pytest.mark.parametrize(
    ("widths", "activation"),
    [(ODD_WIDTHS_INTERPRETED[i % len(ODD_WIDTHS)], a) for i, a in enumerate(ACTIVATIONS)],
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v,
)  # fmt: skip
def test_widths_not_multiples_of_64(widths, activation):
    """Every activation at one of the odd widths' stand-ins, each with two or three, three rows, fp32 (the
    interpreter's default tile crosses each edge). The widths set the masks, the activation the epilogue: all 44
    pairs took ~70 CPU-s under the interpreter for what these 11 check (the GPU test below runs every real pair at
    every batch)."""
    N, K = widths
    config = linear_mod._interpreter_config(3, N, K)
    real = ODD_WIDTHS[ODD_WIDTHS_INTERPRETED.index(widths)]
    assert config == linear_mod._interpreter_config(3, *real), "the stand-in runs another tile than its width"
    assert (N % config["BLOCK_N"], K % config["BLOCK_K"]) == (real[0] % config["BLOCK_N"], real[1] % config["BLOCK_K"])
    assert (linear_mod.pow2_alignment(N), linear_mod.pow2_alignment(K)) == tuple(map(linear_mod.pow2_alignment, real))
    _check(3, N, K, torch.float32, activation, DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 7, 33, 256, 1000, 4096])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("widths", ODD_WIDTHS, ids=lambda s: "x".join(map(str, s)))
def test_gpu_widths_not_multiples_of_64_at_every_batch(widths, dtype, M):
    for activation in ACTIVATIONS:
        _check(M, *widths, dtype, activation, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(64, 256, 128), (1024, 1024, 1024), (16, 4096, 4096)], ids=str)
def test_gpu_tf32(shape):
    """TF32 against float64: each operand rounded to 10 mantissa bits, so a looser bound than fp32."""
    got, want = _check(*shape, torch.float32, "relu", "cuda", allow_tf32=True, rtol=RTOL_TF32)
    err = normwise_error(got, want)
    assert err <= NORMWISE_TF32, f"TF32 normwise error {err:.2e} > {NORMWISE_TF32:.0e}"
    # and it really ran in TF32: full fp32 would be ~1e-6, so a much smaller error means the flag was ignored
    assert err > 1e-5, f"normwise error {err:.2e}: looks like fp32, not TF32"


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 2, 3, 15, 16, 17, 31, 33, 100, 255, 256, 257, 1000])
def test_gpu_every_batch_size_bucket(M):
    """Autotuning is keyed on a power-of-two bucket of M: each M in a bucket must still be right."""
    _check(M, 256, 64, torch.float16, "relu", "cuda")


def test_prepared_layer_matches_function_and_remembers_nothing_wrong(small_tile):
    """FusedLinear (weights checked once, per-bucket config cache on CUDA) computes what fused_linear does,
    across batch sizes that share and that do not share a bucket."""
    x, w, b = _inputs(70, 37, 29, torch.float32, DEVICE)
    layer = FusedLinear(w, b, "tanh")
    for m in (1, 3, 4, 33, 70, 5):
        want = reference.linear(x[:m].double(), w.double(), b.double(), "tanh")
        assert_close_to(layer(x[:m].contiguous()), want, RTOL[torch.float32], f"FusedLinear M={m}")


def test_prepared_layer_checks_x_per_call():
    x, w, b = _inputs(4, 5, 7, torch.float32, DEVICE)
    layer = FusedLinear(w, b, "relu")
    with pytest.raises(ValueError, match="x has K=6 columns"):
        layer(x[:, :6].contiguous())
    with pytest.raises(TypeError, match="x has dtype torch.float16 but weight has torch.float32"):
        layer(x.half())
    with pytest.raises(ValueError, match="unknown activation 'gelu_fast'"):
        FusedLinear(w, b, "gelu_fast")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", ["relu6", "hardswish"])
def test_relu6_and_hardswish_over_their_whole_range(dtype, activation):
    """Both bends of each (0 and 6; -3 and 3), which the GEMM tests' O(1) outputs seldom reach, and NaN and the
    infinities as torch answers them (NaN stays NaN; hardswish(-inf) is NaN, -inf * 0, in torch too)."""
    x = torch.cat([torch.linspace(-10, 10, 2001), torch.tensor([float("nan"), float("inf"), -float("inf")])])
    x = x.to(device=DEVICE, dtype=dtype)
    got = fused_activation(x, activation).cpu()
    want = reference.activation(x.cpu().double(), activation)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    finite = want.isfinite()
    assert_close_to(got[finite], want[finite], RTOL[dtype], f"{activation} {dtype}")


def test_gelu_is_accurate_in_the_negative_tail():
    """The erf form's 1 + erf(x / sqrt 2) cancels for x < 0 (torch's fp32 gelu: 8.8e-4 relative error
    at x = -3, zero below -4); ours goes through erfc. Checked elementwise, relative, against math.erfc."""
    x = -torch.rand(4096, device=DEVICE) * 9.0  # (-9, 0]
    got = fused_activation(x, "gelu")
    want = torch.tensor([0.5 * v * math.erfc(-v / math.sqrt(2.0)) for v in x.double().tolist()], dtype=torch.float64)
    rel = (got.double().cpu() - want).abs() / want.abs().clamp_min(1e-300)
    assert rel.max() < 2e-5, f"worst relative error {rel.max():.2e} at x = {x[int(rel.argmax())]:.4f}"


# ---- split-K (small batches on the GPU) and every config the tuner may pick ----


@pytest.mark.parametrize("split", [2, 3])
@pytest.mark.parametrize("shape", [(1, 40, 200), (5, 33, 97), (17, 70, 129)], ids=lambda s: "x".join(map(str, s)))
def test_split_k_sums_every_partial_and_resets_its_counters(small_tile, shape, split):
    """Split-K: the last program of each tile adds all partials (some splits get no K tile at all when
    the K tiles do not divide evenly) and leaves its counter at 0, so the next call needs no memset."""
    x, w, b = _inputs(*shape, torch.float32, DEVICE)
    layer = FusedLinear(w, b, "gelu_tanh")
    want = reference.linear(x.double(), w.double(), b.double(), "gelu_tanh")
    with linear_mod.INTERPRETER.override(split_k=split):
        for _ in range(2):  # the second call reuses the workspace and its counters
            out = torch.full((shape[0], shape[1]), float("nan"), device=DEVICE)
            assert_close_to(layer(x, out=out), want, RTOL[torch.float32], f"split-K {split} {shape}")
            assert int(layer.workspace.counters.abs().sum()) == 0, "split-K counters not reset"


def test_workspace_is_sized_for_split_k_only():
    ws = linear_mod.SplitKWorkspace(torch.device(DEVICE))
    partials, counters = ws.get(tiles=4096, tile_elems=128 * 256, split=1)  # a 4096x8192 output, no split
    assert partials.numel() == 1 and counters.numel() == 1
    partials, counters = ws.get(tiles=32, tile_elems=16 * 64, split=4)
    assert partials.numel() == 32 * 4 * 16 * 64 and counters.numel() == 32 and int(counters.abs().sum()) == 0
    again, _ = ws.get(tiles=8, tile_elems=16 * 64, split=2)  # smaller: the same buffer, nothing allocated
    assert again.data_ptr() == partials.data_ptr()


def _force_config(monkeypatch, config):
    monkeypatch.setattr(linear_mod, "tune", lambda scope, key, candidates, run, bench=None: config)


def _candidate_ids(configs):
    return [
        "bm{BLOCK_M}-bn{BLOCK_N}-bk{BLOCK_K}-s{SPLIT_K}".format(**dict(c.kwargs)) + f"-st{c.num_stages}"
        for c in configs
    ]


def _candidates(bucket, N, K, dtypes):
    """(dtype, config) for every config the tuner may try for this bucket and dtype on a 132-SM H100/H200."""
    return [(dt, c) for dt in dtypes for c in linear_mod.cuda_configs(bucket, N, K, 132, dt.itemsize)]


SMALL_M_CANDIDATES = _candidates(1, 1000, 4096, DTYPES)
LARGER_M_CANDIDATES = _candidates(64, 1000, 1000, [torch.float16]) + _candidates(1024, 1000, 1000, DTYPES)


def _ids(pairs):
    return [_candidate_ids([c])[0] + f"-{str(dt).removeprefix('torch.')}" for dt, c in pairs]


def test_small_batches_get_split_k_candidates():
    for dt in DTYPES:
        configs = linear_mod.cuda_configs(1, 1000, 4096, 132, dt.itemsize)
        splits = {c["SPLIT_K"] for c in configs}
        assert splits & {2, 4, 8}, f"no split-K candidate for M=1, N=1000, K=4096, {dt}: {splits}"
        # 16-row MMA tiles, and for the one-row bucket only, the CUDA-core GEMV kernel's 1-row ones
        assert {c["BLOCK_M"] for c in configs if not linear_mod.gemv.is_gemv(c)} == {16}
        assert {c["BLOCK_M"] for c in configs if linear_mod.gemv.is_gemv(c)} == {1}
    assert not any(linear_mod.gemv.is_gemv(c) for c in linear_mod.cuda_configs(2, 1000, 4096, 132))


def test_big_batches_are_split_only_for_long_k_and_less_than_a_wave():
    """At 1024^3 the split 128x128 tiles lost to 64x128 unsplit on an H200, 17.4 vs 11.6 us (8 K steps per
    split); with 16+ K steps per split and fewer 128x128 tiles than half the SMs they are offered."""
    for bucket, N, K in [(1024, 1024, 1024), (4096, 4096, 4096), (128, 256, 64), (256, 257, 129), (512, 4096, 4096)]:
        assert {c["SPLIT_K"] for c in linear_mod.cuda_configs(bucket, N, K, 132)} == {1}, (bucket, N, K)
    for bucket, N, K, split in [(256, 4096, 4096, 2), (256, 1024, 4096, 4), (128, 1000, 4104, 4)]:
        splits = {c["SPLIT_K"] for c in linear_mod.cuda_configs(bucket, N, K, 132) if c["BLOCK_M"] == 128}
        assert splits == {1, split}, (bucket, N, K, splits)
    # 64x64 tiles, twice as many as 64x128 ones, split half as much: the wide MLP's last layer at batch 256
    # (64 tiles, 2 ways) and 128 (32 tiles, 4 ways); none where 64x64 tiles already fill half the SMs
    for bucket, N, K, splits in [(256, 1024, 4096, {2}), (128, 1024, 4096, {4}), (256, 4096, 4096, set())]:
        narrow = [c for c in linear_mod.cuda_configs(bucket, N, K, 132) if c["BLOCK_M"] == c["BLOCK_N"] == 64]
        assert {c["SPLIT_K"] for c in narrow if c["SPLIT_K"] > 1} == splits, (bucket, N, K, narrow)


def test_small_gemms_get_narrow_tiles_and_big_ones_do_not():
    """16x32 tiles won every published small shape cold on an H200 (64x256x128 fp16: 6.69 us against
    7.14 for the best older candidate); at 1024^3 (256 tiles of 64x64 for 132 SMs) they are not offered."""
    narrow = {(16, 32, 64), (16, 32, 256), (16, 64, 256)}

    def tiles(bucket, N, K):
        return {(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]) for c in linear_mod.cuda_configs(bucket, N, K, 132)}

    for bucket, N, K in [(64, 128, 256), (128, 256, 256), (32, 4096, 1024)]:
        assert narrow <= tiles(bucket, N, K), (bucket, N, K)
    for bucket, N, K in [(1024, 1024, 1024), (4096, 4096, 4096), (256, 4096, 4096)]:
        assert not narrow & tiles(bucket, N, K), (bucket, N, K)


def test_candidates_fit_shared_memory():
    """A candidate whose pipeline overflows shared memory fails to launch (H200: 16x64x256 fp32 at 4 stages
    asked for 245,760 B of 232,448): it is never offered, so every candidate can be tested and picked."""
    big = linear_mod.LaunchConfig.of(4, 4, BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, GROUP_M=8, SPLIT_K=1)
    assert linear_mod.pipeline_shared_memory(big, 4) == 245_760
    wide = linear_mod.LaunchConfig.of(8, 3, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, SPLIT_K=1)
    assert linear_mod.pipeline_shared_memory(wide, 4) == 294_912  # warpgroup MMA: num_stages buffers
    assert wide not in linear_mod.cuda_configs(1024, 1024, 1024, 132, 4)
    for bucket, N, K in [(1, 1000, 4096), (64, 1000, 1000), (1024, 4096, 4096)]:
        for dt in DTYPES:
            configs = linear_mod.cuda_configs(bucket, N, K, 132, dt.itemsize)
            assert configs, (bucket, dt)
            for c in configs:
                assert linear_mod.pipeline_shared_memory(c, dt.itemsize) <= linear_mod.HOPPER_SHARED_MEMORY, c
    fp32 = linear_mod.cuda_configs(1, 1000, 4096, 132, 4)
    assert big not in fp32 and big in linear_mod.cuda_configs(1, 1000, 4096, 132, 2)


# Tiles split along K, offered to batches of 65-256 with long K
MID_M_SPLIT_CANDIDATES = [
    (dt, c) for dt in DTYPES for c in linear_mod.cuda_configs(128, 1000, 4104, 132, dt.itemsize) if c["SPLIT_K"] > 1
]
SPLIT_CASES = [(3, 4096, dt, c) for dt, c in SMALL_M_CANDIDATES]
SPLIT_CASES += [(100, 4104, dt, c) for dt, c in MID_M_SPLIT_CANDIDATES]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "rows,K,dtype,config", SPLIT_CASES, ids=_ids(SMALL_M_CANDIDATES) + _ids(MID_M_SPLIT_CANDIDATES)
)
def test_gpu_every_small_batch_and_split_config(monkeypatch, rows, K, dtype, config):
    """Whatever the tuner picks must be exact: every small-M candidate and every split 128-row one, twice
    (the second call finds the split-K counters back at 0)."""
    _force_config(monkeypatch, config)
    for _ in range(2):
        _check(rows, 1000, K, dtype, "gelu_tanh", "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,config", LARGER_M_CANDIDATES, ids=_ids(LARGER_M_CANDIDATES))
def test_gpu_every_larger_batch_config(monkeypatch, config, dtype):
    _force_config(monkeypatch, config)
    _check(77, 1000, 1000, dtype, "relu", "cuda")


# ---- the direct-launch paths (CUDA only in production), run here through the interpreter ----


def _pointer_dtypes(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """x, W, bias, y and the residual (y again, without one) in the layer's dtype; the split-K partials (fp32) and
    tile counters (int32)."""
    return (dtype,) * 5 + (torch.float32, torch.int32)


# Every dtype, and both HAS_BIAS branches in fp32, fp16 with a bias, bf16 without: without one the layer passes its
# weight in the bias's slot, never read, in every dtype, and the branch adds in fp32 whatever the dtype. The full
# product (6 cases, ~2.5 CPU-s each under the interpreter, issue 51) passed the same arguments twice more.
DIRECT_CASES = [(torch.float32, True), (torch.float32, False), (torch.float16, True), (torch.bfloat16, False)]


@pytest.mark.skipif(DEVICE != "cpu", reason="on CUDA the real direct launch runs in every GPU test")
@pytest.mark.parametrize(("dtype", "bias"), DIRECT_CASES, ids=str)
def test_direct_and_fast_paths_pass_the_right_arguments(dtype, bias):
    x0, w, b = _inputs(5, 37, 70, dtype, DEVICE, bias)
    layer = FusedLinear(w, b, "leaky_relu", negative_slope=0.3, allow_tf32=False)
    config = linear_mod.LaunchConfig.of(4, 1, BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=4, SPLIT_K=2)
    upcast = bf16_on_interpreter(dtype)
    fixed = dict(
        HAS_BIAS=bias,
        HAS_RESIDUAL=False,
        ACTIVATION="leaky_relu",
        INPUT_PRECISION="ieee",
        UPCAST_DOT=upcast,
        ROUND_BF16=upcast,
        PDL=False,
    )
    align = dict(K_ALIGN=2, N_ALIGN=1)  # K = 70, N = 37
    launch = InterpretedLaunch(linear_mod._linear_kernel, {**fixed, **config.meta(), **align}, _pointer_dtypes(dtype))
    for bucket in (4, 8, 32):
        layer.direct[(bucket, "ieee")] = (launch, config)
    for M in (5, 3, 5, 17, 5, 3):  # first of a size: direct path, records it; then the fast path
        x = torch.randn(M, 70, device=DEVICE).to(dtype) if M != 5 else x0
        want = reference.linear(x.double(), w.double(), b.double() if bias else None, "leaky_relu", negative_slope=0.3)
        assert_close_to(layer(x), want, RTOL[dtype], f"direct M={M} {dtype} bias={bias}")
        assert int(layer.workspace.counters.abs().sum()) == 0
    assert launch.calls == 6 and set(layer._fast) == {(5, False), (3, False), (17, False)}
    out = torch.full((5, 37), float("nan"), device=DEVICE).to(dtype)  # a given output takes the same path
    want = reference.linear(x0.double(), w.double(), b.double() if bias else None, "leaky_relu", negative_slope=0.3)
    assert layer(x0, out=out) is out and launch.calls == 7
    assert_close_to(out, want, RTOL[dtype], f"direct with out= {dtype} bias={bias}")
    # Anything the checks must reject still raises on the fast path's layer, naming the problem.
    with pytest.raises(ValueError, match="x has K=69 columns"):
        layer(torch.randn(5, 69, device=DEVICE).to(dtype))
    with pytest.raises(TypeError, match="x has dtype"):
        layer(torch.randn(5, 70, device=DEVICE).to(torch.float64))
    with pytest.raises(ValueError, match="must be contiguous"):
        layer(torch.randn(70, 5, device=DEVICE).to(dtype).t())


# ---- the persistent TMA kernel as a tuner candidate of FusedLinear (kernels/linear_persistent.py) ----

PERSISTENT_SMALL = linear_mod.LaunchConfig.of(4, 2, BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, PERSISTENT=1)


def test_persistent_configs_are_offered_for_a_full_wave_of_tma_eligible_tiles():
    """On an H200 the persistent kernel beat linear.py at 4096x4096x{1024,4096} (55.0 vs 62.2, 200.6 vs 267.9
    us) and lost where 128x128 tiles do not fill the 132 SMs (1024^3: 64 tiles, 15.4 vs 12.4 us)."""

    def persistent(bucket, N, K, tma=True, element_size=2):
        configs = linear_mod.cuda_configs(bucket, N, K, 132, element_size, tma=tma)
        return [c for c in configs if linear_mod.persistent.is_persistent(c)]

    for bucket, N, K in [(4096, 4096, 4096), (4096, 1024, 4096), (2048, 4096, 1024), (4096, 1024, 10)]:
        assert len(persistent(bucket, N, K)) == 5 and len(persistent(bucket, N, K, element_size=4)) == 4
    for bucket, N, K in [(1024, 1024, 1024), (256, 4096, 4096), (16, 4096, 4096), (2048, 1024, 4096)]:
        assert not persistent(bucket, N, K), (bucket, N, K)
    assert not persistent(4096, 4096, 4096, tma=False)


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's override; on CUDA the tuner picks")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prepared_layer_runs_the_persistent_kernel_where_tma_can_and_the_pointer_kernel_where_not(monkeypatch, dtype):
    with linear_mod.INTERPRETER.override(config=PERSISTENT_SMALL):
        calls = []
        real = linear_mod.persistent.launch
        monkeypatch.setattr(linear_mod.persistent, "launch", lambda *a: calls.append(a[0].shape) or real(*a))
        x, w, b = _inputs(37, 56, 72, dtype, DEVICE)
        layer = FusedLinear(w, b, "gelu_tanh")
        want = reference.linear(x.double(), w.double(), b.double(), "gelu_tanh")
        out = torch.full((37, 56), float("nan"), device=DEVICE).to(dtype)
        assert_close_to(layer(x, out=out), want, RTOL[dtype], f"persistent via FusedLinear {dtype}")
        assert calls == [(37, 72)]
        # x one element past an aligned base: TMA cannot address it, so the pointer kernel runs, just as right
        shifted = torch.empty(37 * 72 + 1, device=DEVICE, dtype=dtype)[1:].view(37, 72)
        shifted.copy_(x)
        assert_close_to(layer(shifted), want, RTOL[dtype], f"unaligned x via FusedLinear {dtype}")
        assert calls == [(37, 72)]


@pytest.mark.skipif(DEVICE != "cpu", reason="on CUDA the real direct launch runs in the gpu test below")
@pytest.mark.parametrize("bias", [True, False])
def test_persistent_fast_path_passes_the_right_arguments(bias):
    """The persistent kernel's launch record: 4 programs (the interpreter's 'SMs') for 1-13 tiles."""
    x0, w, b = _inputs(5, 40, 72, torch.float16, DEVICE, bias)
    layer = FusedLinear(w, b, "leaky_relu", negative_slope=0.3, allow_tf32=False)
    fixed = dict(
        HAS_BIAS=bias, ACTIVATION="leaky_relu", INPUT_PRECISION="ieee", UPCAST_DOT=False, ROUND_BF16=False, PDL=False
    )
    constexprs = linear_mod.persistent.constexprs(fixed, PERSISTENT_SMALL, 4)
    launch = InterpretedLaunch(linear_mod.persistent._linear_persistent_kernel, constexprs, (torch.float16,) * 4)
    for bucket in (8, 32, 128):
        layer.direct[(bucket, "ieee")] = (launch, PERSISTENT_SMALL)
    for M in (5, 100, 5, 17, 100):
        x = torch.randn(M, 72, device=DEVICE).to(torch.float16) if M != 5 else x0
        want = reference.linear(x.double(), w.double(), b.double() if bias else None, "leaky_relu", negative_slope=0.3)
        out = torch.full((M, 40), float("nan"), device=DEVICE).to(torch.float16)
        assert layer(x, out=out) is out
        assert_close_to(out, want, RTOL[torch.float16], f"persistent direct M={M} bias={bias}")
    assert launch.calls == 5 and set(layer._fast) == {(5, False), (100, False), (17, False)}
    assert all(record.grid == 4 and record.persistent for record in layer._fast.values())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_prepared_layer_with_each_persistent_config(monkeypatch, dtype):
    """Each persistent config through FusedLinear on CUDA: the checked launch, then the direct launch
    record (one compiled kernel on one program per SM) for batch sizes of the same bucket and of others,
    down to 1 row (1 tile for 132 programs), and replayed from a CUDA graph with new inputs."""
    from kernels.graph_capture import capture

    N, K = 1000, 1032  # edges in N and K for 128x128x64 tiles; N * 2 bytes a multiple of 16
    for config in linear_mod.persistent.cuda_configs(dtype.itemsize):
        _force_config(monkeypatch, config)
        _, w, b = _inputs(1, N, K, dtype, "cuda")
        layer = FusedLinear(w, b, "gelu_tanh", allow_tf32=False)
        for M in (4096, 2500, 4096, 1, 300):
            x = torch.randn(M, K, device="cuda").to(dtype)
            out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
            want = reference.linear(x.double(), w.double(), b.double(), "gelu_tanh")
            assert_close_to(layer(x, out=out), want, RTOL[dtype], f"persistent M={M} {dtype} {config.meta()}")
        records = layer._fast.values()
        assert all(record.persistent for record in records), "the direct path did not run the persistent kernel"
        static_x = torch.randn(777, K, device="cuda").to(dtype)
        graph, static_out = capture(lambda layer=layer, static_x=static_x: layer(static_x), warmups=1)
        static_x.copy_(torch.randn(777, K, device="cuda").to(dtype))
        static_out.fill_(float("nan"))
        graph.replay()
        want = reference.linear(static_x.double(), w.double(), b.double(), "gelu_tanh")
        assert_close_to(static_out, want, RTOL[dtype], f"persistent graph replay {dtype} {config.meta()}")


# ---- the GEMV kernel for one-row batches (kernels/linear_gemv.py), a tuner candidate of FusedLinear ----


def _gemv_small(split: int) -> linear_mod.LaunchConfig:
    return linear_mod.LaunchConfig.of(4, 1, GEMV=1, BLOCK_M=1, BLOCK_N=16, BLOCK_K=32, GROUP_M=1, SPLIT_K=split)


# Each shape with each dtype and each split, the third taken in turn ((shape + split) % 3 picks the dtype), so every
# pair of the three meets: the dtype decides the loads and the final rounding, the split how the fp32 partials are
# summed, the shape the masks; no code depends on all three at once. The full product (36 cases, each run twice,
# ~7 CPU-s more under the interpreter, issue 51) ran nothing these 12 do not; the GPU test runs every config.
GEMV_SHAPES = [(1, 1, 1), (1, 37, 71), (1, 53, 130), (3, 17, 33)]
GEMV_CASES = [(shape, DTYPES[(i + split) % 3], split) for i, shape in enumerate(GEMV_SHAPES) for split in (1, 2, 3)]


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's override; on CUDA the gpu test below")
@pytest.mark.parametrize(("shape", "dtype", "split"), GEMV_CASES, ids=str)
def test_gemv_kernel_on_awkward_shapes(shape, dtype, split):
    """One row (and, though only offered for one, several), N and K past the 16x32 tile's edges, splits
    that get no K step at all (K=1 split 3): every element written and right, split-K counters back at 0."""
    with linear_mod.INTERPRETER.override(config=_gemv_small(split)):
        x, w, b = _inputs(*shape, dtype, DEVICE)
        layer = FusedLinear(w, b, "gelu_tanh")
        want = reference.linear(x.double(), w.double(), b.double(), "gelu_tanh")
        for _ in range(2):
            out = torch.full(shape[:2], float("nan"), device=DEVICE).to(dtype)
            assert_close_to(layer(x, out=out), want, RTOL[dtype], f"gemv {shape} {dtype} split {split}")
            assert int(layer.workspace.counters.abs().sum()) == 0, "split-K counters not reset"


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's override; on CUDA the gpu test below")
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gemv_kernel_every_activation_and_no_bias(activation):
    with linear_mod.INTERPRETER.override(config=_gemv_small(2)):
        for bias in (True, False):
            _check(1, 40, 100, torch.float32, activation, DEVICE, bias=bias, slope=0.3)


@pytest.mark.skipif(DEVICE != "cpu", reason="on CUDA the real direct launch runs in the gpu test below")
def test_gemv_fast_path_passes_the_right_arguments():
    x, w, b = _inputs(1, 45, 100, torch.float16, DEVICE)
    layer = FusedLinear(w, b, "silu", allow_tf32=False)
    config = _gemv_small(2)
    fixed = dict(
        HAS_BIAS=True,
        HAS_RESIDUAL=False,
        ACTIVATION="silu",
        INPUT_PRECISION="ieee",
        UPCAST_DOT=False,
        ROUND_BF16=False,
        PDL=False,
    )
    meta = {**fixed, **linear_mod.gemv.kernel_meta(config), "K_ALIGN": 4, "N_ALIGN": 1}  # K = 100, N = 45
    launch = InterpretedLaunch(linear_mod.gemv._gemv_kernel, meta, _pointer_dtypes(torch.float16))
    layer.direct[(1, "ieee")] = (launch, config)
    want = reference.linear(x.double(), w.double(), b.double(), "silu")
    for _ in range(2):  # the direct path records the size, then the fast path
        out = torch.full((1, 45), float("nan"), device=DEVICE).to(torch.float16)
        assert layer(x, out=out) is out
        assert_close_to(out, want, RTOL[torch.float16], "gemv direct")
    assert launch.calls == 2 and layer._fast[(1, False)].grid == 3 * 2  # 3 column blocks of 16, split 2


GEMV_CANDIDATES = [(dt, c) for dt in DTYPES for c in linear_mod.gemv.cuda_configs(4096, 4096, 132)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,config", GEMV_CANDIDATES, ids=_ids(GEMV_CANDIDATES))
def test_gpu_every_gemv_config(monkeypatch, config, dtype):
    """Each GEMV candidate compiled, one row, N and K off its tile edges; through the direct path twice."""
    _force_config(monkeypatch, config)
    x, w, b = _inputs(1, 1000, 4104, dtype, "cuda")
    layer = FusedLinear(w, b, "gelu_tanh")
    want = reference.linear(x.double(), w.double(), b.double(), "gelu_tanh")
    for _ in range(3):
        out = torch.full((1, 1000), float("nan"), device="cuda", dtype=dtype)
        assert_close_to(layer(x, out=out), want, RTOL[dtype], f"gemv {dtype} {config.meta()}")
        assert int(layer.workspace.counters.abs().sum()) == 0


# ---- residual: act(x @ W^T + b + residual), the skip connection added in the epilogue ----


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_residual_every_activation(small_tile, activation):
    _check(37, 53, 71, torch.float32, activation, DEVICE, residual=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", AWKWARD, ids=lambda s: "x".join(map(str, s)))
def test_residual_every_dtype_on_awkward_shapes(small_tile, shape, dtype):
    _check(*shape, dtype, "relu", DEVICE, residual=True)
    _check(*shape, dtype, "hardswish", DEVICE, bias=False, residual=True)


@pytest.mark.parametrize(
    "config,shape", [("split3", (1, 40, 200)), ("split3", (5, 33, 97)), ("gemv", (1, 40, 100))], ids=str
)
def test_residual_is_read_by_the_program_that_stores(small_tile, config, shape):
    """Split-K (3 programs a tile, some with no K step) and the one-row GEMV kernel: the residual enters once."""
    override = dict(split_k=3) if config == "split3" else dict(config=_gemv_small(2))
    with linear_mod.INTERPRETER.override(**override):
        _check(*shape, torch.float32, "silu", DEVICE, residual=True)
        _check(*shape, torch.float16, "relu", DEVICE, residual=True)


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's override; on CUDA the tuner picks")
def test_prepared_layer_with_and_without_residual(monkeypatch):
    """FusedLinear takes a residual per call; with one, the persistent kernel (whose epilogue has none) is not
    run even where it is asked for, and calls without one are unchanged."""
    calls = []
    real = linear_mod.persistent.launch
    monkeypatch.setattr(linear_mod.persistent, "launch", lambda *a: calls.append(a[0].shape) or real(*a))
    x, w, b = _inputs(37, 56, 72, torch.float16, DEVICE)
    r = torch.randn(37, 56, device=DEVICE).half()
    layer = FusedLinear(w, b, "relu6")
    with linear_mod.INTERPRETER.override(config=PERSISTENT_SMALL):
        got = layer(x, residual=r)
        assert not calls, "the persistent kernel ran with a residual"
        want = reference.linear(x.double(), w.double(), b.double(), "relu6", residual=r.double())
        assert_close_to(got, want, RTOL[torch.float16], "FusedLinear with a residual")
        want = reference.linear(x.double(), w.double(), b.double(), "relu6")
        assert_close_to(layer(x), want, RTOL[torch.float16], "FusedLinear without")
        assert calls == [(37, 72)]


def test_residual_in_another_layout_is_read_right():
    """A transposed view (not contiguous) is copied into the output's layout first; the result is the same."""
    x, w, b = _inputs(19, 23, 40, torch.float32, DEVICE)
    r = torch.randn(23, 19, device=DEVICE).t()
    got = fused_linear(x, w, b, "tanh", residual=r)
    want = reference.linear(x.double(), w.double(), b.double(), "tanh", residual=r.double())
    assert_close_to(got, want, RTOL[torch.float32], "transposed residual")


def test_bad_residuals_are_named():
    x, w, b = _inputs(4, 5, 7, torch.float32, DEVICE)
    with pytest.raises(ValueError, match=r"residual must have the output's shape \(4, 5\); got \(5, 4\)"):
        fused_linear(x, w, b, residual=torch.randn(5, 4, device=DEVICE))
    with pytest.raises(TypeError, match="residual has dtype torch.float16"):
        fused_linear(x, w, b, residual=torch.randn(4, 5, device=DEVICE).half())
    out = torch.empty(4, 5, device=DEVICE)
    with pytest.raises(ValueError, match="residual shares memory with out"):
        fused_linear(x, w, b, out=out, residual=out)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape", [(1, 1, 1), (37, 53, 71), (16, 4096, 4096), (1000, 1000, 1000), (1, 4096, 4096)], ids=str
)
def test_gpu_residual_every_dtype_and_activation(shape, dtype, activation):
    _check(*shape, dtype, activation, "cuda", residual=True)


@pytest.mark.gpu
def test_gpu_residual_is_tuned_apart_and_leaves_out_the_widest_tiles(monkeypatch):
    """A residual changes the compiled kernel: its picks have their own tuning key, and no candidate that spills
    with it (128x256 tiles) is timed; calls without one keep the direct path."""
    offered = {}
    real = linear_mod.tune

    def recording(scope, key, candidates, run, *args, **kwargs):
        offered[key] = list(candidates)
        return real(scope, key, candidates, run, *args, **kwargs)

    monkeypatch.setattr(linear_mod, "tune", recording)
    x, w, b = _inputs(1024, 1024, 1024, torch.float16, "cuda")
    layer = FusedLinear(w, b, "relu")
    layer(x)
    layer(x, residual=torch.randn(1024, 1024, device="cuda").half())
    (plain, plain_configs), (res, res_configs) = offered.items()
    assert res == plain + "|residual"
    assert any(c["BLOCK_N"] == 256 for c in plain_configs) and not any(c["BLOCK_N"] == 256 for c in res_configs)
    assert set(layer.direct) == {(1024, "ieee")}
