"""The ONNX importer's handlers (service/model/onnx_import.py runs them), registered by op type, one module per family:

    conv.py            Conv; the padding rules convs and pools share (a zero Pad in front taken into their own)
    pools.py           MaxPool, AveragePool, GlobalAveragePool, GlobalMaxPool, ReduceMean / ReduceMax over H and W
    linear.py          Gemm, MatMul by a constant (on a channels-last view: a 1x1 conv)
    elementwise.py     Add, Sub, Mul, Div with broadcasting, of two tensors or with a constant; bias folding
    activations.py     Relu, LeakyRelu, Sigmoid, Tanh, HardSigmoid, HardSwish, Gelu, Clip, Softmax; patterns:
                       SiLU, hard swish, GELU's erf form
    normalization.py   BatchNormalization, LayerNormalization; pattern: LayerNorm's decomposed form
    layout.py          Flatten, Reshape, Squeeze, Unsqueeze, Transpose (channels-last views, channel shuffle),
                       Concat, Split, Slice
    passthrough.py     Identity, Dropout, Cast to a float type, Pad

importer.py walks the graph (constants folded, patterns matched, each node to its handler, refusals gathered);
registry.py holds the tables; builder.py the graph being built.
"""

from . import activations, conv, elementwise, layout, linear, normalization, passthrough, pools  # noqa: F401 (register)
from .builder import GraphBuilder
from .importer import Importer, Refused
from .registry import FAMILIES, HANDLERS, PATTERNS, Refuse, supported_summary

__all__ = ["FAMILIES", "HANDLERS", "PATTERNS", "GraphBuilder", "Importer", "Refuse", "Refused", "supported_summary"]
