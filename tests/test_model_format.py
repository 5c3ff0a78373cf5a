"""The model format (service.model.spec + loader) and the planner: what loads, what is refused and how.

Every refusal must be a ModelFormatError whose message says what is wrong and where (the file, the
op index, the tensor name, the expected shape), so a user can fix the model from the message alone.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from service.cli import main
from service.model.loader import conv_out, load_model, pool_out
from service.model.planner import (
    ActivationStep,
    Conv2dStep,
    FlattenStep,
    LinearStep,
    MLPStep,
    Pool2dStep,
    fused_steps,
    group_conv_pools,
    group_mlps,
    kernel_names,
    plan,
)
from service.model.spec import ModelFormatError, parse_op
from tests.modelgen import cnn_spec_id, random_cnn_spec, random_model_spec, spec_id, write_cnn_model, write_model

pytestmark = pytest.mark.timeout(120)

SHIPPED = Path(__file__).resolve().parents[1] / "model_weights" / "digits-mlp"


# ---- helpers: a valid model in tmp_path, then one thing broken ----


def _config(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())


def _write_config(d: Path, cfg: dict) -> None:
    (d / "config.json").write_text(json.dumps(cfg))


def _edit_config(d: Path, edit) -> None:
    cfg = _config(d)
    edit(cfg)
    _write_config(d, cfg)


def _edit_tensors(d: Path, edit) -> None:
    tensors = load_file(str(d / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(d / "model.safetensors"))


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """64 -> 37 (relu) -> 13 (leaky 0.2) -> 10, with labels: the baseline that each case breaks."""
    return write_model(
        tmp_path / "m",
        [64, 37, 13, 10],
        ["relu", {"op": "leaky_relu", "negative_slope": 0.2}, None],
        seed=int(torch.randint(0, 2**31, ())),
        labels=[f"class{i}" for i in range(10)],
    )


# ---- what loads ----


def test_shipped_model_loads():
    model = load_model(SHIPPED)
    assert model.name == "digits-mlp"
    assert model.input_shape == (64,)
    assert model.input_features == 64
    assert model.output_features == 10
    assert model.spec.labels == [str(i) for i in range(10)]
    assert {k: tuple(v.shape) for k, v in model.tensors.items()} == {
        "fc1.weight": (256, 64),
        "fc1.bias": (256,),
        "fc2.weight": (256, 256),
        "fc2.bias": (256,),
        "fc3.weight": (10, 256),
        "fc3.bias": (10,),
    }
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in model.tensors.values())


def test_check_model_cli_on_shipped_model(capsys):
    assert main(["check-model", str(SHIPPED)]) == 0
    out = capsys.readouterr().out
    assert "digits-mlp: input (64,) -> 10 outputs; 5 ops" in out
    assert "fused plan (1 kernel): mlp_0_2" in out  # the whole MLP in one kernel, as the executors run it


def test_check_model_cli_on_invalid_model(model_dir, capsys):
    (model_dir / "model.safetensors").unlink()
    assert main(["check-model", str(model_dir)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("invalid model: ") and "model.safetensors: not found" in err


RANDOM_SPECS = [random_model_spec(np.random.default_rng(seed)) for seed in range(16)]


@pytest.mark.parametrize("spec", RANDOM_SPECS, ids=spec_id)
def test_random_models_load(tmp_path, spec):
    d = write_model(tmp_path / "m", **spec)
    model = load_model(d)
    assert model.input_shape == tuple(spec["input_shape"] or [spec["widths"][0]])
    assert model.output_features == spec["widths"][-1]
    n_layers = len(spec["widths"]) - 1
    biases = spec["bias"]
    assert len(model.tensors) == n_layers + sum(biases)
    steps = plan(model.ops)
    assert sum(isinstance(s, LinearStep) for s in steps) == n_layers
    assert [s.bias is not None for s in steps if isinstance(s, LinearStep)] == biases


def test_stored_half_precision_tensors_load(tmp_path):
    d = write_model(tmp_path / "m", [7, 5, 3], ["silu", None])
    _edit_tensors(d, lambda t: t.update({k: v.half() if "0" in k else v.bfloat16() for k, v in t.items()}))
    model = load_model(d)
    assert model.tensors["layer0.weight"].dtype == torch.float16
    assert model.tensors["layer1.weight"].dtype == torch.bfloat16


def test_unused_tensors_are_dropped(model_dir):
    _edit_tensors(model_dir, lambda t: t.update({"optimizer.state": torch.randn(3, 3), "step": torch.tensor([1])}))
    model = load_model(model_dir)
    assert "optimizer.state" not in model.tensors and "step" not in model.tensors


def test_labels_are_optional(model_dir):
    _edit_config(model_dir, lambda c: c.pop("labels"))
    assert load_model(model_dir).spec.labels is None


# ---- what is refused, and the message ----


def _set_op(index: int, op: dict):
    def edit(cfg):
        cfg["ops"][index] = op

    return edit


# (id, how to break the config, regex the message must match). The baseline ops are
# [linear layer0, relu, linear layer1, leaky_relu, linear layer2].
BAD_CONFIGS = [
    (
        "wrong format",
        lambda c: c.update(format="fusedserve-model/3"),
        r"format 'fusedserve-model/3' is not supported; expected 'fusedserve-model/1' or 'fusedserve-model/2'",
    ),
    ("unknown top-level field", lambda c: c.update(layers=3), r"layers: Extra inputs are not permitted"),
    ("empty ops", lambda c: c.update(ops=[]), r"ops: List should have at least 1 item"),
    ("missing ops", lambda c: c.pop("ops"), r"ops: Field required"),
    ("bad name", lambda c: c.update(name="my model!"), r"name: String should match pattern"),
    ("zero input dim", lambda c: c.update(input={"shape": [0]}), r"input\.shape\.0: Input should be greater than"),
    ("input dtype", lambda c: c.update(input={"shape": [64], "dtype": "int8"}), r"input\.dtype: Input should be"),
    ("unknown op", _set_op(1, {"op": "conv9"}), r"ops\[1\]: unknown op 'conv9'; expected one of linear, "),
    ("op not an object", _set_op(1, "relu"), r"ops\.1: Input should be a valid dictionary"),
    ("op name not a string", _set_op(1, {"op": 3}), r"ops\[1\]: each op must be an object with a string 'op' field"),
    ("op without op", _set_op(3, {"negative_slope": 0.1}), r"ops\[3\]: each op must be an object with a string 'op'"),
    (
        "leaky slope not a number",
        _set_op(3, {"op": "leaky_relu", "negative_slope": "x"}),
        r"ops\[3\] \(leaky_relu\): negative_slope: Input should be a valid number",
    ),
    (
        "gelu approximate fast",
        _set_op(1, {"op": "gelu", "approximate": "fast"}),
        r"ops\[1\] \(gelu\): approximate: Input should be 'none' or 'tanh'",
    ),
    (
        "extra op field",
        _set_op(1, {"op": "relu", "inplace": True}),
        r"ops\[1\] \(relu\): inplace: Extra inputs are not",
    ),
    ("linear without weight", _set_op(2, {"op": "linear"}), r"ops\[2\] \(linear\): weight: Field required"),
    (
        "missing tensor",
        _set_op(2, {"op": "linear", "weight": "fc2.weight", "bias": "layer1.bias"}),
        r"ops\[2\] \(linear\): weight tensor 'fc2.weight' is not in model.safetensors "
        r"\(it has: layer0.bias, layer0.weight, layer1.bias, layer1.weight, layer2.bias, layer2.weight\)",
    ),
    (
        "missing bias tensor",
        _set_op(4, {"op": "linear", "weight": "layer2.weight", "bias": "head.bias"}),
        r"ops\[4\] \(linear\): bias tensor 'head.bias' is not in model.safetensors \(it has: layer0.bias, ",
    ),
    (
        "input size mismatch",
        lambda c: c.update(input={"shape": [65]}),
        r"ops\[0\] \(linear\): weight 'layer0.weight' has shape \(37, 64\); expected \(N, 65\) "
        r"because its input has 65 features",
    ),
    (
        "multi-dim input without flatten",
        lambda c: c.update(input={"shape": [4, 16]}),
        r"ops\[0\] \(linear\): input has shape \(4, 16\) per row; linear needs a vector \(add flatten\)",
    ),
    (
        "layers swapped",
        lambda c: c.update(ops=[c["ops"][0], c["ops"][1], c["ops"][4], c["ops"][3], c["ops"][2]]),
        r"ops\[2\] \(linear\): weight 'layer2.weight' has shape \(10, 13\); expected \(N, 37\)",
    ),
    ("too few labels", lambda c: c.update(labels=["a", "b", "c"]), r"3 labels but the model outputs 10 values per row"),
    ("too many labels", lambda c: c.update(labels=list("abcdefghijk")), r"11 labels but the model outputs 10 values"),
]


@pytest.mark.parametrize("edit,message", [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS])
def test_bad_config_is_named(model_dir, edit, message):
    _edit_config(model_dir, edit)
    with pytest.raises(ModelFormatError, match=message) as info:
        load_model(model_dir)
    # The place: every message starts with the file it is about.
    assert str(info.value).startswith(str(model_dir / "config.json") + ": "), str(info.value)


# (id, how to break the tensors, regex). layer0.weight is (37, 64), layer1 (13, 37), layer2 (10, 13).
BAD_TENSORS = [
    (
        "wrong weight shape",
        lambda t: t.update({"layer1.weight": torch.randn(13, 38)}),
        r"ops\[2\] \(linear\): weight 'layer1.weight' has shape \(13, 38\); expected \(N, 37\) "
        r"because its input has 37 features",
    ),
    (
        "1-D weight",
        lambda t: t.update({"layer2.weight": torch.randn(13)}),
        r"ops\[4\] \(linear\): weight 'layer2.weight' has shape \(13,\); expected \(N, 13\)",
    ),
    (
        "wrong bias shape",
        lambda t: t.update({"layer0.bias": torch.randn(36)}),
        r"ops\[0\] \(linear\): bias 'layer0.bias' has shape \(36,\); expected \(37,\) to match weight 'layer0.weight'",
    ),
    (
        "2-D bias",
        lambda t: t.update({"layer2.bias": torch.randn(1, 10)}),
        r"ops\[4\] \(linear\): bias 'layer2.bias' has shape \(1, 10\); expected \(10,\)",
    ),
    (
        "integer weight",
        lambda t: t.update({"layer1.weight": torch.randint(-3, 3, (13, 37), dtype=torch.int32)}),
        r"ops\[2\] \(linear\): weight tensor 'layer1.weight' has dtype torch.int32; expected float32/16 or bfloat16",
    ),
    (
        "float64 bias",
        lambda t: t.update({"layer2.bias": t["layer2.bias"].double()}),
        r"ops\[4\] \(linear\): bias tensor 'layer2.bias' has dtype torch.float64",
    ),
    (
        "NaN in a weight",
        lambda t: t["layer1.weight"].view(-1)[int(torch.randint(0, 13 * 37, ()))].fill_(float("nan")),
        r"ops\[2\] \(linear\): weight tensor 'layer1.weight' contains NaN or Inf",
    ),
    (
        "Inf in a bias",
        lambda t: t["layer0.bias"].view(-1)[int(torch.randint(0, 37, ()))].fill_(float("-inf")),
        r"ops\[0\] \(linear\): bias tensor 'layer0.bias' contains NaN or Inf",
    ),
    (
        "missing tensor",
        lambda t: t.pop("layer2.weight"),
        r"ops\[4\] \(linear\): weight tensor 'layer2.weight' is not in model.safetensors \(it has: layer0.bias, "
        r"layer0.weight, layer1.bias, layer1.weight, layer2.bias\)",
    ),
]


@pytest.mark.parametrize("edit,message", [c[1:] for c in BAD_TENSORS], ids=[c[0] for c in BAD_TENSORS])
def test_bad_tensor_is_named(model_dir, edit, message):
    _edit_tensors(model_dir, edit)
    with pytest.raises(ModelFormatError, match=message) as info:
        load_model(model_dir)
    assert str(info.value).startswith(str(model_dir / "config.json") + ": "), str(info.value)


def test_missing_model_dir(tmp_path):
    with pytest.raises(ModelFormatError, match=re.escape(f"{tmp_path / 'nope'}: no such model directory")):
        load_model(tmp_path / "nope")


def test_missing_config(model_dir):
    (model_dir / "config.json").unlink()
    with pytest.raises(ModelFormatError, match=re.escape(f"{model_dir / 'config.json'}: not found")):
        load_model(model_dir)


@pytest.mark.parametrize("text", ['{"format": "fusedserve-model/1",', "", "ops: []", "{'single': 'quotes'}"])
def test_invalid_json(model_dir, text):
    (model_dir / "config.json").write_text(text)
    with pytest.raises(ModelFormatError, match=re.escape(f"{model_dir / 'config.json'}: not valid JSON: ")):
        load_model(model_dir)


def test_config_not_an_object(model_dir):
    (model_dir / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelFormatError, match=re.escape(f"{model_dir / 'config.json'}: ")):
        load_model(model_dir)


def test_missing_safetensors(model_dir):
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelFormatError, match=re.escape(f"{model_dir / 'model.safetensors'}: not found")):
        load_model(model_dir)


@pytest.mark.parametrize("corrupt", ["truncated", "garbage", "empty"])
def test_corrupt_safetensors(model_dir, corrupt):
    path = model_dir / "model.safetensors"
    data = path.read_bytes()
    new = {"truncated": data[: len(data) // 2], "garbage": bytes(np.random.default_rng().bytes(300)), "empty": b""}
    path.write_bytes(new[corrupt])
    with pytest.raises(ModelFormatError, match=re.escape(f"{path}: not a readable safetensors file: ")):
        load_model(model_dir)


def test_output_must_be_a_vector(tmp_path):
    d = write_model(tmp_path / "m", [4, 3], ["relu"])
    _edit_config(d, lambda c: c.update(input={"shape": [2, 3]}, ops=[{"op": "tanh"}]))
    with pytest.raises(
        ModelFormatError, match=r"the last op leaves shape \(2, 3\) per row; the output must be a vector"
    ):
        load_model(d)


def test_flatten_makes_multi_dim_input_valid(tmp_path):
    d = write_model(tmp_path / "m", [30, 7], ["relu"], input_shape=[2, 3, 5], extra_ops=[{"op": "flatten"}])
    model = load_model(d)
    assert model.input_shape == (2, 3, 5) and model.input_features == 30 and model.output_features == 7


# ---- planner ----


def _ops(*raw: dict):
    return [parse_op(r, i) for i, r in enumerate(raw)]


def _linear(i: int, bias: bool = True) -> dict:
    return {"op": "linear", "weight": f"w{i}", **({"bias": f"b{i}"} if bias else {})}


def test_digits_plan():
    steps = plan(load_model(SHIPPED).ops)
    assert steps == [
        LinearStep("linear_0_relu", "fc1.weight", "fc1.bias", "relu", 0.01),
        LinearStep("linear_1_relu", "fc2.weight", "fc2.bias", "relu", 0.01),
        LinearStep("linear_2", "fc3.weight", "fc3.bias", "none", 0.01),
    ]
    assert kernel_names(steps) == ["linear_0_relu", "linear_1_relu", "linear_2"]


def test_second_activation_becomes_its_own_step():
    steps = plan(_ops(_linear(0), {"op": "relu"}, {"op": "sigmoid"}, _linear(1, bias=False)))
    assert steps == [
        LinearStep("linear_0_relu", "w0", "b0", "relu", 0.01),
        ActivationStep("activation_0_sigmoid", "sigmoid", 0.01),
        LinearStep("linear_1", "w1", None, "none", 0.01),
    ]


@pytest.mark.parametrize(
    "op,kernel",
    [
        ({"op": "gelu", "approximate": "tanh"}, "gelu_tanh"),
        ({"op": "gelu", "approximate": "none"}, "gelu"),
        ({"op": "gelu"}, "gelu"),
        ({"op": "silu"}, "silu"),
        ({"op": "tanh"}, "tanh"),
        ({"op": "sigmoid"}, "sigmoid"),
    ],
    ids=lambda v: v if isinstance(v, str) else json.dumps(v),
)
def test_activation_names(op, kernel):
    (step,) = plan(_ops(_linear(0), op))
    assert step == LinearStep(f"linear_0_{kernel}", "w0", "b0", kernel, 0.01)


@pytest.mark.parametrize("slope", [0.2, -0.5, 3.0])
def test_leaky_slope_is_carried(slope):
    steps = plan(_ops(_linear(0), {"op": "leaky_relu", "negative_slope": slope}, {"op": "leaky_relu"}))
    assert steps == [
        LinearStep("linear_0_leaky_relu", "w0", "b0", "leaky_relu", slope),
        ActivationStep("activation_0_leaky_relu", "leaky_relu", 0.01),
    ]


def test_leading_activation_and_flatten():
    steps = plan(_ops({"op": "flatten"}, {"op": "tanh"}, _linear(0), {"op": "relu"}, {"op": "flatten"}, _linear(1)))
    assert steps == [
        FlattenStep("flatten_0"),
        ActivationStep("activation_0_tanh", "tanh", 0.01),
        LinearStep("linear_0_relu", "w0", "b0", "relu", 0.01),
        FlattenStep("flatten_1"),
        LinearStep("linear_1", "w1", "b1", "none", 0.01),
    ]
    assert kernel_names(steps) == ["activation_0_tanh", "linear_0_relu", "linear_1"]


def test_activation_then_flatten_is_not_fused():
    """Only an activation directly after a linear rides in its epilogue."""
    steps = plan(_ops(_linear(0), {"op": "flatten"}, {"op": "silu"}))
    assert [type(s) for s in steps] == [LinearStep, FlattenStep, ActivationStep]
    assert steps[0].activation == "none" and steps[2].name == "activation_0_silu"


# ---- CNNs: conv2d, avgpool2d, maxpool2d ----

SHIPPED_CNN = Path(__file__).resolve().parents[1] / "model_weights" / "digits-cnn"


@pytest.fixture
def cnn_dir(tmp_path) -> Path:
    """(2, 9, 7) -> conv 5x3x3 pad 1 + relu (5, 9, 7) -> maxpool 2 (5, 4, 3) -> conv 4x2x3 (4, 3, 1) -> flatten 12
    -> linear 10: the CNN baseline each case below breaks. ops: [conv2d conv0, relu, maxpool2d, conv2d conv3,
    flatten, linear linear5]."""
    layers = [
        {"op": "conv2d", "out": 5, "kernel": 3, "padding": 1}, {"op": "relu"},
        {"op": "maxpool2d", "kernel_size": 2}, {"op": "conv2d", "out": 4, "kernel": [2, 3]},
        {"op": "flatten"}, {"op": "linear", "out": 10},
    ]  # fmt: skip
    return write_cnn_model(tmp_path / "cnn", [2, 9, 7], layers, seed=int(torch.randint(0, 2**31, ())))


def test_cnn_loads_with_its_shapes(cnn_dir):
    model = load_model(cnn_dir)
    assert model.input_shape == (2, 9, 7) and model.input_features == 126 and model.output_features == 10
    assert {k: tuple(v.shape) for k, v in model.tensors.items()} == {
        "conv2d0.weight": (5, 2, 3, 3), "conv2d0.bias": (5,), "conv2d3.weight": (4, 5, 2, 3), "conv2d3.bias": (4,),
        "linear5.weight": (10, 12), "linear5.bias": (10,),
    }  # fmt: skip
    conv = model.ops[0]
    assert (conv.stride, conv.padding, conv.dilation, conv.groups) == ((1, 1), (1, 1), (1, 1), 1)
    pool = model.ops[2]
    assert (pool.kernel_size, pool.stride, pool.stride_or_kernel, pool.padding, pool.ceil_mode) == (
        (2, 2), None, (2, 2), (0, 0), False,
    )  # fmt: skip


RANDOM_CNN_SPECS = [random_cnn_spec(np.random.default_rng(seed)) for seed in range(24)]


@pytest.mark.parametrize("spec", RANDOM_CNN_SPECS, ids=cnn_spec_id)
def test_random_cnns_load_with_torchs_shapes(tmp_path, spec):
    """write_cnn_model follows the shapes with torch's own ops; the loader must agree on every one."""
    d = write_cnn_model(tmp_path / "m", **spec)
    model = load_model(d)
    assert model.input_shape == tuple(spec["input_shape"])
    assert model.output_features == [x for x in spec["layers"] if x["op"] == "linear"][-1]["out"]
    steps = plan(model.ops)
    assert sum(isinstance(s, Conv2dStep) for s in steps) == sum(x["op"] == "conv2d" for x in spec["layers"])
    assert sum(isinstance(s, Pool2dStep) for s in steps) == sum(x["op"].endswith("pool2d") for x in spec["layers"])


