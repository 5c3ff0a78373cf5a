"""`fusedserve calibrate` and serving in float8 without and with a calibration (issue 52), on the CPU: the shipped
digits CNN copied to a temporary directory, calibrated on the 360 held-out digits saved as .npy, then run in float8 by
the unfused executor (the fp8 kernels' torch references: tests/test_kernels_fp8.py checks the kernels against them,
tests/test_fp8_gpu.py the fused float8 executor on the GPU)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from service.cli import main
from service.config import Settings
from service.model.calibrate import files_sha256
from service.model.executors import Executor
from service.model.float8 import CalibrationMissing, Fp8Output, load_calibration
from service.model.loader import load_model
from service.model.planner import Conv2dStep, Pool2dStep
from service.model.spec import ModelFormatError
from tests.digits import held_out_split
from tests.server import REPO
from tests.tolerances import normwise_error

CPU = torch.device("cpu")


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "digits-cnn"
    shutil.copytree(REPO / "model_weights" / "digits-cnn", d)
    return d


@pytest.fixture
def samples(tmp_path):
    X, y = held_out_split()
    path = tmp_path / "samples" / "held_out.npy"
    path.parent.mkdir()
    np.save(path, X.astype(np.float32))  # flat rows of 64: read as (1, 8, 8) rows
    return path, X, y


def test_float8_is_refused_without_a_calibration(model_dir):
    model = load_model(model_dir)
    with pytest.raises(CalibrationMissing, match="fusedserve calibrate digits-cnn --samples"):
        Executor(model, "unfused", CPU, torch.float32, precision="float8")


def test_calibrate_writes_the_models_calibration_and_float8_serves_from_it(model_dir, samples, capsys):
    path, X, y = samples
    assert main(["calibrate", str(model_dir), "--samples", str(path.parent), "--batch-size", "100"]) == 0
    out, err = capsys.readouterr()
    assert "calibrate: 100 rows" in err and "calibrate: 360 rows" in err  # progress, one line per forward
    assert f"wrote {model_dir / 'calibration.json'}" in out
    doc = json.loads((model_dir / "calibration.json").read_text())
    assert doc["format"] == "fusedserve-calibration/1" and doc["model"] == "digits-cnn"
    assert doc["samples"] == 360 and doc["statistic"] == "absmax"
    assert doc["samples_sha256"] == files_sha256([path])
    assert doc["tensors"]["input"] == 16.0  # the digits' largest pixel
    model = load_model(model_dir)
    cal = load_calibration(model)
    x = torch.tensor(X, dtype=torch.float32).reshape(-1, *model.input_shape)
    acc = {}
    for precision in ("float32", "float8"):
        ex = Executor(model, "unfused", CPU, torch.float32, precision=precision, calibration=cal)
        acc[precision] = float((ex.forward(x).argmax(1).numpy() == y).mean())
        if precision == "float8":
            # the first conv and the classifier stay in the compute dtype; the second conv runs in float8
            kinds = ex.precisions()
            assert kinds["conv2d_0_relu"] == "float32" and kinds["linear_1"] == "float32", kinds
            assert "float8" in kinds.values(), kinds
            from service.link.plan import read_plan, write_plan

            write_plan(model_dir, ex, "cpu")  # what GET /model shows: each step's precision
            plan = read_plan(model_dir)["plan"]
            assert {e["kernel"]: e["precision"] for e in plan if e.get("kernel")} == {
                k: v for k, v in kinds.items() if not k.startswith("flatten")
            }
    assert abs(acc["float8"] - acc["float32"]) <= 0.005, acc


def test_float8_fp16_steps_configurable(model_dir, samples):
    path, _, _ = samples
    assert main(["calibrate", str(model_dir), "--samples", str(path)]) == 0
    model = load_model(model_dir)
    every = Executor(model, "unfused", CPU, torch.float32, precision="float8", fp16_steps=())
    # with nothing kept: every conv the fp8 kernels can run (the first reads the raw input: fp32, quantized as read)
    assert set(every.fp8) == {s.name for s in every.steps if s.name.startswith(("conv2d", "linear"))}
    assert every.fp8["linear_1"].out_scale is None  # the model's output: written in the compute dtype


def test_calibrate_refusals(model_dir, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["calibrate", str(model_dir), "--samples", str(tmp_path / "empty")]) == 1
    assert "no sample files" in capsys.readouterr().err
    np.save(tmp_path / "bad.npy", np.zeros((3, 7), np.float32))
    assert main(["calibrate", str(model_dir), "--samples", str(tmp_path / "bad.npy")]) == 1
    assert "rows of shape (1, 8, 8)" in capsys.readouterr().err
    image = REPO / "model_weights" / "digits-resnet" / "images" / "0.png"
    with pytest.raises(ModelFormatError, match="does not take images"):
        from service.model.calibrate import calibrate

        calibrate(load_model(model_dir), image, CPU)


def test_float8_setting():
    s = Settings(dtype="float8")
    assert s.compute_dtype("cuda") == "float8" and s.float8_fp16_steps == "first,last,pooled"


def test_runner_serves_float8(model_dir, samples):
    """The engine's runner with dtype float8 (FUSEDSERVE_DTYPE=float8): float16 rows in and out, the plan in float8."""
    from service.model.runner import ModelRunner

    path, X, y = samples
    assert main(["calibrate", str(model_dir), "--samples", str(path)]) == 0
    runner = ModelRunner(load_model(model_dir), "unfused", CPU, "float8", fp16_steps=("first",))
    assert runner.executor.precision == "float8" and "linear_1" in runner.executor.fp8
    out = runner.run(X[:16].astype(np.float32).reshape(16, 1, 8, 8))
    assert out.shape == (16, 10) and (out.argmax(1) == y[:16]).mean() >= 0.9


