"""The ops of the CNNs people deploy beyond ResNets (issue 49), on hand-written graphs: a squeeze-and-excitation
block (global pool, two 1x1 convs, a hard-sigmoid gate, a per-image per-channel multiply), clip, layer norm over
the channels with a layer scale, elementwise ops with constants (reversed too), padding, channel slices, a
channel shuffle and a broadcasting add. Both executors against the float64 reference of test_model_graph, which
runs the config op by op without the loader's Model or the planner.

Small on purpose: the fused mode's convs run Triton's interpreter on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from service.model.executors import Executor, torch_parts
from service.model.loader import load_model
from service.model.planner import ClampStep, Conv2dStep, ElementwiseStep, LayerNormStep, fused_steps
from service.model.spec import ModelFormatError

from .test_model_graph import DEVICE, _act, _bn, _conv, _linear, assert_normwise, reference_forward, write_graph

pytestmark = pytest.mark.timeout(300)


def blocks_graph(c: int = 6):
    """conv+relu -> SE (global avg pool, 1x1 conv+relu, 1x1 conv+hardsigmoid, mul) -> clip -> layernorm -> layer
    scale (mul by a constant) -> 1 - x (reversed sub) -> / constant -> pad -> two channel slices, concatenated the
    other way round -> channel shuffle -> + the SE gate (broadcast) + relu -> hard sigmoid of ONNX's slope -> global
    pool -> linear. Input 3x9x7 (odd, unequal sides)."""
    t: dict = {}
    t["ls"] = torch.rand(c, 1, 1) + 0.5
    t["one"] = torch.tensor(1.0)
    t["dv"] = torch.rand(c, 1, 1) + 0.5
    t["ln.w"] = torch.rand(c) + 0.5
    t["ln.b"] = torch.randn(c) * 0.1
    half = c // 2
    ops = [
        _conv("stem", "x", "s0", 3, c, t=t), _act("relu", "s0", "a0"),
        {"op": "avgpool2d", "inputs": ["a0"], "output": "sq", "kernel_size": [9, 7]},
        _conv("se1", "sq", "e1", c, 3, k=1, pad=0, t=t), _act("relu", "e1", "e2"),
        _conv("se2", "e2", "e3", 3, c, k=1, pad=0, t=t), _act("hardsigmoid", "e3", "gate"),
        {"op": "mul", "inputs": ["a0", "gate"], "output": "se"},
        _act("clip", "se", "cl", min=-0.25, max=1.5),
        {"op": "layernorm", "inputs": ["cl"], "output": "ln", "weight": "ln.w", "bias": "ln.b", "eps": 1e-6},
        {"op": "mul", "inputs": ["ln"], "output": "sc", "constant": "ls"},
        {"op": "sub", "inputs": ["sc"], "output": "rs", "constant": "one", "reverse": True},
        {"op": "div", "inputs": ["rs"], "output": "dv", "constant": "dv"},
        {"op": "pad", "inputs": ["dv"], "output": "pd", "pads": [1, 0, 2, 1], "value": 0.5},
        {"op": "slice", "inputs": ["pd"], "output": "lo", "start": 0, "end": half},
        {"op": "slice", "inputs": ["pd"], "output": "hi", "start": half, "end": c},
        {"op": "concat", "inputs": ["hi", "lo"], "output": "cc"},
        {"op": "channel_shuffle", "inputs": ["cc"], "output": "sh", "groups": 2},
        {"op": "add", "inputs": ["sh", "gate"], "output": "bg"}, _act("relu", "bg", "r"),
        _act("hardsigmoid", "r", "hs", alpha=0.2, beta=0.5),
        {"op": "avgpool2d", "inputs": ["hs"], "output": "gap", "kernel_size": [12, 8]},
        {"op": "flatten", "inputs": ["gap"], "output": "flat"}, _linear("fc", "flat", "logits", c, 5, t),
    ]  # fmt: skip
    return ops, t


def test_blocks_load_and_plan(tmp_path):
    ops, t = blocks_graph()
    model = load_model(write_graph(tmp_path / "m", ops, t, [3, 9, 7]))
    assert model.shapes["gate"] == (6, 1, 1) and model.shapes["se"] == (6, 9, 7)
    assert model.shapes["pd"] == (6, 12, 8) and model.shapes["lo"] == (3, 12, 8) and model.shapes["flat"] == (6,)
    steps = fused_steps(model.ops, model.tensors, shapes=model.shapes)
    by_name = {s.name: s for s in steps}
    # the SE gate rides in its 1x1 conv's epilogue; the broadcast add is no residual: an elementwise step + relu
    assert isinstance(by_name["conv2d_2_hardsigmoid"], Conv2dStep)
    assert isinstance(by_name["mul_0"], ElementwiseStep) and by_name["mul_0"].constant is None
    assert isinstance(by_name["add_0_relu"], ElementwiseStep) and by_name["add_0_relu"].inputs == ("sh", "gate")
    assert isinstance(by_name["layernorm_0"], LayerNormStep)
    assert isinstance(by_name["hardsigmoid_0"], ClampStep) and by_name["hardsigmoid_0"].scale == 0.2
    assert by_name["sub_0"].reverse and by_name["sub_0"].constant == "one"
    # the shuffle is its buffer (place_shuffles): the concat copies both slices into their strided channels of it
    assert by_name["channel_shuffle_0"].in_place and torch_parts(by_name["channel_shuffle_0"]) == []
    assert by_name["concat_0"].in_place and by_name["concat_0"].copied == ("hi", "lo")
    assert torch_parts(by_name["conv2d_2_hardsigmoid"]) == []  # hardsigmoid is in the kernels' table


@pytest.mark.parametrize("mode", ["fused", "unfused"])
@pytest.mark.parametrize("rows", [1, 3])
def test_blocks_match_the_reference(tmp_path, mode, rows):
    ops, t = blocks_graph()
    d = write_graph(tmp_path / "m", ops, t, [3, 9, 7])
    model = load_model(d)
    x = torch.randn(rows, 3, 9, 7)
    got = Executor(model, mode, DEVICE, torch.float32).forward(x.to(DEVICE))
    assert got.shape == (rows, 5) and torch.isfinite(got).all()
    assert_normwise(got, reference_forward(d, x), 1e-5, f"{mode}, {rows} rows")


@pytest.mark.parametrize(
    "edit,needle",
    [
        (
            lambda o, t: o[7].update(inputs=["a0", "e2"]),
            "multiplies 'a0' of shape (6, 9, 7) by 'e2' of shape (3, 1, 1)",
        ),
        (lambda o, t: t.update(ls=torch.rand(1, 6, 1, 1)), "the constant 'ls' of shape (1, 6, 1, 1)"),
        (lambda o, t: o[14].update(end=7), "slices channels 0:7 of an input of shape (6, 12, 8) (6 channels)"),
        (lambda o, t: o[17].update(groups=4), "groups 4 does not divide the input's 6 channels"),
        (lambda o, t: t.update({"ln.w": torch.ones(5)}), "weight 'ln.w' has shape (5,); expected (6,)"),
        (lambda o, t: o[11].pop("constant"), "sub takes two tensors, or one tensor and a constant"),
        (lambda o, t: o[14].update(start=3, end=3), "start 3 and end 3: the slice must keep a channel"),
    ],
    ids=["broadcast", "constant-rank", "slice", "shuffle", "layernorm", "no-constant", "empty-slice"],
)
def test_block_mistakes_are_named(tmp_path, edit, needle):
    ops, t = blocks_graph()
    edit(ops, t)
    d = write_graph(tmp_path / "m", ops, t, [3, 9, 7])
    with pytest.raises(ModelFormatError) as info:
        load_model(d)
    assert needle in str(info.value), str(info.value)


def convnext_graph(c: int = 4):
    """A ConvNeXt block as the importers write it, channel-first: depthwise 7x7 conv -> layernorm over channels ->
    1x1 conv (4c) + gelu -> 1x1 conv (c) -> layer scale (mul by a (c, 1, 1) constant) -> + the block's input; then
    a global pool and a linear. Input c x 9 x 9."""
    t: dict = {"gamma": torch.rand(c, 1, 1) + 0.5, "ln.w": torch.rand(c) + 0.5, "ln.b": torch.randn(c) * 0.1}
    ops = [
        _conv("dw", "x", "d", c, c, k=7, pad=3, groups=c, t=t),
        {"op": "layernorm", "inputs": ["d"], "output": "n", "weight": "ln.w", "bias": "ln.b", "eps": 1e-6},
        _conv("pw1", "n", "p1", c, 4 * c, k=1, pad=0, t=t), _act("gelu", "p1", "g"),
        _conv("pw2", "g", "p2", 4 * c, c, k=1, pad=0, t=t),
        {"op": "mul", "inputs": ["p2"], "output": "ls", "constant": "gamma"},
        {"op": "add", "inputs": ["ls", "x"], "output": "res"},
        {"op": "avgpool2d", "inputs": ["res"], "output": "gap", "kernel_size": 9},
        {"op": "flatten", "inputs": ["gap"], "output": "flat"}, _linear("fc", "flat", "logits", c, 3, t),
    ]  # fmt: skip
    return ops, t


def test_a_layer_scale_folds_into_the_conv_before_it(tmp_path):
    ops, t = convnext_graph()
    model = load_model(write_graph(tmp_path / "m", ops, t, [4, 9, 9]))
    steps = fused_steps(model.ops, model.tensors, shapes=model.shapes)
    conv = next(s for s in steps if s.name.startswith("conv2d_2"))
    assert conv.name == "conv2d_2_scale_add" and conv.scale == "gamma" and conv.residual == "x"
    assert not any(isinstance(s, ElementwiseStep) for s in steps)
    # a mul by a constant of another shape (one value per column) is no layer scale: its own step
    t["gamma"] = torch.rand(1, 1, 9) + 0.5
    model = load_model(write_graph(tmp_path / "m2", ops, t, [4, 9, 9]))
    steps = fused_steps(model.ops, model.tensors, shapes=model.shapes)
    assert [s.name for s in steps if isinstance(s, ElementwiseStep)] == ["mul_0"]


@pytest.mark.parametrize("mode", ["fused", "unfused"])
def test_a_convnext_block_matches_the_reference(tmp_path, mode):
    ops, t = convnext_graph()
    d = write_graph(tmp_path / "m", ops, t, [4, 9, 9])
    x = torch.randn(2, 4, 9, 9)
    got = Executor(load_model(d), mode, DEVICE, torch.float32).forward(x.to(DEVICE))
    assert_normwise(got, reference_forward(d, x), 1e-5, mode)


def se_graph(c: int = 8):
    """An MBConv-like block with squeeze-and-excitation, as EfficientNet writes it: 1x1 expand + silu, depthwise 3x3
    + silu, SE (global pool, 1x1 conv + silu, 1x1 conv + sigmoid, gate * x with the gate first), 1x1 projection +
    batch norm, + the block's input; then a global pool and a linear. Input c x 7 x 5."""
    t: dict = {}
    ops = [
        _conv("exp", "x", "e", c, 2 * c, k=1, pad=0, t=t), _act("silu", "e", "e1"),
        _conv("dw", "e1", "d", 2 * c, 2 * c, groups=2 * c, t=t), _act("silu", "d", "d1"),
        {"op": "avgpool2d", "inputs": ["d1"], "output": "sq", "kernel_size": [7, 5]},
        _conv("fc1", "sq", "f1", 2 * c, 3, k=1, pad=0, t=t), _act("silu", "f1", "f2"),
        _conv("fc2", "f2", "f3", 3, 2 * c, k=1, pad=0, t=t), _act("sigmoid", "f3", "gate"),
        {"op": "mul", "inputs": ["gate", "d1"], "output": "se"},
        _conv("proj", "se", "p", 2 * c, c, k=1, pad=0, bias=False, t=t), _bn("proj_bn", "p", "pb", c, t),
        {"op": "add", "inputs": ["pb", "x"], "output": "res"},
        {"op": "avgpool2d", "inputs": ["res"], "output": "gap", "kernel_size": [7, 5]},
        {"op": "flatten", "inputs": ["gap"], "output": "flat"}, _linear("fc", "flat", "logits", c, 4, t),
    ]  # fmt: skip
    return ops, t


