"""Add, Sub, Mul, Div with numpy's broadcasting: of two tensors (a residual add; a squeeze-and-excitation block's
scale of an image (N, C, H, W) by its gate (N, C, 1, 1)), or of a tensor and a constant (a layer scale; `reverse`
for c - x and c / x). A constant added to a Conv's or Gemm/MatMul's output, which only that Add reads, becomes the
layer's bias. On channels-last views (two of them, or one and a constant moved to (C, 1, 1)) they run on the
channel-first tensors."""

from __future__ import annotations

import numpy as np

from .importer import Importer, Node, Value, broadcast, channels_last_view
from .registry import Refuse, handles

FAMILY = "elementwise (broadcasting)"
VERBS = {"add": ("adds", "to"), "sub": ("subtracts", "from"), "mul": ("multiplies", "by"), "div": ("divides", "by")}


@handles("Add", "Sub", "Mul", "Div", family=FAMILY)
def elementwise(im: Importer, node: Node) -> None:
    kind = node.op_type.lower()
    a, b = node.input(0), node.input(1)
    if not im.is_const(a) and not im.is_const(b):
        _two_tensors(im, node, kind)
        return
    k = 1 if im.is_const(a) else 0  # the data input
    v = im.value(node, k)
    c = im.const(node, 1 - k, "constant")
    if kind == "add" and _fold_bias(im, node, node.input(k), v, c):
        return
    per = im.per_row_constant(node, c, v)
    name = im.op_name(node)
    fields = {"constant": im.weight(name, "constant", per)}
    if k == 1 and kind in ("sub", "div"):
        fields["reverse"] = True
    im.emit(node, kind, [v.tensor], im.shape(v.tensor), view=v.view, name=name, **fields)


def _two_tensors(im: Importer, node: Node, kind: str) -> None:
    va, vb = im.value(node, 0), im.value(node, 1)
    verb, joint = VERBS[kind]
    a, b = node.input(0), node.input(1)
    if va.channels_last != vb.channels_last:
        raise Refuse(
            f"{verb} {im.describe(a)} {joint} {im.describe(b)}: one is a channels-last transpose and the "
            "other is not; fusedserve takes two tensors of one layout"
        )
    sa, sb = im.shape(va.tensor), im.shape(vb.tensor)
    out = broadcast(sa, sb)
    if out is None or out not in (sa, sb):
        raise Refuse(
            f"{verb} {im.describe(a)} {joint} {im.describe(b)}: fusedserve takes tensors of one shape, or "
            "shapes of which one broadcasts to the other (numpy's rules, the batch apart)"
        )
    view = channels_last_view(out) if va.channels_last else None
    im.emit(node, kind, [va.tensor, vb.tensor], out, view=view)


def _fold_bias(im: Importer, node: Node, x: str, v: Value, c: np.ndarray) -> bool:
    """A constant added per output channel to a Conv's or linear's output that only this Add reads: into its bias.
    True if folded."""
    if v.view is not None and not v.channels_last:
        return False
    op = im.g.producer.get(v.tensor)
    if op is None or op["op"] not in ("conv2d", "linear") or v.tensor != x or im.sole_reader(x) != node.index:
        return False  # also a tensor reached through an Identity, which other nodes may read as it is
    shape = im.shape(v.tensor)
    per = im.per_row_constant(node, c, v, "addend")
    if per.size == 1:
        add = np.full(shape[0], float(per))
    elif per.shape == (shape[0],) + (1,) * (len(shape) - 1):
        add = per.reshape(-1)
    else:
        return False
    if "bias" in op:
        add = add + im.g.tensors[op["bias"]].double().numpy()
    op["bias"] = im.weight(op["name"], "bias", add)
    im.alias(node.out, v)
    return True
