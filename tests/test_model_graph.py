"""The graph format (fusedserve-model/2), its loader checks, the planner's fusion rules on graphs, and both
executors on hand-written graphs against a float64 reference that runs the config op by op (written here, with
plain torch functions, without the loader's Model or the planner, so a planning mistake shows as a mismatch).

Small on purpose: 8x8 images and a few channels, since the fused mode runs Triton's interpreter on the CPU.
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from service.cli import main
from service.model.executors import Executor, channels_last_outputs, kernel_support, torch_parts
from service.model.loader import load_model
from service.model.planner import (
    AddStep,
    BatchNormStep,
    Conv2dStep,
    MLPStep,
    fused_steps,
    kernel_names,
    plan,
    reads,
)
from service.model.spec import ModelFormatError

pytestmark = pytest.mark.timeout(300)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
V2 = "fusedserve-model/2"


@pytest.fixture(autouse=True)
def _exact_float32_convs():
    """float32 convs in full fp32 on a GPU (cuDNN and fused_conv2d would use TF32 by default)."""
    before = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = before


# ---- building graph models ----


def _conv(name, x, out, cin, cout, k=3, stride=1, pad=1, bias=True, groups=1, t=None):
    t[f"{name}.w"] = torch.randn(cout, cin // groups, k, k) * (2.0 / (cin // groups * k * k)) ** 0.5
    op = {"op": "conv2d", "name": name, "inputs": [x], "output": out, "weight": f"{name}.w", "stride": stride,
          "padding": pad, "groups": groups}  # fmt: skip
    if bias:
        t[f"{name}.b"] = torch.randn(cout) * 0.1
        op["bias"] = f"{name}.b"
    return op


def _bn(name, x, out, c, t):
    t[f"{name}.g"] = torch.rand(c) + 0.5
    t[f"{name}.beta"] = torch.randn(c) * 0.2
    t[f"{name}.mean"] = torch.randn(c) * 0.2
    t[f"{name}.var"] = torch.rand(c) + 0.5
    return {"op": "batchnorm", "name": name, "inputs": [x], "output": out, "weight": f"{name}.g",
            "bias": f"{name}.beta", "mean": f"{name}.mean", "var": f"{name}.var", "eps": 1e-5}  # fmt: skip


def _linear(name, x, out, k, n, t, bias=True):
    t[f"{name}.w"] = torch.randn(n, k) / k**0.5
    op = {"op": "linear", "name": name, "inputs": [x], "output": out, "weight": f"{name}.w"}
    if bias:
        t[f"{name}.b"] = torch.randn(n) * 0.1
        op["bias"] = f"{name}.b"
    return op


def _act(kind, x, out, **extra):
    return {"op": kind, "inputs": [x], "output": out, **extra}


def write_graph(d: Path, ops: list[dict], tensors: dict, shape, labels=None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"format": V2, "name": "graph-test", "input": {"name": "x", "shape": list(shape)}, "ops": ops}
    if labels:
        cfg["labels"] = labels
    (d / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"))
    return d


def resnet_graph(c=4):
    """stem conv+bn+relu; block 1 (identity shortcut); block 2 (stride 2, 1x1 conv + bn shortcut); global avg pool;
    linear. Channel count c, 8x8 input of 3 channels."""
    t: dict = {}
    ops = [
        _conv("stem", "x", "s0", 3, c, bias=False, t=t), _bn("stem_bn", "s0", "s1", c, t), _act("relu", "s1", "a0"),
        _conv("b1c1", "a0", "b1a", c, c, bias=False, t=t), _bn("b1bn1", "b1a", "b1b", c, t), _act("relu", "b1b", "b1c"),
        _conv("b1c2", "b1c", "b1d", c, c, bias=False, t=t), _bn("b1bn2", "b1d", "b1e", c, t),
        {"op": "add", "inputs": ["b1e", "a0"], "output": "b1f"}, _act("relu", "b1f", "a1"),
        _conv("b2c1", "a1", "b2a", c, 2 * c, stride=2, bias=False, t=t), _bn("b2bn1", "b2a", "b2b", 2 * c, t),
        _act("relu", "b2b", "b2c"),
        _conv("b2c2", "b2c", "b2d", 2 * c, 2 * c, bias=False, t=t), _bn("b2bn2", "b2d", "b2e", 2 * c, t),
        _conv("down", "a1", "dn", c, 2 * c, k=1, stride=2, pad=0, bias=False, t=t),
        _bn("down_bn", "dn", "dn2", 2 * c, t),
        {"op": "add", "inputs": ["b2e", "dn2"], "output": "b2f"}, _act("relu", "b2f", "a2"),
        {"op": "avgpool2d", "inputs": ["a2"], "output": "gap", "kernel_size": 4}, {"op": "flatten", "inputs": ["gap"],
        "output": "flat"}, _linear("fc", "flat", "logits", 2 * c, 10, t),
    ]  # fmt: skip
    return ops, t


def reference_forward(model_dir: Path, x: torch.Tensor) -> torch.Tensor:
    """The config op by op in float64 (inputs and weights as the float32 model stores them)."""
    from safetensors.torch import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    t = {k: v.double() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    live = {cfg["input"]["name"]: x.double().cpu()}
    for op in cfg["ops"]:
        a = [live[i] for i in op["inputs"]]
        kind = op["op"]
        if kind == "conv2d":
            y = F.conv2d(a[0], t[op["weight"]], t.get(op.get("bias")), op.get("stride", 1), op.get("padding", 0),
                         op.get("dilation", 1), op.get("groups", 1))  # fmt: skip
        elif kind == "batchnorm":
            y = F.batch_norm(a[0], t[op["mean"]], t[op["var"]], t[op["weight"]], t[op["bias"]], False, 0.0, op["eps"])
        elif kind == "linear":
            y = F.linear(a[0], t[op["weight"]], t.get(op.get("bias")))
        elif kind in ("add", "sub", "mul", "div"):
            fn = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}[kind]
            if op.get("constant"):
                c = t[op["constant"]]
                y = fn(c, a[0]) if op.get("reverse") else fn(a[0], c)
            else:
                y = fn(a[0], a[1])
        elif kind == "hardsigmoid":
            y = torch.clamp(a[0] * op.get("alpha", 1 / 6) + op.get("beta", 0.5), 0, 1)
        elif kind == "clip":
            y = torch.clamp(a[0], op.get("min"), op.get("max"))
        elif kind == "layernorm":
            x = a[0].movedim(1, -1)
            y = F.layer_norm(x, (x.shape[-1],), t[op["weight"]], t.get(op.get("bias")), op.get("eps", 1e-5))
            y = y.movedim(-1, 1)
        elif kind == "slice":
            y = a[0][:, op["start"] : op["end"]]
        elif kind == "channel_shuffle":
            n, c, h, w = a[0].shape
            g = op["groups"]
            y = a[0].reshape(n, g, c // g, h, w).transpose(1, 2).reshape(n, c, h, w)
        elif kind == "pad":
            top, left, bottom, right = op["pads"]
            y = F.pad(a[0], (left, right, top, bottom), value=op.get("value", 0.0))
        elif kind == "concat":
            y = torch.cat(a, 1)
        elif kind == "flatten":
            y = a[0].flatten(1)
        elif kind == "avgpool2d":
            y = F.avg_pool2d(a[0], op["kernel_size"], op.get("stride"), op.get("padding", 0),
                             op.get("ceil_mode", False), op.get("count_include_pad", True))  # fmt: skip
        elif kind == "maxpool2d":
            y = F.max_pool2d(a[0], op["kernel_size"], op.get("stride"), op.get("padding", 0),
                             ceil_mode=op.get("ceil_mode", False))  # fmt: skip
        elif kind == "softmax":
            y = torch.softmax(a[0], 1)
        else:
            fn = {"relu": F.relu, "relu6": F.relu6, "hardswish": F.hardswish, "silu": F.silu, "tanh": torch.tanh,
                  "sigmoid": torch.sigmoid, "gelu": F.gelu}[kind]  # fmt: skip
            y = fn(a[0])
        live[op["output"]] = y
    return live[cfg["ops"][-1]["output"]]


def assert_normwise(got: torch.Tensor, want: torch.Tensor, bound: float, what: str) -> None:
    got, want = got.double().cpu(), want.double().cpu()
    err = float((got - want).norm() / want.norm())
    assert err <= bound, f"{what}: relative norm error {err:.3g} > {bound}"


# ---- the format ----


def test_resnet_graph_loads_with_every_shape(tmp_path):
    ops, t = resnet_graph()
    model = load_model(write_graph(tmp_path / "m", ops, t, [3, 8, 8]))
    assert model.input_shape == (3, 8, 8) and model.output_features == 10 and model.input_name == "x"
    assert model.shapes["a0"] == (4, 8, 8) and model.shapes["dn2"] == (8, 4, 4) and model.shapes["flat"] == (8,)
    assert [op.name for op in model.ops[:3]] == ["stem", "stem_bn", "ops[2]"]  # unnamed ops are named by place
    assert set(model.tensors) == set(t)  # batch norm's tensors are kept: the unfused mode runs batch norm


def test_inputs_and_outputs_default_to_a_chain(tmp_path):
    t: dict = {}
    ops = [_linear("a", "x", "h", 6, 5, t), {"op": "relu"}, {"op": "linear", "weight": "b.w"}]
    t["b.w"] = torch.randn(3, 5)
    model = load_model(write_graph(tmp_path / "m", ops, t, [6]))
    assert [(op.inputs, op.output) for op in model.ops] == [(("x",), "h"), (("h",), "ops[1]"), (("ops[1]",), "ops[2]")]


def _broken(tmp_path, edit) -> str:
    ops, t = resnet_graph()
    edit(ops, t)
    d = write_graph(tmp_path / "m", ops, t, [3, 8, 8])
    with pytest.raises(ModelFormatError) as info:
        load_model(d)
    message = str(info.value)
    assert message.startswith(str(d / "config.json") + ": "), message
    return message


@pytest.mark.parametrize(
    "edit,needle",
    [
        (lambda o, t: o[8].update(inputs=["b1e", "nope"]), "ops[8] (add): input 'nope' is not the model's input or"),
        (lambda o, t: o[8].update(inputs=["b1e", "b2e"]), "ops[8] (add): input 'b2e' is not the model's input or an"),
        (lambda o, t: o[2].update(output="s0"), "ops[2] (relu): output 's0' is already written by ops[0] (conv2d"),
        (lambda o, t: o[8].update(inputs=["b1e"]), "ops[8] (add): reads 1 tensor(s) ['b1e']; add takes two tensors,"),
        (lambda o, t: o[8].update(inputs=["b1e", "x"]), "adds 'b1e' of shape (4, 8, 8) to 'x' of shape (3, 8, 8)"),
        (lambda o, t: o.insert(3, _act("tanh", "a0", "dead")), "ops[3] (tanh): its output 'dead' is never read"),
        (lambda o, t: t.update({"stem_bn.var": -torch.ones(4)}), "var 'stem_bn.var' has negative values"),
        (lambda o, t: t.update({"b1bn1.mean": torch.zeros(5)}),
         "ops[4] (batchnorm 'b1bn1'): mean 'b1bn1.mean' has shape (5,); expected (4,)"),
        (lambda o, t: o[0].update(groups=2), "ops[0] (conv2d 'stem'): groups 2 does not divide the input's 3"),
        (lambda o, t: o.append({"op": "softmax", "inputs": ["a2"], "output": "p"}), "its output 'logits' is never"),
    ],
    ids=["unknown-input", "read-before-written", "written-twice", "add-arity", "add-shapes", "dead-op", "negative-var",
         "bn-shape", "groups", "dead-after-output"],
)  # fmt: skip
def test_graph_mistakes_are_named(tmp_path, edit, needle):
    message = _broken(tmp_path, edit)
    assert needle in message, message


def test_softmax_only_at_the_output(tmp_path):
    t: dict = {}
    ops = [_linear("a", "x", "h", 6, 5, t), {"op": "softmax"}, {"op": "relu"}]
    with pytest.raises(ModelFormatError, match=r"ops\[1\] \(softmax\): softmax is supported only as the op that"):
        load_model(write_graph(tmp_path / "m", ops, t, [6]))


def test_concat_shapes_must_agree(tmp_path):
    t: dict = {}
    ops = [_conv("a", "x", "p", 3, 4, t=t), _conv("b", "x", "q", 3, 2, stride=2, t=t),
           {"op": "concat", "inputs": ["p", "q"], "output": "c"}, {"op": "flatten"}]  # fmt: skip
    with pytest.raises(ModelFormatError, match=r"ops\[2\] \(concat\): concatenates 'p' \(4, 8, 8\), 'q' \(2, 4, 4\)"):
        load_model(write_graph(tmp_path / "m", ops, t, [3, 8, 8]))


@pytest.mark.parametrize(
    "op,needle",
    [
        ({"op": "relu", "inputs": ["input"]}, "inputs: graph fields need format 'fusedserve-model/2'"),
        ({"op": "batchnorm", "weight": "w", "bias": "b", "mean": "m", "var": "v"},
         "unknown op 'batchnorm'; expected one of linear, conv2d, avgpool2d, maxpool2d, flatten, relu, sigmoid, silu, "
         "tanh, leaky_relu, gelu (op 'batchnorm' needs format 'fusedserve-model/2')"),
        ({"op": "relu6"}, "(op 'relu6' needs format 'fusedserve-model/2')"),
    ],
)  # fmt: skip
def test_format_1_stays_what_it_was(tmp_path, op, needle):
    t: dict = {}
    d = write_graph(tmp_path / "m", [_linear("a", "x", "h", 6, 5, t)], t, [6])
    cfg = json.loads((d / "config.json").read_text())
    cfg["format"] = "fusedserve-model/1"
    cfg["input"] = {"shape": [6]}
    cfg["ops"] = [{"op": "linear", "weight": "a.w", "bias": "a.b"}, op]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFormatError) as info:
        load_model(d)
    assert needle in str(info.value), str(info.value)


# ---- the planner ----


def test_resnet_plan_fuses_bn_residual_and_relu_into_convs(tmp_path):
    ops, t = resnet_graph()
    model = load_model(write_graph(tmp_path / "m", ops, t, [3, 8, 8]))
    steps = fused_steps(model.ops, model.tensors)
    assert kernel_names(steps) == [
        "conv2d_0_bn_relu", "conv2d_1_bn_relu", "conv2d_2_bn_add_relu", "conv2d_3_bn_relu",
        "conv2d_5_bn", "conv2d_4_bn_add_relu", "avgpool2d_0", "linear_0",
    ]  # fmt: skip
    by_name = {s.name: s for s in steps}
    # block 1: the residual is the stem's output, read in conv 2's epilogue
    assert by_name["conv2d_2_bn_add_relu"].residual == "a0" and by_name["conv2d_2_bn_add_relu"].inputs == ("b1c",)
    # block 2: the add's first input (the main branch) takes it; the shortcut conv runs before, its output kept
    assert by_name["conv2d_4_bn_add_relu"].residual == "dn2" and by_name["conv2d_5_bn"].output == "dn2"
    assert all(s.batchnorm is not None for s in steps if isinstance(s, Conv2dStep))
    # every step reads only tensors written before it
    written = {"x"}
    for s in steps:
        assert set(reads(s)) <= written, s.name
        written.add(s.output)


def test_a_conv_output_read_twice_stays_materialised(tmp_path):
    """y = conv(x); z = relu(y + x0); out = z + y: the add cannot take y away from its second reader."""
    t: dict = {}
    ops = [
        _conv("c0", "x", "x0", 3, 4, t=t), _act("relu", "x0", "r0"),
        _conv("c1", "r0", "y", 4, 4, t=t),
        {"op": "add", "inputs": ["y", "r0"], "output": "s"}, _act("relu", "s", "z"),
        {"op": "add", "inputs": ["z", "y"], "output": "w"}, {"op": "flatten", "inputs": ["w"], "output": "f"},
    ]  # fmt: skip
    model = load_model(write_graph(tmp_path / "m", ops, t, [3, 8, 8]))
    steps = plan(model.ops)
    assert kernel_names(steps) == ["conv2d_0_relu", "conv2d_1", "add_0_relu", "add_1"]
    assert isinstance(steps[2], AddStep) and steps[2].inputs == ("y", "r0") and steps[1].residual is None


def test_pool_after_a_residual_conv_stays_its_own_step(tmp_path):
    t: dict = {}
    ops = [_conv("c0", "x", "a", 3, 4, t=t), _conv("c1", "a", "b", 4, 4, t=t),
           {"op": "add", "inputs": ["b", "a"], "output": "s"}, {"op": "maxpool2d", "inputs": ["s"], "output": "p",
           "kernel_size": 2}, {"op": "flatten"}]  # fmt: skip
    model = load_model(write_graph(tmp_path / "m", ops, t, [3, 8, 8]))
    assert kernel_names(fused_steps(model.ops, model.tensors)) == ["conv2d_0", "conv2d_1_add", "maxpool2d_0"]
    ops[2]["inputs"] = ["b", "b"]  # x + x: two reads of the conv output, so no fusion, and the pool joins nothing
    model = load_model(write_graph(tmp_path / "m2", ops, t, [3, 8, 8]))
    assert kernel_names(fused_steps(model.ops, model.tensors)) == ["conv2d_0", "conv2d_1", "add_0", "maxpool2d_0"]


def test_mlp_with_batchnorm_is_one_whole_mlp_kernel_unless_a_branch_reads_inside(tmp_path):
    t: dict = {}
    ops = [_linear("l0", "x", "h0", 12, 16, t), _bn("bn0", "h0", "h1", 16, t), _act("relu", "h1", "h2"),
           _linear("l1", "h2", "h3", 16, 16, t), _bn("bn1", "h3", "h4", 16, t), _act("gelu", "h4", "h5"),
           _linear("l2", "h5", "out", 16, 5, t)]  # fmt: skip
    model = load_model(write_graph(tmp_path / "m", ops, t, [12]))
    steps = fused_steps(model.ops, model.tensors)
    assert kernel_names(steps) == ["mlp_0_2"] and isinstance(steps[0], MLPStep)
    assert [s.name for s in steps[0].layers] == ["linear_0_bn_relu", "linear_1_bn_gelu", "linear_2"]
    # a residual over layer 1 (h2 read twice): layer 0's chain ends there, and layer 1 takes the add
    ops[6] = _linear("l2", "h6", "out", 16, 5, t)
    ops.insert(6, {"op": "add", "inputs": ["h5", "h2"], "output": "h6"})
    ops[5] = _act("gelu", "h4", "h5")
    model = load_model(write_graph(tmp_path / "m2", ops, t, [12]))
    steps = fused_steps(model.ops, model.tensors)
    assert kernel_names(steps) == ["linear_0_bn_relu", "linear_1_bn_gelu", "add_0", "linear_2"]


def test_batchnorm_without_a_layer_before_is_a_scale_shift_step(tmp_path):
    t: dict = {}
    ops = [_bn("pre", "x", "n", 3, t), _conv("c", "n", "y", 3, 4, t=t), {"op": "flatten"}]
    model = load_model(write_graph(tmp_path / "m", ops, t, [3, 8, 8]))
    steps = plan(model.ops)
    assert kernel_names(steps) == ["batchnorm_0", "conv2d_0"] and isinstance(steps[0], BatchNormStep)


def test_fused_residual_steps_write_channels_last_between_image_steps(tmp_path):
    ops, t = resnet_graph()
    model = load_model(write_graph(tmp_path / "m", ops, t, [3, 8, 8]))
    steps = fused_steps(model.ops, model.tensors)
    nhwc = dict(zip([s.name for s in steps], channels_last_outputs(steps), strict=True))
    assert nhwc["conv2d_0_bn_relu"] and nhwc["conv2d_5_bn"] and nhwc["conv2d_4_bn_add_relu"]
    assert not nhwc["linear_0"]


def test_check_model_prints_the_graph_and_what_each_step_fuses(tmp_path, capsys):
    ops, t = resnet_graph()
    d = write_graph(tmp_path / "m", ops, t, [3, 8, 8])
    assert main(["check-model", str(d)]) == 0
    out = capsys.readouterr().out
    assert "graph-test: input (3, 8, 8) -> 10 outputs; 22 ops" in out
    assert "fused plan (8 kernels): conv2d_0_bn_relu, conv2d_1_bn_relu, conv2d_2_bn_add_relu," in out
    assert re.search(r"  add +ops\[8\]: b1e, a0 -> b1f \(4, 8, 8\)", out), out
    assert "  conv2d_2_bn_add_relu: conv2d + batchnorm + add + relu (fused mode: " in out
    assert "<- b1c; residual a0" in out


# ---- both executors against float64 ----


@pytest.mark.parametrize("mode", ["unfused", "fused"])
def test_resnet_graph_matches_float64_in_both_modes(tmp_path, mode):
    ops, t = resnet_graph()
    d = write_graph(tmp_path / "m", ops, t, [3, 8, 8])
    model = load_model(d)
    x = torch.randn(5, 3, 8, 8)
    with torch.inference_mode():
        got = Executor(model, mode, DEVICE, torch.float32).forward(x.to(DEVICE))
    assert_normwise(got, reference_forward(d, x), 1e-5, mode)


@pytest.mark.parametrize("mode", ["unfused", "fused"])
def test_every_new_op_matches_float64_in_both_modes(tmp_path, mode):
    """relu6, hardswish, silu, gelu; a depthwise conv (groups = channels); concat; a batch norm with no layer before
    it (applied by the conv after it as it reads x: `_prebn`) and a standalone add; a pool; an MLP tail with batch
    norm; softmax at the output."""
    t: dict = {}
    ops = [
        _bn("pre", "x", "n", 3, t),
        _conv("c0", "n", "a", 3, 4, t=t), _bn("bn0", "a", "b", 4, t), _act("relu6", "b", "c"),
        _conv("dw", "c", "d", 4, 4, groups=4, t=t), _bn("bn1", "d", "e", 4, t), _act("hardswish", "e", "f"),
        _conv("c1", "c", "g", 4, 4, k=1, pad=0, t=t), _act("silu", "g", "h"),
        {"op": "concat", "inputs": ["f", "h"], "output": "cat"},
        _conv("c2", "cat", "i", 8, 8, t=t), _act("gelu", "i", "j"),
        {"op": "add", "inputs": ["j", "cat"], "output": "k"},  # j is a conv chain's output read once: rides in c2
        {"op": "maxpool2d", "inputs": ["k"], "output": "p", "kernel_size": 2},
        {"op": "add", "inputs": ["p", "p"], "output": "pp"}, _act("tanh", "pp", "q"),
        {"op": "avgpool2d", "inputs": ["q"], "output": "gap", "kernel_size": 4},
        {"op": "flatten", "inputs": ["gap"], "output": "flat"},
        _linear("l0", "flat", "h0", 8, 16, t), _bn("bnl", "h0", "h1", 16, t), _act("relu", "h1", "h2"),
        _linear("l1", "h2", "h3", 16, 6, t), {"op": "softmax", "inputs": ["h3"], "output": "probs"},
    ]  # fmt: skip
    d = write_graph(tmp_path / "m", ops, t, [3, 8, 8])
    model = load_model(d)
    steps = fused_steps(model.ops, model.tensors)
    assert kernel_names(steps) == [
        "conv2d_0_prebn_bn_relu6", "conv2d_1_bn_hardswish", "conv2d_2_silu", "concat_0", "conv2d_3_gelu",
        "add_0", "maxpool2d_0", "add_1_tanh", "avgpool2d_0", "mlp_0_1", "softmax_0",
    ]  # fmt: skip
    x = torch.randn(4, 3, 8, 8)
    with torch.inference_mode():
        got = Executor(model, mode, DEVICE, torch.float32).forward(x.to(DEVICE))
    assert_normwise(got, reference_forward(d, x), 1e-5, mode)


def test_the_plan_says_what_the_fused_mode_runs_as_torch_ops(tmp_path):
    ops, t = resnet_graph()
    model = load_model(write_graph(tmp_path / "m", ops, t, [3, 8, 8]))
    support = kernel_support()
    step = next(s for s in fused_steps(model.ops, model.tensors) if s.name == "conv2d_2_bn_add_relu")
    assert torch_parts(step, support) == ([] if support.conv_residual else ["add"])


@pytest.mark.skipif(
    not kernel_support().conv_residual,
    reason="kernels.conv.fused_conv2d has no residual= keyword on this branch (the kernel engineer's change): "
    "the fused executor adds the residual as a torch op after the conv kernel, checked by the tests above",
)
def test_fused_residual_is_read_in_the_conv_kernel(tmp_path):
    import kernels.conv

    ops, t = resnet_graph()
    model = load_model(write_graph(tmp_path / "m", ops, t, [3, 8, 8]))
    ex = Executor(model, "fused", DEVICE, torch.float32)
    name, layer = ex.layers[[s.name for s in ex.steps].index("conv2d_2_bn_add_relu")]
    assert layer.keywords["fn"] is kernels.conv.fused_conv2d and layer.keywords["activation"] == "relu"
    assert "residual" in inspect.signature(kernels.conv.fused_conv2d).parameters
