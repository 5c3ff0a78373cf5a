"""Gemm and MatMul by a constant weight: `linear` on (N, features); on a channels-last view (N, H, W, C) a MatMul by
a (C, K) weight is a 1x1 `conv2d` of the channel-first tensor (ConvNeXt's pointwise linears, which then run in the
conv kernel with their bias and activation). A MatMul of two tensors computed from the input (attention) is
refused."""

from __future__ import annotations

from .importer import Importer, Node, channels_last_view, shape_text
from .registry import Refuse, handles

FAMILY = "linear layers"


@handles("Gemm", "MatMul", family=FAMILY)
def linear(im: Importer, node: Node) -> None:
    a, b = node.input(0), node.input(1)
    if not im.is_const(a) and not im.is_const(b):
        raise Refuse(
            f"multiplies two tensors computed from the input, {im.describe(a)} by {im.describe(b)} (as "
            f"attention does); fusedserve takes a {node.op_type} of a tensor by a constant weight"
        )
    if im.is_const(a):
        raise Refuse(
            f"multiplies the constant {im.describe(a)} by {im.describe(b)}; fusedserve takes "
            f"{node.op_type}(x, weight): the tensor first, a constant (K, N) weight second"
        )
    v = im.value(node, 0)
    if node.op_type == "Gemm":
        if node.attr("transA", 0):
            raise Refuse("transA = 1: the input must not be transposed")
        w = im.const(node, 1, "weight (B)")
        w = (w if node.attr("transB", 0) else w.T) * float(node.attr("alpha", 1.0))  # (N, K)
    else:
        w = im.const(node, 1, "weight (B)")
        if w.ndim != 2:
            raise Refuse(f"its weight has shape {tuple(w.shape)}; fusedserve takes a 2-D (K, N) weight")
        w = w.T
    shape = im.onnx_shape(v)
    if v.channels_last:
        _pointwise_conv(im, node, v, w)
        return
    if len(shape) != 1:
        raise Refuse(
            f"reads {im.describe(a)}; fusedserve takes {node.op_type} on (N, features) (flatten first), "
            "or a MatMul over the channels of a channels-last transpose (N, H, W, C) of an image"
        )
    if w.shape[1] != shape[0]:
        raise Refuse(f"its weight of shape {tuple(w.shape)} (N, K) does not fit its input {shape_text(shape)}")
    bias = None
    if node.op_type == "Gemm":
        c = im.const(node, 2, "bias (C)", optional=True)
        if c is not None:
            n = w.shape[0]
            if c.size == 1:
                bias = [float(c.reshape(-1)[0])] * n
            elif c.size == n and [d for d in c.shape if d != 1] == [n]:
                bias = c.reshape(n)
            else:
                raise Refuse(f"its bias (C) has shape {tuple(c.shape)}; fusedserve takes one value per output ({n})")
            bias = [float(x) * float(node.attr("beta", 1.0)) for x in bias]
    name = im.op_name(node)
    fields = {"weight": im.weight(name, "weight", w)}
    if bias is not None:
        fields["bias"] = im.weight(name, "bias", bias)
    im.emit(node, "linear", [v.tensor], (w.shape[0],), name=name, **fields)


def _pointwise_conv(im: Importer, node: Node, v, w) -> None:
    """x (N, H, W, C) @ weight (C, K) + bias: a 1x1 conv of the channel-first tensor, weight (K, C, 1, 1)."""
    c, h, wd = im.shape(v.tensor)
    if node.op_type == "Gemm" or w.shape[1] != c:
        raise Refuse(
            f"its weight of shape {tuple(w.T.shape)} does not fit {im.describe(node.input(0))}; over a "
            "channels-last image fusedserve takes MatMul by a (C, K) weight"
        )
    name = im.op_name(node)
    k = w.shape[0]
    weight = im.weight(name, "weight", w.reshape(k, c, 1, 1))
    im.emit(
        node,
        "conv2d",
        [v.tensor],
        (k, h, wd),
        view=channels_last_view((k, h, wd)),
        name=name,
        weight=weight,
        stride=[1, 1],
        padding=[0, 0],
        dilation=[1, 1],
        groups=1,
    )
