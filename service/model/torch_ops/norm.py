"""Normalisations in inference: batch_norm -> batchnorm (the fused plan folds it into the conv or linear before it);
layer_norm over the channels -> layernorm: over the last dim of a channels-last view (ConvNeXt's LayerNorm, and
LayerNorm2d's permute-layer_norm-permute) or over a vector's features."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .registry import CHANNELS_LAST, PLAIN, RESULT, Args, register

if TYPE_CHECKING:
    from torch import fx

    from ..torch_import import Exporter

BATCH_NORM = "fusedserve maps batch norm in inference (eval mode, running statistics) over dim 1"
LAYER_NORM = (
    "fusedserve normalises over channels: layer_norm over the last dim of a channels-last view (permute(0, 2, 3, 1) "
    "of an image, as ConvNeXt's LayerNorm2d), or over the features of (N, features)"
)


@register("batch_norm", "_native_batch_norm_legit_no_training", "_native_batch_norm_legit", "native_batch_norm")
def batch_norm(ex: Exporter, node: fx.Node, a: Args) -> None:
    if a.get("training"):
        ex.refuse(node, "batch norm in training mode", BATCH_NORM + ": call module.eval() before exporting")
    x = ex.data(node, a["input"], BATCH_NORM)
    channels = ex.shape(x)[0]
    stats = {}
    for role, key in (("mean", "running_mean"), ("var", "running_var")):
        if a.get(key) is None:
            ex.refuse(node, "batch norm without running statistics (track_running_stats=False)", BATCH_NORM)
        stats[role] = ex.const(node, a[key], f"running {role}")
    weight = ex.const(node, a.get("weight"), "weight", optional=True)
    bias = ex.const(node, a.get("bias"), "bias", optional=True)
    weights = {
        "weight": np.ones(channels) if weight is None else weight,
        "bias": np.zeros(channels) if bias is None else bias,
        **stats,
    }
    tuple_result = isinstance(node.meta["val"], (list, tuple))
    ex.emit(node, "batchnorm", [x], weights=weights, shape=ex.shape(x), kind=RESULT if tuple_result else PLAIN,
            eps=float(a.get("eps", 1e-5)))  # fmt: skip


@register("layer_norm", "native_layer_norm")
def layer_norm(ex: Exporter, node: fx.Node, a: Args) -> None:
    x = a["input"]
    v = ex.view(node, x)
    dims = [int(d) for d in a["normalized_shape"]]
    row = ex.row_shape(x)
    fits = dims == [row[-1]] and (v.kind == CHANNELS_LAST or (v.kind == PLAIN and len(row) == 1))
    if not fits:
        if v.kind not in (PLAIN, CHANNELS_LAST):
            ex.data(node, x, LAYER_NORM)
        layout = "channels-last view" if v.kind == CHANNELS_LAST else "tensor"
        ex.refuse(node, f"normalises the last {len(dims)} dim(s) {dims} of a {layout} of per-row shape {row}",
                  LAYER_NORM)  # fmt: skip
    channels = dims[0]
    weight = ex.const(node, a.get("weight"), "weight", optional=True)
    weights = {"weight": np.ones(channels) if weight is None else weight,
               "bias": ex.const(node, a.get("bias"), "bias", optional=True)}  # fmt: skip
    tuple_result = isinstance(node.meta["val"], (list, tuple))
    ex.emit(node, "layernorm", [v.tensor], weights=weights, shape=ex.shape(v.tensor),
            kind=RESULT if tuple_result else v.kind, item=v.kind, eps=float(a.get("eps", 1e-5)))  # fmt: skip
