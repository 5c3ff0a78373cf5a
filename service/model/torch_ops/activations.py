"""Activations, elementwise on an image, a vector or a channels-last view (whose output is again one): relu, relu6,
sigmoid, tanh, silu, hardswish, hardsigmoid, gelu, leaky_relu as the format's ops of those names; hardtanh and clamp
as relu6 or relu where their bounds are (0, 6) or (0, inf), else clip; softmax over the output's features."""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

from .registry import CHANNELS_LAST, PLAIN, Args, register

if TYPE_CHECKING:
    from torch import fx

    from ..torch_import import Exporter

ACTIVATIONS = "fusedserve applies activations to images, vectors and channels-last views"
SIMPLE = ("relu", "relu6", "sigmoid", "tanh", "silu", "hardswish", "hardsigmoid")


def activation(ex: Exporter, node: fx.Node, x, op: str, **fields) -> None:
    """`node` is activation `op` of x, in x's layout."""
    v = ex.view(node, x)
    if v.kind not in (PLAIN, CHANNELS_LAST):
        ex.data(node, x, ACTIVATIONS)  # refuses, naming the view
    ex.emit(node, op, [v.tensor], shape=ex.shape(v.tensor), kind=v.kind, **fields)


def _simple(ex: Exporter, node: fx.Node, a: Args, *, op: str) -> None:
    activation(ex, node, a["self"], op)


for _op in SIMPLE:
    register(_op)(functools.partial(_simple, op=_op))


@register("leaky_relu")
def leaky_relu(ex: Exporter, node: fx.Node, a: Args) -> None:
    activation(ex, node, a["self"], "leaky_relu", negative_slope=float(a.get("negative_slope", 0.01)))


@register("gelu")
def gelu(ex: Exporter, node: fx.Node, a: Args) -> None:
    activation(ex, node, a["self"], "gelu", approximate=a.get("approximate", "none"))


def bounded(ex: Exporter, node: fx.Node, x, lo, hi) -> None:
    """min(max(x, lo), hi), either bound None: relu6 for (0, 6), relu for (0, None), else clip."""
    for bound in (lo, hi):
        if bound is not None and not (isinstance(bound, (int, float)) and not isinstance(bound, bool)):
            ex.refuse(node, f"a bound {ex.describe(bound)} that is a tensor", "fusedserve clamps between numbers")
    lo = None if lo is None or lo == -math.inf else float(lo)
    hi = None if hi is None or hi == math.inf else float(hi)
    if (lo, hi) == (0.0, 6.0):
        activation(ex, node, x, "relu6")
    elif (lo, hi) == (0.0, None):
        activation(ex, node, x, "relu")
    else:
        activation(ex, node, x, "clip", min=lo, max=hi)


@register("hardtanh")
def hardtanh(ex: Exporter, node: fx.Node, a: Args) -> None:
    bounded(ex, node, a["self"], a.get("min_val", -1.0), a.get("max_val", 1.0))


@register("clamp", "clip")
def clamp(ex: Exporter, node: fx.Node, a: Args) -> None:
    bounded(ex, node, a["self"], a.get("min"), a.get("max"))


@register("clamp_min")
def clamp_min(ex: Exporter, node: fx.Node, a: Args) -> None:
    bounded(ex, node, a["self"], a["min"], None)


@register("clamp_max")
def clamp_max(ex: Exporter, node: fx.Node, a: Args) -> None:
    bounded(ex, node, a["self"], None, a["max"])


@register("softmax", "_softmax")
def softmax(ex: Exporter, node: fx.Node, a: Args) -> None:
    accepts = "fusedserve takes softmax over the features of the module's output (its last op)"
    x = ex.data(node, a["self"], accepts)
    dim = int(a["dim"])
    if len(ex.shape(x)) != 1 or dim not in (1, -1):
        ex.refuse(node, f"softmax over dim {dim} of per-row shape {ex.shape(x)}", accepts)
    if any(u.op != "output" for u in node.users):
        ex.refuse(node, f"softmax read by {', '.join(repr(u.name) for u in node.users if u.op != 'output')}", accepts)
    ex.emit(node, "softmax", [x])