def _calibrated_on_random_rows(model_dir, tmp_path, shape: tuple[int, ...], rows: int, checked: int):
    """The model calibrated (the CLI) on `rows` fresh normal rows; (the loaded model, the first `checked` rows on the
    device the fused half runs on, that device: CUDA where there is one)."""
    data = np.random.default_rng().standard_normal((rows, *shape)).astype(np.float32)
    (tmp_path / "samples").mkdir()
    np.save(tmp_path / "samples" / "rows.npy", data)
    assert main(["calibrate", str(model_dir), "--samples", str(tmp_path / "samples")]) == 0
    device = torch.device("cuda") if torch.cuda.is_available() else CPU
    return load_model(model_dir), torch.from_numpy(data[:checked]).to(device), device


def _same_outputs_without_e4m3_outputs(ex, model, x, monkeypatch) -> None:
    """ex's outputs equal those of the same float8 plan without its float8.Fp8Output steps (whose readers then
    quantize the compute dtype's tensor as they gather it): exactly on the CPU and unfused; on a GPU normwise, since
    the same e4m3 operands summed in another order (an e4m3 input may take another kernel, TMA) can move a value of an
    e4m3 intermediate across a rounding boundary, one step (1/16 to 1/8 of it), which the classifier mixes in (an
    H200: 3 of 70 logits off by up to 1.4%, 5.9e-4 of 0.2)."""
    from service.model import float8

    plan = float8.plan_float8
    monkeypatch.setattr(float8, "plan_float8", lambda *a, **k: {
        n: p for n, p in plan(*a, **k).items() if not isinstance(p, Fp8Output)})  # fmt: skip
    before = Executor(model, ex.mode, ex.device, ex.dtype, precision="float8")
    monkeypatch.setattr(float8, "plan_float8", plan)
    assert not any(isinstance(p, Fp8Output) for p in before.fp8.values())
    with torch.no_grad():
        got, want = ex.forward(x), before.forward(x)
    if ex.device.type == "cpu" or ex.mode == "unfused":
        assert torch.equal(got, want), ex.mode
    else:
        assert normwise_error(got, want) < 1e-2, ex.mode


def test_a_max_pool_between_the_float16_stem_and_float8_convs_writes_e4m3(tmp_path, monkeypatch):
    """ResNet's shape in small: a conv kept in the compute dtype, a 3x3/2 max pool, float8 convs. The pool writes
    e4m3 with its readers' input scale (float8.Fp8Output), so they read one byte a value; a max of quantized values is
    the quantized max, so the model's outputs are those of the plan where the pool writes float32 and its readers
    quantize as they read, in both modes: exactly on the CPU (fused: Triton's interpreter); on a GPU up to the order
    of the fp8 MMA's sums (an e4m3 input may take another kernel, TMA, than a float32 one), normwise."""
    from torch import nn

    from service.model.export import export_sequential

    torch.manual_seed(int(np.random.default_rng().integers(1 << 31)))
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
                        nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 1), nn.ReLU(), nn.Flatten(),
                        nn.Linear(32 * 5 * 5, 10))  # fmt: skip
    model_dir = export_sequential(net, tmp_path / "stem-pool", input_shape=[3, 9, 9])
    model, x, device = _calibrated_on_random_rows(model_dir, tmp_path, (3, 9, 9), rows=48, checked=7)
    for mode in ("unfused", "fused"):
        ex = Executor(model, mode, device, torch.float32, precision="float8")
        pools = {name: p for name, p in ex.fp8.items() if isinstance(p, Fp8Output)}
        (pool,) = [s for s in ex.steps if s.name in pools]
        cal = load_calibration(model)
        assert pools[pool.name].out_scale == pytest.approx(cal.ranges[pool.output] / 448)
        assert ex.precisions()[pool.name] == "float32"  # computes in the compute dtype, writes e4m3
        index = ex.steps.index(pool)
        pooled = ex.layers[index][1](torch.randn(2, 16, 9, 9, device=device))
        assert pooled.dtype == torch.float8_e4m3fn and pooled.shape == (2, 16, 5, 5)
        _same_outputs_without_e4m3_outputs(ex, model, x, monkeypatch)


