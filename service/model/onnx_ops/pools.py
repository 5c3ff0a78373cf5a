"""MaxPool, AveragePool (ceil_mode, count_include_pad, pads) -> maxpool2d, avgpool2d; GlobalAveragePool,
GlobalMaxPool, and ReduceMean / ReduceMax over height and width -> a pool of the whole image (then flatten when the
dimensions are not kept). Padding as conv.py splits it: a zero Pad in front is taken into an average pool that
counts padding, a Pad by -inf into a max pool; uneven padding becomes a `pad` op before the pool."""

from __future__ import annotations

import numpy as np

from ..shapes import pool_out
from .conv import input_with_pad, onnx_pads, pad_before, split_pads
from .importer import Importer, Node, channels_last_view
from .registry import Refuse, handles

FAMILY = "pools"
# What a max pool's padding holds where a `pad` op must make it: float32's lowest, as -inf cannot be written in JSON
# (in fp16 and bf16 it rounds to -inf, which is what a max pool pads with).
MAX_PAD = float(np.finfo(np.float32).min)


@handles("MaxPool", "AveragePool", family=FAMILY)
def pool(im: Importer, node: Node) -> None:
    is_max = node.op_type == "MaxPool"
    if is_max:
        im.unused_extra_outputs(node)
        if any(d != 1 for d in node.attr("dilations", [1, 1])):
            raise Refuse(f"dilations {list(node.attr('dilations'))}: fusedserve pools with dilation 1")
    kernel = list(node.attr("kernel_shape", []))
    if len(kernel) != 2:
        raise Refuse(f"kernel_shape {kernel}: fusedserve takes 2-D pooling")
    ceil = bool(node.attr("ceil_mode", 0))
    count_pad = bool(node.attr("count_include_pad", 0))
    # A Pad in front is the pool's own padding when the pool treats it as it treats its padding.
    takes = -np.inf if is_max else (0.0 if count_pad or not any(node.attr("pads", [0])) else None)
    if takes is not None and not ceil:
        x, pre = input_with_pad(im, node, takes)
    else:
        x, pre = im.data(node, 0), [0, 0, 0, 0]
    if any(pre) and not is_max:
        count_pad = True
    c, h, w = im.image(node, x)
    strides = list(node.attr("strides", [1, 1]))
    pads = [p + q for p, q in zip(onnx_pads(node, (h, w), kernel, strides, [1, 1]), pre, strict=True)]
    sym, excess = split_pads(pads, (kernel[0] // 2, kernel[1] // 2))
    if any(excess):
        if ceil:
            raise Refuse(f"pads {pads} with ceil_mode: fusedserve pools uneven padding with ceil_mode 0 only")
        if not (is_max or count_pad):
            raise Refuse(
                f"pads {pads} (uneven, or more than half the kernel {kernel}) with count_include_pad 0: "
                "fusedserve can pad unevenly only where the pool counts its padding"
            )
        x = pad_before(im, node, x, excess, MAX_PAD if is_max else 0.0)
        _, h, w = im.shape(x)
    kind = "maxpool2d" if is_max else "avgpool2d"
    fields = {"kernel_size": kernel, "stride": strides, "padding": sym, "ceil_mode": ceil}
    if not is_max:
        fields["count_include_pad"] = count_pad
    sizes = [pool_out(n, k, s, p, ceil) for n, k, s, p in zip((h, w), kernel, strides, sym, strict=True)]
    if min(sizes) < 1:
        raise Refuse(f"kernel_shape {kernel} does not fit its input of {h}x{w} pixels")
    im.emit(node, kind, [x], (c, *sizes), **fields)


@handles("GlobalAveragePool", "GlobalMaxPool", family=FAMILY)
def global_pool(im: Importer, node: Node) -> None:
    x = im.data(node, 0)
    c, h, w = im.image(node, x)
    kind = "avgpool2d" if node.op_type == "GlobalAveragePool" else "maxpool2d"
    im.emit(node, kind, [x], (c, 1, 1), kernel_size=[h, w])


@handles("ReduceMean", "ReduceMax", family=FAMILY)
def reduce(im: Importer, node: Node) -> None:
    """The mean (max) over height and width of an image, or of a channels-last view's (axes 1, 2)."""
    v = im.value(node, 0)
    shape = im.onnx_shape(v)
    rank = len(shape) + 1
    axes = im.axes(node)
    if axes is None or not axes:
        axes = [] if node.attr("noop_with_empty_axes", 0) else list(range(rank))
    axes = sorted(a % rank for a in axes)
    spatial = [1, 2] if v.channels_last else [2, 3]
    if rank != 4 or axes != spatial:
        what = "mean" if node.op_type == "ReduceMean" else "max"
        raise Refuse(
            f"axes {axes} of {im.describe(node.input(0))}: fusedserve takes the {what} over height and "
            f"width (axes {spatial}); a mean over the channels only inside a decomposed LayerNorm"
        )
    c, h, w = im.shape(v.tensor)
    kind = "avgpool2d" if node.op_type == "ReduceMean" else "maxpool2d"
    keep = node.attr("keepdims", 1)
    if keep:
        view = channels_last_view((c, 1, 1)) if v.channels_last else None
        im.emit(node, kind, [v.tensor], (c, 1, 1), view=view, kernel_size=[h, w])
        return
    pooled = f"{node.out}:pooled"
    op = im.emit(node, kind, [v.tensor], (c, 1, 1), output=pooled, kernel_size=[h, w])
    im.emit(node, "flatten", [pooled], (c,), name=im.g.op_name(f"{op['name']}:flatten"))
