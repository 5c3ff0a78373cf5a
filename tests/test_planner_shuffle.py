"""ShuffleNetV2's units in the plan (issue 49): a channel shuffle (groups g) of a concat of g inputs of equal width gets
one channels_last buffer (`place_shuffles`, `shuffle_slots`): each input made by a conv writes its channels straight
into their shuffled positions (input k at channels k::g), an input that is a slice of the last unit's buffer is
copied there by the concat (one strided copy), and the concat, the shuffle and the split of the next unit are views.
Both executors against the float64 op-by-op reference of tests/test_model_graph.py and each other; the zoo's
ShuffleNetV2 (tiny) against onnxruntime; the GPU: the same graph through CUDA-graph replays.
"""

from __future__ import annotations

import pytest
import torch

from service.model.executors import Executor, torch_parts
from service.model.loader import load_model
from service.model.planner import (
    ChannelShuffleStep,
    ConcatStep,
    SliceStep,
    describe_step,
    fused_steps,
    is_view,
    reads,
    shuffle_slots,
    step_extras,
)
from tests.test_model_graph import (
    _act,
    _bn,
    _conv,
    _exact_float32_convs,  # noqa: F401  (autouse: fp32 convs without TF32 on a GPU)
    _linear,
    assert_normwise,
    reference_forward,
    write_graph,
)

pytestmark = pytest.mark.timeout(600)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _concat(inputs, out):
    return {"op": "concat", "inputs": list(inputs), "output": out}


def _shuffle(x, out, groups=2):
    return {"op": "channel_shuffle", "inputs": [x], "output": out, "groups": groups}


def _slice(x, out, start, end):
    return {"op": "slice", "inputs": [x], "output": out, "start": start, "end": end}


def _branch(p, x, c_in, c, stride, t):
    """1x1 conv + BN + ReLU, depthwise 3x3 (stride) + BN, 1x1 conv + BN + ReLU: ShuffleNetV2's branch."""
    return [
        _conv(f"{p}a", x, f"{p}a", c_in, c, k=1, pad=0, bias=False, t=t), _bn(f"{p}na", f"{p}a", f"{p}an", c, t),
        _act("relu", f"{p}an", f"{p}ar"),
        _conv(f"{p}d", f"{p}ar", f"{p}d", c, c, stride=stride, groups=c, bias=False, t=t),
        _bn(f"{p}nd", f"{p}d", f"{p}dn", c, t),
        _conv(f"{p}b", f"{p}dn", f"{p}b", c, c, k=1, pad=0, bias=False, t=t), _bn(f"{p}nb", f"{p}b", f"{p}bn", c, t),
        _act("relu", f"{p}bn", f"{p}out"),
    ]  # fmt: skip


def shuffle_graph(c=8, units=2, tail="conv"):
    """A stem conv, a stride-2 unit (two branches of the stem's output: depthwise 3x3 stride 2 + BN, 1x1 + BN + ReLU;
    and the 3-conv branch; concat, shuffle), `units` stride-1 units (split the last shuffle into halves x1, x2; concat
    x1 and branch(x2); shuffle), then (tail "conv") a 1x1 conv, a global pool and a linear; tail "flatten": the last
    shuffle read by a flatten and the linear. 3x16x16 input; c channels per half."""
    t: dict = {}
    ops = [_conv("stem", "x", "s", 3, c, t=t), _act("relu", "s", "s1")]
    ops += [
        _conv("d0a", "s1", "d0a", c, c, stride=2, groups=c, bias=False, t=t), _bn("d0na", "d0a", "d0an", c, t),
        _conv("d0b", "d0an", "d0b", c, c, k=1, pad=0, bias=False, t=t), _bn("d0nb", "d0b", "d0bn", c, t),
        _act("relu", "d0bn", "d0out"),
    ]  # fmt: skip
    ops += _branch("e0", "s1", c, c, 2, t)
    ops += [_concat(["d0out", "e0out"], "cat0"), _shuffle("cat0", "sh0")]
    last = "sh0"
    for u in range(1, units + 1):
        ops += [_slice(last, f"x1_{u}", 0, c), _slice(last, f"x2_{u}", c, 2 * c)]
        ops += _branch(f"u{u}", f"x2_{u}", c, c, 1, t)
        ops += [_concat([f"x1_{u}", f"u{u}out"], f"cat{u}"), _shuffle(f"cat{u}", f"sh{u}")]
        last = f"sh{u}"
    if tail == "conv":
        ops += [
            _conv("head", last, "h", 2 * c, 16, k=1, pad=0, t=t), _act("relu", "h", "hr"),
            {"op": "avgpool2d", "inputs": ["hr"], "output": "gap", "kernel_size": 8},
            {"op": "flatten", "inputs": ["gap"], "output": "flat"}, _linear("fc", "flat", "logits", 16, 10, t),
        ]  # fmt: skip
    else:
        ops += [
            {"op": "flatten", "inputs": [last], "output": "flat"},
            _linear("fc", "flat", "logits", 2 * c * 64, 10, t),
        ]
    return ops, t