def test_a_float16_stem_before_a_float8_depthwise_conv_writes_e4m3(tmp_path, monkeypatch):
    """MobileNet's start in small: the stem conv kept in the compute dtype, then a float8 depthwise conv. The stem
    writes e4m3 with its reader's input scale (float8.Fp8Output; fused: in its own kernel's epilogue, fused_conv2d's
    out_scale), rounded to the compute dtype first, so the depthwise conv reads the values it quantized itself as it
    gathered before: the model's outputs are those of the plan without it, exactly on the CPU in both modes."""
    from torch import nn

    from service.model.export import export_module

    torch.manual_seed(int(np.random.default_rng().integers(1 << 31)))
    net = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU6(),
                        nn.Conv2d(16, 16, 3, padding=1, groups=16), nn.ReLU6(), nn.Conv2d(16, 24, 1), nn.Flatten(),
                        nn.Linear(24 * 5 * 5, 10))  # fmt: skip
    model_dir = export_module(net.eval(), torch.randn(1, 3, 9, 9), tmp_path / "stem-dw")
    model, x, device = _calibrated_on_random_rows(model_dir, tmp_path, (3, 9, 9), rows=48, checked=7)
    for mode in ("unfused", "fused"):
        ex = Executor(model, mode, device, torch.float32, precision="float8")
        stem = ex.steps[0]
        assert isinstance(ex.fp8[stem.name], Fp8Output) and ex.precisions()[stem.name] == "float32"
        assert ex.precisions()[ex.steps[1].name] == "float8"  # the depthwise conv
        assert ex.fp8[stem.name].out_scale == pytest.approx(load_calibration(model).ranges[stem.output] / 448)
        layer = ex.layers[0][1]
        if mode == "fused":  # quantized in the conv's epilogue, not by a pass of its own
            assert layer.keywords["out_scale"] == ex.fp8[stem.name].out_scale
        y = layer(torch.randn(2, 3, 9, 9, device=device))
        assert y.dtype == torch.float8_e4m3fn and y.shape == (2, 16, 5, 5)
        _same_outputs_without_e4m3_outputs(ex, model, x, monkeypatch)


def test_grouped_and_depthwise_convs_run_in_float8_alike_in_both_modes(tmp_path):
    """MobileNet's block in small: a depthwise 3x3 (with its BatchNorm and ReLU6) between 1x1 convs, and a grouped
    conv of 4 channels a group. Both run in float8 (kernels/conv_grouped_fp8.py fused; reference.conv2d_fp8 with its
    groups unfused), writing e4m3 where a float8 step reads them and float32 for the kept classifier, and the two modes
    agree: the same e4m3 operands and one rounding each, so up to an intermediate value rounded one e4m3 step apart."""
    from torch import nn

    from service.model.export import export_module
    from service.model.float8 import Fp8Step

    torch.manual_seed(int(np.random.default_rng().integers(1 << 31)))
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 48, 1), nn.ReLU6(),
                        nn.Conv2d(48, 48, 3, stride=2, padding=1, groups=48), nn.BatchNorm2d(48), nn.ReLU6(),
                        nn.Conv2d(48, 32, 1), nn.Conv2d(32, 32, 3, padding=1, groups=8), nn.ReLU(), nn.Flatten(),
                        nn.Linear(32 * 4 * 4, 10)).eval()  # fmt: skip
    with torch.no_grad():
        bn = net[5]
        bn.running_mean.uniform_(-0.5, 0.5), bn.running_var.uniform_(0.5, 2.0), bn.weight.uniform_(0.5, 1.5)
    model_dir = export_module(net, torch.randn(1, 3, 7, 7), tmp_path / "mobile")
    model, x, device = _calibrated_on_random_rows(model_dir, tmp_path, (3, 7, 7), rows=40, checked=5)
    outs = {}
    for mode in ("unfused", "fused"):
        ex = Executor(model, mode, device, torch.float32, precision="float8")
        grouped = [s for s in ex.steps if getattr(s, "groups", 1) > 1]
        assert [s.groups for s in grouped] == [48, 8], [s.name for s in ex.steps]
        assert all(isinstance(ex.fp8.get(s.name), Fp8Step) for s in grouped)
        depthwise, last = grouped
        assert ex.fp8[depthwise.name].out_scale is not None  # read by a float8 1x1 conv: e4m3 out
        assert ex.fp8[last.name].out_scale is None  # read by the float32 classifier (through the flatten)
        assert all(ex.precisions()[s.name] == "float8" for s in grouped)
        with torch.no_grad():
            outs[mode] = ex.forward(x).float().cpu()
    assert outs["fused"].shape == (5, 10) and torch.isfinite(outs["fused"]).all()
    assert normwise_error(outs["fused"], outs["unfused"]) < 2e-2


