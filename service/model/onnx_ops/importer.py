"""The walk over an ONNX graph: constants folded, patterns matched, every other node handed to its family's handler
(registry.py), refusals gathered so that one message names every node that cannot be served.

Each ONNX tensor computed from the input is a Value: the graph tensor that holds it, and a View where the graph
holds it in another form than ONNX sees it:

    channels_last   a Transpose(0, 2, 3, 1) of an image: ONNX sees (N, H, W, C), the graph keeps the (N, C, H, W)
                    tensor. Ops that commute with the layout (activations, layernorm over C, a MatMul over C as a
                    1x1 conv, elementwise ops with constants moved to (C, 1, 1)) run on it and give views again;
                    Transpose(0, 3, 1, 2) turns it back. ConvNeXt's blocks so stay channel-first and their linears
                    run in the conv kernel.
    grouped         a Reshape of an image (C, H, W) to (g, C / g, H, W), and its Transpose(0, 2, 1, 3, 4) (swapped):
                    the halves of a channel shuffle; the Reshape back to (C, H, W) is `channel_shuffle` (or nothing).
    pad             a constant Pad not yet made: a conv or pool after it takes zero padding into its own; any other
                    reader makes the `pad` op.
    batch_flat      a Reshape of (N, ...) to (N * F,): the dynamo exporter's as_strided flattens so, then a Gather
                    takes each row back (layout.py); nothing else may read it.

A handler that reads a view it does not understand is refused by `value`/`data` with the view named.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..spec import ModelFormatError
from .builder import GraphBuilder
from .registry import HANDLERS, PARTS, PATTERNS, Match, Refuse, supported_summary

# Ops that compute shapes: the only ones evaluated at import on values that depend on the batch size (its stand-ins
# are BATCHES), so no data is ever computed at import with a made-up batch.
SHAPE_OPS = {
    "Shape", "Gather", "Slice", "Concat", "Unsqueeze", "Squeeze", "Cast", "Reshape", "Mul", "Add", "Sub", "Div",
    "Identity", "Constant", "ConstantOfShape", "Range", "Equal", "Where", "Max", "Min", "Abs", "Neg",
}  # fmt: skip
# The batch sizes that Shape reports at import: shape arithmetic on a batch is evaluated twice, once with each, so
# a value that differs between the two depends on the batch (a Reshape's batch dimension, a Slice to its end, an
# as_strided's row offsets) and one that does not is a constant. Small, so no constant the size of a batch is big.
BATCHES = (2, 3)
MAX_FOLDED = 1 << 24  # elements: larger constants made at import are refused (an exporter's data-sized tensor)
FLOAT_TYPES = {1: "float32", 10: "float16", 11: "float64", 16: "bfloat16"}
ELEM_NAMES = {2: "uint8", 3: "int8", 6: "int32", 7: "int64", 9: "bool"}
MAX_LISTED = 8  # nodes named in one refusal; the rest are counted
CHANNELS_LAST, GROUPED, PAD, BATCH_FLAT = "channels_last", "grouped", "pad", "batch_flat"


class Refused(ModelFormatError):
    pass


@dataclass(frozen=True)
class View:
    """How ONNX sees a tensor that the graph holds in another form (module docstring)."""

    kind: str  # CHANNELS_LAST | GROUPED | PAD | BATCH_FLAT
    shape: tuple[int, ...]  # the per-row shape ONNX sees (BATCH_FLAT: (F,), the values of one row)
    groups: int = 0  # GROUPED: g of (g, C / g, H, W)
    swapped: bool = False  # GROUPED: (C / g, g, H, W)
    pads: tuple[int, int, int, int] = (0, 0, 0, 0)  # PAD: top, left, bottom, right
    value: float = 0.0  # PAD
    node: Node | None = None  # PAD: the Pad node (its name names the op if it is made)


@dataclass(frozen=True)
class Value:
    """An ONNX data tensor: the graph tensor that holds it (channel-first), and how ONNX sees it if otherwise."""

    tensor: str
    view: View | None = None

    @property
    def channels_last(self) -> bool:
        return self.view is not None and self.view.kind == CHANNELS_LAST


def channels_last_view(shape: tuple[int, ...]) -> View:
    """The channels-last view of a channel-first image of per-row shape (C, H, W)."""
    c, h, w = shape
    return View(CHANNELS_LAST, (h, w, c))


def shape_text(shape: tuple[int, ...]) -> str:
    """A per-row shape as ONNX writes the tensor's: (N, 4, 8, 8)."""
    return f"({', '.join(['N', *map(str, shape)])})"


def broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    """numpy's (and ONNX's) broadcast of two shapes, or None where they do not broadcast."""
    rank = max(len(a), len(b))
    a, b = (1,) * (rank - len(a)) + tuple(a), (1,) * (rank - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b, strict=True):
        if x != y and 1 not in (x, y):
            return None
        out.append(max(x, y))
    return tuple(out)


class Node:
    """One ONNX node as handlers see it: its inputs and outputs, attributes (strings decoded), and its label."""

    def __init__(self, proto, index: int, attrs: dict):
        self.proto = proto
        self.index = index
        self.op_type: str = proto.op_type
        self.domain: str = proto.domain
        self.name: str = proto.name
        self.inputs: list[str] = list(proto.input)
        self.outputs: list[str] = list(proto.output)
        self.out: str = self.outputs[0] if self.outputs else ""
        self.attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}

    @property
    def label(self) -> str:
        """The node as messages name it: its name, or its place and output when it has none."""
        return repr(self.name) if self.name else f"#{self.index} (output {self.out!r})"

    def attr(self, name: str, default=None):
        return self.attrs.get(name, default)

    def input(self, k: int) -> str:
        return self.inputs[k] if k < len(self.inputs) else ""


class Importer:
    """One import: the ONNX graph, its constants, what each data tensor is in the graph being built."""

    def __init__(self, onnx, graph, opset: int, path: Path):
        self.onnx = onnx
        self.graph = graph
        self.opset = opset
        self.path = path
        self.protos = list(graph.node)
        self._nodes: dict[int, Node] = {}
        self.consts: dict[str, np.ndarray] = {}
        # Constants that depend on the batch: their value with batch BATCHES[1] (`consts` has BATCHES[0]'s).
        self.batch_alt: dict[str, np.ndarray] = {}
        for init in graph.initializer:
            self.consts[init.name] = onnx.numpy_helper.to_array(init)
        self.values: dict[str, Value] = {}
        self.made_pads: dict[str, Value] = {}  # pending pads made into `pad` ops, by the Pad's output
        self.g = GraphBuilder()
        self.poisoned: set[str] = set()  # outputs of refused nodes (and of the nodes that read them)
        self.refusals: list[tuple[Node, str | None]] = []  # (node, why); why None: no handler for its op type
        self.unchecked = 0  # nodes skipped because they read a refused node's output

    # ---- nodes and readers ----

    def node(self, index: int) -> Node:
        if index not in self._nodes:
            proto = self.protos[index]
            attrs = {a.name: self.onnx.helper.get_attribute_value(a) for a in proto.attribute}
            self._nodes[index] = Node(proto, index, attrs)
        return self._nodes[index]

    def readers_of(self, name: str) -> list[Node]:
        """The live nodes that read `name` (not counting the graph's output)."""
        return [self.node(i) for i in self.readers.get(name, []) if i >= 0]

    def sole_reader(self, name: str) -> int | None:
        """The node that reads `name`, if it is its only reader and `name` is not the graph's output."""
        readers = self.readers.get(name, [])
        return readers[0] if len(readers) == 1 and readers[0] >= 0 else None

    def only_reader(self, name: str, op_type: str) -> Node | None:
        """The sole reader of `name` if it is a data node of `op_type`."""
        j = self.sole_reader(name)
        if j is None or j not in self.data_nodes or self.node(j).op_type != op_type:
            return None
        return self.node(j)

    def producer_index(self, name: str) -> int | None:
        if not hasattr(self, "_producer_of"):
            self._producer_of = {o: i for i, n in enumerate(self.protos) for o in n.output}
        return self._producer_of.get(name)

    # ---- constants ----

    def is_const(self, name: str) -> bool:
        return name in self.consts

    def scalar(self, name: str) -> float | None:
        v = self.consts.get(name)
        return float(v.reshape(-1)[0]) if v is not None and v.size == 1 else None

    def is_scalar(self, name: str, value: float) -> bool:
        v = self.scalar(name)
        return v is not None and math.isclose(v, value, rel_tol=1e-4)

    def const(self, node: Node, k: int, role: str, optional: bool = False) -> np.ndarray | None:
        """Input k of a node, which must be a floating-point constant (as float64); None if optional and absent."""
        name = node.input(k)
        if not name:
            if optional:
                return None
            raise Refuse(f"has no {role}")
        if name not in self.consts:
            raise Refuse(
                f"its {role} ({name!r}{self._shape_of_name(name)}) is computed from the input; fusedserve "
                "needs a constant"
            )
        value = self.consts[name]
        if value.dtype.kind != "f":
            raise Refuse(f"its {role} ({name!r}) has dtype {value.dtype}; fusedserve needs floating point")
        if name in self.batch_alt:
            raise Refuse(f"its {role} ({name!r}) depends on the batch size; fusedserve needs a constant")
        return value.astype(np.float64)

    def ints(self, node: Node, k: int, role: str) -> list[int]:
        """Input k, a constant that does not depend on the batch, as a list of ints."""
        values, batch = self.ints_with_batch(node, k, role)
        if any(batch):
            raise Refuse(f"its {role} ({node.input(k)!r}) depends on the batch size; fusedserve needs it fixed")
        return values

    def ints_with_batch(self, node: Node, k: int, role: str) -> tuple[list[int], list[bool]]:
        """Input k as ints (with batch BATCHES[0]), and which of them are that batch size (with BATCHES[1], they
        are BATCHES[1]); refused where a value depends on the batch otherwise."""
        name = node.input(k)
        if name not in self.consts:
            raise Refuse(f"its {role} ({name!r}) is computed from the input; fusedserve needs it known at import")
        values = [int(v) for v in self.consts[name].reshape(-1)]
        if name not in self.batch_alt:
            return values, [False] * len(values)
        alt = [int(v) for v in self.batch_alt[name].reshape(-1)]
        if len(alt) != len(values):
            raise Refuse(f"its {role} ({name!r}) has as many values as the batch has rows; fusedserve needs it fixed")
        batch = [a != b for a, b in zip(values, alt, strict=True)]
        if any(b and (v, a) != BATCHES for b, v, a in zip(batch, values, alt, strict=True)):
            raise Refuse(
                f"its {role} ({name!r}) is computed from the batch size; fusedserve takes the batch size "
                "itself there, or values that do not depend on it"
            )
        return values, batch

    def axes(self, node: Node, k: int = 1) -> list[int] | None:
        """A reduction's or (un)squeeze's axes: input k (opset 13 and 18 forms), else the `axes` attribute."""
        if node.input(k):
            return self.ints(node, k, "axes")
        return list(node.attr("axes")) if node.attr("axes") is not None else None

    # ---- data tensors ----

    def _shape_of_name(self, name: str) -> str:
        v = self.values.get(name)
        return f" {shape_text(self.onnx_shape(v))}" if v is not None else ""

    def onnx_shape(self, v: Value) -> tuple[int, ...]:
        """The per-row shape ONNX sees for a value."""
        return v.view.shape if v.view is not None else self.g.shapes[v.tensor]

    def shape(self, tensor: str) -> tuple[int, ...]:
        """The per-row shape of a graph tensor (channel-first)."""
        return self.g.shapes[tensor]

    def describe(self, name: str) -> str:
        """An ONNX tensor for messages: its name and shape as ONNX sees it, and the view the graph keeps it as."""
        v = self.values.get(name)
        if v is None:
            return (
                f"{name!r} (a constant of shape {tuple(self.consts[name].shape)})"
                if name in self.consts
                else repr(name)
            )
        if v.view is not None and v.view.kind == BATCH_FLAT:
            return f"{name!r} (N*{v.view.shape[0]},)"
        text = f"{name!r} {shape_text(self.onnx_shape(v))}"
        if v.view is not None and v.view.kind == CHANNELS_LAST:
            text += " (channels-last)"
        elif v.view is not None and v.view.kind == GROUPED:
            text += f" (channels split into {v.view.groups} groups{', transposed' if v.view.swapped else ''})"
        return text

    def raw(self, node: Node, k: int | str) -> Value:
        """Input k (or the tensor named k) of a node as it stands, views included; refused if not data."""
        name = node.input(k) if isinstance(k, int) else k
        v = self.values.get(name)
        if v is None:
            what = f"a constant of shape {tuple(self.consts[name].shape)}" if name in self.consts else "missing"
            which = f"input {k} ({name!r})" if isinstance(k, int) else repr(name)
            raise Refuse(f"{which} is {what}; fusedserve expects a tensor computed from the input")
        return v

    def value(self, node: Node, k: int | str, *, channels_last: bool = True) -> Value:
        """Input k of a node for an op that runs on the graph's tensor: a pending pad is made; a channels-last view
        is taken only if `channels_last` (the op commutes with the layout); a grouped view is refused."""
        v = self.raw(node, k)
        name = node.input(k) if isinstance(k, int) else k
        if v.view is None:
            return v
        if v.view.kind == PAD:
            return self.make_pad(v)
        if v.view.kind == CHANNELS_LAST and channels_last:
            return v
        if v.view.kind == BATCH_FLAT:
            raise Refuse(
                f"reads {self.describe(name)}: every row of a batch flattened into one vector; fusedserve takes "
                "that only where a Gather takes each row back whole (the dynamo exporter's as_strided)"
            )
        if v.view.kind == CHANNELS_LAST:
            raise Refuse(
                f"reads {self.describe(name)}, a channels-last transpose of a (N, C, H, W) tensor; "
                f"{node.op_type} is supported on channel-first tensors (transpose back with perm "
                "[0, 3, 1, 2] first)"
            )
        raise Refuse(
            f"reads {self.describe(name)}; a tensor reshaped into channel groups is supported only as "
            "a channel shuffle: Reshape (N, g, C/g, H, W), Transpose(0, 2, 1, 3, 4), Reshape (N, C, H, W)"
        )

    def data(self, node: Node, k: int | str) -> str:
        """Input k of a node as a plain channel-first graph tensor."""
        return self.value(node, k, channels_last=False).tensor

    def image(self, node: Node, tensor: str, role: str = "its input") -> tuple[int, int, int]:
        shape = self.shape(tensor)
        if len(shape) != 3:
            raise Refuse(f"{role} {tensor!r} has shape {shape_text(shape)}; it needs (N, channels, height, width)")
        return shape

    def per_row_constant(self, node: Node, c: np.ndarray, v: Value, role: str = "constant") -> np.ndarray:
        """A constant broadcast against the data `v` (numpy's rules, as ONNX's), as the format stores it: a per-row
        shape in the channel-first layout of v's graph tensor, leading 1s stripped (the batch's among them: ONNX's
        (1, C, 1, 1) becomes (C, 1, 1)); a single value becomes a scalar ()."""
        shape = self.onnx_shape(v)
        rank = len(shape) + 1
        if c.size == 1:
            return c.reshape(())
        dims = list(c.shape)
        while len(dims) > rank and dims[0] == 1:
            dims.pop(0)
        if len(dims) > rank:
            raise Refuse(
                f"its {role} has shape {tuple(c.shape)}, more dimensions than its data input "
                f"{shape_text(shape)}; the result would grow"
            )
        full = [1] * (rank - len(dims)) + dims
        per = full[1:]
        if full[0] != 1 or any(p not in (1, s) for p, s in zip(per, shape, strict=True)):
            raise Refuse(
                f"its {role} of shape {tuple(c.shape)} does not broadcast against its data input "
                f"{shape_text(shape)} without growing it; fusedserve takes constants of one row whose "
                "dimensions are 1 or the data's"
            )
        arr = c.reshape(per)
        if v.channels_last:
            arr = arr.transpose(2, 0, 1)  # (h, w, c) -> (c, h, w)
        while arr.ndim and arr.shape[0] == 1:
            arr = arr.reshape(arr.shape[1:])
        return arr

    def channel_vector(self, node: Node, c: np.ndarray, v: Value, role: str) -> np.ndarray:
        """A constant that holds one value per channel of `v` (in v's layout), as (C,)."""
        shape = self.shape(v.tensor)
        per = self.per_row_constant(node, c, v, role)
        if per.shape == (shape[0],) + (1,) * (len(shape) - 1):
            return per.reshape(-1)
        raise Refuse(
            f"its {role} has shape {tuple(c.shape)}; fusedserve needs one value per channel "
            f"({shape[0]}) of its data input {shape_text(self.onnx_shape(v))}"
        )

    # ---- writing ----

    def op_name(self, node: Node, suffix: str = "") -> str:
        return self.g.op_name((node.name or f"{node.op_type}_{node.index}") + suffix)

    def emit(
        self,
        node: Node,
        kind: str,
        inputs: list[str],
        shape: tuple[int, ...],
        *,
        output: str | None = None,
        view: View | None = None,
        name: str | None = None,
        **fields,
    ) -> dict:
        """Add an op reading graph tensors `inputs` and writing `output` (default: the node's first output, which
        then names the Value of that ONNX tensor, seen through `view` if given)."""
        out = output if output is not None else node.out
        op = {"op": kind, "name": name or self.op_name(node), "inputs": list(inputs), "output": out, **fields}
        self.g.add(op, shape)
        if output is None:
            self.values[node.out] = Value(out, view)
        return op

    def alias(self, onnx_name: str, value: Value) -> None:
        """`onnx_name` is `value` (no op): Identity, a transpose into or out of a view, a reshape that keeps it."""
        self.values[onnx_name] = value

    def weight(self, op_name: str, role: str, value: np.ndarray) -> str:
        return self.g.weight(op_name, role, value)

    def make_pad(self, v: Value) -> Value:
        """The `pad` op of a pending Pad (once per Pad node, however many readers need it)."""
        pad = v.view.node
        if pad.out in self.made_pads:
            return self.made_pads[pad.out]
        if not math.isfinite(v.view.value):
            raise Refuse(
                f"reads {pad.out!r}, a Pad by {v.view.value}; fusedserve pads by finite values (a Pad by "
                "-inf is supported only right before a MaxPool, which takes it as its padding)"
            )
        self.emit(pad, "pad", [v.tensor], v.view.shape, output=pad.out, pads=list(v.view.pads), value=v.view.value)
        made = Value(pad.out)
        self.made_pads[pad.out] = made
        self.values[pad.out] = made
        return made

    def unused_extra_outputs(self, node: Node) -> None:
        for o in node.outputs[1:]:
            if o and self.readers.get(o):
                raise Refuse(f"its output {o!r} is read; fusedserve computes only the first output")

    # ---- input, output, liveness ----

    def _input(self):
        inits = {i.name for i in self.graph.initializer}
        inputs = [i for i in self.graph.input if i.name not in inits]
        if len(inputs) != 1:
            names = ", ".join(repr(i.name) for i in inputs) or "none"
            raise ModelFormatError(
                f"{self.path}: the graph has {len(inputs)} inputs ({names}); fusedserve serves models of one input"
            )
        (inp,) = inputs
        t = inp.type.tensor_type
        if not inp.type.HasField("tensor_type"):
            raise ModelFormatError(f"{self.path}: input {inp.name!r} is not a tensor")
        if t.elem_type not in FLOAT_TYPES:
            kind = ELEM_NAMES.get(t.elem_type, f"element type {t.elem_type}")
            raise ModelFormatError(
                f"{self.path}: input {inp.name!r} is {kind}; fusedserve imports models whose input is floating point "
                "(send uint8 images to the server as they are: it converts them)"
            )
        if not t.HasField("shape"):
            raise ModelFormatError(f"{self.path}: input {inp.name!r} has no shape; export it with a fixed shape")
        dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in t.shape.dim]
        if len(dims) not in (2, 4):
            raise ModelFormatError(
                f"{self.path}: input {inp.name!r} has shape {dims}; fusedserve imports (batch, features) and "
                "(batch, channels, height, width) inputs"
            )
        names = ["batch", "features"] if len(dims) == 2 else ["batch", "channels", "height", "width"]
        for i, d in enumerate(dims[1:], start=1):
            if not isinstance(d, int) or d < 1:
                raise ModelFormatError(
                    f"{self.path}: input {inp.name!r} has shape {dims}: its {names[i]} ({d!r}) is not fixed; "
                    "fusedserve needs every size but the batch fixed (export with a fixed input size; a dynamic "
                    "batch dimension is fine)"
                )
        return inp.name, tuple(dims[1:]), dims[0]

    def _live(self, output: str) -> list[int]:
        """Indices of the nodes the output depends on, in graph order."""
        producer = {}
        for i, n in enumerate(self.protos):
            for o in n.output:
                producer[o] = i
        needed, live = {output}, set()
        for i in range(len(self.protos) - 1, -1, -1):
            n = self.protos[i]
            if any(o in needed for o in n.output):
                live.add(i)
                needed.update(x for x in n.input if x)
                for attr in n.attribute:  # subgraphs (If, Loop) read outer tensors: they are refused anyway
                    if attr.type == self.onnx.AttributeProto.GRAPH:
                        needed.update(x for sub in attr.g.node for x in sub.input)
        return sorted(live)

    # ---- constants folded at import ----

    def _fold(self, node: Node, *, shapes: bool) -> bool:
        """Evaluate a node whose inputs are all constants; True if it was. With `shapes`, also Shape of a data tensor
        (whose per-row shape is known once the node writing it is mapped) and shape arithmetic on such values."""
        ins = [x for x in node.inputs if x]
        if node.op_type == "Constant":
            self.consts[node.out] = self._constant_value(node)
            return True
        if node.op_type == "Shape" and ins and ins[0] not in self.consts:
            if not shapes:
                return False
            v = self.values.get(ins[0])
            if v is None:
                raise Refuse("reads the shape of a tensor fusedserve does not compute")
            if v.view is not None and v.view.kind == BATCH_FLAT:
                raise Refuse(f"reads the shape of {self.describe(ins[0])}, a tensor whose rows are flattened into one")
            start, end = node.attr("start", 0), node.attr("end")
            full = [np.array([b, *self.onnx_shape(v)], dtype=np.int64)[start:end] for b in BATCHES]
            self.consts[node.out] = full[0]
            if not np.array_equal(full[0], full[1]):
                self.batch_alt[node.out] = full[1]
            return True
        if node.op_type == "CastLike" and ins and ins[0] in self.consts and ins[1] not in self.consts:
            # A constant cast to the type of a data tensor (exporters cast scalars so): data is floating point, and
            # computed in the model's dtype, so the constant stays a float constant.
            self.consts[node.out] = self.consts[ins[0]].astype(np.float32)
            return True
        if not ins or not all(x in self.consts for x in ins):
            return False
        batch = any(x in self.batch_alt for x in ins)
        if batch and node.op_type not in SHAPE_OPS:
            return False
        values = self._evaluate(node, {x: self.consts[x] for x in ins})
        alt = self._evaluate(node, {x: self.batch_alt.get(x, self.consts[x]) for x in ins}) if batch else values
        for out, v, w in zip(node.outputs, values, alt, strict=False):
            self.consts[out] = v
            if batch and (v.shape != w.shape or not np.array_equal(v, w)):
                self.batch_alt[out] = w
        return True

    def _evaluate(self, node: Node, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
        from onnx.reference import ReferenceEvaluator

        try:
            evaluator = ReferenceEvaluator(node.proto, opsets={"": self.opset})
            values = [np.asarray(v) for v in evaluator.run(None, inputs)]
        except Exception as e:  # noqa: BLE001 (the reference evaluator raises anything on a node it cannot run)
            raise Refuse(f"its inputs are constants, but evaluating it at import failed: {e}") from None
        for v in values:
            if v.size > MAX_FOLDED:
                raise Refuse(f"makes a constant of {v.size} elements at import; too large")
        return values

    def _constant_value(self, node: Node) -> np.ndarray:
        numpy_helper = self.onnx.numpy_helper
        for a in node.proto.attribute:
            if a.name == "value":
                return numpy_helper.to_array(a.t)
            if a.name == "value_float":
                return np.array(a.f, dtype=np.float32)
            if a.name == "value_floats":
                return np.array(list(a.floats), dtype=np.float32)
            if a.name == "value_int":
                return np.array(a.i, dtype=np.int64)
            if a.name == "value_ints":
                return np.array(list(a.ints), dtype=np.int64)
        raise Refuse("a Constant without a value fusedserve reads")

    # ---- the walk ----

    def run(self) -> GraphBuilder:
        self.input_name, self.input_shape, _ = self._input()
        outputs = list(self.graph.output)
        if len(outputs) != 1:
            names = ", ".join(repr(o.name) for o in outputs)
            raise ModelFormatError(
                f"{self.path}: the graph has {len(outputs)} outputs ({names}); fusedserve serves models of one output"
            )
        self.output = output = outputs[0].name
        self.g.shapes[self.input_name] = self.input_shape
        self.values[self.input_name] = Value(self.input_name)
        live = self._live(output)
        # Readers of each tensor among the live nodes (and the graph's output), for the one-reader rules.
        self.readers: dict[str, list[int]] = {output: [-1]}
        for i in live:
            for x in self.protos[i].input:
                if x:
                    self.readers.setdefault(x, []).append(i)
        # 1. Fold the constants; set aside shape arithmetic (evaluated once the shapes it reads are known); the rest
        #    computes data.
        shape_like: set[str] = set()
        deferred: set[int] = set()
        self.data_nodes: set[int] = set()
        for i in live:
            node = self.node(i)
            try:
                if self._fold(node, shapes=False):
                    continue
            except Refuse as r:
                self._refuse(node, str(r))
                continue
            ins = [x for x in node.inputs if x]
            if node.op_type == "Shape" or (
                ins and node.op_type in SHAPE_OPS and all(x in self.consts or x in shape_like for x in ins)
            ):
                shape_like.update(node.outputs)
                deferred.add(i)
            else:
                self.data_nodes.add(i)
        # 2. Patterns of several nodes (registry.PATTERNS), matched before any is mapped.
        matches, absorbed = self._match(live)
        # 3. In graph order: shape arithmetic, patterns, and each other data node through its handler.
        for i in live:
            node = self.node(i)
            if i in deferred:
                if self._reads_refused(node.inputs, node):
                    continue
                try:
                    if not self._fold(node, shapes=True):
                        raise Refuse("computes a shape fusedserve cannot evaluate at import")
                except Refuse as r:
                    self._refuse(node, str(r))
            elif i in matches:
                m = matches[i]
                if self._reads_refused(m.reads, node):
                    continue
                try:
                    m.emit()
                except Refuse as r:
                    self._refuse(node, str(r))
            elif i in self.data_nodes and i not in absorbed:
                self._map(node)
        if self.refusals:
            raise Refused(self._refusal_message())
        return self._finish(output)

    def _match(self, live: list[int]) -> tuple[dict[int, Match], set[int]]:
        """{index of a pattern's last node: the match}, and every node some match covers."""
        matches: dict[int, Match] = {}
        covered: set[int] = set()
        for i in live:
            if i not in self.data_nodes or i in covered:
                continue
            node = self.node(i)
            for p in PATTERNS.get(node.op_type, ()):
                m = p.match(self, node)
                if m is not None and m.nodes <= self.data_nodes and not (m.nodes & covered):
                    matches[m.last] = m
                    covered |= m.nodes
                    break
        return matches, covered

    def _map(self, node: Node) -> None:
        handler = HANDLERS.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        if handler is None:
            if node.op_type in PARTS and node.domain in ("", "ai.onnx"):
                patterns = "; ".join(p.describe for p in PARTS[node.op_type])
                ins = ", ".join(self.describe(x) for x in node.inputs if x)
                self._refuse(
                    node,
                    f"{node.op_type} is supported only as part of a pattern ({patterns}); this one, "
                    f"reading {ins}, is not",
                )
            else:
                self._refuse(node, None)
            return
        if self._reads_refused(node.inputs, node):
            return
        try:
            handler.fn(self, node)
        except Refuse as r:
            self._refuse(node, str(r))

    def _reads_refused(self, names, node: Node | None = None) -> bool:
        """Whether any of `names` is an output of a refused node; then the node is skipped (its outputs refused
        too): its shapes are unknown, and the message names the node that blocks it."""
        if not any(x in self.poisoned for x in names if x):
            return False
        if node is not None:
            self.poisoned.update(node.outputs)
            self.unchecked += 1
        return True

    def _refuse(self, node: Node, why: str | None) -> None:
        if why is not None and not re.search(r"\(N(, |\*)\d", why):  # a refusal gives the shapes: at least its inputs'
            reads = [self.describe(x) for x in node.inputs if x in self.values]
            why += f" (it reads {', '.join(reads)})" if reads else ""
        self.refusals.append((node, why))
        self.poisoned.update(node.outputs)

    def _refusal_message(self) -> str:
        known = [(n, why) for n, why in self.refusals if why is not None]
        unknown = [n for n, why in self.refusals if why is None]
        entries = [f"node {n.label} ({n.op_type}): {why}" for n, why in known[:MAX_LISTED]]
        if len(known) > MAX_LISTED:
            entries.append(f"and {len(known) - MAX_LISTED} more nodes that cannot be served")
        if unknown:
            listed = []
            for n in unknown[:MAX_LISTED]:
                domain = f", domain {n.domain}" if n.domain not in ("", "ai.onnx") else ""
                listed.append(f"node {n.label} ({n.op_type}{domain})")
            more = f" and {len(unknown) - MAX_LISTED} more" if len(unknown) > MAX_LISTED else ""
            what = "this op is" if len(unknown) == 1 else "these ops are"
            entries.append(f"{'; '.join(listed)}{more}: {what} not supported. {supported_summary()}")
        n = self.unchecked
        skipped = f" ({n} node{'s' if n != 1 else ''} reading their results not checked)" if n else ""
        if len(entries) == 1:
            return f"{self.path}: {entries[0]}{skipped}"
        count = len(self.refusals)
        return f"{self.path}: {count} nodes cannot be served{skipped}:\n" + "\n".join(f"  {e}" for e in entries)

    def _finish(self, output: str) -> GraphBuilder:
        v = self.values.get(output)
        if v is None:
            raise ModelFormatError(f"{self.path}: the output {output!r} is not computed from the input by any node")
        if v.view is not None and v.view.kind == PAD:
            v = self.make_pad(v)
        elif v.view is not None:
            raise ModelFormatError(
                f"{self.path}: the output {self.describe(output)} is a view fusedserve keeps in "
                "another layout; the output must be (N, features)"
            )
        final = v.tensor
        if final == self.input_name or final not in self.g.producer:
            raise ModelFormatError(f"{self.path}: the output {output!r} is not computed from the input by any node")
        self._prune(final)
        if self.g.ops[-1]["output"] != final:  # cannot happen: every op left leads to the output, in graph order
            raise ModelFormatError(f"{self.path}: the output {output!r} is not written by the graph's last op")
        return self.g

    def _prune(self, final: str) -> None:
        """Drop ops whose results nothing on the way to the output reads (a tensor read only by Shape)."""
        needed, kept = {final}, []
        for op in reversed(self.g.ops):
            if op["output"] in needed:
                needed.update(op["inputs"])
                kept.append(op)
        if len(kept) != len(self.g.ops):
            self.g.ops[:] = kept[::-1]
            used = {t for op in kept for k in ("weight", "bias", "mean", "var", "constant") if (t := op.get(k))}
            for key in [k for k in self.g.tensors if k not in used]:
                del self.g.tensors[key]
