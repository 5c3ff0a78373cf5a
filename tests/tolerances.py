"""Error bounds for comparing a fused result with a float64 reference of the same inputs.

The bound per element is rtol * (|ref| + rms(ref)) + tiny(out.dtype): relative where values are large,
anchored to the output's own scale near zero, where a GEMM's rounding error does not shrink with the
value, and never tighter than the output dtype's smallest normal number. Below that a store is subnormal
or flushed to zero: an fp16 output of a reference at -1.06e-11 (gelu_tanh of a one-element GEMM
at x = -6.2) can only be 0, an error of 1.06e-11 that rtol times a one-element rms (2.1e-14) would reject.
The rtol are the rounding of one final store plus fp32 accumulation: fp16 half-ulp is 4.9e-4,
bf16 3.9e-3; TF32 rounds each operand to 10 mantissa bits (~5e-4 per product).
"""

from __future__ import annotations

import torch

RTOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
RTOL_TF32 = 3e-3  # elementwise, with the rms anchor; the normwise bound below is the tight one
# ||out - ref|| / ||ref|| for TF32. Measured on an H200 (triton 3.6), relu(x @ W^T + b) with unit-scale
# inputs: 5.4e-4 to 5.7e-4 at 64x256x128, 1024^3 and 16x4096x4096 (fp32: 1.5e-7 to 8.2e-7). That is what
# TRUNCATING each operand to TF32's 10 mantissa bits gives (rms 2^-10/sqrt 3 = 5.6e-4 per operand, diluted
# by the exact bias); rounding to nearest, which cuBLAS does before its TF32 MMA, would give ~3e-4.
NORMWISE_TF32 = 8e-4
# Fused vs unfused in the model's dtype: the unfused path rounds after the matmul, after the bias add
# and after the activation (three roundings to two for ours), so both sit within a few ulp.
RTOL_VS_UNFUSED = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def assert_close_to(
    out: torch.Tensor, ref: torch.Tensor, rtol: float, what: str = "", anchor: torch.Tensor | None = None
) -> None:
    """`anchor`, per element: the magnitude the kernel's rounding scales with where it exceeds rms(ref), e.g. a
    GEMM's root-sum-square of its terms (`gemm_anchor`). A one-element output has no scale of its own to anchor
    to (its rms is itself), and an fp32 x * w + b that nearly cancels is only as exact as its terms."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    out64 = out.detach().double().cpu()
    ref64 = ref.detach().double().cpu()
    assert torch.isfinite(out64).all(), f"{what}: output has NaN/Inf (an element not written?)"
    scale = ref64.pow(2).mean().sqrt() if ref64.numel() else torch.tensor(0.0, dtype=torch.float64)
    if anchor is not None:
        scale = torch.maximum(scale, anchor.detach().double().cpu())
    bound = rtol * (ref64.abs() + scale) + torch.finfo(out.dtype).tiny
    err = (out64 - ref64).abs()
    worst = int(torch.argmax(err - bound)) if err.numel() else 0
    assert (err <= bound).all(), (
        f"{what}: max error {err.max():.3e} over bound at flat index {worst}: "
        f"got {out64.flatten()[worst]:.6g}, want {ref64.flatten()[worst]:.6g} (rtol {rtol})"
    )


def gemm_anchor(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """sqrt(sum_k (x_ik w_jk)^2 + b_j^2) in float64, per output of x @ w.T + b: how large the terms are whose
    rounding errors add up. For fp32 (1, 1, 1) GEMMs with random unit-scale x, w, b, 2.5e-4 of draws round
    x * w + b off by more than 2e-5 of the result (a near-cancelling sum); none is off by more than 1.3e-7
    of this (1e7 draws)."""
    x64, w64 = x.detach().double().cpu(), w.detach().double().cpu()
    sq = x64.pow(2) @ w64.pow(2).T
    if b is not None:
        sq = sq + b.detach().double().cpu().pow(2)
    return sq.sqrt()


def normwise_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64."""
    ref64 = ref.detach().double().cpu()
    return float((out.detach().double().cpu() - ref64).norm() / ref64.norm())


# Hopper's fp8 MMA keeps about 14 bits of its running sum (DeepSeek-V3 report, 3.3.2: "around 14 bits" on H800), not
# fp32's 24: taken as one rounding of the sum's magnitude per 32-deep MMA step, K/32 of them. Measured on an H200
# over every candidate of the 64-channel cases (bench/results/h200/gpu_tests_session5_h200.txt): up to 2^-13.25 of the
# magnitude per step, at K = 64 with a residual (2^-14 failed there by 1.1-40 fp16 steps); 2^-12 leaves 2.4x of that.
FP8_MMA_ROUNDING = 2.0**-12


def binade_step(t: torch.Tensor, mantissa_bits: int) -> torch.Tensor:
    """One rounding step of a format with `mantissa_bits` at each |t| (> 0, normal): 2**(floor(log2 |t|) -
    mantissa_bits), in float64 and exact: the exponent from frexp, the power built from its bits (torch.pow(2.0, k)
    on CUDA may return 2**k times (1 - 1e-16), and an exact one-step difference then read 1.0000000000000002
    steps on the H200)."""
    exponent = torch.frexp(t.double().abs()).exponent.long() - 1 - mantissa_bits  # t = m * 2**(e+1), 0.5 <= m < 1
    return ((exponent + 1023) << 52).view(torch.float64)


def assert_close_on_hopper(got, want, magnitude, K: int, what: str) -> None:
    """got and want e4m3 with one scale, or fp16; magnitude: the same output computed from |x| and |W| (the sum of the
    products' magnitudes, in the output's units). Each element within one rounding step of the output's format (e4m3:
    2^-3 of the binade, fp16: 2^-10) at the larger of got and want, once the MMA's accumulation slack,
    K / 32 * FP8_MMA_ROUNDING * magnitude, is taken off: a wrong index or scale moves an element by about its own
    size. (The larger of the two: a sum that lands in the next binade is one of its steps away, two of want's; 1.98
    were seen.)"""
    e4m3 = got.dtype != torch.float16
    g, w = got.double(), want.double()
    assert not g.isnan().any(), f"{what}: NaN in the output (an element not written?)"
    slack = max(K / 32, 1.0) * FP8_MMA_ROUNDING * magnitude.double()
    top = torch.maximum(g.abs(), w.abs()).clamp_min(2.0**-6 if e4m3 else 2.0**-14)
    steps = ((g - w).abs() - slack).clamp_min(0) / binade_step(top, 3 if e4m3 else 10)
    assert steps.max() <= 1.0, f"{what}: {steps.max():.2f} steps off beyond the MMA's slack at worst"


def abs_e4m3(t: torch.Tensor) -> torch.Tensor:
    """|t| for an e4m3 tensor (a sign flip: exact)."""
    return t.float().abs().to(t.dtype)
