"""Conv (2-D; any groups) -> conv2d, and the padding rules convs and pools share: ONNX's pads [top, left, bottom,
right] (or auto_pad), plus a zero Pad in front that the conv takes into its own padding; what is the same on both
sides of an axis is the op's padding, the rest a `pad` op before it."""

from __future__ import annotations

import math

from ..shapes import conv_out
from .importer import PAD, Importer, Node
from .registry import Refuse, handles

FAMILY = "convolutions"


def onnx_pads(node: Node, size, kernel, strides, dilations) -> list[int]:
    """The node's padding as [top, left, bottom, right] pixels, from `pads` or `auto_pad`."""
    auto = node.attr("auto_pad", "NOTSET")
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        begin, end = [], []
        for n, k, s, d in zip(size, kernel, strides, dilations, strict=True):
            total = max(0, (math.ceil(n / s) - 1) * s + (k - 1) * d + 1 - n)
            small, large = total // 2, total - total // 2
            begin.append(small if auto == "SAME_UPPER" else large)
            end.append(large if auto == "SAME_UPPER" else small)
        return begin + end
    if auto == "VALID":
        return [0, 0, 0, 0]
    pads = list(node.attr("pads", [0, 0, 0, 0]))
    if len(pads) != 4:
        raise Refuse(f"pads {pads}: fusedserve takes 2-D padding [top, left, bottom, right]")
    if any(p < 0 for p in pads):
        raise Refuse(f"pads {pads}: negative padding (cropping) is not supported")
    return pads


def split_pads(pads: list[int], limit: tuple[int, int] | None = None) -> tuple[list[int], list[int]]:
    """([h, w] padding on both sides, [top, left, bottom, right] left over for a `pad` op). `limit`: the most an
    op may pad per side (a pool pads at most half its kernel, as torch requires)."""
    top, left, bottom, right = pads
    sym = [min(top, bottom), min(left, right)]
    if limit is not None:
        sym = [min(s, m) for s, m in zip(sym, limit, strict=True)]
    return sym, [top - sym[0], left - sym[1], bottom - sym[0], right - sym[1]]


def pad_before(im: Importer, node: Node, x: str, excess: list[int], value: float) -> str:
    """A `pad` op of `excess` [top, left, bottom, right] before the node's op; its output tensor."""
    if not any(excess):
        return x
    c, h, w = im.shape(x)
    top, left, bottom, right = excess
    out = f"{node.out}:pad"
    im.emit(
        node,
        "pad",
        [x],
        (c, h + top + bottom, w + left + right),
        output=out,
        name=im.op_name(node, ":pad"),
        pads=list(excess),
        value=value,
    )
    return out


def input_with_pad(im: Importer, node: Node, value: float) -> tuple[str, list[int]]:
    """The tensor the node reads, and [top, left, bottom, right] of a pending Pad by `value` in front of it that the
    node takes into its own padding ([0, 0, 0, 0] if none; any other Pad is made)."""
    raw = im.raw(node, 0)
    if raw.view is not None and raw.view.kind == PAD and raw.view.value == value:
        return raw.tensor, list(raw.view.pads)
    return im.data(node, 0), [0, 0, 0, 0]


@handles("Conv", family=FAMILY)
def conv(im: Importer, node: Node) -> None:
    x, pre = input_with_pad(im, node, 0.0)
    w = im.const(node, 1, "weight")
    b = im.const(node, 2, "bias", optional=True)
    if w.ndim != 4:
        raise Refuse(f"its weight has shape {tuple(w.shape)}: fusedserve takes 2-D convolutions (out, in, kh, kw)")
    c, h, wd = im.image(node, x)
    groups = int(node.attr("group", 1))
    if c != w.shape[1] * groups:
        raise Refuse(f"its weight of shape {tuple(w.shape)} with group {groups} does not fit its input of {c} channels")
    strides = list(node.attr("strides", [1, 1]))
    dilations = list(node.attr("dilations", [1, 1]))
    kernel = list(w.shape[2:])
    pads = onnx_pads(node, (h, wd), kernel, strides, dilations)
    sym, excess = split_pads([p + q for p, q in zip(pads, pre, strict=True)])
    x = pad_before(im, node, x, excess, 0.0)
    _, h, wd = im.shape(x)
    name = im.op_name(node)
    fields = {"weight": im.weight(name, "weight", w)}
    if b is not None:
        fields["bias"] = im.weight(name, "bias", b)
    fields.update(stride=strides, padding=sym, dilation=dilations, groups=groups)
    sizes = [conv_out(n, k, s, p, d) for n, k, s, p, d in zip((h, wd), kernel, strides, sym, dilations, strict=True)]
    if min(sizes) < 1:
        raise Refuse(f"its kernel {tuple(kernel)} does not fit its input of {h}x{wd} pixels")
    im.emit(node, "conv2d", [x], (w.shape[0], *sizes), name=name, **fields)
