"""Shapes and layouts: Flatten, Reshape, Squeeze and Unsqueeze to (N, features) -> flatten (or nothing when the
shape stays); Transpose(0, 2, 3, 1) of an image -> a channels-last view, Transpose(0, 3, 1, 2) of one -> the image
again (no op: importer.py's views); ShuffleNet's channel shuffle Reshape (N, g, C/g, H, W), Transpose(0, 2, 1, 3, 4),
Reshape (N, C, H, W) -> channel_shuffle; Concat along the channels -> concat (one input: nothing); Split and Slice of
a run of channels -> slice."""

from __future__ import annotations

import math

import numpy as np

from .importer import (
    BATCH_FLAT,
    BATCHES,
    CHANNELS_LAST,
    GROUPED,
    Importer,
    Node,
    Value,
    View,
    channels_last_view,
    shape_text,
)
from .registry import Refuse, handles

FAMILY = "shapes and layouts"


def _target(im: Importer, node: Node, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The per-row shape a Flatten, Reshape, Squeeze or Unsqueeze makes of a tensor of per-row `shape`; None for a
    Reshape to [-1], which flattens the whole batch into one vector."""
    features = math.prod(shape)
    rank = len(shape) + 1
    if node.op_type == "Flatten":
        axis = node.attr("axis", 1)
        if (axis + rank if axis < 0 else axis) != 1:
            raise Refuse(f"axis {axis}: only Flatten(axis=1), to (N, features), is supported")
        return (features,)
    if node.op_type == "Squeeze":
        axes = im.axes(node)
        axes = [a % rank for a in axes] if axes else [k for k in range(1, rank) if shape[k - 1] == 1]
        if 0 in axes or any(shape[a - 1] != 1 for a in axes):
            raise Refuse(f"axes {axes} of {shape_text(shape)}: only dimensions of size 1 after the batch")
        return tuple(d for k, d in enumerate(shape, start=1) if k not in axes)
    if node.op_type == "Unsqueeze":
        axes = im.axes(node) or []
        out_rank = rank + len(axes)
        axes = sorted(a % out_rank for a in axes)
        if 0 in axes:
            raise Refuse(f"axes {axes}: a dimension before the batch")
        dims, rest = [], iter(shape)
        for k in range(1, out_rank):
            dims.append(1 if k in axes else next(rest))
        return tuple(dims)
    if not im.is_const(node.input(1)):
        raise Refuse("its target shape is computed from data; fusedserve needs it known at import")
    dims, batch = im.ints_with_batch(node, 1, "target shape")
    if dims == [-1]:
        return None
    return _reshape_target(im, shape, dims, batch, bool(node.attr("allowzero", 0)))


def _reshape_target(im: Importer, shape: tuple, dims: list[int], batch: list[bool], allowzero: bool) -> tuple:
    """Reshape's per-row target: its first dimension must be the batch (0, -1, the batch from Shape, or a fixed
    batch written as itself)."""
    if not dims:
        raise Refuse("reshapes to a scalar")
    first, rest = dims[0], dims[1:]
    full_in = [None, *shape]
    rest = [full_in[k + 1] if d == 0 and not allowzero and k + 1 < len(full_in) else d for k, d in enumerate(rest)]
    fixed = {d.dim_value for inp in im.graph.input for d in inp.type.tensor_type.shape.dim[:1] if d.dim_value}
    if not (batch[0] or first in ({0, -1} | fixed)) or any(batch[1:]) or (first == -1 and -1 in rest):
        shown = ["N" if b else d for d, b in zip(dims, batch, strict=True)]
        raise Refuse(f"target shape {shown} of {shape_text(shape)}: its first dimension is not the batch")
    features = math.prod(shape)
    if rest.count(-1) > 1:
        raise Refuse(f"target shape {dims} has several -1")
    if -1 in rest:
        known = math.prod(d for d in rest if d != -1)
        if known == 0 or features % known:
            raise Refuse(f"target shape {dims} does not fit {shape_text(shape)}")
        rest = [features // known if d == -1 else d for d in rest]
    if math.prod(rest) != features:
        raise Refuse(f"target shape {dims} does not keep the {features} values of each row of {shape_text(shape)}")
    return tuple(rest)


@handles("Flatten", "Reshape", "Squeeze", "Unsqueeze", family=FAMILY)
def reshape(im: Importer, node: Node) -> None:
    v = im.raw(node, 0)
    if v.view is not None and v.view.kind not in (CHANNELS_LAST, GROUPED):
        v = im.value(node, 0)
    shape = im.onnx_shape(v)
    target = _target(im, node, shape)
    if target is None:
        if v.view is not None:
            raise Refuse(
                f"flattens the batch of {im.describe(node.input(0))} into one vector; fusedserve takes "
                "that only of a channel-first tensor, for a Gather that takes each row back whole"
            )
        im.alias(node.out, Value(v.tensor, View(BATCH_FLAT, (math.prod(shape),))))
        return
    if target == shape:
        im.alias(node.out, v)
        return
    flat = (math.prod(shape),)
    src = im.shape(v.tensor)
    what = f"{node.op_type.lower()}s {im.describe(node.input(0))} to {shape_text(target)}"
    if v.view is None:
        producer = im.g.producer.get(v.tensor)
        if target == flat:
            im.emit(node, "flatten", [v.tensor], target)
        elif len(shape) == 3 and len(target) == 4 and target[0] * target[1] == shape[0] and target[2:] == shape[1:]:
            im.alias(node.out, Value(v.tensor, View(GROUPED, target, groups=target[0])))
        elif producer is not None and producer["op"] == "flatten" and im.shape(producer["inputs"][0]) == target:
            im.alias(node.out, Value(producer["inputs"][0]))  # back to what a flatten flattened: (C, 1, 1) again
        else:
            raise Refuse(
                f"{what}; fusedserve reshapes only to (N, features) (a flatten), or an image to "
                "(N, g, C/g, H, W) for a channel shuffle; the format has no general reshape"
            )
    elif v.view.kind == CHANNELS_LAST:
        if target == flat and src[1:] == (1, 1):  # (N, 1, 1, C): the same order as (N, C, 1, 1) flattened
            im.emit(node, "flatten", [v.tensor], target)
        else:
            raise Refuse(
                f"{what}; a channels-last view flattens only when it is (N, 1, 1, C): transpose back "
                "with perm [0, 3, 1, 2] first"
            )
    elif target == src:
        if v.view.swapped:
            im.emit(node, "channel_shuffle", [v.tensor], src, groups=v.view.groups)
        else:
            im.alias(node.out, Value(v.tensor))
    else:
        raise Refuse(f"{what}; channels reshaped into groups go back to {shape_text(src)} (a channel shuffle)")


@handles("Transpose", family=FAMILY)
def transpose(im: Importer, node: Node) -> None:
    v = im.raw(node, 0)
    if v.view is not None and v.view.kind not in (CHANNELS_LAST, GROUPED):
        v = im.value(node, 0)
    shape = im.onnx_shape(v)
    rank = len(shape) + 1
    perm = list(node.attr("perm", range(rank - 1, -1, -1)))
    if perm == list(range(rank)):
        im.alias(node.out, v)
        return
    kind = None if v.view is None else v.view.kind
    if kind is None and rank == 4 and perm == [0, 2, 3, 1]:
        im.alias(node.out, Value(v.tensor, channels_last_view(shape)))
    elif kind == CHANNELS_LAST and perm == [0, 3, 1, 2]:
        im.alias(node.out, Value(v.tensor))
    elif kind == GROUPED and perm == [0, 2, 1, 3, 4]:
        a, b, h, w = shape
        im.alias(
            node.out, Value(v.tensor, View(GROUPED, (b, a, h, w), groups=v.view.groups, swapped=not v.view.swapped))
        )
    else:
        raise Refuse(
            f"perm {perm} of {im.describe(node.input(0))}; fusedserve transposes an image (N, C, H, W) to "
            "channels-last (N, H, W, C) with perm [0, 2, 3, 1] and back with [0, 3, 1, 2], and swaps "
            "the groups of a channel shuffle (perm [0, 2, 1, 3, 4])"
        )


def _channel_axis(im: Importer, node: Node, v: Value, axis: int, what: str) -> int:
    """`axis` normalized, which must be v's channels (1, or 3 of a channels-last view)."""
    shape = im.onnx_shape(v)
    rank = len(shape) + 1
    channel = 3 if v.channels_last else 1
    if (axis + rank if axis < 0 else axis) != channel:
        raise Refuse(
            f"axis {axis} of rank-{rank} tensors: only {what} along channels (axis {channel}) is supported; it "
            f"reads {im.describe(node.input(0))}"
        )
    return channel


