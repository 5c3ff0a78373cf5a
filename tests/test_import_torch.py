"""export_module (service/model/torch_import.py): torch modules written in tests/torch_models.py, exported through
torch.export to a format-2 model directory, loaded back and run by both executors against the module itself in
eval mode: fp32 within 1e-4 relative norm error, the same top-1 on at least 99.5% of the inputs (512 random
inputs unfused; the fused mode on the CPU runs Triton's interpreter, so it gets FUSED_CPU_ROWS). Then what is
refused: an ATen op fusedserve cannot run (by node name and op), a module of two inputs. export_sequential keeps
writing format 1 (tests/test_export.py).
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from service.model.executors import Executor
from service.model.export import export_module
from service.model.loader import load_model
from service.model.planner import fused_steps, kernel_names
from service.model.spec import ModelFormatError
from tests.torch_models import MODELS, make

pytestmark = pytest.mark.timeout(600)

ROWS = 512
FUSED_CPU_ROWS = 24
HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict:
    """{name: (module, model directory)}, exported once per module."""
    d = tmp_path_factory.mktemp("torch-export")
    out = {}
    for name, (_, shape) in MODELS.items():
        module = make(name)
        out[name] = (module, export_module(module, torch.randn(1, *shape), d / name, labels=None))
    return out


def run_exported(module: nn.Module, path, x: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the exported model's output in `mode`, fp32 on the GPU if there is one, else the CPU; the module's own eager
    forward in float64) for the images or rows x; TF32 off."""
    model = load_model(path)
    device = torch.device("cuda" if HAS_CUDA else "cpu")
    before = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.inference_mode():
            want = module.double()(x.double())
            module.float()
            got = Executor(model, mode, device, torch.float32).forward(x.to(device)).cpu()
    finally:
        torch.backends.cudnn.allow_tf32 = before
    return got, want


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """|got - want| / |want|, norms over the whole batch."""
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("mode", ["unfused", "fused"])
def test_exported_module_matches_the_module(exported, name, mode):
    module, path = exported[name]
    rows = ROWS if (mode == "unfused" or HAS_CUDA) else FUSED_CPU_ROWS
    x = torch.randn(rows, *MODELS[name][1], generator=torch.Generator().manual_seed(3))
    got, want = run_exported(module, path, x, mode)
    err = relative_error(got, want)
    agree = float((got.argmax(1) == want.argmax(1)).float().mean())
    assert err <= 1e-4 and agree >= 0.995, f"{name} {mode}: relative norm error {err:.3g}, top-1 agreement {agree}"


def test_the_graph_keeps_batchnorm_and_the_plan_folds_it(exported):
    _, path = exported["resnet"]
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["format"] == "fusedserve-model/2" and cfg["source"].startswith("torch.export of TinyResNet")
    model = load_model(path)
    assert sum(op.op == "batchnorm" for op in model.ops) == 6
    assert kernel_names(fused_steps(model.ops, model.tensors)) == [
        "conv2d_0_bn_relu", "conv2d_1_bn_relu", "conv2d_2_bn_add_relu", "conv2d_3_bn_relu", "conv2d_5_bn",
        "conv2d_4_bn_add_relu", "avgpool2d_0", "linear_0",
    ]  # fmt: skip
    ops = [op.op for op in load_model(exported["activations"][1]).ops]
    assert {"relu6", "silu", "gelu", "hardswish", "concat", "leaky_relu", "tanh", "maxpool2d"} <= set(ops)
    assert [op.op for op in load_model(exported["mlp-bn"][1]).ops] == [
        "linear", "batchnorm", "relu", "linear", "batchnorm", "gelu", "linear", "softmax",
    ]  # fmt: skip


def test_labels_and_name(tmp_path):
    path = export_module(make("mlp-bn"), torch.randn(4, 20), tmp_path / "m", name="tabular", labels=list("abcde"))
    model = load_model(path)
    assert model.name == "tabular" and model.spec.labels == list("abcde") and model.input_shape == (20,)


class WithSin(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.sin(x))


class TwoInputs(nn.Module):
    def forward(self, x, y):
        return x + y


def test_an_unsupported_aten_op_is_named(tmp_path):
    needle = r"node 'sin' \(aten\.sin\.default, reading 'x' \(N, 8\)\): not supported; fusedserve exports the ATen "
    with pytest.raises(ModelFormatError, match=needle):
        export_module(WithSin(), torch.randn(2, 8), tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_a_module_of_two_inputs(tmp_path):
    module = TwoInputs()
    with pytest.raises(ModelFormatError, match=r"the module takes 2 inputs \('x', 'y'\); fusedserve serves one"):
        from service.model.torch_import import Exporter

        program = torch.export.export(module, (torch.randn(2, 3), torch.randn(2, 3)))
        Exporter(program).run()


def test_export_declares_uint8_pixels_and_their_normalization(tmp_path):
    """input_dtype, mean, std: the served model takes uint8 pixels and runs the module on (x - mean) / std."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 5 * 6, 7))
    mean, std = [120.0, 110.0, 100.0], [60.0, 55.0, 50.0]
    out = export_module(module, torch.randn(2, 3, 5, 6), tmp_path / "m", input_dtype="uint8", mean=mean, std=std)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["input"]["dtype"] == "uint8" and cfg["input"]["normalize"] == {"mean": mean, "std": std}
    model = load_model(out)
    x = torch.randint(0, 256, (3, 3, 5, 6), dtype=torch.uint8)
    want = module((x.float() - torch.tensor(mean).reshape(1, 3, 1, 1)) / torch.tensor(std).reshape(1, 3, 1, 1))
    with torch.inference_mode():
        got = Executor(model, "unfused", torch.device("cpu"), torch.float32).forward(x)
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ModelFormatError, match=r"input\.normalize: 2 mean and std values but the input has 3"):
        export_module(module, torch.randn(2, 3, 5, 6), tmp_path / "bad", mean=[1.0, 2.0], std=[1.0, 2.0])