def test_an_se_gate_rides_in_the_projection_conv(tmp_path):
    ops, t = se_graph()
    model = load_model(write_graph(tmp_path / "m", ops, t, [8, 7, 5]))
    steps = fused_steps(model.ops, model.tensors, shapes=model.shapes)
    proj = next(s for s in steps if s.name.startswith("conv2d_4"))
    assert proj.name == "conv2d_4_gated_bn_add" and proj.gate == "gate" and proj.inputs == ("d1",)
    assert proj.residual == "x" and not any(isinstance(s, ElementwiseStep) for s in steps)
    assert torch_parts(proj) == []  # the gate in the kernel's gather
    # two muls before the conv: it takes the one it reads (se * gate), and gate * d1 stays a step of its own
    ops.insert(10, {"op": "mul", "inputs": ["se", "gate"], "output": "se2"})
    ops[11]["inputs"] = ["se2"]
    model = load_model(write_graph(tmp_path / "m2", ops, t, [8, 7, 5]))
    steps = fused_steps(model.ops, model.tensors, shapes=model.shapes)
    assert next(s for s in steps if s.name.startswith("conv2d_4")).gate == "gate"  # the second mul's, read once
    assert [s.name for s in steps if isinstance(s, ElementwiseStep)] == ["mul_0"]