@handles("Concat", family=FAMILY)
def concat(im: Importer, node: Node) -> None:
    names = [x for x in node.inputs if x]
    consts = [x for x in names if im.is_const(x)]
    if consts:
        raise Refuse(
            f"joins the constant {im.describe(consts[0])} to tensors computed from the input (as a class "
            "token is joined); fusedserve concatenates tensors computed from the input"
        )
    vs = [im.value(node, x) for x in names]
    if len(vs) == 1:
        im.alias(node.out, vs[0])
        return
    if len({v.channels_last for v in vs}) != 1:
        raise Refuse("joins channels-last views and channel-first tensors: " + ", ".join(map(im.describe, names)))
    _channel_axis(im, node, vs[0], node.attr("axis", 1), "concat")
    shapes = [im.shape(v.tensor) for v in vs]
    if any(len(s) != len(shapes[0]) or s[1:] != shapes[0][1:] for s in shapes):
        raise Refuse(f"joins {', '.join(map(im.describe, names))}: all dimensions but the channels must agree")
    out = (sum(s[0] for s in shapes), *shapes[0][1:])
    view = channels_last_view(out) if vs[0].channels_last else None
    im.emit(node, "concat", [v.tensor for v in vs], out, view=view)


def _slice(im: Importer, node: Node, v: Value, out: str, start: int, end: int, name: str | None = None) -> None:
    """out = v[:, start:end] along the channels (a Split's part, a Slice)."""
    src = im.shape(v.tensor)
    shape = (end - start, *src[1:])
    if (start, end) == (0, src[0]):
        im.alias(out, v)
        return
    view = channels_last_view(shape) if v.channels_last else None
    name = name or im.op_name(node)
    op = {"op": "slice", "name": name, "inputs": [v.tensor], "output": out, "start": start, "end": end}
    im.g.add(op, shape)
    im.alias(out, Value(out, view))


