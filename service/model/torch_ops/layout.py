"""Ops that move, cut, join or only name data: flatten / view / reshape / squeeze (to (rows, features): flatten), cat
(concat), split / chunk / slice / narrow of channels (slice), channel shuffles, permutes to and from channels-last
views, and the ops that are identities in inference (dropout, clone, contiguous, detach, alias, _to_copy)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .registry import CHANNELS_LAST, GROUPED, PARTS, PLAIN, RESULT, SELECTED, SHUFFLED, Args, View, register

if TYPE_CHECKING:
    from torch import fx

    from ..torch_import import Exporter

RESHAPES = (
    "fusedserve maps reshapes to (N, features) (a flatten), to the same shape, and a channel shuffle's "
    "view(N, groups, C / groups, H, W), transpose(1, 2), view(N, C, H, W)"
)
PERMUTES = (
    "fusedserve maps permute(0, 2, 3, 1) of an image (a channels-last view), permute(0, 3, 1, 2) of such a view "
    "(back), and transpose(1, 2) of a channel shuffle's (N, groups, C / groups, H, W) view"
)
CHANNEL_CUTS = (
    "fusedserve cuts channels only: dim 1 of an image or a vector, the last dim of a channels-last view, in runs of "
    "step 1; other dims whole"
)


@register("dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout")
def dropout(ex: Exporter, node: fx.Node, a: Args) -> None:
    if a.get("train"):
        ex.refuse(node, "dropout in training mode", "call module.eval() before exporting: dropout is then nothing")
    ex.same(node, ex.view(node, a["input"]))


@register("clone", "contiguous", "detach", "alias", "lift_fresh_copy", "_to_copy", "to")
def identity(ex: Exporter, node: fx.Node, a: Args) -> None:
    dtype = a.get("dtype")
    if dtype is not None and dtype != torch.float32:
        ex.refuse(node, f"converts to {dtype}", "fusedserve computes in one dtype: conversions to float32 only")
    ex.same(node, ex.view(node, node.args[0]))


@register("view", "_unsafe_view", "reshape", "flatten", "squeeze", "unsqueeze", "unflatten")
def reshape(ex: Exporter, node: fx.Node, a: Args) -> None:
    v = ex.view(node, node.args[0])
    src, target = ex.row_shape(node.args[0]), ex.row_shape(node)
    if target == src:
        ex.same(node, v)
        return
    if v.kind == PLAIN:
        shape = ex.shape(v.tensor)
        if target == (math.prod(shape),):
            ex.emit(node, "flatten", [v.tensor])
            return
        if len(shape) == 3 and len(target) == 4 and target[0] * target[1] == shape[0] and target[2:] == shape[1:]:
            ex.same(node, View(GROUPED, v.tensor, groups=target[0]))
            return
        if len(shape) == 1 and target == (shape[0], 1, 1):
            ex.refuse(
                node,
                f"reshapes per-row {shape} to {target}: the format has no op that turns a vector back into an image",
                RESHAPES + " (a squeeze-and-excitation block written with 1x1 convs, as torchvision's "
                "SqueezeExcitation, needs none)",
            )
    elif v.kind == CHANNELS_LAST and target == (math.prod(src),) and src[0] * src[1] == 1:  # (1, 1, C): as (C, 1, 1)
        ex.emit(node, "flatten", [v.tensor], shape=target)
        return
    elif v.kind == SELECTED and target == (1, *src):
        _channels(ex, node, View(PLAIN, v.tensor), *v.parts[0])
        return
    elif v.kind in (GROUPED, SHUFFLED) and target == ex.shape(v.tensor):
        if v.kind == GROUPED:  # viewed back unshuffled
            ex.same(node, View(PLAIN, v.tensor))
        else:
            ex.emit(node, "channel_shuffle", [v.tensor], groups=v.groups)
        return
    elif v.kind != PLAIN:
        ex.data(node, node.args[0], RESHAPES)  # refuses, naming the view
    ex.refuse(node, f"reshapes per-row {src} to {target}", RESHAPES)


@register("permute", "transpose", "swapaxes", "swapdims")
def permute(ex: Exporter, node: fx.Node, a: Args) -> None:
    x = node.args[0]
    v = ex.view(node, x)
    rank = len(ex.row_shape(x)) + 1
    if "dims" in a:
        dims = tuple(int(d) % rank for d in a["dims"])
    else:
        d0, d1 = (int(d) % rank for d in list(a.values())[1:3])  # transpose(self, dim0, dim1) and its aliases
        order = list(range(rank))
        order[d0], order[d1] = order[d1], order[d0]
        dims = tuple(order)
    if dims == tuple(range(rank)):
        ex.same(node, v)
    elif v.kind == PLAIN and rank == 4 and dims == (0, 2, 3, 1):
        ex.same(node, View(CHANNELS_LAST, v.tensor))
    elif v.kind == CHANNELS_LAST and dims == (0, 3, 1, 2):
        ex.same(node, View(PLAIN, v.tensor))
    elif v.kind in (GROUPED, SHUFFLED) and dims == (0, 2, 1, 3, 4):
        ex.same(node, View(SHUFFLED if v.kind == GROUPED else GROUPED, v.tensor, groups=v.groups))
    else:
        if v.kind not in (PLAIN, CHANNELS_LAST, GROUPED, SHUFFLED):
            ex.data(node, x, PERMUTES)
        ex.refuse(node, f"permutes dims {list(dims)} of per-row shape {ex.row_shape(x)}", PERMUTES)


def _channel_dim(ex: Exporter, node: fx.Node, x, dim: int) -> tuple[View, bool]:
    """(x's view, whether torch's `dim` of it is the graph tensor's channels); refuses views with no channel dim."""
    v = ex.view(node, x)
    rank = len(ex.row_shape(x)) + 1
    dim = int(dim) % rank
    if v.kind == PLAIN:
        return v, dim == 1
    if v.kind == CHANNELS_LAST:
        return v, dim == 3
    ex.data(node, x, CHANNEL_CUTS)  # refuses, naming the view
    raise AssertionError


@register(
    "split", "split_with_sizes", "chunk", "tensor_split", "unsafe_split", "unsafe_split_with_sizes", "unsafe_chunk"
)
def split(ex: Exporter, node: fx.Node, a: Args) -> None:
    x = node.args[0]
    dim = a.get("dim", 0)
    v, on_channels = _channel_dim(ex, node, x, dim)
    if not on_channels:
        ex.refuse(node, f"splits dim {dim} of {ex.describe(x)}", CHANNEL_CUTS)
    sizes = [int(t.shape[int(dim)]) for t in node.meta["val"]]  # the sizes torch gave each part
    runs, start = [], 0
    for n in sizes:
        runs.append((start, start + n))
        start += n
    ex.same(node, View(PARTS, v.tensor, parts=tuple(runs), item=v.kind))


def _channels(ex: Exporter, node: fx.Node, v: View, start: int, end: int) -> None:
    """`node` is channels [start, end) of v's tensor, as a view of v's kind."""
    shape = ex.shape(v.tensor)
    if (start, end) == (0, shape[0]):
        ex.same(node, View(v.kind, v.tensor))
    else:
        ex.emit(node, "slice", [v.tensor], shape=(end - start, *shape[1:]), kind=v.kind, start=start, end=end)


@register("getitem")
def getitem(ex: Exporter, node: fx.Node, a: Args) -> None:
    source, index = node.args
    v = ex.view(node, source)
    if v.kind == RESULT:
        if index != 0:
            ex.refuse(node, f"reads item {index} of {ex.describe(source)}: its saved statistics", "fusedserve runs "
                      "inference, reading an op's result (item 0)")  # fmt: skip
        ex.same(node, View(v.item, v.tensor))
    elif v.kind == PARTS:
        _channels(ex, node, View(v.item, v.tensor), *v.parts[index])
    else:
        ex.refuse(node, f"reads item {index} of {ex.describe(source)}", "fusedserve reads the items of a split or "
                  "chunk along channels, and an op's result (item 0)")  # fmt: skip


@register("slice", "narrow")
def slice_(ex: Exporter, node: fx.Node, a: Args) -> None:
    x = node.args[0]
    row = ex.row_shape(x)
    dim = int(a.get("dim", 0)) % (len(row) + 1)
    if "length" in a:  # narrow
        start, end, step = int(a["start"]), int(a["start"]) + int(a["length"]), 1
    else:
        start, end, step = a.get("start"), a.get("end"), int(a.get("step", 1))
    v, on_channels = _channel_dim(ex, node, x, dim)
    if dim == 0:  # the batch: only whole
        if start in (None, 0) and (end is None or (isinstance(end, int) and end >= 2**62)) and step == 1:
            ex.same(node, v)
            return
        ex.refuse(node, f"slices the batch [{start}:{end}:{step}]", CHANNEL_CUTS)
    size = row[dim - 1]
    lo, hi, step = slice(start, end, step).indices(size)
    if step != 1:
        ex.refuse(node, f"takes every {step}th element of dim {dim}", CHANNEL_CUTS)
    if (lo, hi) == (0, size):
        ex.same(node, v)
    elif not on_channels:
        ex.refuse(node, f"crops dim {dim} of {ex.describe(x)} to [{lo}:{hi}]", CHANNEL_CUTS)
    elif hi <= lo:
        ex.refuse(node, f"keeps no channel ([{lo}:{hi}] of {size})", CHANNEL_CUTS)
    else:
        _channels(ex, node, v, lo, hi)


@register("select")
def select(ex: Exporter, node: fx.Node, a: Args) -> None:
    x = node.args[0]
    v, on_channels = _channel_dim(ex, node, x, a["dim"])
    if not on_channels or v.kind != PLAIN or len(ex.shape(v.tensor)) != 3:
        ex.refuse(node, f"selects index {a['index']} of dim {a['dim']} of {ex.describe(x)}", "fusedserve selects "
                  "one channel of an image (x[:, c]), read through unsqueeze(1)")  # fmt: skip
    c = int(a["index"]) % ex.shape(v.tensor)[0]
    ex.same(node, View(SELECTED, v.tensor, parts=((c, c + 1),)))


@register("cat", "concat", "concatenate")
def cat(ex: Exporter, node: fx.Node, a: Args) -> None:
    parts = list(node.args[0])
    views = [ex.view(node, p) for p in parts]
    kinds = {v.kind for v in views}
    dim = a.get("dim", 0)
    accepts = (
        "fusedserve concatenates images or vectors along dim 1, or channels-last views along their last dim, all alike"
    )
    if len(kinds) != 1 or not kinds <= {PLAIN, CHANNELS_LAST}:
        for p, v in zip(parts, views, strict=True):
            if v.kind not in (PLAIN, CHANNELS_LAST):
                ex.data(node, p, accepts)
        ex.refuse(node, "concatenates channel-first tensors with channels-last views", accepts)
    kind = views[0].kind
    on_channels = int(dim) % (len(ex.row_shape(parts[0])) + 1) == (3 if kind == CHANNELS_LAST else 1)
    if not on_channels:
        ex.refuse(node, f"concatenates along dim {dim}", accepts)
    if len(parts) == 1:
        ex.same(node, views[0])
        return
    shapes = [ex.shape(v.tensor) for v in views]
    shape = (sum(s[0] for s in shapes), *shapes[0][1:])
    ex.emit(node, "concat", [v.tensor for v in views], shape=shape, kind=kind)


@register("channel_shuffle", "native_channel_shuffle")
def channel_shuffle(ex: Exporter, node: fx.Node, a: Args) -> None:
    x = ex.data(node, node.args[0])
    ex.emit(node, "channel_shuffle", [x], groups=int(a["groups"]))