def _model(tmp_path, ops, t, shape=(3, 16, 16)):
    return load_model(write_graph(tmp_path / "m", ops, t, list(shape)))


def test_both_unit_kinds_write_into_one_shuffled_buffer_each(tmp_path):
    model = _model(tmp_path, *shuffle_graph(c=8, units=2))
    steps = fused_steps(model.ops, model.tensors, shapes=model.shapes)
    slots = shuffle_slots(steps, model.shapes)
    shuffles = [s for s in steps if isinstance(s, ChannelShuffleStep)]
    concats = [s for s in steps if isinstance(s, ConcatStep)]
    slices = [s for s in steps if isinstance(s, SliceStep)]
    assert len(shuffles) == 3 and all(s.in_place and is_view(s) and torch_parts(s) == [] for s in shuffles)
    assert all(s.in_place and is_view(s) and torch_parts(s) == [] for s in slices) and len(slices) == 4
    # the stride-2 unit: the later branch's last conv writes channels 1::2 of sh0's buffer and the earlier branch's
    # output (dense, its own tensor) at 0::2 in the same store; the concat a view
    assert concats[0].copied == () and is_view(concats[0]) and torch_parts(concats[0]) == []
    conv_of = {s.output: s for s in steps}
    d, e = concats[0].inputs
    assert conv_of[d].name.startswith("conv2d") and conv_of[e].name.startswith("conv2d")
    assert (conv_of[e].interleave, conv_of[e].interleave_index, conv_of[d].interleave) == (d, 1, None)
    assert d not in slots and (slots[e].buffer, slots[e].offset, slots[e].channels, slots[e].stride) == (
        "sh0:shuffled", 1, 8, 2)  # fmt: skip
    # a stride-1 unit: the branch's conv writes 1::2 and x1 (a view of the last buffer) beside it at 0::2, in one
    # store (the conv reads x1: interleave); the concat, which would copy x1 otherwise, is a view
    for u in (1, 2):
        cat = concats[u]
        assert cat.in_place and cat.copied == () and is_view(cat) and torch_parts(cat) == []
        assert describe_step(cat) == {"op": "concat", "inputs": [f"x1_{u}", cat.inputs[1]], "in_place": True}
        assert f"x1_{u}" not in slots and slots[cat.inputs[1]].offset == 1 and slots[cat.inputs[1]].stride == 2
        conv = conv_of[cat.inputs[1]]
        assert (conv.interleave, conv.interleave_index) == (f"x1_{u}", 1) and reads(conv)[-1] == f"x1_{u}"
        assert step_extras(conv)["interleave"] == {"with": f"x1_{u}", "channels": "1::2"}
    assert slots["sh1"] == slots["cat1"] and slots["sh1"].width == 16 and slots["sh1"].stride == 1
    # without shapes (a plan made in a test), nothing is placed
    plain = fused_steps(model.ops, model.tensors)
    assert not any(getattr(s, "in_place", False) for s in plain if isinstance(s, (ChannelShuffleStep, SliceStep)))


def _plan_places_nothing(tmp_path, ops, t, shape=(3, 16, 16)):
    model = _model(tmp_path, ops, t, shape)
    steps = fused_steps(model.ops, model.tensors, shapes=model.shapes)
    assert not shuffle_slots(steps, model.shapes)
    assert not any(getattr(s, "in_place", False) for s in steps if isinstance(s, (ChannelShuffleStep, SliceStep)))
    return model


