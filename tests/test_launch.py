"""kernels/launch.py: when DirectLaunch may call Triton's C launch function itself, and that a direct launch
computes what the checked launch does (on the GPU)."""

from __future__ import annotations

import inspect

import pytest
import torch
import triton

from kernels import FusedLinear
from kernels import launch as launch_mod
from kernels.mlp import FusedMLP, MLPLayer


class _KnownLauncher:
    """Has the __call__ signature of triton 3.6's CudaLauncher, whose body DirectLaunch skips."""

    def __init__(self, global_scratch_size=0, profile_scratch_size=0):
        self.global_scratch_size, self.profile_scratch_size = global_scratch_size, profile_scratch_size
        self.launch_cooperative_grid, self.launch_pdl = False, True

    def launch(self, *args):
        return args

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        raise AssertionError("not called when the C launch is taken")


class _OtherLauncher(_KnownLauncher):
    """A launcher whose __call__ takes other parameters (triton 3.9's names the metadata and hooks)."""

    def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata, *args):
        raise AssertionError("unused")


def test_the_c_launch_is_taken_only_for_the_known_launcher_and_a_kernel_without_scratch():
    known = _KnownLauncher()
    assert launch_mod.c_launch_of(known) == known.launch
    assert launch_mod.c_launch_of(_KnownLauncher(global_scratch_size=128)) is None  # needs its scratch allocated
    assert launch_mod.c_launch_of(_KnownLauncher(profile_scratch_size=64)) is None
    assert launch_mod.c_launch_of(_OtherLauncher()) is None
    no_launch = _KnownLauncher()
    no_launch.launch = None
    assert launch_mod.c_launch_of(no_launch) is None


def test_the_installed_launcher_takes_the_c_launch_only_with_the_known_signature():
    """The GPU machine runs triton 3.6, whose CudaLauncher must take the C launch; a newer one (triton 3.9 on
    the dev machine) whose __call__ differs must go through the object. Checked on the installed class."""
    from triton.backends.nvidia.driver import CudaLauncher

    launcher = object.__new__(CudaLauncher)  # no compiled kernel needed: c_launch_of reads these and the class
    launcher.launch, launcher.global_scratch_size, launcher.profile_scratch_size = print, 0, 0
    taken = launch_mod.c_launch_of(launcher) is not None
    if triton.__version__.startswith("3.6."):
        assert taken
    else:
        known = tuple(inspect.signature(CudaLauncher.__call__).parameters) == launch_mod._KNOWN_LAUNCHER_CALL
        assert taken == known


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_gpu_direct_launch_computes_what_the_checked_launch_does(dtype):
    torch.manual_seed(0)
    x = torch.randn(37, 200, device="cuda").to(dtype)
    w = (torch.randn(300, 200, device="cuda") / 200**0.5).to(dtype)
    b = torch.randn(300, device="cuda").to(dtype)
    layer = FusedLinear(w, b, "gelu_tanh")
    first = layer(x)  # the checked launch: tunes, compiles, keeps the DirectLaunch
    tf32 = torch.backends.cuda.matmul.allow_tf32
    for _ in range(3):
        out = torch.full_like(first, float("nan"))
        assert layer(x, out=out) is out and torch.equal(out, first)
        assert torch.equal(layer(x), first)
    launch = layer._fast[(37, tf32)].launch
    known = tuple(inspect.signature(type(launch._run).__call__).parameters) == launch_mod._KNOWN_LAUNCHER_CALL
    assert launch.calls_c_launcher == (known and not layer._fast[(37, tf32)].persistent)
    if triton.__version__.startswith("3.6.") and not layer._fast[(37, tf32)].persistent:
        assert launch.calls_c_launcher, "on triton 3.6 the pointer kernels launch through the C function"

    layers = [MLPLayer((torch.randn(n, k, device="cuda") / k**0.5).to(dtype), torch.randn(n, device="cuda").to(dtype),
                       "relu") for k, n in [(64, 128), (128, 10)]]  # fmt: skip
    mlp = FusedMLP(layers)
    xm = torch.randn(5, 64, device="cuda").to(dtype)
    first = mlp(xm)
    for _ in range(3):
        assert torch.equal(mlp(xm), first)
    assert mlp._fast[(5, tf32)][0].calls_c_launcher == known
