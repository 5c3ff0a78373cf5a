"""The ONNX importer's handlers one by one, on graphs written node by node with onnx.helper (no exporter): the forms
exporters and hand-written graphs use that the torch blocks of test_import_onnx_blocks.py may not reach (Split by
sizes and by num_outputs, Slice with negative ends and over the batch, constants of every broadcastable shape and
reversed, ONNX's default hard sigmoid, each Clip form, Pad folding, LayerNorm decomposed over axis 1, reductions of
a channels-last view, Unsqueeze back to (C, 1, 1), the dynamo exporter's as_strided). Each is compared with
onnxruntime (unfused; fused where the form changes what the plan fuses) and checked for the ops it becomes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from service.model.loader import load_onnx
from service.model.planner import fused_steps, kernel_names

from .test_import_onnx import NORMWISE, _const, _graph_file, _refused, _vi, check_against_ort, run_fp32, run_ort

pytestmark = pytest.mark.timeout(300)
ROWS = 32
IMAGE = (4, 6, 6)


def _ints(name: str, values) -> onnx.TensorProto:
    return onnx.numpy_helper.from_array(np.asarray(values, dtype=np.int64), name)


def _file(path: Path, nodes, inits=(), *, out="y", features=None, opset=17, image=IMAGE) -> Path:
    """x (N, *image) -> `nodes` (ending in `out`, an image) -> global average pool, flatten -> 'y' (N, features).
    `out="y"`: the nodes end in y themselves."""
    tail = []
    if out != "y":
        tail = [helper.make_node("GlobalAveragePool", [out], ["gap"]), helper.make_node("Flatten", ["gap"], ["y"])]
    shape = ["N", features if features is not None else "F"]
    return _graph_file(path, [*nodes, *tail], [_vi("x", ["N", *image])], [_vi("y", shape)], inits, opset)


def _matches(path: Path, modes=("unfused",), rows: int = ROWS) -> object:
    """The imported model, after checking it against onnxruntime in `modes`."""
    model = load_onnx(path)
    x = np.random.default_rng(11).standard_normal((rows, *model.input_shape), dtype=np.float32)
    want = run_ort(path, x)
    for mode in modes:
        n = rows if mode == "unfused" else 3
        check_against_ort(run_fp32(model, mode, x[:n]), want[:n], NORMWISE, f"{path.name} ({mode})")
    return model


def _ops(model) -> list[str]:
    return [op.op for op in model.ops]


def _conv(name: str, x: str, out: str, cin: int, cout: int, k: int = 3, pads=(1, 1, 1, 1), seed: int = 0):
    w = _const(f"{name}.w", np.random.default_rng(seed).standard_normal((cout, cin, k, k)) * 0.3)
    b = _const(f"{name}.b", np.random.default_rng(seed + 1).standard_normal(cout) * 0.1)
    return helper.make_node("Conv", [x, w.name, b.name], [out], name=name, pads=list(pads)), [w, b]


# ---- Split and Slice ----


@pytest.mark.parametrize("form", ["sizes", "num_outputs", "equal"])
def test_split_of_channels_becomes_slices(tmp_path, form):
    """Split by a `split` input (opset 13), by num_outputs (opset 18: the last part smaller), or into equal parts;
    an output nobody reads makes no op."""
    conv, w = _conv("c0", "x", "c", 4, 5)
    if form == "sizes":
        split = helper.make_node("Split", ["c", "sizes"], ["a", "b", "unused"], axis=1)
        w.append(_ints("sizes", [1, 3, 1]))
        opset, parts = 13, [(0, 1), (1, 4)]
    elif form == "num_outputs":
        split = helper.make_node("Split", ["c"], ["a", "b"], axis=-3, num_outputs=2)
        opset, parts = 18, [(0, 3), (3, 5)]
    else:
        conv, w = _conv("c0", "x", "c", 4, 6)
        split = helper.make_node("Split", ["c"], ["a", "b"], axis=1)
        opset, parts = 17, [(0, 3), (3, 6)]
    mix = helper.make_node("Concat", ["b", "a"], ["m"], axis=1)
    model = _matches(_file(tmp_path / f"split-{form}.onnx", [conv, split, mix], w, out="m", opset=opset))
    assert [(op.start, op.end) for op in model.ops if op.op == "slice"] == parts


def test_slice_of_channels_with_negative_ends_and_the_whole_batch(tmp_path):
    conv, w = _conv("c0", "x", "c", 4, 6)
    # channels 1:-1 (1:5), and the batch 0:INT64_MAX
    s = helper.make_node("Slice", ["c", "starts", "ends", "axes"], ["s"], name="cut")
    w += [_ints("starts", [1, 0]), _ints("ends", [-1, 2**63 - 1]), _ints("axes", [1, 0])]
    model = _matches(_file(tmp_path / "slice.onnx", [conv, s], w, out="s"))
    assert [(op.start, op.end) for op in model.ops if op.op == "slice"] == [(1, 5)]
    w[-2:] = [_ints("ends", [-1, 4]), _ints("axes", [1, 2])]
    path = _file(tmp_path / "spatial.onnx", [conv, s], w, out="s")
    _refused(path, "node 'cut' (Slice): slices axis 2 of 'c' (N, 6, 6, 6) to 0:4; fusedserve slices only a run of "
             "channels (axis 1)")  # fmt: skip


# ---- elementwise ops with constants ----


def test_constants_of_every_broadcastable_shape_and_reversed(tmp_path):
    """c - x and c / x (reverse), a (1, C, 1, 1) scale (stored as (C, 1, 1)), a (W,) row added along the width, a
    scalar; a constant added right after a conv is its bias, one added after an Identity is an add op."""
    conv, w = _conv("c0", "x", "c", 4, 4)
    scale = np.arange(4).reshape(1, 4, 1, 1) + 0.5
    w += [_const("bias", np.arange(4.0).reshape(1, 4, 1, 1)), _const("two", 2.0), _const("scale", scale),
          _const("row", np.linspace(-1, 1, 6)), _const("one", 1.5)]  # fmt: skip
    nodes = [
        conv,
        helper.make_node("Add", ["c", "bias"], ["b"], name="into_bias"),
        helper.make_node("Identity", ["b"], ["i"]),
        helper.make_node("Add", ["i", "two"], ["p"], name="plus_two"),
        helper.make_node("Sub", ["one", "p"], ["r"], name="one_minus"),
        helper.make_node("Mul", ["r", "scale"], ["m"], name="scaled"),
        helper.make_node("Add", ["row", "m"], ["a"], name="rows"),
        helper.make_node("Sigmoid", ["a"], ["s"]),
        helper.make_node("Add", ["s", "one"], ["s1"], name="shift"),
        helper.make_node("Div", ["one", "s1"], ["d"], name="inverse"),
    ]
    model = _matches(_file(tmp_path / "constants.onnx", nodes, w, out="d"), ("unfused", "fused"))
    assert _ops(model) == ["conv2d", "add", "sub", "mul", "add", "sigmoid", "add", "div", "avgpool2d", "flatten"]
    by = {op.name: op for op in model.ops}
    shapes = {n: tuple(model.tensors[op.constant].shape) for n, op in by.items() if getattr(op, "constant", None)}
    assert shapes == {"plus_two": (), "one_minus": (), "scaled": (4, 1, 1), "rows": (6,), "shift": (), "inverse": ()}
    assert by["one_minus"].reverse and by["inverse"].reverse and not by["scaled"].reverse
    np.testing.assert_allclose(model.tensors[by["c0"].bias].numpy(), 0.0 + np.arange(4) + _bias_of(w), rtol=1e-6)


def _bias_of(inits) -> np.ndarray:
    return next(onnx.numpy_helper.to_array(t) for t in inits if t.name == "c0.b")


def test_a_constant_that_would_grow_the_tensor_is_refused(tmp_path):
    conv, w = _conv("c0", "x", "c", 4, 4)
    w.append(_const("big", np.ones((4, 6, 6, 2))))
    path = _file(tmp_path / "grow.onnx", [conv, helper.make_node("Mul", ["c", "big"], ["m"], name="grow")], w,
                 out="m")  # fmt: skip
    _refused(path, "node 'grow' (Mul): its constant of shape (4, 6, 6, 2) does not broadcast against its data input "
             "(N, 4, 6, 6) without growing it")  # fmt: skip


# ---- activations ----


def test_hardsigmoid_with_onnx_defaults_and_each_clip(tmp_path):
    """HardSigmoid without attributes is ONNX's alpha 0.2 (not torch's 1/6): a hardsigmoid op of its own slope,
    not the kernels' activation; Clip(0, 6) is relu6, Clip(0) relu, Clip(max=1) a clip, Clip() nothing."""
    conv, w = _conv("c0", "x", "c", 4, 4)
    w += [_const("zero", 0.0), _const("six", 6.0), _const("top", 1.0)]
    nodes = [
        conv,
        helper.make_node("Clip", ["c", "zero", "six"], ["r6"]),
        helper.make_node("HardSigmoid", ["r6"], ["h"], name="onnx_default"),
        helper.make_node("Clip", ["h", "", "top"], ["cl"], name="upper"),
        helper.make_node("Clip", ["cl"], ["same"]),
        helper.make_node("Clip", ["same", "zero"], ["relu"]),
    ]
    model = _matches(_file(tmp_path / "clips.onnx", nodes, w, out="relu"), ("unfused", "fused"))
    assert _ops(model) == ["conv2d", "relu6", "hardsigmoid", "clip", "relu", "avgpool2d", "flatten"]
    by = {op.name: op for op in model.ops}
    assert (by["onnx_default"].alpha, by["onnx_default"].beta) == (pytest.approx(0.2), 0.5)
    assert (by["upper"].min, by["upper"].max) == (None, 1.0)
    names = kernel_names(fused_steps(model.ops, model.tensors, shapes=model.shapes))
    assert names[0] == "conv2d_0_relu6" and "hardsigmoid_0" in names, names