@handles("Split", family=FAMILY)
def split(im: Importer, node: Node) -> None:
    v = im.value(node, 0)
    axis = _channel_axis(im, node, v, node.attr("axis", 0), "splits")
    channels = im.onnx_shape(v)[axis - 1]
    parts = len(node.outputs)
    if node.input(1):
        sizes = im.ints(node, 1, "split")
    elif node.attr("split") is not None:
        sizes = list(node.attr("split"))
    elif node.attr("num_outputs") is not None:  # opset 18: equal parts, the last one smaller
        n = int(node.attr("num_outputs"))
        step = -(-channels // n)
        sizes = [min(step, channels - k * step) for k in range(n)]
    else:
        if channels % parts:
            raise Refuse(f"splits {channels} channels into {parts} equal parts")
        sizes = [channels // parts] * parts
    if len(sizes) != parts or sum(sizes) != channels or min(sizes) < 0:
        raise Refuse(
            f"split {sizes} into {parts} outputs does not add up to the {channels} channels of "
            f"{im.describe(node.input(0))}"
        )
    start = 0
    for k, (out, size) in enumerate(zip(node.outputs, sizes, strict=True)):
        if out and im.readers.get(out):
            if size == 0:
                raise Refuse(f"its output {out!r} is empty (0 channels) and is read")
            _slice(im, node, v, out, start, start + size, im.op_name(node, f":{k}"))
        start += size


@handles("Slice", family=FAMILY)
def slice_(im: Importer, node: Node) -> None:
    v = im.value(node, 0)
    shape = im.onnx_shape(v)
    rank = len(shape) + 1
    starts = im.ints(node, 1, "starts")
    ends, to_batch = im.ints_with_batch(node, 2, "ends")
    axes = im.ints(node, 3, "axes") if node.input(3) else list(range(len(starts)))
    steps = im.ints(node, 4, "steps") if node.input(4) else [1] * len(starts)
    channel = 3 if v.channels_last else 1
    run = None
    for axis, s, e, whole, step in zip(axes, starts, ends, to_batch, steps, strict=True):
        a = axis % rank
        if step != 1:
            raise Refuse(f"steps {steps}: fusedserve slices with step 1")
        if a == 0:  # the batch: whole, to its size from Shape or to the end (INT64_MAX)
            if s != 0 or not (whole or e >= 1 << 31):
                raise Refuse(f"slices the batch to {s}:{e}; fusedserve slices only a run of channels (axis {channel})")
            continue
        dim = shape[a - 1]
        s, e = (s + dim if s < 0 else s), (e + dim if e < 0 else e)
        s, e = max(0, min(s, dim)), max(0, min(e, dim))
        if a == channel:
            run = (s, e)
        elif (s, e) != (0, dim):
            raise Refuse(
                f"slices axis {a} of {im.describe(node.input(0))} to {s}:{e}; fusedserve slices only a run "
                f"of channels (axis {channel})"
            )
    if run is None:
        im.alias(node.out, v)
        return
    if run[1] <= run[0]:
        raise Refuse(f"slices channels {run[0]}:{run[1]} of {im.describe(node.input(0))}: nothing is left")
    _slice(im, node, v, node.out, *run)


@handles("Gather", family=FAMILY)
def gather(im: Importer, node: Node) -> None:
    """The dynamo exporter's as_strided: Reshape (N, ...) to [-1], then a Gather whose indices (computed from the
    batch size) take row n's F values at n * F + offsets. Offsets 0..F-1 in order take each row back whole."""
    v = im.raw(node, 0)
    axis = node.attr("axis", 0)
    if v.view is None or v.view.kind != BATCH_FLAT or axis != 0:
        raise Refuse(
            f"gathers from {im.describe(node.input(0))} along axis {axis}; fusedserve takes Gather only as the "
            "dynamo exporter's as_strided: from a tensor flattened with its batch (Reshape [-1]), each row's "
            "values in order"
        )
    name = node.input(1)
    if name not in im.consts:
        raise Refuse(f"its indices ({name!r}) are computed from the input; fusedserve needs them known at import")
    features = v.view.shape[0]
    idx, alt = im.consts[name], im.batch_alt.get(name)
    whole = (
        alt is not None
        and idx.shape[0] == BATCHES[0]
        and alt.shape[0] == BATCHES[1]
        and idx.shape[1:] == alt.shape[1:]
        and all(np.array_equal(a[n], a[0] + n * features) for a in (idx, alt) for n in range(len(a)))
        and np.array_equal(idx[0], alt[0])
        and np.array_equal(idx[0].reshape(-1), np.arange(features))
    )
    if not whole:
        raise Refuse(
            f"its indices ({name!r}, shape {tuple(idx.shape)} with a batch of {BATCHES[0]}) do not take "
            f"each row of {features} values back whole and in order; fusedserve takes no other as_strided"
        )
    target = tuple(idx.shape[1:])
    src = im.shape(v.tensor)
    if target == src:
        im.alias(node.out, Value(v.tensor))
    elif target == (features,):
        im.emit(node, "flatten", [v.tensor], target)
    else:
        raise Refuse(
            f"takes the rows of {shape_text(src)} back as {shape_text(target)}; fusedserve reshapes only to "
            "(N, features)"
        )
