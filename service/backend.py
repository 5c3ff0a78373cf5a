"""What the supervisor and every engine do before they touch torch's devices or define a kernel: choose the device
and, for fused kernels on the CPU, Triton's interpreter. Both sides import this; neither imports the other."""

from __future__ import annotations

import os

from .config import Settings


def prepare_backend(settings: Settings):
    """Resolve the device, and pick Triton's interpreter for fused kernels on the CPU.

    Triton fixes interpreted-vs-compiled when a kernel is defined, so this must run before `kernels` is first
    imported; if it already was, compiled for CUDA, the kernels' own device check names the problem at the
    first forward. On the CPU the interpreter is chosen in every mode: an unfused engine imports `kernels` too (for
    its reference ops), and a reload may switch it to fused or ab later.
    """
    device = resolve_device(settings.device)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return device


def resolve_device(name: str):
    """'auto' -> cuda if present, else cpu; 'cuda' without a GPU is an error, not a silent fallback. torch only: the
    supervisor calls this and never runs a model, so it does not import the kernels (1.5 CPU-s a start on 2 cores)."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("FUSEDSERVE_DEVICE=cuda but torch sees no CUDA device (torch.cuda.is_available() is False)")
    return torch.device(name)
