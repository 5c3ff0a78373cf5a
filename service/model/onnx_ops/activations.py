"""Activations, one tensor in, one out, elementwise: they commute with the layout, so on a channels-last view they run
on the channel-first tensor and give a view again. And the patterns of several nodes that are one activation:
SiLU (x * Sigmoid(x)), hard swish (x * HardSigmoid(x)) and GELU's erf form."""

from __future__ import annotations

import math

from .importer import Importer, Node
from .registry import Match, Refuse, handles, pattern

FAMILY = "activations"
SIMPLE = {"Relu": "relu", "Sigmoid": "sigmoid", "Tanh": "tanh", "HardSwish": "hardswish"}
TORCH_HARDSIGMOID = (1 / 6, 0.5)  # nn.Hardsigmoid's alpha and beta (ONNX's defaults are 0.2 and 0.5)


def unary(im: Importer, node: Node, kind: str, x: str | None = None, **fields) -> None:
    """An op of one tensor that keeps its shape, at `node`, reading x (default: the node's first input)."""
    v = im.value(node, x if x is not None else 0)
    im.emit(node, kind, [v.tensor], im.shape(v.tensor), view=v.view, **fields)


@handles("Relu", "Sigmoid", "Tanh", "HardSwish", family=FAMILY)
def simple(im: Importer, node: Node) -> None:
    unary(im, node, SIMPLE[node.op_type])


@handles("LeakyRelu", family=FAMILY)
def leaky_relu(im: Importer, node: Node) -> None:
    unary(im, node, "leaky_relu", negative_slope=float(node.attr("alpha", 0.01)))


@handles("HardSigmoid", family=FAMILY)
def hardsigmoid(im: Importer, node: Node) -> None:
    unary(im, node, "hardsigmoid", alpha=float(node.attr("alpha", 0.2)), beta=float(node.attr("beta", 0.5)))


@handles("Gelu", family=FAMILY)
def gelu(im: Importer, node: Node) -> None:
    approximate = node.attr("approximate", "none")
    if approximate not in ("none", "tanh"):
        raise Refuse(f"approximate {approximate!r}: fusedserve runs 'none' and 'tanh'")
    unary(im, node, "gelu", approximate=approximate)


@handles("Clip", family=FAMILY)
def clip(im: Importer, node: Node) -> None:
    """Clip(0, 6) is relu6 and Clip(0) relu (the kernels' activations, fused into the op before); other bounds
    are `clip`."""
    bounds = []
    for k, role in ((1, "min"), (2, "max")):
        c = im.const(node, k, role, optional=True)
        if c is not None and c.size != 1:
            raise Refuse(f"its {role} has shape {tuple(c.shape)}; fusedserve clips by one value")
        bounds.append(None if c is None else float(c.reshape(-1)[0]))
    lo, hi = bounds
    if lo == 0 and hi == 6:
        unary(im, node, "relu6")
    elif lo == 0 and hi is None:
        unary(im, node, "relu")
    elif lo is None and hi is None:
        im.alias(node.out, im.raw(node, 0))
    else:
        unary(im, node, "clip", min=lo, max=hi)


@handles("Softmax", family=FAMILY)
def softmax(im: Importer, node: Node) -> None:
    v = im.value(node, 0)
    shape = im.onnx_shape(v)
    axis = node.attr("axis", -1)
    if v.view is not None or len(shape) != 1 or axis not in (1, -1):
        raise Refuse(
            f"axis {axis} of {im.describe(node.inputs[0])}: fusedserve runs softmax only over the features "
            "of the model's output (N, features), as its last node"
        )
    if node.out != im.output:
        raise Refuse(
            "softmax is supported only as the node that gives the model's output (an attention softmax "
            "inside the network is not)"
        )
    im.emit(node, "softmax", [v.tensor], shape)


# ---- patterns ----


def _gated(im: Importer, node: Node, kind: str) -> Match | None:
    """x * gate(x), the gate being `node`: its output read only by a Mul of it and its own input."""
    x, s = node.inputs[0], node.out
    mul = im.only_reader(s, "Mul")
    if mul is None or sorted(mul.inputs) != sorted([x, s]):
        return None
    return Match(kind, mul.index, {node.index, mul.index}, (x,), lambda: unary(im, mul, kind, x))


@pattern("silu", "Sigmoid", describe="x * Sigmoid(x) -> silu")
def silu(im: Importer, node: Node) -> Match | None:
    return _gated(im, node, "silu")


@pattern("hardswish", "HardSigmoid", describe="x * HardSigmoid(x) with torch's alpha 1/6 and beta 1/2 -> hardswish")
def hardswish(im: Importer, node: Node) -> Match | None:
    alpha, beta = float(node.attr("alpha", 0.2)), float(node.attr("beta", 0.5))
    if not (math.isclose(alpha, TORCH_HARDSIGMOID[0], rel_tol=1e-4) and beta == TORCH_HARDSIGMOID[1]):
        return None
    return _gated(im, node, "hardswish")


@pattern("gelu", "Erf", parts=("Erf",), describe="GELU's erf form x * 0.5 * (1 + Erf(x / sqrt(2))) -> gelu")
def gelu_erf(im: Importer, node: Node) -> Match | None:
    """x * 0.5 * (1 + erf(x / sqrt 2)) in the orders exporters write it."""
    d = node.inputs[0]
    pd = im.producer_index(d)
    if pd is None or pd not in im.data_nodes or im.sole_reader(d) != node.index:
        return None
    scale = im.node(pd)
    if scale.op_type == "Div" and im.is_scalar(scale.input(1), math.sqrt(2)):
        x = scale.inputs[0]
    elif scale.op_type == "Mul" and any(im.is_scalar(t, 1 / math.sqrt(2)) for t in scale.inputs):
        x = next(t for t in scale.inputs if not im.is_scalar(t, 1 / math.sqrt(2)))
    else:
        return None
    add = im.only_reader(node.out, "Add")
    if add is None or not any(im.is_scalar(t, 1.0) for t in add.inputs):
        return None
    a = add.out
    m1 = im.only_reader(a, "Mul")
    if m1 is None:
        return None
    other = next((t for t in m1.inputs if t != a), None)
    parts = {pd, node.index, add.index, m1.index}
    if other == x or im.is_scalar(other, 0.5):  # (x * a) * 0.5, or x * (a * 0.5)
        m2 = im.only_reader(m1.out, "Mul")
        if m2 is None:
            return None
        rest = [t for t in m2.inputs if t != m1.out]
        if len(rest) != 1 or not (im.is_scalar(rest[0], 0.5) if other == x else rest[0] == x):
            return None
        last = m2
    else:  # (x * 0.5) * a
        h = im.producer_index(other)
        if h is None or h not in im.data_nodes or im.sole_reader(other) != m1.index:
            return None
        half = im.node(h)
        if (
            half.op_type != "Mul"
            or x not in half.inputs
            or not any(im.is_scalar(t, 0.5) for t in half.inputs if t != x)
        ):
            return None
        last, parts = m1, parts | {h}
    return Match("gelu", last.index, parts | {last.index}, (x,), lambda: unary(im, last, "gelu", x, approximate="none"))