@pytest.mark.parametrize("mode", ["fused", "unfused"])
@pytest.mark.parametrize("rows", [1, 2])
def test_an_se_block_matches_the_reference(tmp_path, mode, rows):
    ops, t = se_graph()
    d = write_graph(tmp_path / "m", ops, t, [8, 7, 5])
    x = torch.randn(rows, 8, 7, 5)
    got = Executor(load_model(d), mode, DEVICE, torch.float32).forward(x.to(DEVICE))
    assert_normwise(got, reference_forward(d, x), 1e-5, f"{mode}, {rows} rows")


@pytest.mark.parametrize("kind", ["avgpool2d", "maxpool2d"])
@pytest.mark.parametrize("mode", ["fused", "unfused"])
def test_a_large_global_pool_matches_the_reference(tmp_path, kind, mode):
    """A global pool of 11 x 9 = 99 taps (more than the pool kernel unrolls: torch's reduction in the fused mode)."""
    t: dict = {}
    ops = [
        _conv("c", "x", "a", 3, 5, t=t), _act("relu", "a", "r"),
        {"op": kind, "inputs": ["r"], "output": "p", "kernel_size": [11, 9]}, _act("sigmoid", "p", "s"),
        {"op": "flatten", "inputs": ["s"], "output": "f"}, _linear("fc", "f", "logits", 5, 2, t),
    ]  # fmt: skip
    d = write_graph(tmp_path / "m", ops, t, [3, 11, 9])
    x = torch.randn(3, 3, 11, 9)
    executor = Executor(load_model(d), mode, DEVICE, torch.float32)
    assert any(s.name == f"{kind}_0_sigmoid" for s in executor.steps)
    assert_normwise(executor.forward(x.to(DEVICE)), reference_forward(d, x), 1e-5, f"{kind}, {mode}")
