"""A torch nn.Sequential exported to the model format serves the same function, fused and unfused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from service.model.executors import Executor
from service.model.export import export_sequential
from service.model.loader import load_model
from tests.tolerances import assert_close_to

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("mode", ["fused", "unfused"])
def test_exported_sequential_matches_torch(tmp_path, mode):
    model = nn.Sequential(
        nn.Flatten(),
        nn.Linear(2 * 3 * 5, 37),
        nn.GELU(approximate="tanh"),
        nn.Linear(37, 19, bias=False),
        nn.LeakyReLU(0.2),
        nn.Tanh(),
        nn.Linear(19, 4),
    )
    path = export_sequential(model, tmp_path / "seq", input_shape=[2, 3, 5], labels=list("abcd"))
    loaded = load_model(path)
    assert loaded.spec.labels == list("abcd")
    x = torch.randn(11, 2, 3, 5)
    with torch.no_grad():
        want = model.double()(x.double())
    # Per-layer plan, and the plan that runs the two adjacent linear layers as one whole-MLP kernel.
    per_layer = Executor(loaded, mode, DEVICE, torch.float32, whole_mlp=False)
    assert [name for name, _ in per_layer.layers] == [None, "linear_0_gelu_tanh", "linear_1_leaky_relu",
                                                      "activation_0_tanh", "linear_2"]  # fmt: skip
    grouped = Executor(loaded, mode, DEVICE, torch.float32)
    assert [name for name, _ in grouped.layers] == [None, "mlp_0_1", "activation_0_tanh", "linear_2"]
    for ex in (per_layer, grouped):
        assert_close_to(ex.forward(x.to(DEVICE)), want, 1e-5, f"exported sequential, {mode}")


def test_unsupported_module_is_named(tmp_path):
    with pytest.raises(ValueError, match="layer 1: Conv1d has no fusedserve op"):
        export_sequential(nn.Sequential(nn.Flatten(), nn.Conv1d(1, 1, 1)), tmp_path / "bad", input_shape=[4])
