"""Elementwise arithmetic: add, sub, rsub, mul, div, reciprocal, neg -> the format's add / sub / mul / div, of two
tensors (with numpy's broadcasting: an SE block's `x * scale` by an (N, C, 1, 1) gate) or of a tensor and a constant
(a parameter, buffer or number: a layer scale `gamma * x`), stored per row (a leading batch 1 stripped; on a
channels-last view, moved channel first: a (C,) parameter becomes (C, 1, 1)); `reverse` for c - x and c / x. An add
of a per-channel constant to a conv's or linear's output (read by the add alone) becomes that layer's bias."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .registry import CHANNELS_LAST, PLAIN, Args, View, register

if TYPE_CHECKING:
    from torch import fx

    from ..torch_import import Exporter

ELEMENTWISE = (
    "fusedserve maps add, sub, mul and div of two tensors of one layout whose shapes broadcast to one of them, or "
    "of a tensor and a constant that broadcasts to the tensor's shape (per row: the batch is never broadcast)"
)


def _tensor(ex: Exporter, node: fx.Node, x) -> View:
    v = ex.view(node, x)
    if v.kind not in (PLAIN, CHANNELS_LAST):
        ex.data(node, x, ELEMENTWISE)  # refuses, naming the view
    return v


def per_row(ex: Exporter, node: fx.Node, c: np.ndarray, x, v: View) -> np.ndarray:
    """The constant `c` (torch's shape, broadcasting against x's) as the format stores it: per row, channel first."""
    row = ex.row_shape(x)
    if c.ndim > len(row):
        if c.ndim > len(row) + 1 or c.shape[0] != 1:
            ex.refuse(node, f"a constant of shape {c.shape} against per-row shape {row}", ELEMENTWISE)
        c = c[0]
    if v.kind == CHANNELS_LAST and c.ndim:  # torch's (H, W, C) -> the graph's (C, H, W)
        c = c.reshape((1,) * (3 - c.ndim) + c.shape).transpose(2, 0, 1)
    shape = ex.shape(v.tensor)
    try:
        grown = np.broadcast_shapes(shape, c.shape) != shape
    except ValueError:
        grown = True
    if grown:
        ex.refuse(node, f"a constant of shape {c.shape} (per row, channel first) grows per-row shape {shape}",
                  ELEMENTWISE)  # fmt: skip
    return c


def binary(ex: Exporter, node: fx.Node, op: str, a, b, alpha=1) -> None:
    """`node` is a (op) b, alpha scaling b (add, sub)."""
    if not ex.is_const(a) and not ex.is_const(b):
        va, vb = _tensor(ex, node, a), _tensor(ex, node, b)
        if alpha != 1:
            ex.refuse(node, f"{op} with alpha {alpha} of two tensors", ELEMENTWISE)
        if va.kind != vb.kind:
            ex.refuse(node, f"{op} of a channel-first tensor and a channels-last view", ELEMENTWISE)
        sa, sb = ex.shape(va.tensor), ex.shape(vb.tensor)
        try:
            out = np.broadcast_shapes(sa, sb)
        except ValueError:
            out = None
        if out not in (sa, sb) or len(sa) != len(sb):
            ex.refuse(node, f"{op} of per-row shapes {sa} and {sb} (channel first)", ELEMENTWISE)
        ex.emit(node, op, [va.tensor, vb.tensor], shape=out, kind=va.kind)
        return
    reverse = ex.is_const(a)
    x, c_arg = (b, a) if reverse else (a, b)
    v = _tensor(ex, node, x)
    c = ex.const(node, c_arg, "constant")
    if reverse and alpha != 1:  # c + alpha * x, c - alpha * x
        ex.refuse(node, f"{op} with alpha {alpha} scaling the tensor", ELEMENTWISE)
    c = per_row(ex, node, c * alpha, x, v)
    if op in ("add", "mul"):
        reverse = False  # commutes
    if op == "add" and not reverse and _into_bias(ex, node, x, v, c):
        return
    ex.emit(node, op, [v.tensor], weights={"constant": c}, shape=ex.shape(v.tensor), kind=v.kind,
            **({"reverse": True} if reverse else {}))  # fmt: skip


def _into_bias(ex: Exporter, node: fx.Node, x, v: View, c: np.ndarray) -> bool:
    """Add a per-channel constant to the bias of the conv or linear that writes x, where this add alone reads it."""
    producer = ex.g.producer.get(v.tensor)
    if producer is None or producer["op"] not in ("linear", "conv2d") or v.tensor != x.name or len(x.users) != 1:
        return False
    shape = ex.shape(v.tensor)
    channels = shape[0]
    per_channel = c.size == 1 or (c.ndim == len(shape) and c.shape[0] == channels and c.size == channels)
    if not per_channel:
        return False
    add = np.broadcast_to(c.reshape(-1), (channels,)).astype(np.float64)
    if "bias" in producer:
        add = add + ex.g.tensors[producer["bias"]].double().numpy()
    producer["bias"] = ex.g.weight(producer["name"], "bias", add)
    ex.same(node, v)
    return True


@register("add", "sub", "mul", "div")
def arithmetic(ex: Exporter, node: fx.Node, a: Args) -> None:
    op = node.target._opname.rstrip("_")  # add_ (in place) as add
    if a.get("rounding_mode") is not None:
        ex.refuse(node, f"division rounding {a['rounding_mode']!r}", ELEMENTWISE + "; true division only")
    binary(ex, node, op, a["self"], a["other"], a.get("alpha", 1))


@register("rsub")
def rsub(ex: Exporter, node: fx.Node, a: Args) -> None:  # other - alpha * self
    if a.get("alpha", 1) != 1:
        ex.refuse(node, f"rsub with alpha {a['alpha']}", ELEMENTWISE)
    binary(ex, node, "sub", a["other"], a["self"])


@register("reciprocal")
def reciprocal(ex: Exporter, node: fx.Node, a: Args) -> None:
    binary(ex, node, "div", 1.0, a["self"])


@register("neg")
def neg(ex: Exporter, node: fx.Node, a: Args) -> None:
    binary(ex, node, "mul", a["self"], -1.0)