def test_a_squeeze_excitation_gate_runs_in_float8_in_the_conv_that_reads_it(tmp_path):
    """EfficientNet's block in small: expand 1x1, depthwise 3x3, the squeeze-excitation (global pool, two 1x1 convs,
    a sigmoid) whose gate the project conv applies as it reads. Calibration records x * gate, a tensor no step
    writes (float8.gated_name); the project conv quantizes that product with its scale as it gathers, so the
    depthwise conv before it writes the compute dtype (its reader multiplies first), and both modes agree."""
    from torch import nn

    from service.model.export import export_module
    from service.model.float8 import Calibration, Fp8Step, gated_name, load_calibration

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.SiLU())
            self.expand = nn.Sequential(nn.Conv2d(16, 48, 1), nn.SiLU())
            self.dw = nn.Sequential(nn.Conv2d(48, 48, 3, padding=1, groups=48), nn.SiLU())
            self.fc1, self.fc2 = nn.Conv2d(48, 8, 1), nn.Conv2d(8, 48, 1)
            self.project = nn.Conv2d(48, 32, 1)
            self.head = nn.Linear(32 * 6 * 6, 10)

        def forward(self, x):
            y = self.dw(self.expand(self.stem(x)))
            gate = torch.sigmoid(self.fc2(torch.nn.functional.silu(self.fc1(y.mean((2, 3), keepdim=True)))))
            return self.head(torch.flatten(self.project(y * gate), 1))

    torch.manual_seed(int(np.random.default_rng().integers(1 << 31)))
    model_dir = export_module(Block().eval(), torch.randn(1, 3, 6, 6), tmp_path / "se")
    model, x, device = _calibrated_on_random_rows(model_dir, tmp_path, (3, 6, 6), rows=40, checked=5)
    outs = {}
    for mode in ("unfused", "fused"):
        ex = Executor(model, mode, device, torch.float32, precision="float8")
        (gated,) = [s for s in ex.steps if getattr(s, "gate", None)]
        plan = ex.fp8[gated.name]
        assert isinstance(plan, Fp8Step) and ex.precisions()[gated.name] == "float8"
        cal = load_calibration(model)
        assert plan.x_scale == pytest.approx(cal.ranges[gated_name(gated)] / 448)
        (dw,) = [s for s in ex.steps if getattr(s, "groups", 1) > 1]
        assert dw.output == gated.inputs[0] and ex.fp8[dw.name].out_scale is None  # read in float32 by the gated conv
        with torch.no_grad():
            outs[mode] = ex.forward(x).float().cpu()
    assert torch.isfinite(outs["fused"]).all()
    assert normwise_error(outs["fused"], outs["unfused"]) < 2e-2
    # a calibration from before gated convs ran in float8 lacks x * gate: that conv stays float32, the rest float8
    older = Calibration({k: v for k, v in cal.ranges.items() if "*" not in k}, cal.samples, cal.samples_sha256)
    ex = Executor(model, "unfused", device, torch.float32, precision="float8", calibration=older)
    assert gated.name not in ex.fp8 and ex.precisions()[gated.name] == "float32"
    assert ex.fp8[dw.name].out_scale is None and isinstance(ex.fp8[dw.name], Fp8Step)
    # the squeeze-excitation's two convs read a 1x1 map: kept in the compute dtype by default (`pooled`), and the
    # pool before them writes it; named steps alone (no `pooled`) put them in float8, the pool writing e4m3
    pool = next(s for s in ex.steps if isinstance(s, Pool2dStep))
    fcs = [s.name for s in ex.steps if isinstance(s, Conv2dStep) and model.shapes[s.inputs[0]][1:] == (1, 1)]
    assert len(fcs) == 2 and all(ex.precisions()[n] == "float32" for n in fcs) and pool.name not in ex.fp8
    ex = Executor(model, "unfused", device, torch.float32, precision="float8", fp16_steps=("first", "last"))
    assert all(ex.precisions()[n] == "float8" for n in fcs) and isinstance(ex.fp8[pool.name], Fp8Output)
    # `gated` keeps the gated conv in the compute dtype; the depthwise conv before it stays float8
    ex = Executor(model, "unfused", device, torch.float32, precision="float8", fp16_steps=("first", "last", "gated"))
    assert ex.precisions()[gated.name] == "float32" and ex.precisions()[dw.name] == "float8"
