"""The comparison helper itself: what it lets through and what it must still reject."""

from __future__ import annotations

import pytest
import torch

from tests.tolerances import RTOL, assert_close_to, gemm_anchor


def test_an_fp16_output_that_underflows_to_zero_passes():
    # CI once failed here: a 1x1x1 fp16 gelu_tanh whose float64 reference is -1.06e-11, below fp16's
    # smallest subnormal (6e-8), so the only storable answer is 0.
    ref = torch.tensor([[-1.0601e-11]], dtype=torch.float64)
    assert_close_to(torch.zeros(1, 1, dtype=torch.float16), ref, RTOL[torch.float16], "underflow")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_a_wrong_element_still_fails(dtype):
    ref = torch.randn(7, 13, dtype=torch.float64)
    out = ref.to(dtype)
    assert_close_to(out, ref, RTOL[dtype], "rounded copy")
    out[3, 5] += 0.5 * ref.pow(2).mean().sqrt().item()
    with pytest.raises(AssertionError, match="flat index 44"):
        assert_close_to(out, ref, RTOL[dtype], "one element off")


def test_a_small_value_near_zero_still_fails_in_fp32():
    # The dtype floor is fp32's smallest normal (1.2e-38): a real 1e-20 error is not hidden by it.
    ref = torch.tensor([[1e-20]], dtype=torch.float64)
    with pytest.raises(AssertionError):
        assert_close_to(torch.tensor([[2e-20]], dtype=torch.float32), ref, RTOL[torch.float32], "tiny")


def test_a_near_cancelling_fp32_gemm_is_judged_by_its_terms_not_its_result():
    # x * w + b = 1e-4 from terms of 1.2: fp32's rounding of the product (5e-8) is 5e-4 of the result. Against
    # a one-element rms that fails though the kernel is exact to fp32; against gemm_anchor's terms it passes.
    x, w = torch.tensor([[1.2345678]]), torch.tensor([[0.9876543]])
    b = (-(x.double() @ w.double().T) + 1e-4).float().reshape(1)
    got = x @ w.T + b
    want = x.double() @ w.double().T + b.double()
    with pytest.raises(AssertionError):
        assert_close_to(got, want, RTOL[torch.float32], "without anchor")
    assert_close_to(got, want, RTOL[torch.float32], "with anchor", anchor=gemm_anchor(x, w, b))
    # and the anchor does not excuse a real error: 1e-3 of the terms
    with pytest.raises(AssertionError):
        assert_close_to(got + 1.2e-3, want, RTOL[torch.float32], "off", anchor=gemm_anchor(x, w, b))
