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
    _interpret_on_cpu(device.type)
    return device


def _interpret_on_cpu(kind: str) -> None:
    """Triton's interpreter for this process and the children it starts, where the device is the CPU."""
    if kind == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")


# Device files a GPU driver makes: without any of them torch cannot see a GPU (NVIDIA's driver, and ROCm's, which torch
# also reports as cuda).
GPU_DRIVER_PATHS = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd")


def device_type(name: str) -> str:
    """resolve_device(name).type, without importing torch where the answer needs none: `cpu` asked for, or `auto` on
    a host with no GPU driver (GPU_DRIVER_PATHS). The supervisor asks this and never runs a model: torch's import was
    2.8 CPU-s of a 2-core machine's start, before any engine could begin."""
    if name == "cpu" or (name == "auto" and not any(os.path.exists(p) for p in GPU_DRIVER_PATHS)):
        return "cpu"
    return resolve_device(name).type


def prepare_device_type(settings: Settings) -> str:
    """prepare_backend for the supervisor: the device type, and Triton's interpreter chosen for its children on the
    CPU, torch imported only where the host has a GPU driver."""
    kind = device_type(settings.device)
    _interpret_on_cpu(kind)
    return kind


def resolve_device(name: str):
    """'auto' -> cuda if present, else cpu; 'cuda' without a GPU is an error, not a silent fallback. torch only, not
    the kernels (1.5 CPU-s a start on 2 cores): the supervisor calls this (device_type) on a host with a GPU driver."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("FUSEDSERVE_DEVICE=cuda but torch sees no CUDA device (torch.cuda.is_available() is False)")
    return torch.device(name)
