"""BatchNormalization (inference) -> batchnorm, which the fused plan folds into the conv or linear before it and which
runs standalone anywhere else (DenseNet's BN after a concat or a pool); LayerNormalization over the channels ->
layernorm: over the last axis of a channels-last view (ConvNeXt's blocks and its LayerNorm2d), or of (N, features);
and LayerNorm as the TorchScript exporter writes it before opset 17: ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt,
Div (then Mul by the weight, Add of the bias)."""

from __future__ import annotations

import numpy as np

from .importer import Importer, Node, Value, shape_text
from .registry import Match, Refuse, handles, pattern

FAMILY = "normalization"


@handles("BatchNormalization", family=FAMILY)
def batchnorm(im: Importer, node: Node) -> None:
    if node.attr("training_mode", 0):
        raise Refuse("training_mode is 1; fusedserve imports inference batch norm")
    im.unused_extra_outputs(node)
    x = im.data(node, 0)
    channels = im.shape(x)[0]
    name = im.op_name(node)
    fields = {}
    for k, role in enumerate(("weight", "bias", "mean", "var"), start=1):
        t = im.const(node, k, role)
        if t.size != channels:
            raise Refuse(
                f"its {role} has shape {tuple(t.shape)}; expected ({channels},) for {im.describe(node.input(0))}"
            )
        fields[role] = im.weight(name, role, t.reshape(-1))
    im.emit(node, "batchnorm", [x], im.shape(x), name=name, eps=float(node.attr("epsilon", 1e-5)), **fields)


def channel_axes(im: Importer, v: Value, axes: list[int], what: str) -> None:
    """Refuse unless `axes` (of v as ONNX sees it) are its channels, with at most size-1 axes besides."""
    shape = im.onnx_shape(v)
    rank = len(shape) + 1
    channel = 3 if v.channels_last else 1
    axes = sorted(a % rank for a in axes)
    if channel not in axes or 0 in axes or any(shape[a - 1] != 1 for a in axes if a != channel):
        where = "the last axis of a channels-last (N, H, W, C) view or of (N, features), or axis 1 of (N, C, H, W)"
        raise Refuse(f"{what} over axes {axes} of {shape_of(im, v)}; fusedserve normalizes over the channels: {where}")


def shape_of(im: Importer, v: Value) -> str:
    return shape_text(im.onnx_shape(v)) + (" (channels-last)" if v.channels_last else "")


def emit_layernorm(im: Importer, node: Node, v: Value, weight, bias, eps: float) -> None:
    """layernorm of v's tensor at `node`, with `weight` and `bias` constants in v's layout (None: 1 and 0)."""
    channels = im.shape(v.tensor)[0]
    name = im.op_name(node)
    w = np.ones(channels) if weight is None else im.channel_vector(node, weight, v, "weight (scale)")
    fields = {"weight": im.weight(name, "weight", w), "eps": eps}
    if bias is not None:
        fields["bias"] = im.weight(name, "bias", im.channel_vector(node, bias, v, "bias"))
    im.emit(node, "layernorm", [v.tensor], im.shape(v.tensor), view=v.view, name=name, **fields)


@handles("LayerNormalization", family=FAMILY)
def layernorm(im: Importer, node: Node) -> None:
    im.unused_extra_outputs(node)
    v = im.value(node, 0)
    rank = len(im.onnx_shape(v)) + 1
    axis = node.attr("axis", -1) % rank
    channel_axes(im, v, list(range(axis, rank)), "normalizes")
    weight = im.const(node, 1, "scale")
    bias = im.const(node, 2, "bias", optional=True)
    emit_layernorm(im, node, v, weight, bias, float(node.attr("epsilon", 1e-5)))


@pattern(
    "layernorm",
    "ReduceMean",
    parts=("Pow", "Sqrt"),
    describe="LayerNorm's decomposed form (x - mean(x)) / sqrt(mean((x - mean(x))^2) + eps) [* weight + bias] over "
    "the channels -> layernorm",
)
def decomposed_layernorm(im: Importer, node: Node) -> Match | None:
    x, mean = node.input(0), node.out
    sub = im.only_reader(mean, "Sub")
    if sub is None or sub.inputs != [x, mean] or node.attr("keepdims", 1) != 1:
        return None
    d = sub.out
    readers = im.readers_of(d)
    if len(readers) != 2 or -1 in im.readers.get(d, []):
        return None
    square = next((n for n in readers if n.op_type in ("Pow", "Mul")), None)
    div = next((n for n in readers if n.op_type == "Div"), None)
    if square is None or div is None or div.input(0) != d:
        return None
    if not (square.inputs == [d, d] or (square.op_type == "Pow" and im.is_scalar(square.input(1), 2.0))):
        return None
    var = im.only_reader(square.out, "ReduceMean")
    if var is None or var.attr("keepdims", 1) != 1:
        return None
    try:
        axes, var_axes = im.axes(node), im.axes(var)
    except Refuse:
        return None
    if not axes or axes != var_axes:
        return None
    add = im.only_reader(var.out, "Add")
    if add is None:
        return None
    eps_name = next((t for t in add.inputs if t != var.out), "")
    eps = im.scalar(eps_name)
    sqrt = im.only_reader(add.out, "Sqrt")
    if eps is None or sqrt is None or div.input(1) != sqrt.out or im.sole_reader(sqrt.out) != div.index:
        return None
    nodes = {node.index, sub.index, square.index, var.index, add.index, sqrt.index, div.index}
    last, weight, bias = div, None, None
    mul = im.only_reader(div.out, "Mul")
    if mul is not None and any(im.is_const(t) for t in mul.inputs):
        weight = next(t for t in mul.inputs if im.is_const(t))
        last = mul
        nodes.add(mul.index)
    plus = im.only_reader(last.out, "Add")
    if plus is not None and any(im.is_const(t) for t in plus.inputs):
        bias = next(t for t in plus.inputs if im.is_const(t))
        last = plus
        nodes.add(plus.index)

    def emit() -> None:
        v = im.value(last, x)
        channel_axes(im, v, axes, "a decomposed LayerNorm normalizes")
        consts = [None if t is None else im.consts[t].astype(np.float64) for t in (weight, bias)]
        emit_layernorm(im, last, v, consts[0], consts[1], eps)

    return Match("layernorm", last.index, nodes, (x,), emit)
