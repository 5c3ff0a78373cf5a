"""DenseNet's blocks in the plan (issue 49): a pre-activation BatchNorm + ReLU (a BN after a concat or a pool, not a
conv) goes into the prologue of every conv that reads it (`fold_preactivations`), and the concats of a dense block,
each the previous one and one more feature, share one channels_last buffer that each producer writes its channels of
(`place_concats`, `concat_slots`), so the fused mode runs no batch norm, activation or concat kernel there. Both
executors against the float64 op-by-op reference of tests/test_model_graph.py; the zoo's DenseNet-121 (tiny) against
onnxruntime; the GPU: the same graph through CUDA-graph replays.
"""

from __future__ import annotations

import pytest
import torch

from service.model.executors import Executor, torch_parts
from service.model.loader import load_model
from service.model.planner import (
    ActivationStep,
    BatchNormStep,
    ConcatStep,
    Conv2dStep,
    concat_slots,
    fused_steps,
    is_view,
    kernel_names,
    step_extras,
    step_ops,
)
from tests.test_model_graph import _act, _bn, _conv, _linear, assert_normwise, reference_forward, write_graph

pytestmark = pytest.mark.timeout(600)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _concat(inputs, out):
    return {"op": "concat", "inputs": list(inputs), "output": out}


def dense_graph(c0=6, growth=3, layers=3, bottleneck=8):
    """A stem conv + max pool, a dense block of `layers` layers (BN-ReLU-conv1x1-BN-ReLU-conv3x3 on the concat of the
    block input and every earlier feature; the first reads the pool output itself), a transition (BN-ReLU-conv1x1,
    avg pool 2), a second block of 2 layers, then BN-ReLU, a global pool and a linear. 3x16x16 input."""
    t: dict = {}
    pool = {"op": "maxpool2d", "inputs": ["s1"], "output": "p0", "kernel_size": 3, "stride": 2, "padding": 1}
    ops = [_conv("stem", "x", "s", 3, c0, stride=2, t=t), _act("relu", "s", "s1"), pool]

    def block(prefix, x, c, n):
        feats, cat = [x], x
        for i in range(n):
            if i:
                cat = f"{prefix}cat{i}"
                ops.append(_concat(feats, cat))
            cin, p = c + i * growth, f"{prefix}{{}}_{i}".format
            ops.extend([
                _bn(p("n1"), cat, p("b1"), cin, t), _act("relu", p("b1"), p("r1")),
                _conv(p("c1"), p("r1"), p("h"), cin, bottleneck, k=1, pad=0, bias=False, t=t),
                _bn(p("n2"), p("h"), p("b2"), bottleneck, t), _act("relu", p("b2"), p("r2")),
                _conv(p("c2"), p("r2"), p("f"), bottleneck, growth, bias=False, t=t),
            ])  # fmt: skip
            feats.append(p("f"))
        ops.append(_concat(feats, f"{prefix}out"))
        return f"{prefix}out", c + n * growth

    y, c = block("a", "p0", c0, layers)
    ops.extend([
        _bn("tn", y, "tb", c, t), _act("relu", "tb", "tr"),
        _conv("tc", "tr", "th", c, c // 2, k=1, pad=0, bias=False, t=t),
        {"op": "avgpool2d", "inputs": ["th"], "output": "tp", "kernel_size": 2},
    ])  # fmt: skip
    y, c = block("b", "tp", c // 2, 2)
    ops.extend([
        _bn("fn", y, "fb", c, t), _act("relu", "fb", "fr"),
        {"op": "avgpool2d", "inputs": ["fr"], "output": "gap", "kernel_size": 2},
        {"op": "flatten", "inputs": ["gap"], "output": "flat"}, _linear("fc", "flat", "logits", c, 10, t),
    ])  # fmt: skip
    return ops, t


def _model(tmp_path, ops, t, shape=(3, 16, 16)):
    return load_model(write_graph(tmp_path / "m", ops, t, list(shape)))


def test_preactivations_fold_into_every_dense_conv(tmp_path):
    model = _model(tmp_path, *dense_graph())
    steps = fused_steps(model.ops, model.tensors, shapes=model.shapes)
    names = kernel_names(steps)
    assert names[:4] == ["conv2d_0_relu", "maxpool2d_0", "conv2d_1_preact_bn_relu", "conv2d_2"]
    assert "conv2d_7_preact_avgpool2d_0" in names  # the transition: BN-ReLU, conv 1x1, avg pool in one kernel
    # the last BN-ReLU feeds a pool, not a conv: it stays (one batch norm, one activation)
    assert [type(s).__name__ for s in steps if isinstance(s, (BatchNormStep, ActivationStep))] == [
        "BatchNormStep", "ActivationStep"]  # fmt: skip
    conv = next(s for s in steps if s.name == "conv2d_3_preact_bn_relu")
    assert conv.prenorm is not None and conv.prenorm_activation == "relu" and conv.inputs == ("acat1",)
    assert step_ops(conv) == ["batchnorm", "relu", "conv2d", "batchnorm", "relu"]
    assert step_extras(conv) == {"batchnorm": True, "prenorm": {"activation": "relu"}}
    assert all(torch_parts(s) == [] for s in steps if isinstance(s, Conv2dStep))


def test_dense_block_concats_share_one_buffer_per_block(tmp_path):
    model = _model(tmp_path, *dense_graph(c0=6, growth=3, layers=3))
    steps = fused_steps(model.ops, model.tensors, shapes=model.shapes)
    slots = concat_slots(steps, model.shapes)
    concats = [s for s in steps if isinstance(s, ConcatStep)]
    assert len(concats) == 5 and all(s.in_place and is_view(s) and torch_parts(s) == [] for s in concats)
    # block a: the pool output, then 3 features of 3 channels; each concat a prefix of the block's 15 channels
    a = {t: (slots[t].offset, slots[t].channels) for t in ("p0", "af_0", "af_1", "af_2", "acat1", "acat2", "aout")}
    assert a == {"p0": (0, 6), "af_0": (6, 3), "af_1": (9, 3), "af_2": (12, 3), "acat1": (0, 9), "acat2": (0, 12),
                 "aout": (0, 15)}  # fmt: skip
    assert len({slots[t].buffer for t in a}) == 1 and slots["aout"].width == 15
    # block b: the transition's conv + pool writes its 7 channels first
    assert (slots["tp"].offset, slots["tp"].channels, slots["bout"].width) == (0, 7, 13)
    assert slots["tp"].buffer != slots["p0"].buffer
    # without shapes (a plan made in a test), no buffers: every concat a torch.cat
    assert not any(s.in_place for s in fused_steps(model.ops, model.tensors) if isinstance(s, ConcatStep))


def test_a_batchnorm_with_other_readers_stays_its_own_step(tmp_path):
    """BN-ReLU read by a conv and by a max pool, or by a depthwise conv, or as that conv's residual: nothing folds."""
    others = {
        "pool": lambda t: {"op": "maxpool2d", "inputs": ["r"], "output": "o", "kernel_size": 1},
        "depthwise": lambda t: _conv("dw", "r", "o", 4, 4, groups=4, t=t),
        "residual": None,  # y + r, which rides in c1's epilogue: r is its residual
    }
    for kind, other in others.items():
        t: dict = {}
        ops = [_conv("c0", "x", "a", 3, 4, t=t), _POOL, _bn("n", "p", "b", 4, t), _act("relu", "b", "r"),
               _conv("c1", "r", "y", 4, 4, t=t)]  # fmt: skip
        if other is not None:
            ops += [other(t), {"op": "add", "inputs": ["y", "o"], "output": "s"}]
        else:
            ops += [{"op": "add", "inputs": ["y", "r"], "output": "s"}]
        ops += [{"op": "flatten", "inputs": ["s"], "output": "f"}, _linear("fc", "f", "logits", 4 * 4 * 4, 3, t)]
        model = _model(tmp_path / kind, ops, t, (3, 8, 8))
        steps = fused_steps(model.ops, model.tensors, shapes=model.shapes)
        assert any(isinstance(s, BatchNormStep) for s in steps), kind
        assert not any(isinstance(s, Conv2dStep) and s.prenorm is not None for s in steps), kind


# a max pool that the conv before it cannot take in its kernel (overlapping, padded windows): a step of its own
_POOL = {"op": "maxpool2d", "inputs": ["a"], "output": "p", "kernel_size": 3, "stride": 2, "padding": 1}


def test_a_bn_read_by_convs_alone_folds_into_each_and_without_activation(tmp_path):
    """A pre-activation ResNet's BN-ReLU read by the block's conv and its projection shortcut: both take it. A BN
    with no activation after it: `_prebn`."""
    t: dict = {}
    ops = [
        _conv("c0", "x", "a", 3, 4, t=t), _POOL, _bn("n", "p", "b", 4, t), _act("relu", "b", "r"),
        _conv("c1", "r", "y", 4, 6, t=t), _conv("proj", "r", "z", 4, 6, k=1, pad=0, t=t),
        {"op": "add", "inputs": ["y", "z"], "output": "s"},
        _bn("n2", "s", "s2", 6, t), _conv("c2", "s2", "o", 6, 2, t=t),
        {"op": "flatten", "inputs": ["o"], "output": "f"}, _linear("fc", "f", "logits", 2 * 4 * 4, 3, t),
    ]  # fmt: skip
    d = write_graph(tmp_path / "m", ops, t, [3, 8, 8])
    model = load_model(d)
    steps = fused_steps(model.ops, model.tensors, shapes=model.shapes)
    assert kernel_names(steps) == ["conv2d_0", "maxpool2d_0", "conv2d_2_preact", "conv2d_1_preact_add",
                                   "conv2d_3_prebn", "linear_0"]  # fmt: skip
    x = torch.randn(3, 3, 8, 8)
    for mode in ("unfused", "fused"):
        with torch.inference_mode():
            got = Executor(model, mode, DEVICE, torch.float32).forward(x.to(DEVICE))
        assert_normwise(got, reference_forward(d, x), 1e-5, mode)


def test_concats_stay_copies_where_a_producer_cannot_write_in_place(tmp_path):
    """A concat of the model's input, of an activation step's output, or read by a flatten: torch.cat, as before."""
    t: dict = {}
    ops = [
        _conv("c0", "x", "a", 3, 4, t=t), _act("tanh", "a", "a1"), _conv("c1", "a", "b", 4, 4, t=t),
        _concat(["x", "b"], "cat0"),  # the model's input
        _conv("c2", "cat0", "c", 7, 4, t=t), _concat(["c", "a1"], "cat1"),  # a1: an activation step's output
        _conv("c3", "cat1", "d", 8, 4, t=t), _conv("c4", "d", "e", 4, 2, t=t), _conv("c5", "d", "g", 4, 2, t=t),
        _concat(["e", "g"], "cat2"), {"op": "flatten", "inputs": ["cat2"], "output": "f"},  # read by a flatten
        _linear("fc", "f", "logits", 4 * 8 * 8, 3, t),
    ]  # fmt: skip
    d = write_graph(tmp_path / "m", ops, t, [3, 8, 8])
    model = load_model(d)
    steps = fused_steps(model.ops, model.tensors, shapes=model.shapes)
    assert [s.in_place for s in steps if isinstance(s, ConcatStep)] == [False, False, False]
    x = torch.randn(2, 3, 8, 8)
    with torch.inference_mode():
        got = Executor(model, "fused", DEVICE, torch.float32).forward(x.to(DEVICE))
    assert_normwise(got, reference_forward(d, x), 1e-5, "fused")


@pytest.mark.parametrize("mode", ["unfused", "fused"])
def test_dense_graph_matches_float64_in_both_modes(tmp_path, mode):
    d = write_graph(tmp_path / "m", *dense_graph(), [3, 16, 16])
    model = load_model(d)
    ex = Executor(model, mode, DEVICE, torch.float32)
    if mode == "fused":  # 2 buffers, allocated by the max pool and the transition; the concats are views (no name)
        assert sum(w.alloc is not None for w in ex.wiring) == 2
        assert all(name is None for (name, _), s in zip(ex.layers, ex.steps, strict=True) if isinstance(s, ConcatStep))
    else:
        assert not ex.slots and all(w.alloc is None and w.into is None for w in ex.wiring)
    x = torch.randn(3, 3, 16, 16)
    with torch.inference_mode():
        got = ex.forward(x.to(DEVICE))
        again = ex.warm_forward(x.to(DEVICE))
    assert_normwise(got, reference_forward(d, x), 1e-5, mode)
    assert torch.equal(got, again)


def test_the_concat_is_a_view_of_what_its_producers_wrote(tmp_path):
    """Fused, every concat of a block and each of its inputs share one buffer's memory (no torch.cat copy)."""
    model = _model(tmp_path, *dense_graph())
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
    base = seen["aout"].untyped_storage().data_ptr()
    for t in ("p0", "af_0", "af_1", "af_2", "acat1", "acat2"):
        assert seen[t].untyped_storage().data_ptr() == base, t
    assert seen["aout"].shape[1] == 15 and seen["acat1"].shape[1] == 9


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_gpu_dense_graph_replays_equal_launches_and_the_unfused_mode(tmp_path, dtype, monkeypatch):
    """The concat buffers are allocated inside each bucket's captured forward: a replay gives what launching each step
    does, at every bucket, with pad rows left by bigger batches; and the unfused mode agrees."""
    from service.model.graphs import GraphedExecutor
    from tests.tolerances import RTOL_VS_UNFUSED

    # float32 in full fp32 on both sides (tests/test_executors.py's fixture): with torch's default, cuDNN and
    # fused_conv2d multiply in TF32, and the float32 case failed RTOL_VS_UNFUSED on an H200
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model = _model(tmp_path, *dense_graph(c0=16, growth=8, bottleneck=32))
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


def test_zoo_densenet_runs_its_preactivations_and_concats_in_kernels(tmp_path):
    """DenseNet-121 (tiny) from the TorchScript exporter: of its 12 batch norms and 8 concats (all torch ops before),
    only the last BN (read by the global pool, not a conv) stays one; both modes agree with onnxruntime."""
    pytest.importorskip("onnxruntime")
    from bench.zoo import check

    built = check.build("densenet121", "tiny", tmp_path, ("torchscript",))
    rec = check.check(built, "torchscript", ("unfused", "fused"), rows=4, fused_rows=1)
    assert rec["plan"]["torch_parts"] == {"batchnorm": 1} and rec["plan"]["torch"] == 1
    assert rec["plan"]["views"] == 1 + 8  # the flatten and the 8 concats
    for mode, m in rec["modes"].items():
        assert m["ok"], (mode, m)
