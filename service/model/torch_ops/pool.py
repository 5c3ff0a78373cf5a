"""Pools of images: max_pool2d (dilation 1, ceil_mode) -> maxpool2d; avg_pool2d (padding, count_include_pad,
ceil_mode) -> avgpool2d; adaptive average / max pools -> a pool over the whole image for 1x1 (global pooling
anywhere: a squeeze-and-excitation block's), nothing for the input's own size, a pool of equal windows for a size
that divides the input's; mean over (H, W) -> a global avgpool2d (+ flatten without keepdim)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .registry import CHANNELS_LAST, PLAIN, RESULT, Args, View, pair, register

if TYPE_CHECKING:
    from torch import fx

    from ..torch_import import Exporter

POOL = "fusedserve pools (N, C, H, W) images: max (dilation 1) and average (without divisor_override)"
ADAPTIVE = (
    "fusedserve maps adaptive pools to 1x1 (global), to the input's own size (nothing), and to sizes that divide the "
    "input's (windows of one size)"
)
MEAN = "fusedserve maps a mean over height and width (dims (2, 3) of an image, (1, 2) of a channels-last view)"


def _image(ex: Exporter, node: fx.Node, x, accepts: str) -> tuple[str, tuple[int, int, int]]:
    t = ex.data(node, x, accepts)
    shape = ex.shape(t)
    if len(shape) != 3:
        ex.refuse(node, f"pools a tensor of per-row shape {shape}", accepts)
    return t, shape


@register("max_pool2d", "max_pool2d_with_indices")
def max_pool2d(ex: Exporter, node: fx.Node, a: Args) -> None:
    t, _ = _image(ex, node, a["self"], POOL)
    if any(d != 1 for d in pair(a.get("dilation", 1))):
        ex.refuse(node, f"dilation {list(a['dilation'])}", POOL)
    kernel = pair(a["kernel_size"])
    kind = RESULT if isinstance(node.meta["val"], (list, tuple)) else PLAIN
    ex.emit(node, "maxpool2d", [t], kind=kind, shape=_out_shape(ex, node), kernel_size=kernel,
            stride=pair(a.get("stride") or kernel), padding=pair(a.get("padding", 0)),
            ceil_mode=bool(a.get("ceil_mode", False)))  # fmt: skip


@register("avg_pool2d")
def avg_pool2d(ex: Exporter, node: fx.Node, a: Args) -> None:
    t, _ = _image(ex, node, a["self"], POOL)
    if a.get("divisor_override") is not None:
        ex.refuse(node, f"divisor_override {a['divisor_override']}", POOL)
    kernel = pair(a["kernel_size"])
    ex.emit(node, "avgpool2d", [t], kernel_size=kernel, stride=pair(a.get("stride") or kernel),
            padding=pair(a.get("padding", 0)), ceil_mode=bool(a.get("ceil_mode", False)),
            count_include_pad=bool(a.get("count_include_pad", True)))  # fmt: skip


def _out_shape(ex: Exporter, node: fx.Node) -> tuple[int, ...]:
    val = node.meta["val"]
    val = val[0] if isinstance(val, (list, tuple)) else val
    return tuple(int(d) for d in val.shape[1:])


@register("adaptive_avg_pool2d", "_adaptive_avg_pool2d", "adaptive_max_pool2d")
def adaptive_pool2d(ex: Exporter, node: fx.Node, a: Args) -> None:
    t, (_, h, w) = _image(ex, node, a["self"], ADAPTIVE)
    out = [n if s is None else int(s) for s, n in zip(pair_or_none(a["output_size"]), (h, w), strict=True)]
    kind = RESULT if isinstance(node.meta["val"], (list, tuple)) else PLAIN
    op = "maxpool2d" if "max" in node.target._opname else "avgpool2d"
    if out == [h, w]:
        ex.same(node, View(kind, t))
        return
    if h % out[0] or w % out[1]:
        ex.refuse(node, f"pools {(h, w)} pixels to {tuple(out)}: windows of different sizes", ADAPTIVE)
    kernel = [h // out[0], w // out[1]]
    ex.emit(node, op, [t], kind=kind, shape=_out_shape(ex, node), kernel_size=kernel)


def pair_or_none(v) -> list:
    return [v, v] if v is None or isinstance(v, int) else (list(v) * 2)[:2]


@register("mean")
def mean(ex: Exporter, node: fx.Node, a: Args) -> None:
    x = a["self"]
    v = ex.view(node, x)
    rank = len(ex.row_shape(x)) + 1
    dims = sorted(int(d) % rank for d in (a.get("dim") or []))
    spatial = [1, 2] if v.kind == CHANNELS_LAST else [2, 3]
    if v.kind not in (PLAIN, CHANNELS_LAST):
        ex.data(node, x, MEAN)
    if rank != 4 or dims != spatial:
        ex.refuse(node, f"mean over dims {dims} of {ex.describe(x)}", MEAN)
    c, h, w = ex.shape(v.tensor)
    keep = bool(a.get("keepdim", False))
    if keep:
        ex.emit(node, "avgpool2d", [v.tensor], shape=(c, 1, 1), kind=v.kind, kernel_size=[h, w])
        return
    pooled = ex.emit(node, "avgpool2d", [v.tensor], shape=(c, 1, 1), output=f"{node.name}:pooled", kernel_size=[h, w])
    ex.emit(node, "flatten", [pooled], name=f"{node.name}:flatten")
