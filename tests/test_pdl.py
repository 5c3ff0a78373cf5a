"""Programmatic dependent launch (kernels/pdl.py): when the GEMM kernels use it, and that a chain of layers
launched with it reads each layer's output only once that layer is done, in eager calls and in a CUDA graph.

Where the instructions sit in the compiled code (the wait before any write, the GEMV's first weight load
before the wait) is checked without a GPU in test_kernels_compile.py."""

from __future__ import annotations

import pytest
import torch

from kernels import FusedLinear, pdl, reference
from kernels.graph_capture import capture
from kernels.tiles import gemm_flags, launch_options
from tests.tolerances import RTOL, assert_close_to

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def pdl_setting():
    """Restores the process-wide switch after a test changes it."""
    saved = pdl.switch._on
    yield
    pdl.switch.set(saved)


@pytest.mark.parametrize("value, want", [("false", False), ("0", False), ("off", False), ("true", True), ("1", True)])
def test_environment_switch(monkeypatch, pdl_setting, value, want):
    monkeypatch.setenv("FUSEDSERVE_PDL", value)
    pdl.set_enabled(None)  # read the environment again
    assert pdl.enabled() is want


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's side of the switch")
def test_never_under_the_interpreter(pdl_setting):
    pdl.set_enabled(True)
    assert pdl.use_pdl(torch.device("cpu")) is False
    flags = gemm_flags(True, "relu", torch.float16, False, torch.device("cpu"))
    assert flags["PDL"] is False and launch_options(flags) == {}


@pytest.mark.gpu
def test_on_hopper_unless_switched_off(pdl_setting):
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    pdl.set_enabled(True)
    flags = gemm_flags(True, "relu", torch.float16, False, torch.device("cuda"))
    assert flags["PDL"] is (hopper and pdl.AVAILABLE)
    assert launch_options(flags) == ({"launch_pdl": True} if flags["PDL"] else {})
    pdl.set_enabled(False)
    assert gemm_flags(True, "relu", torch.float16, False, torch.device("cuda"))["PDL"] is False


def _chain(dims, dtype):
    layers = []
    for i, (k, n) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
        w = (torch.randn(n, k, device=DEVICE) * (2.0 / k) ** 0.5).to(dtype)
        b = (torch.randn(n, device=DEVICE) * 0.1).to(dtype)
        layers.append(FusedLinear(w, b, "relu" if i < len(dims) - 2 else "none", allow_tf32=False))
    return layers


def _forward(layers, x):
    for layer in layers:
        x = layer(x)
    return x


def _reference(layers, x):
    """float64 layers, each output rounded to x's dtype as the chain stores it: what is left is summation
    order (a stale or half-written input gives errors of the order of the values themselves)."""
    y = x.double()
    for layer in layers:
        y = reference.linear(y, layer.weight.double(), layer.bias.double(), layer.activation).to(x.dtype).double()
    return y


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 600])  # the GEMV kernel, 16-row MMA tiles, TMA-sized (bucket 1024)
@pytest.mark.parametrize("switch", [True, False], ids=["pdl", "no-pdl"])
def test_chain_reads_each_layer_only_when_it_is_done(pdl_setting, rows, switch):
    """Each layer's output feeds the next; a layer that read x before the previous one finished would give
    stale or half-written rows. Twenty replays of one graph with a fresh input each, every one checked, then
    eager calls: the same answers with PDL on and off."""
    pdl.set_enabled(switch)
    dtype = torch.float16
    layers = _chain([1024, 2048, 4096, 512], dtype)
    static_x = torch.randn(rows, 1024, device=DEVICE).to(dtype)
    _forward(layers, static_x)  # tune and compile outside the capture
    graph, static_y = capture(lambda: _forward(layers, static_x), warmups=2)
    for i in range(20):
        static_x.copy_(torch.randn(rows, 1024, device=DEVICE).to(dtype))
        static_y.fill_(float("nan"))  # every element must be written again
        graph.replay()
        assert_close_to(static_y, _reference(layers, static_x), RTOL[dtype], f"replay {i} rows={rows}")
    for i in range(5):
        x = torch.randn(rows, 1024, device=DEVICE).to(dtype)
        assert_close_to(_forward(layers, x), _reference(layers, x), RTOL[dtype], f"eager {i} rows={rows}")
