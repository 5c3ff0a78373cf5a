"""Linear layers: linear, addmm, mm / matmul by a constant weight -> linear on (rows, features); on a channels-last
view of an image (ConvNeXt's pointwise MLP, nn.Linear after permute(0, 2, 3, 1)) -> a 1x1 conv2d, whose output is
again a channels-last view. A product of two tensors computed from the input (attention) is refused."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .registry import CHANNELS_LAST, Args, register

if TYPE_CHECKING:
    from torch import fx

    from ..torch_import import Exporter

LINEAR = (
    "fusedserve maps linear, mm, matmul and addmm by a constant 2-D weight, on (N, features) or on a channels-last "
    "view of an image (permute(0, 2, 3, 1): a 1x1 conv)"
)


def linear_layer(ex: Exporter, node: fx.Node, x, w: np.ndarray, b: np.ndarray | None) -> None:
    """`node` is x @ w.T + b: w (out, in), b broadcasting to (out,) or None."""
    v = ex.view(node, x)
    if w.ndim != 2:
        ex.refuse(node, f"a weight of shape {w.shape}", LINEAR)
    bias = None if b is None else np.broadcast_to(b, (w.shape[0],))
    if v.kind == CHANNELS_LAST:
        c, h, width = ex.shape(v.tensor)
        if w.shape[1] != c:
            ex.refuse(node, f"a weight of shape {w.shape} on {c} channels", LINEAR)
        weights = {"weight": w[:, :, None, None], "bias": bias}
        ex.emit(node, "conv2d", [v.tensor], weights=weights, shape=(w.shape[0], h, width), kind=CHANNELS_LAST)
        return
    t = ex.data(node, x, LINEAR)
    shape = ex.shape(t)
    if len(shape) != 1:
        ex.refuse(node, f"multiplies the last dim of per-row shape {shape}", LINEAR + "; flatten an image first, "
                  "or permute its channels last")  # fmt: skip
    ex.emit(node, "linear", [t], weights={"weight": w, "bias": bias})


@register("linear")
def linear(ex: Exporter, node: fx.Node, a: Args) -> None:
    w = ex.const(node, a["weight"], "weight")
    linear_layer(ex, node, a["input"], w, ex.const(node, a.get("bias"), "bias", optional=True))


@register("addmm")
def addmm(ex: Exporter, node: fx.Node, a: Args) -> None:  # beta * bias + alpha * (x @ w_t)
    beta, alpha = float(a.get("beta", 1)), float(a.get("alpha", 1))
    w = ex.const(node, a["mat2"], "weight").T * alpha
    linear_layer(ex, node, a["mat1"], w, ex.const(node, a["self"], "bias") * beta)


@register("mm", "matmul", "bmm")
def matmul(ex: Exporter, node: fx.Node, a: Args) -> None:
    x, w = node.args[0], node.args[1]
    if not ex.is_const(w):
        what = "two tensors computed from the input" if not ex.is_const(x) else "a constant by the input"
        ex.refuse(node, f"multiplies {what} (attention's q @ k.T or scores @ v)", LINEAR)
    w = ex.const(node, w, "weight")
    if w.ndim != 2:
        ex.refuse(node, f"a weight of shape {w.shape}", LINEAR)
    linear_layer(ex, node, x, w.T, None)