def test_the_rule_declines_where_the_pattern_differs(tmp_path):
    """Unequal widths, groups other than the number of concat inputs, and a shuffle read by a flatten (which wants
    NCHW, not a strided buffer): the concat and the shuffle stay torch ops."""
    t: dict = {}
    stem = [_conv("c0", "x", "a", 3, 4, t=t), _conv("c1", "x", "b", 3, 12, t=t)]
    tail = [{"op": "flatten", "inputs": ["sh"], "output": "f"}]
    unequal = stem + [_concat(["a", "b"], "cat"), _shuffle("cat", "sh", 2)] + tail
    _plan_places_nothing(tmp_path / "unequal", [*unequal, _linear("fc", "f", "logits", 16 * 64, 3, t)], t, (3, 8, 8))
    t = {}
    stem = [_conv("c0", "x", "a", 3, 8, t=t), _conv("c1", "x", "b", 3, 8, t=t)]
    groups = stem + [_concat(["a", "b"], "cat"), _shuffle("cat", "sh", 4), _conv("c2", "sh", "y", 16, 4, t=t)]
    groups += [{"op": "flatten", "inputs": ["y"], "output": "f"}, _linear("fc", "f", "logits", 4 * 64, 3, t)]
    model = _plan_places_nothing(tmp_path / "groups", groups, t, (3, 8, 8))
    d = tmp_path / "groups" / "m"
    x = torch.randn(2, 3, 8, 8)
    with torch.inference_mode():
        got = Executor(model, "fused", DEVICE, torch.float32).forward(x.to(DEVICE))
    assert_normwise(got, reference_forward(d, x), 1e-5, "groups 4 of 2 inputs")
    ops, t = shuffle_graph(c=4, units=1, tail="flatten")
    model = _model(tmp_path / "flatten", ops, t)
    steps = fused_steps(model.ops, model.tensors, shapes=model.shapes)
    shuffles = [s.in_place for s in steps if isinstance(s, ChannelShuffleStep)]
    assert shuffles == [True, False]  # the first unit's shuffle is read by convs and slices; the last by a flatten


@pytest.mark.parametrize("mode", ["unfused", "fused"])
def test_shuffle_graph_matches_float64_in_both_modes(tmp_path, mode):
    d = write_graph(tmp_path / "m", *shuffle_graph(), [3, 16, 16])
    model = load_model(d)
    ex = Executor(model, mode, DEVICE, torch.float32)
    if mode == "fused":  # 3 buffers; the shuffles, slices and the stride-2 unit's concat are views (no name)
        assert sum(w.alloc is not None for w in ex.wiring) == 3
        views = [s for (name, _), s in zip(ex.layers, ex.steps, strict=True) if name is None]
        assert sorted(type(s).__name__ for s in views if not isinstance(s, ConcatStep)) == [
            "ChannelShuffleStep"] * 3 + ["FlattenStep"] + ["SliceStep"] * 4  # fmt: skip
    else:
        assert not ex.slots and all(w.alloc is None and w.into is None for w in ex.wiring)
    x = torch.randn(3, 3, 16, 16)
    with torch.inference_mode():
        got = ex.forward(x.to(DEVICE))
        again = ex.warm_forward(x.to(DEVICE))
        other = Executor(model, "fused" if mode == "unfused" else "unfused", DEVICE, torch.float32).forward(
            x.to(DEVICE)
        )
    assert_normwise(got, reference_forward(d, x), 1e-5, mode)
    assert torch.equal(got, again)
    torch.testing.assert_close(got, other, rtol=1e-4, atol=1e-5)


