"""A torch nn.Sequential exported to the model format serves the same function, fused and unfused."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from service.model.executors import Executor
from service.model.export import export_sequential
from service.model.loader import load_model
from tests.tolerances import assert_close_to

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _exact_float32_convs():
    """float32 convs in full fp32 on the GPU: torch's default lets cuDNN, and fused_conv2d which follows the
    same flag, multiply in TF32 (10 mantissa bits), which the float64 comparisons here would catch."""
    before = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = before


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


def _cnn() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(2, 6, 3, padding=1), nn.ReLU(),
        nn.Conv2d(6, 5, (3, 2), stride=(2, 1), padding="valid", dilation=(1, 2), bias=False), nn.SiLU(),
        nn.MaxPool2d(2, ceil_mode=True),
        nn.Conv2d(5, 4, 3, padding="same"),
        nn.AvgPool2d(3, stride=1, padding=1, count_include_pad=False), nn.LeakyReLU(0.1),
        nn.Flatten(), nn.Linear(4 * 2 * 3, 16), nn.ReLU(), nn.Linear(16, 3),
    )  # fmt: skip


@pytest.mark.parametrize("mode", ["fused", "unfused"])
def test_exported_cnn_matches_torch(tmp_path, mode):
    model = _cnn()
    path = export_sequential(model, tmp_path / "cnn", input_shape=[2, 9, 7])
    ops = json.loads((path / "config.json").read_text())["ops"]
    assert ops[2] == {"op": "conv2d", "weight": "layers.2.weight", "stride": [2, 1], "padding": 0,
                      "dilation": [1, 2]}  # fmt: skip
    assert ops[4] == {"op": "maxpool2d", "kernel_size": 2, "stride": 2, "padding": 0, "ceil_mode": True}
    assert ops[5]["padding"] == 1  # "same" for a 3x3 kernel
    assert ops[6] == {"op": "avgpool2d", "kernel_size": 3, "stride": 1, "padding": 1, "ceil_mode": False,
                      "count_include_pad": False}  # fmt: skip
    loaded = load_model(path)
    x = torch.randn(5, 2, 9, 7)
    with torch.no_grad():
        want = model.double()(x.double())
    ex = Executor(loaded, mode, DEVICE, torch.float32)
    assert [name for name, _ in ex.layers] == [
        "conv2d_0_relu", "conv2d_1_silu", "maxpool2d_0", "conv2d_2", "avgpool2d_0_leaky_relu", None, "mlp_0_1",
    ]  # fmt: skip
    assert_close_to(ex.forward(x.to(DEVICE)), want, 1e-5, f"exported CNN, {mode}")


@pytest.mark.parametrize(
    "module,message",
    [
        (nn.Conv2d(2, 2, 3, groups=2), "layer 0: Conv2d has groups=2; only groups=1 is supported"),
        (nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"), "layer 0: Conv2d has padding_mode='reflect'"),
        (nn.Conv2d(2, 2, 2, padding="same"), "layer 0: Conv2d has padding='same' with an even kernel"),
        (nn.MaxPool2d(2, dilation=2), r"layer 0: MaxPool2d has dilation=2; only 1 is supported"),
        (nn.MaxPool2d(2, return_indices=True), "layer 0: MaxPool2d has return_indices=True"),
        (nn.AvgPool2d(2, divisor_override=3), "layer 0: AvgPool2d has divisor_override=3; not supported"),
        (nn.Conv1d(1, 1, 1), "layer 0: Conv1d has no fusedserve op"),
        (nn.BatchNorm2d(2), r"layer 0: BatchNorm2d has no fusedserve op \(Linear, Conv2d, AvgPool2d, MaxPool2d, "),
    ],
    ids=["groups", "reflect", "same-even", "pool-dilation", "indices", "divisor", "conv1d", "batchnorm"],
)
def test_unsupported_cnn_module_is_named(tmp_path, module, message):
    with pytest.raises(ValueError, match=message):
        export_sequential(nn.Sequential(module, nn.Flatten()), tmp_path / "bad", input_shape=[2, 6, 6])


def test_both_export_helpers_say_what_they_wrote_with_the_same_modes(tmp_path, capsys):
    """export_sequential and export_module print what they wrote where, and write both files 0644 (one wrote its
    weights 0600, safetensors' default, and neither printed anything: issue 51)."""
    import os
    import stat

    from service.model.export import export_module

    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2)).eval()
    old = os.umask(0o077)  # a strict umask must not make the weights unreadable to a server of another user
    try:
        seq = export_sequential(model, tmp_path / "seq", input_shape=[6])
        graph = export_module(model, torch.randn(2, 6), tmp_path / "graph")
    finally:
        os.umask(old)
    lines = capsys.readouterr().out.splitlines()
    for out, line in zip((seq, graph), lines, strict=True):
        assert line.startswith(f"wrote {out / 'config.json'} (3 ops) and {out / 'model.safetensors'} (4 tensors, ")
        assert line.endswith(f"mode 644; serve it: fusedserve serve --model {out}")
        for name in ("config.json", "model.safetensors"):
            assert stat.S_IMODE((out / name).stat().st_mode) == 0o644, (out, name)