# ---- Pad ----


def test_zero_pads_go_into_the_next_conv_or_average_pool(tmp_path):
    """A symmetric zero Pad before a conv is its padding; before an average pool without padding it is the pool's
    padding, counted (count_include_pad); a Pad by 0.25 stays a pad op."""
    conv, w = _conv("c0", "x", "c", 4, 4, pads=(0, 0, 0, 0))
    w += [_ints("p1", [0, 0, 1, 1, 0, 0, 1, 1]), _ints("p2", [0, 0, 1, 0, 0, 0, 1, 0]), _const("quarter", 0.25)]
    nodes = [
        helper.make_node("Pad", ["x", "p1"], ["xp"]),
        helper.make_node("Conv", ["xp", "c0.w", "c0.b"], ["c"], name="c0"),
        helper.make_node("Pad", ["c", "p2"], ["cp"]),
        helper.make_node("AveragePool", ["cp"], ["ap"], kernel_shape=[3, 3], strides=[1, 1]),
        helper.make_node("Pad", ["ap", "p1", "quarter"], ["q"], name="by_quarter"),
    ]
    model = _matches(_file(tmp_path / "pads.onnx", nodes, w, out="q"), ("unfused", "fused"))
    assert _ops(model) == ["conv2d", "avgpool2d", "pad", "avgpool2d", "flatten"]
    conv_op, pool, pad = model.ops[:3]
    assert conv_op.padding == (1, 1) and pool.padding == (1, 0) and pool.count_include_pad
    assert pad.pads == (1, 1, 1, 1) and pad.value == 0.25


