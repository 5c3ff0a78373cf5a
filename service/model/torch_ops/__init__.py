"""The torch.export importer's ATen op handlers (torch_import.py walks the program; these map its nodes), one
module per op family, each registering its ops in registry.HANDLERS:

    conv.py          conv2d, convolution; pad, constant_pad_nd
    linear.py        linear, addmm, mm, matmul, bmm
    norm.py          batch_norm and its native forms; layer_norm, native_layer_norm
    activations.py   relu, relu6, sigmoid, tanh, silu, hardswish, hardsigmoid, gelu, leaky_relu, hardtanh, clamp
                     (clamp_min, clamp_max, clip), softmax
    elementwise.py   add, sub, rsub, mul, div, reciprocal, neg
    pool.py          max_pool2d, avg_pool2d, adaptive_avg_pool2d, adaptive_max_pool2d, mean
    layout.py        view, reshape, flatten, squeeze, unsqueeze, permute, transpose, split, chunk, slice, narrow,
                     getitem, cat, channel_shuffle; dropout, clone, contiguous, detach, alias, _to_copy

A handler is `handler(exporter, node, args)`: args by the op's schema names; it reads its inputs through
exporter.data / view / const, writes ops through exporter.emit (or names an alias through exporter.same), and
refuses through exporter.refuse(node, why, what would be accepted).
"""

from . import activations, conv, elementwise, layout, linear, norm, pool  # noqa: F401 (each registers its ops)
from .registry import HANDLERS, View, register

__all__ = ["HANDLERS", "View", "register"]