def test_the_shuffle_and_its_split_are_views_of_what_the_producers_wrote(tmp_path):
    """Fused, each unit's concat inputs (but the stride-2 unit's earlier branch), concat, shuffle and the next unit's
    halves share one buffer's memory."""
    model = _model(tmp_path, *shuffle_graph())
    ex = Executor(model, "fused", DEVICE, torch.float32)
    seen: dict[str, torch.Tensor] = {}
    layers = []
    for (name, layer), step in zip(ex.layers, ex.steps, strict=True):

        def keep(*args, layer=layer, out_name=step.output, **kw):
            y = layer(*args, **kw)
            seen[out_name] = y
            return y

        layers.append((name, keep))
    ex.layers = layers
    with torch.inference_mode():
        ex.forward(torch.randn(2, 3, 16, 16, device=DEVICE))
    # the stride-2 unit's earlier branch writes a dense channels_last tensor of its own, which the later branch's conv
    # stores beside its output (the kernel's dense-partner path)
    assert seen["d0out"].is_contiguous(memory_format=torch.channels_last)
    assert seen["d0out"].untyped_storage().data_ptr() != seen["sh0"].untyped_storage().data_ptr()
    for unit, members in {0: ("e0out", "cat0", "x1_1", "x2_1"), 1: ("u1out", "cat1", "x1_2", "x2_2")}.items():
        base = seen[f"sh{unit}"].untyped_storage().data_ptr()
        assert seen[f"sh{unit}"].is_contiguous(memory_format=torch.channels_last)
        for t in members:
            assert seen[t].untyped_storage().data_ptr() == base, (unit, t)
    assert seen["e0out"].stride(1) == 2 and seen["x2_1"].stride(1) == 1 and seen["x2_1"].shape[1] == 8
    assert seen["sh1"].untyped_storage().data_ptr() != seen["sh0"].untyped_storage().data_ptr()


def test_the_unfused_mode_keeps_the_torch_ops(tmp_path):
    """The plan marks the steps; only the fused executor places buffers (not float8 either, as for concats): unfused,
    every concat, shuffle and slice runs its torch op under its own name."""
    model = _model(tmp_path, *shuffle_graph())
    ex = Executor(model, "unfused", DEVICE, torch.float32)
    names = {s.name: name for (name, _), s in zip(ex.layers, ex.steps, strict=True)}
    assert all(names[s.name] == s.name for s in ex.steps if isinstance(s, (ChannelShuffleStep, SliceStep, ConcatStep)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_gpu_shuffle_graph_replays_equal_launches_and_the_unfused_mode(tmp_path, dtype, monkeypatch):
    """The shuffled buffers are allocated inside each bucket's captured forward: a replay gives what launching each
    step does, at every bucket; and the unfused mode agrees."""
    from service.model.graphs import GraphedExecutor
    from tests.tolerances import RTOL_VS_UNFUSED

    # float32 in full fp32 on both sides (as tests/test_planner_dense.py): TF32 is torch's default for convs
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model = _model(tmp_path, *shuffle_graph(c=16, units=2))
    ex = Executor(model, "fused", torch.device("cuda"), dtype)
    unfused = Executor(model, "unfused", torch.device("cuda"), dtype)
    graphs = GraphedExecutor(ex, 64)
    graphs.capture_all()
    for rows in (1, 3, 64, 17, 2):
        x = torch.randn(rows, 3, 16, 16, device="cuda").to(dtype)
        with torch.inference_mode():
            want = ex.forward(x)
            base = unfused.forward(x)
        got = graphs.forward(x).clone()
        assert torch.equal(got, want), f"{dtype} rows={rows}: replay differs from launches"
        tol = RTOL_VS_UNFUSED[dtype]
        torch.testing.assert_close(got.float(), base.float(), rtol=tol, atol=tol, msg=f"{dtype} rows={rows}")


@pytest.mark.cpu_interpreter
def test_zoo_shufflenet_runs_its_concats_shuffles_and_splits_in_place(tmp_path):
    """ShuffleNetV2 (tiny) from the TorchScript exporter: of its 6 concats, 6 shuffles and 6 slices (18 torch ops
    before, each a copy of a feature map), none runs a torch op: the 3 stride-1 units' branch convs store x1 beside
    their outputs (interleave), so every concat is a view too; both modes agree with onnxruntime."""
    pytest.importorskip("onnxruntime")
    from bench.zoo import check

    built = check.build("shufflenet_v2_x1_0", "tiny", tmp_path, ("torchscript",))
    rec = check.check(built, "torchscript", ("unfused", "fused"), rows=4, fused_rows=1)
    assert rec["plan"]["torch_parts"] == {} and rec["plan"]["torch"] == 0
    assert rec["plan"]["views"] == 1 + 6 + 6 + 6  # the flatten, the concats, the shuffles, the slices
    for mode, m in rec["modes"].items():
        assert m.get("ok"), (mode, m)