def test_pads_that_cannot_be_served(tmp_path):
    w = [_ints("p", [0, 0, 1, 1, 0, 0, 1, 1]), _ints("pc", [0, 1, 0, 0, 0, 0, 0, 0])]
    path = _file(tmp_path / "reflect.onnx", [helper.make_node("Pad", ["x", "p"], ["r"], name="mirror", mode="reflect")],
                 w, out="r")  # fmt: skip
    _refused(path, "node 'mirror' (Pad): mode 'reflect': fusedserve pads with a constant (mode 'constant')")
    path = _file(tmp_path / "chan.onnx", [helper.make_node("Pad", ["x", "pc"], ["r"], name="more_channels")], w,
                 out="r")  # fmt: skip
    _refused(path, "node 'more_channels' (Pad): pads [0, 1, 0, 0, 0, 0, 0, 0] of 'x' (N, 4, 6, 6): fusedserve pads "
             "the height and width")  # fmt: skip


# ---- normalization ----


def test_layernorm_decomposed_over_the_channels_of_an_image(tmp_path):
    """A LayerNorm2d written by hand on (N, C, H, W): mean over axis 1, (x - u), its square's mean, + eps, sqrt,
    divide, * weight (C, 1, 1) + bias (C, 1, 1): one layernorm op. Opset 18 gives ReduceMean its axes as an input."""
    conv, w = _conv("c0", "x", "c", 4, 4)
    rng = np.random.default_rng(2)
    w += [_ints("axes", [1]), _const("two", 2.0), _const("eps", 1e-5),
          _const("g", rng.random((4, 1, 1)) + 0.5), _const("beta", rng.standard_normal((4, 1, 1)) * 0.1)]  # fmt: skip
    nodes = [
        conv,
        helper.make_node("ReduceMean", ["c", "axes"], ["u"]),
        helper.make_node("Sub", ["c", "u"], ["d"]),
        helper.make_node("Pow", ["d", "two"], ["d2"]),
        helper.make_node("ReduceMean", ["d2", "axes"], ["v"]),
        helper.make_node("Add", ["v", "eps"], ["ve"]),
        helper.make_node("Sqrt", ["ve"], ["sd"]),
        helper.make_node("Div", ["d", "sd"], ["n"]),
        helper.make_node("Mul", ["n", "g"], ["ng"]),
        helper.make_node("Add", ["ng", "beta"], ["ln"], name="ln"),
    ]
    model = _matches(_file(tmp_path / "ln.onnx", nodes, w, out="ln", opset=18))
    assert _ops(model) == ["conv2d", "layernorm", "avgpool2d", "flatten"]
    ln = model.ops[1]
    assert ln.eps == pytest.approx(1e-5) and tuple(model.tensors[ln.weight].shape) == (4,)
    # the same over the width (axis 3) is no layer norm over the channels: refused at the pattern's last node
    w[2] = _ints("axes", [3])
    _refused(_file(tmp_path / "ln-w.onnx", nodes, w, out="ln", opset=18),
             "normalizes over axes [3] of (N, 4, 6, 6); fusedserve normalizes over the channels")  # fmt: skip


