"""Convolutions and padding: conv2d / convolution -> conv2d (stride, padding, dilation, groups: grouped and
depthwise; asymmetric kernels and padding); pad / constant_pad_nd -> pad, or nothing where the padding is zeros,
alike on opposite sides, and every reader is a conv (each adds it to its own padding: one op and one copy less)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .registry import PADDED, Args, View, op_name, pair, register

if TYPE_CHECKING:
    from torch import fx

    from ..torch_import import Exporter

CONVS = ("conv2d", "convolution", "_convolution")
CONV = "fusedserve maps 2-D convolutions by a constant weight, with any stride, zero padding, dilation and groups"
PAD = "fusedserve pads an image's height and width with a constant (F.pad mode 'constant', nn.ZeroPad2d)"


@register(*CONVS)
def conv(ex: Exporter, node: fx.Node, a: Args) -> None:
    if a.get("transposed"):
        ex.refuse(node, "a transposed convolution (ConvTranspose2d)", CONV)
    v = ex.view(node, a["input"])
    x, extra = (v.tensor, v.pad) if v.kind == PADDED else (ex.data(node, a["input"], CONV), (0, 0))
    if len(ex.shape(x)) != 3:
        ex.refuse(node, f"convolves a tensor of per-row shape {ex.shape(x)}", CONV + " of (N, C, H, W) images")
    w = ex.const(node, a["weight"], "weight")
    if w.ndim != 4:
        ex.refuse(node, f"a weight of shape {w.shape}: a {w.ndim - 2}-D convolution", CONV)
    b = ex.const(node, a.get("bias"), "bias", optional=True)
    stride, dilation, padding = pair(a["stride"]), pair(a["dilation"]), a["padding"]
    if isinstance(padding, str):
        if padding == "valid":
            padding = [0, 0]
        else:  # "same": symmetric where each dilation * (kernel - 1) is even
            totals = [d * (k - 1) for d, k in zip(dilation, w.shape[2:], strict=True)]
            if any(t % 2 for t in totals):
                ex.refuse(node, f"padding='same' with kernel {list(w.shape[2:])} pads one side more", CONV + " (the "
                          "same padding on both sides; F.pad the odd pixel first)")  # fmt: skip
            padding = [t // 2 for t in totals]
    padding = [p + e for p, e in zip(pair(padding), extra, strict=True)]
    ex.emit(node, "conv2d", [x], weights={"weight": w, "bias": b}, stride=stride, padding=padding,
            dilation=dilation, groups=int(a.get("groups") or 1))  # fmt: skip


@register("pad", "constant_pad_nd")
def pad(ex: Exporter, node: fx.Node, a: Args) -> None:
    x = a["self"]
    mode = a.get("mode", "constant")
    if mode != "constant":
        ex.refuse(node, f"{mode} padding", PAD)
    t = ex.data(node, x, PAD)
    if len(ex.shape(t)) != 3:
        ex.refuse(node, f"pads a tensor of per-row shape {ex.shape(t)}", PAD)
    pads = [int(p) for p in a["pad"]] + [0] * max(0, 4 - len(a["pad"]))
    left, right, top, bottom = pads[:4]
    if any(pads[4:]):
        ex.refuse(node, f"pads the channels or the batch (pad {list(a['pad'])})", PAD)
    if min(pads) < 0:
        ex.refuse(node, f"crops (negative pad {list(a['pad'])})", PAD + ", adding pixels only")
    value = float(a.get("value") or 0.0)
    if not any(pads):
        ex.same(node, View("plain", t))
    elif value == 0 and left == right and top == bottom and _read_by_convs_only(node):
        ex.same(node, View(PADDED, t, pad=(top, left)))
    else:
        ex.emit(node, "pad", [t], pads=[top, left, bottom, right], value=value)


def _read_by_convs_only(node: fx.Node) -> bool:
    """Every reader is a (forward) conv that reads `node` as its input."""
    return bool(node.users) and all(
        op_name(u.target) in CONVS and u.args[0] is node and node not in u.args[1:] and not _transposed(u)
        for u in node.users
    )


def _transposed(conv: fx.Node) -> bool:
    return op_name(conv.target) != "conv2d" and bool(conv.args[6] if len(conv.args) > 6 else False)
