"""service.engine.faults.classify on the CPU: the named kinds by message, and the unknown-error path, where a CUDA
RuntimeError whose message names no known kind is STICKY exactly when a follow-up torch.cuda.synchronize() fails
too (faked here: no GPU can be made to fail on demand)."""

from __future__ import annotations

import pytest
import torch

from service.engine.faults import OOM, OTHER, STICKY, classify

# torch >= 2.8 raises CUDA's errors as torch.AcceleratorError, a RuntimeError; older torch as RuntimeError itself
CUDA_ERROR = getattr(torch, "AcceleratorError", RuntimeError)
UNKNOWN = CUDA_ERROR("CUDA error: something this engine has never seen")


@pytest.fixture
def synchronize(monkeypatch):
    """synchronize(raises): torch.cuda.synchronize faked to raise (or not); returns the list of its calls."""
    calls: list[tuple] = []

    def set_up(raises: bool) -> list[tuple]:
        def fake(*args, **kwargs):
            calls.append((args, kwargs))
            if raises:
                raise CUDA_ERROR("CUDA error: an unknown error, again")

        monkeypatch.setattr(torch.cuda, "synchronize", fake)
        return calls

    return set_up


@pytest.mark.parametrize("err", [UNKNOWN, RuntimeError("CUDA error: unknown error")], ids=["accelerator", "runtime"])
def test_unknown_cuda_error_is_sticky_when_synchronize_fails_too(synchronize, err):
    calls = synchronize(raises=True)
    assert classify(err, "cuda") == STICKY
    assert len(calls) == 1


@pytest.mark.parametrize("err", [UNKNOWN, RuntimeError("CUDA error: unknown error")], ids=["accelerator", "runtime"])
def test_unknown_cuda_error_is_other_when_synchronize_succeeds(synchronize, err):
    calls = synchronize(raises=False)
    assert classify(err, "cuda") == OTHER
    assert len(calls) == 1


@pytest.mark.parametrize("raises", [True, False])
def test_on_the_cpu_an_unknown_error_is_other_and_synchronize_is_not_called(synchronize, raises):
    calls = synchronize(raises)
    assert classify(UNKNOWN, "cpu") == OTHER
    assert calls == []


@pytest.mark.parametrize("err", [ValueError("bad shape"), TypeError("no"), KeyError("x")], ids=type)
def test_an_error_that_is_not_a_runtime_error_is_other_without_synchronize(synchronize, err):
    """A Python-level mistake (not torch's RuntimeError family) says nothing about the device."""
    calls = synchronize(raises=True)
    assert classify(err, "cuda") == OTHER
    assert calls == []


@pytest.mark.parametrize(
    "err,kind",
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), OOM),
        (RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"), OOM),
        (RuntimeError("CUDA error: an illegal memory access was encountered"), STICKY),
        (RuntimeError("CUDA error: unspecified launch failure"), STICKY),
        (RuntimeError("CUDA error: device-side assert triggered"), STICKY),
        (RuntimeError("CUDA error: uncorrectable ECC error encountered"), STICKY),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_named_kinds_go_by_the_message_and_never_synchronize(synchronize, err, kind):
    calls = synchronize(raises=True)  # were it called, every error would come out STICKY
    assert classify(err, "cuda") == kind
    assert calls == []