# ---- shapes and layouts ----


def test_reductions_of_a_channels_last_view_and_unsqueeze_back(tmp_path):
    """ReduceMean over (H, W) of a channels-last view is the pool of the channel-first tensor; a (C,) vector
    unsqueezed back to (C, 1, 1) is the pooled tensor again (no op), and scales the image."""
    conv, w = _conv("c0", "x", "c", 4, 4)
    w += [_ints("hw", [1, 2]), _ints("two_three", [2, 3])]
    nodes = [
        conv,
        helper.make_node("Transpose", ["c"], ["t"], perm=[0, 2, 3, 1]),
        helper.make_node("ReduceMean", ["t", "hw"], ["m"], keepdims=0),  # (N, C)
        helper.make_node("Unsqueeze", ["m", "two_three"], ["g"]),  # (N, C, 1, 1)
        helper.make_node("Sigmoid", ["g"], ["gate"]),
        helper.make_node("Mul", ["c", "gate"], ["se"]),
    ]
    model = _matches(_file(tmp_path / "views.onnx", nodes, w, out="se", opset=18))
    # the flatten of the (N, C) mean is read by nothing once the Unsqueeze goes back to the pooled tensor: dropped
    assert _ops(model) == ["conv2d", "avgpool2d", "sigmoid", "mul", "avgpool2d", "flatten"]
    assert model.ops[2].inputs == (model.ops[1].output,)


def test_the_dynamo_exporters_as_strided(tmp_path):
    """Reshape (N, C, 1, 1) to [-1], then Gather with indices n * C + c computed from the batch size (Shape, Range,
    Mul, Unsqueeze, Add): each row back whole, no op. Indices that reorder a row are refused."""
    conv, w = _conv("c0", "x", "c", 4, 4)
    w += [_ints("hw", [2, 3]), _ints("flat", [-1]), _ints("zero", 0), _ints("one", 1), _ints("four", 4),
          _ints("axes", [1, 2, 3]), _ints("offsets", np.arange(4).reshape(1, 4, 1, 1))]  # fmt: skip
    nodes = [
        conv,
        helper.make_node("ReduceMean", ["c", "hw"], ["m"]),
        helper.make_node("Reshape", ["m", "flat"], ["f"]),
        helper.make_node("Shape", ["x"], ["shape"], start=0, end=1),
        helper.make_node("Squeeze", ["shape"], ["n"]),
        helper.make_node("Range", ["zero", "n", "one"], ["rows"]),
        helper.make_node("Mul", ["rows", "four"], ["starts"]),
        helper.make_node("Unsqueeze", ["starts", "axes"], ["s4"]),
        helper.make_node("Add", ["s4", "offsets"], ["idx"]),
        helper.make_node("Gather", ["f", "idx"], ["g"], name="as_strided", axis=0),
        helper.make_node("Flatten", ["g"], ["y"]),
    ]
    model = _matches(_file(tmp_path / "strided.onnx", nodes, w, features=4, opset=18))
    assert _ops(model) == ["conv2d", "avgpool2d", "flatten"]
    w[-1] = _ints("offsets", np.array([1, 0, 2, 3]).reshape(1, 4, 1, 1))
    _refused(_file(tmp_path / "reordered.onnx", nodes, w, features=4, opset=18),
             "node 'as_strided' (Gather): its indices ('idx', shape (2, 4, 1, 1) with a batch of 2) do not take each "
             "row of 4 values back whole and in order")  # fmt: skip


def test_casts_and_squeezes(tmp_path):
    """A Cast of data to float is no op; to an integer type it is refused. Squeeze of (N, C, 1, 1) is a flatten."""
    conv, w = _conv("c0", "x", "c", 4, 4)
    nodes = [
        conv,
        helper.make_node("Cast", ["c"], ["f"], to=TensorProto.FLOAT),
        helper.make_node("GlobalMaxPool", ["f"], ["p"]),
        helper.make_node("Squeeze", ["p"], ["y"]),
    ]
    model = _matches(_file(tmp_path / "squeeze.onnx", nodes, w, features=4))
    assert _ops(model) == ["conv2d", "maxpool2d", "flatten"]
    nodes[1] = helper.make_node("Cast", ["c"], ["f"], name="to_int", to=TensorProto.INT32)
    _refused(_file(tmp_path / "int.onnx", nodes, w, features=4), "node 'to_int' (Cast): casts 'c' (N, 4, 6, 6) to "
             "element type 6")  # fmt: skip