@pytest.mark.parametrize(
    "n,kernel,stride,padding,ceil_mode", [(n, k, s, p, c) for n in range(1, 10) for k in (1, 2, 3, 4) for s in (1, 2, 3)
                                          for p in range(0, k // 2 + 1) for c in (False, True)],
)  # fmt: skip
def test_pool_out_is_torchs(n, kernel, stride, padding, ceil_mode):
    x = torch.zeros(1, 1, n, n)
    try:
        want = torch.nn.functional.max_pool2d(x, kernel, stride, padding, ceil_mode=ceil_mode).shape[-1]
    except RuntimeError:
        want = 0  # torch refuses: output size < 1
    assert max(pool_out(n, kernel, stride, padding, ceil_mode), 0) == want


@pytest.mark.parametrize(
    "n,kernel,stride,padding,dilation", [(n, k, s, p, d) for n in range(1, 9) for k in (1, 2, 3, 5) for s in (1, 2, 3)
                                         for p in (0, 1, 2) for d in (1, 2)],
)  # fmt: skip
def test_conv_out_is_torchs(n, kernel, stride, padding, dilation):
    x, w = torch.zeros(1, 1, n, n), torch.zeros(1, 1, kernel, kernel)
    try:
        want = torch.nn.functional.conv2d(x, w, None, stride, padding, dilation).shape[-1]
    except RuntimeError:
        want = 0
    assert max(conv_out(n, kernel, stride, padding, dilation), 0) == want


def _set_field(index: int, **fields):
    def edit(cfg):
        cfg["ops"][index] = {**cfg["ops"][index], **fields}

    return edit


def _drop_field(index: int, field: str):
    def edit(cfg):
        cfg["ops"][index].pop(field)

    return edit


# (id, how to break the config, regex). ops: [conv2d conv2d0 pad 1, relu, maxpool2d 2, conv2d conv2d3 (2, 3),
# flatten, linear linear5]; per-row shapes (2, 9, 7) -> (5, 9, 7) -> (5, 4, 3) -> (4, 3, 1) -> 12 -> 10.
BAD_CNN_CONFIGS = [
    (
        "flat input into conv",
        lambda c: c.update(input={"shape": [126]}),
        r"ops\[0\] \(conv2d\): input has shape \(126,\) per row; conv2d needs \(channels, height, width\), "
        r'e\.g\. "input": \{"shape": \[1, 8, 8\]\}',
    ),
    (
        "channels mismatch",
        lambda c: c.update(input={"shape": [3, 9, 7]}),
        r"ops\[0\] \(conv2d\): weight 'conv2d0.weight' has shape \(5, 2, 3, 3\); expected \(out, 3, kh, kw\) "
        r"because its input has 3 channels",
    ),
    (
        "input too small for the kernel",
        lambda c: c.update(input={"shape": [2, 9, 3]}),
        r"ops\[3\] \(conv2d\): kernel \(2, 3\) \(from weight 'conv2d3.weight'\) with dilation \(1, 1\) and padding "
        r"\(0, 0\) does not fit the input's \(4, 1\) pixels \(output would be \(3, -1\)\)",
    ),
    (
        "dilation too large",
        _set_field(3, dilation=[1, 2]),
        r"ops\[3\] \(conv2d\): kernel \(2, 3\) .* with dilation \(1, 2\) .* does not fit the input's \(4, 3\) pixels",
    ),
    (
        "conv stride zero",
        _set_field(0, stride=0),
        r"ops\[0\] \(conv2d\): stride: must be an integer >= 1 or a pair \[h, w\] of them; got 0",
    ),
    ("conv padding float", _set_field(0, padding=1.5), r"ops\[0\] \(conv2d\): padding: must be an integer >= 0 "),
    ("conv padding triple", _set_field(0, padding=[1, 1, 1]), r"ops\[0\] \(conv2d\): padding: .*; got \[1, 1, 1\]"),
    ("conv groups", _set_field(0, groups=2), r"ops\[0\] \(conv2d\): groups: Input should be 1"),
    ("conv padding_mode", _set_field(0, padding_mode="reflect"), r"ops\[0\] \(conv2d\): padding_mode: Extra inputs"),
    ("conv without weight", _drop_field(0, "weight"), r"ops\[0\] \(conv2d\): weight: Field required"),
    (
        "conv weight missing",
        _set_field(3, weight="conv9.weight"),
        r"ops\[3\] \(conv2d\): weight tensor 'conv9.weight' is not in model.safetensors \(it has: conv2d0.bias, ",
    ),
    ("pool without kernel_size", _drop_field(2, "kernel_size"), r"ops\[2\] \(maxpool2d\): kernel_size: Field required"),
    (
        "pool padding over half the kernel",
        _set_field(2, padding=[1, 2], kernel_size=3),
        r"ops\[2\] \(maxpool2d\): padding \(1, 2\) is more than half of kernel_size \(3, 3\)",
    ),
    (
        "pool larger than its input",
        _set_field(2, kernel_size=[10, 2]),
        r"ops\[2\] \(maxpool2d\): kernel_size \(10, 2\) with padding \(0, 0\) does not fit the input's \(9, 7\) "
        r"pixels \(output would be \(0, 3\)\)",
    ),
    ("pool ceil_mode string", _set_field(2, ceil_mode="yes"), r"ops\[2\] \(maxpool2d\): ceil_mode: Input should be a"),
    (
        "count_include_pad on max",
        _set_field(2, count_include_pad=False),
        r"ops\[2\] \(maxpool2d\): count_include_pad: Extra inputs are not permitted",
    ),
    ("max pool dilation", _set_field(2, dilation=2), r"ops\[2\] \(maxpool2d\): dilation: Extra inputs are not"),
    (
        "avg pool after flatten",
        lambda c: c["ops"].insert(5, {"op": "avgpool2d", "kernel_size": 2}),
        r"ops\[5\] \(avgpool2d\): input has shape \(12,\) per row; avgpool2d needs \(channels, height, width\)",
    ),
    (
        "linear without flatten",
        lambda c: c["ops"].pop(4),
        r"ops\[4\] \(linear\): input has shape \(4, 3, 1\) per row; linear needs a vector \(add flatten\)",
    ),
    (
        "output not a vector",
        lambda c: c.update(ops=c["ops"][:4]),
        r"the last op leaves shape \(4, 3, 1\) per row; the output must be a vector \(add a flatten op\)",
    ),
]


@pytest.mark.parametrize("edit,message", [c[1:] for c in BAD_CNN_CONFIGS], ids=[c[0] for c in BAD_CNN_CONFIGS])
def test_bad_cnn_config_is_named(cnn_dir, edit, message):
    _edit_config(cnn_dir, edit)
    with pytest.raises(ModelFormatError, match=message) as info:
        load_model(cnn_dir)
    assert str(info.value).startswith(str(cnn_dir / "config.json") + ": "), str(info.value)


BAD_CNN_TENSORS = [
    (
        "conv weight in-channels",
        lambda t: t.update({"conv2d3.weight": torch.randn(4, 6, 2, 3)}),
        r"ops\[3\] \(conv2d\): weight 'conv2d3.weight' has shape \(4, 6, 2, 3\); expected \(out, 5, kh, kw\) "
        r"because its input has 5 channels",
    ),
    (
        "conv weight 2-D",
        lambda t: t.update({"conv2d0.weight": torch.randn(5, 18)}),
        r"ops\[0\] \(conv2d\): weight 'conv2d0.weight' has shape \(5, 18\); expected \(out, 2, kh, kw\)",
    ),
    (
        "conv bias shape",
        lambda t: t.update({"conv2d0.bias": torch.randn(4)}),
        r"ops\[0\] \(conv2d\): bias 'conv2d0.bias' has shape \(4,\); expected \(5,\) to match weight 'conv2d0.weight'",
    ),
    (
        "conv weight NaN",
        lambda t: t["conv2d3.weight"].view(-1)[7].fill_(float("nan")),
        r"ops\[3\] \(conv2d\): weight tensor 'conv2d3.weight' contains NaN or Inf",
    ),
    (
        "conv weight int",
        lambda t: t.update({"conv2d0.weight": torch.ones(5, 2, 3, 3, dtype=torch.int8)}),
        r"ops\[0\] \(conv2d\): weight tensor 'conv2d0.weight' has dtype torch.int8",
    ),
    (
        "conv kernel larger than the padded input",
        lambda t: t.update({"conv2d3.weight": torch.randn(4, 5, 5, 3)}),
        r"ops\[3\] \(conv2d\): kernel \(5, 3\) \(from weight 'conv2d3.weight'\) .* the input's \(4, 3\) pixels",
    ),
    (
        "linear after conv: features",
        lambda t: t.update({"linear5.weight": torch.randn(10, 13)}),
        r"ops\[5\] \(linear\): weight 'linear5.weight' has shape \(10, 13\); expected \(N, 12\) because its input "
        r"has 12 features",
    ),
]


@pytest.mark.parametrize("edit,message", [c[1:] for c in BAD_CNN_TENSORS], ids=[c[0] for c in BAD_CNN_TENSORS])
def test_bad_cnn_tensor_is_named(cnn_dir, edit, message):
    _edit_tensors(cnn_dir, edit)
    with pytest.raises(ModelFormatError, match=message) as info:
        load_model(cnn_dir)
    assert str(info.value).startswith(str(cnn_dir / "config.json") + ": "), str(info.value)


def test_cnn_plan_fuses_activations_and_names_by_kind():
    conv = {"op": "conv2d", "weight": "c", "bias": "cb", "padding": [1, 2]}
    steps = plan(_ops(
        conv, {"op": "relu"}, {"op": "maxpool2d", "kernel_size": 2},
        {"op": "avgpool2d", "kernel_size": 3, "stride": 1, "padding": 1, "ceil_mode": True, "count_include_pad": False},
        {"op": "leaky_relu", "negative_slope": 0.2}, {"op": "tanh"},
        {"op": "conv2d", "weight": "d", "stride": 2, "dilation": [1, 2]}, {"op": "maxpool2d", "kernel_size": [2, 1]},
        {"op": "silu"}, {"op": "flatten"}, _linear(0),
    ))  # fmt: skip
    assert steps == [
        Conv2dStep("conv2d_0_relu", "c", "cb", (1, 1), (1, 2), (1, 1), "relu", 0.01),
        Pool2dStep("maxpool2d_0", "max", (2, 2), (2, 2), (0, 0), False, True, "none", 0.01),
        Pool2dStep("avgpool2d_0_leaky_relu", "avg", (3, 3), (1, 1), (1, 1), True, False, "leaky_relu", 0.2),
        ActivationStep("activation_0_tanh", "tanh", 0.01),
        Conv2dStep("conv2d_1", "d", None, (2, 2), (0, 0), (1, 2), "none", 0.01),
        Pool2dStep("maxpool2d_1_silu", "max", (2, 1), (2, 1), (0, 0), False, True, "silu", 0.01),
        FlattenStep("flatten_0"),
        LinearStep("linear_0", "w0", "b0", "none", 0.01),
    ]
    assert kernel_names(steps) == [
        "conv2d_0_relu", "maxpool2d_0", "avgpool2d_0_leaky_relu", "activation_0_tanh", "conv2d_1", "maxpool2d_1_silu",
        "linear_0",
    ]  # fmt: skip


def test_cnn_tail_becomes_one_whole_mlp_kernel(cnn_dir):
    _edit_config(cnn_dir, lambda c: c["ops"].extend([{"op": "relu"}, {"op": "linear", "weight": "head.weight"}]))
    _edit_tensors(cnn_dir, lambda t: t.update({"head.weight": torch.randn(3, 10)}))
    model = load_model(cnn_dir)
    steps = group_mlps(plan(model.ops), model.tensors)
    assert [type(s) for s in steps] == [Conv2dStep, Pool2dStep, Conv2dStep, FlattenStep, MLPStep]
    assert [s.name for s in steps] == ["conv2d_0_relu", "maxpool2d_0", "conv2d_1", "flatten_0", "mlp_0_1"]


_CONV = {"op": "conv2d", "weight": "c"}


@pytest.mark.parametrize(
    "ops,names",
    [
        ([_CONV, {"op": "maxpool2d", "kernel_size": 2}], ["conv2d_0_maxpool2d_0"]),
        ([_CONV, {"op": "silu"}, {"op": "avgpool2d", "kernel_size": [2, 3], "stride": [3, 4]}],
         ["conv2d_0_silu_avgpool2d_0"]),
        ([_CONV, {"op": "avgpool2d", "kernel_size": 2, "count_include_pad": False}], ["conv2d_0_avgpool2d_0"]),
        ([_CONV, {"op": "maxpool2d", "kernel_size": 3, "stride": 2}], ["conv2d_0", "maxpool2d_0"]),  # overlap
        ([_CONV, {"op": "maxpool2d", "kernel_size": 2, "padding": 1}], ["conv2d_0", "maxpool2d_0"]),
        ([_CONV, {"op": "maxpool2d", "kernel_size": 2, "ceil_mode": True}], ["conv2d_0", "maxpool2d_0"]),
        ([_CONV, {"op": "maxpool2d", "kernel_size": 2}, {"op": "relu"}], ["conv2d_0", "maxpool2d_0_relu"]),
        ([_CONV, {"op": "relu"}, {"op": "tanh"}, {"op": "maxpool2d", "kernel_size": 2}],
         ["conv2d_0_relu", "activation_0_tanh", "maxpool2d_0"]),
        ([_CONV, {"op": "maxpool2d", "kernel_size": 2}, {"op": "avgpool2d", "kernel_size": 2}],
         ["conv2d_0_maxpool2d_0", "avgpool2d_0"]),  # one pool per conv
        ([{"op": "maxpool2d", "kernel_size": 2}, _CONV], ["maxpool2d_0", "conv2d_0"]),
    ],
    ids=["max", "act-avg-pairs", "avg-nopad", "overlapping", "padded", "ceil", "act-after-pool", "act-between",
         "two-pools", "pool-first"],
)  # fmt: skip
def test_conv_pool_folding(ops, names):
    steps = group_conv_pools(plan(_ops(*ops)))
    assert kernel_names(steps) == names


def test_shipped_cnn_loads_and_plans():
    model = load_model(SHIPPED_CNN)
    assert model.name == "digits-cnn" and model.input_shape == (1, 8, 8) and model.output_features == 10
    assert model.spec.labels == [str(i) for i in range(10)]
    assert {k: tuple(v.shape) for k, v in model.tensors.items()} == {
        "layers.0.weight": (16, 1, 3, 3), "layers.0.bias": (16,), "layers.2.weight": (16, 16, 3, 3),
        "layers.2.bias": (16,), "layers.6.weight": (64, 256), "layers.6.bias": (64,), "layers.8.weight": (10, 64),
        "layers.8.bias": (10,),
    }  # fmt: skip
    steps = group_mlps(plan(model.ops), model.tensors)
    # the flattened 16 x 4 x 4 = 256 features fit the whole-MLP kernel
    assert kernel_names(steps) == ["conv2d_0_relu", "conv2d_1_relu", "maxpool2d_0", "mlp_0_1"]
    # and the 2x2 max pool (no padding, floor mode, windows apart) rides in the second conv's kernel: 3 kernels
    steps = group_conv_pools(steps)
    assert kernel_names(steps) == ["conv2d_0_relu", "conv2d_1_relu_maxpool2d_0", "mlp_0_1"]
    assert fused_steps(model.ops, model.tensors) == steps
    assert steps[1].pool == Pool2dStep("maxpool2d_0", "max", (2, 2), (2, 2), (0, 0), False, True, "none", 0.01)


def test_check_model_cli_on_shipped_cnn(capsys):
    assert main(["check-model", str(SHIPPED_CNN)]) == 0
    out = capsys.readouterr().out
    assert "digits-cnn: input (1, 8, 8) -> 10 outputs; 9 ops" in out
    # the plan the executors run: the max pool rides in the second conv's kernel, the MLP tail is one kernel
    assert "fused plan (3 kernels): conv2d_0_relu, conv2d_1_relu_maxpool2d_0, mlp_0_1" in out


# ---- the input: uint8 pixels and a per-channel normalization ----


def _normalize(cfg: dict, mean=(120.0, 60.0), std=(50.0, 25.0), dtype="uint8") -> None:
    cfg["input"].update(dtype=dtype, normalize={"mean": list(mean), "std": list(std)})


@pytest.mark.parametrize("dtype", ["uint8", "float32"])
def test_uint8_and_normalized_inputs_load(cnn_dir, dtype):
    _edit_config(cnn_dir, lambda c: _normalize(c, dtype=dtype))
    model = load_model(cnn_dir)
    assert model.input_dtype == (torch.uint8 if dtype == "uint8" else torch.float32)
    assert model.normalize.mean == (120.0, 60.0) and model.normalize.std == (50.0, 25.0)
    # the stem conv (the input's only reader) normalizes as it loads: same steps, same names
    steps = fused_steps(model.ops, model.tensors, normalize=model.normalize)
    assert kernel_names(steps) == kernel_names(fused_steps(model.ops, model.tensors))
    assert steps[0].normalize == model.normalize and all(getattr(s, "normalize", None) is None for s in steps[1:])


def test_uint8_without_normalization_loads(model_dir):
    _edit_config(model_dir, lambda c: c["input"].update(dtype="uint8"))
    model = load_model(model_dir)
    assert model.input_dtype == torch.uint8 and model.normalize is None


BAD_INPUTS = [
    ("dtype", lambda c: c["input"].update(dtype="int8"), r"input\.dtype: Input should be 'float32' or 'uint8'"),
    ("std zero", lambda c: _normalize(c, std=(50.0, 0.0)), r"input\.normalize: std\[1\] is 0\.0; each std must be > 0"),
    ("std negative", lambda c: _normalize(c, std=(-1.0, 2.0)), r"input\.normalize: std\[0\] is -1\.0; each std must"),
    (
        "mean and std counts",
        lambda c: _normalize(c, mean=(1.0, 2.0, 3.0)),
        r"input\.normalize: mean has 3 values and std 2; one of each per channel",
    ),
    (
        "one per channel",
        lambda c: _normalize(c, mean=(1.0, 2.0, 3.0), std=(1.0, 2.0, 3.0)),
        r"input\.normalize: 3 mean and std values but the input has 2 channels \(shape \(2, 9, 7\)\); one of each",
    ),
    ("unknown field", lambda c: c["input"].update(normalize={"mean": [1], "std": [1], "scale": 2}), "scale: Extra"),
    ("mean missing", lambda c: c["input"].update(normalize={"std": [1.0, 2.0]}), r"input\.normalize\.mean: Field"),
    ("empty", lambda c: _normalize(c, mean=(), std=()), r"input\.normalize\.mean: List should have at least 1 item"),
]


@pytest.mark.parametrize("edit,message", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_named(cnn_dir, edit, message):
    _edit_config(cnn_dir, edit)
    with pytest.raises(ModelFormatError, match=message) as info:
        load_model(cnn_dir)
    assert str(info.value).startswith(str(cnn_dir / "config.json") + ": "), str(info.value)


def test_non_finite_statistics_from_an_importer_are_named(cnn_dir):
    """JSON holds no inf or NaN; an importer's config (a dict) can."""
    from service.model.spec import parse_spec

    cfg = _config(cnn_dir)
    _normalize(cfg, mean=(1.0, float("nan")), std=(float("inf"), 2.0))
    with pytest.raises(
        ModelFormatError, match=r"^import: input\.normalize: mean\[1\] is nan; each mean must be finite"
    ):
        parse_spec(cfg, "import")
    _normalize(cfg, std=(float("inf"), 2.0))
    with pytest.raises(ModelFormatError, match=r"input\.normalize: std\[0\] is inf; each std must be > 0 and finite"):
        parse_spec(cfg, "import")


def test_normalizing_a_vector_input_is_refused(model_dir):
    _edit_config(model_dir, lambda c: _normalize(c, mean=[0.0] * 64, std=[1.0] * 64))
    with pytest.raises(ModelFormatError, match=r"config\.json: input\.normalize: the input has shape \(64,\) per row; "
                       r"normalization is per channel of an image \(channels, height, width\)"):  # fmt: skip
        load_model(model_dir)


def test_check_model_cli_names_the_normalization(cnn_dir, capsys):
    _edit_config(cnn_dir, _normalize)
    assert main(["check-model", str(cnn_dir)]) == 0
    out = capsys.readouterr().out
    assert "input (2, 9, 7) uint8 -> 10 outputs" in out
    assert "input normalized: (x - mean) / std per channel, mean [120.0, 60.0], std [50.0, 25.0]" in out
    stem = "conv2d_0_relu_maxpool2d_0: conv2d + relu + maxpool2d"
    assert f"{stem} (fused mode: one kernel, normalizing the input as it loads it)" in out
