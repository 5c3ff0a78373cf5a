"""Nodes that make no op of their own: Identity, Dropout (inference), a Cast of data to a float type (the graph
computes in the model's dtype), and Pad (constant mode): a pending pad, taken into the padding of a conv or pool
after it where it can be, else a `pad` op (importer.py's views)."""

from __future__ import annotations

from .importer import CHANNELS_LAST, FLOAT_TYPES, PAD, Importer, Node, Value, View
from .registry import Refuse, handles

FAMILY = "identities and padding"


@handles("Identity", "Dropout", family=FAMILY)
def identity(im: Importer, node: Node) -> None:
    if node.op_type == "Dropout":
        im.unused_extra_outputs(node)
        training = im.consts.get(node.input(2)) if node.input(2) else None
        if training is not None and bool(training.reshape(-1)[0]):
            raise Refuse("training_mode is true; fusedserve runs inference")
        if node.input(2) and training is None:
            raise Refuse("its training_mode is computed from the input; fusedserve needs it known (false)")
    im.alias(node.out, im.raw(node, 0))


@handles("Cast", family=FAMILY)
def cast(im: Importer, node: Node) -> None:
    to = node.attr("to")
    if to not in FLOAT_TYPES:
        raise Refuse(
            f"casts {im.describe(node.input(0))} to element type {to}; fusedserve computes in floating point "
            "and takes a Cast of data only to a float type"
        )
    im.alias(node.out, im.raw(node, 0))


@handles("Pad", family=FAMILY)
def pad(im: Importer, node: Node) -> None:
    mode = node.attr("mode", "constant")
    if mode != "constant":
        raise Refuse(f"mode {mode!r}: fusedserve pads with a constant (mode 'constant')")
    v = im.raw(node, 0)
    if v.view is not None and v.view.kind == PAD:
        v = im.make_pad(v)
    if v.view is not None and v.view.kind == CHANNELS_LAST:
        raise Refuse(
            f"pads {im.describe(node.input(0))}, a channels-last view; fusedserve pads channel-first "
            "images (N, C, H, W)"
        )
    if v.view is not None:
        v = im.value(node, 0)
    shape = im.onnx_shape(v)
    rank = len(shape) + 1
    pads = im.ints(node, 1, "pads")
    value = im.const(node, 2, "constant_value", optional=True)
    value = 0.0 if value is None else float(value.reshape(-1)[0])
    axes = [a % rank for a in im.ints(node, 3, "axes")] if node.input(3) else list(range(rank))
    if len(pads) != 2 * len(axes):
        raise Refuse(f"pads {pads} for axes {axes}: expected two per axis")
    begin, end = [0] * rank, [0] * rank
    for k, a in enumerate(axes):
        begin[a], end[a] = pads[k], pads[k + len(axes)]
    if any(p < 0 for p in begin + end):
        raise Refuse(f"pads {pads}: negative padding (cropping) is not supported")
    if rank != 4 or begin[:2] != [0, 0] or end[:2] != [0, 0]:
        raise Refuse(
            f"pads {pads} of {im.describe(node.input(0))}: fusedserve pads the height and width of an image "
            "(N, C, H, W)"
        )
    top, left, bottom, right = begin[2], begin[3], end[2], end[3]
    if not (top or left or bottom or right):
        im.alias(node.out, v)
        return
    c, h, w = shape
    view = View(PAD, (c, h + top + bottom, w + left + right), pads=(top, left, bottom, right), value=value, node=node)
    im.alias(node.out, Value(v.tensor, view))
