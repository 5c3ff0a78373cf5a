"""Import an ONNX file (opset 13 and later) into the model format, fusedserve-model/2, with the `onnx` package.

    fusedserve import model.onnx model_weights/my-model [--name N] [--labels labels.txt]
    fusedserve serve --model model.onnx            # imported on the fly, as check-model does

What it takes, node by node (every node on the way from the input to the output):

    Conv (2-D; groups 1, or grouped/depthwise, which run as torch ops)  -> conv2d
    BatchNormalization (inference)       -> batchnorm (folded into the conv or linear before it when fused)
    Gemm, MatMul (+ Add of a constant)   -> linear
    Add of two tensors of one shape      -> add (a residual connection); Add of a constant after a conv or
                                            linear -> its bias
    Relu, LeakyRelu, Sigmoid, Tanh, HardSwish, Gelu, Clip(0, 6) / Clip(0)   -> relu, leaky_relu, ..., relu6, relu
    x * Sigmoid(x) -> silu; x * HardSigmoid(x) (1/6, 1/2) -> hardswish; x * 0.5 * (1 + Erf(x / sqrt 2)) -> gelu
    MaxPool, AveragePool, GlobalAveragePool, GlobalMaxPool, ReduceMean over (H, W)  -> maxpool2d, avgpool2d
    Flatten, Reshape or Squeeze to (batch, features)   -> flatten
    Concat along channels (or features)  -> concat
    Identity, Dropout                    -> dropped
    Softmax over the output's features   -> softmax (only as the last node)

Nodes whose inputs are all constants (initializers, Constant nodes, shapes of tensors whose per-row size is
fixed) are evaluated at import with onnx's reference evaluator: an exporter's shape arithmetic before a Reshape,
or a bias made by Expand, become constants. Anything else is refused with the node's name, its op type and what
is supported, never run wrongly. So is a file that is not ONNX, a graph with several inputs or outputs, and an
input whose sizes other than the batch are not fixed (a dynamic batch dimension is normal).

Weights become float32 safetensors named after their node (`/layer1/conv1/Conv.weight`); tensor names in the
graph are the ONNX names, so a plan can be traced back to the file.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .shapes import conv_out, pool_out
from .spec import FORMAT_V2, ModelFormatError, input_fields

MIN_OPSET = 13
# Every op type the importer maps (the patterns' parts included), for the refusal message.
SUPPORTED = (
    "Conv", "BatchNormalization", "Gemm", "MatMul", "Add", "Relu", "LeakyRelu", "Sigmoid", "Tanh", "HardSwish",
    "Gelu", "Clip", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "ReduceMean", "Flatten",
    "Reshape", "Squeeze", "Concat", "Identity", "Dropout", "Softmax",
)  # fmt: skip
PATTERNS = "Mul and Erf in GELU's x * 0.5 * (1 + erf(x / sqrt(2))), Mul in SiLU's x * sigmoid(x) and hard swish's"
# Ops that compute shapes: the only ones evaluated at import on values derived from a tensor's shape (whose batch
# dimension is a stand-in), so no constant the size of a batch is ever made.
SHAPE_OPS = {
    "Shape", "Gather", "Slice", "Concat", "Unsqueeze", "Squeeze", "Cast", "Reshape", "Mul", "Add", "Sub", "Div",
    "Identity", "Constant", "ConstantOfShape", "Range", "Equal", "Where", "Max", "Min", "Abs", "Neg",
}  # fmt: skip
BATCH = 1_000_003  # the batch size that Shape reports at import: a prime no layer has, to tell it apart
MAX_FOLDED = 1 << 24  # elements: larger constants made at import are refused (an exporter's data-sized tensor)
FLOAT_TYPES = {1: "float32", 10: "float16", 11: "float64", 16: "bfloat16"}
ELEM_NAMES = {2: "uint8", 3: "int8", 6: "int32", 7: "int64", 9: "bool"}


def _onnx():
    try:
        import onnx
    except ImportError as e:  # a runtime dependency; say how to get it rather than a bare traceback
        raise ModelFormatError(f"importing ONNX files needs the `onnx` package ({e}); pip install onnx") from None
    return onnx


@dataclass
class GraphBuilder:
    """What an importer has built so far: ops (format-2 dicts), tensors, per-row shapes of data tensors (this one's
    and torch_import.py's)."""

    ops: list[dict] = field(default_factory=list)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    producer: dict[str, dict] = field(default_factory=dict)  # data tensor -> the op that writes it
    names: set[str] = field(default_factory=set)

    def op_name(self, base: str) -> str:
        name, i = base, 1
        while name in self.names:
            i += 1
            name = f"{base}#{i}"
        self.names.add(name)
        return name

    def add(self, op: dict, shape: tuple[int, ...]) -> dict:
        self.ops.append(op)
        self.shapes[op["output"]] = shape
        self.producer[op["output"]] = op
        return op

    def weight(self, op_name: str, role: str, value: np.ndarray) -> str:
        key = f"{op_name}.{role}"
        self.tensors[key] = torch.from_numpy(np.ascontiguousarray(value, dtype=np.float32))
        return key


class _Refused(ModelFormatError):
    pass


def _node_label(node, index: int) -> str:
    """A node as messages name it: its name, or its place and output when it has none."""
    return repr(node.name) if node.name else f"#{index} (output {node.output[0]!r})"


def import_onnx(
    path: Path | str,
    *,
    name: str | None = None,
    labels: list[str] | None = None,
    description: str | None = None,
    input_dtype: str = "float32",
    mean: list[float] | None = None,
    std: list[float] | None = None,
) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, tensors) of the model format for the ONNX file at `path`; ModelFormatError saying what is wrong.

    name: the model's name (default: the file's stem); labels: one per output (default: the file's metadata
    `labels`, a JSON list, if it has one); input_dtype, mean, std: what clients send ("uint8" pixels) and the
    input's per-channel normalization, which the ONNX graph does not hold (spec.input_fields)."""
    declared = input_fields(input_dtype, mean, std)
    path = Path(path)
    onnx = _onnx()
    model = _read(onnx, path)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None or opset < MIN_OPSET:
        raise ModelFormatError(
            f"{path}: opset {opset}; fusedserve imports ONNX opset {MIN_OPSET} and later (export again with "
            f"opset_version={MIN_OPSET} or more)"
        )
    graph = model.graph
    meta = {p.key: p.value for p in model.metadata_props}
    importer = _Importer(onnx, graph, opset, path)
    g = importer.run()
    if labels is None and "labels" in meta:
        try:
            labels = [str(v) for v in json.loads(meta["labels"])]
        except (ValueError, TypeError):
            raise ModelFormatError(f"{path}: metadata 'labels' is not a JSON list of strings") from None
    sha = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    config = {
        "format": FORMAT_V2,
        "name": name or meta.get("name") or safe_name(path.stem),
        "description": description if description is not None else meta.get("description", graph.doc_string or ""),
        "source": f"onnx: {path.name} (opset {opset}, sha256 {sha}...), {model.producer_name or 'unknown'} "
        f"{model.producer_version}".strip(),
        "input": {"name": importer.input_name, "shape": list(importer.input_shape), **declared},
        "output": g.ops[-1]["output"],
        **({"labels": labels} if labels is not None else {}),
        "ops": g.ops,
    }
    return config, g.tensors


def safe_name(stem: str) -> str:
    """A model name from a file name: the characters the format allows."""
    cleaned = "".join(c if c.isalnum() or c in "_.-" else "-" for c in stem)
    return cleaned or "model"


def _read(onnx, path: Path):
    if not path.is_file():
        raise ModelFormatError(f"{path}: no such file")
    try:
        model = onnx.load(str(path))
        onnx.checker.check_model(model)
    except Exception as e:  # protobuf's DecodeError, onnx's ValidationError, a missing external-data file
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelFormatError(f"{path}: not a valid ONNX file ({first})") from None
    if not model.graph.node:
        raise ModelFormatError(f"{path}: not a valid ONNX file (its graph has no nodes)")
    return model


class _Importer:
    def __init__(self, onnx, graph, opset: int, path: Path):
        self.onnx = onnx
        self.graph = graph
        self.opset = opset
        self.path = path
        self.nodes = list(graph.node)
        self.consts: dict[str, np.ndarray] = {}
        self.symbolic: set[str] = set()  # constants derived from a shape (their batch is BATCH)
        for init in graph.initializer:
            self.consts[init.name] = onnx.numpy_helper.to_array(init)
        self.alias: dict[str, str] = {}
        self.g = GraphBuilder()

    def refuse(self, node, index: int, why: str):
        raise _Refused(f"{self.path}: node {_node_label(node, index)} ({node.op_type}): {why}")

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
        for i, n in enumerate(self.nodes):
            for o in n.output:
                producer[o] = i
        needed, live = {output}, set()
        for i in range(len(self.nodes) - 1, -1, -1):
            n = self.nodes[i]
            if any(o in needed for o in n.output):
                live.add(i)
                needed.update(x for x in n.input if x)
                for attr in n.attribute:  # subgraphs (If, Loop) read outer tensors: they are refused anyway
                    if attr.type == self.onnx.AttributeProto.GRAPH:
                        needed.update(x for sub in attr.g.node for x in sub.input)
        return sorted(live)

    # ---- constants ----

    def _fold(self, node, index: int, *, shapes: bool) -> bool:
        """Evaluate a node whose inputs are all constants; True if it was. With `shapes`, also Shape of a data tensor
        (whose per-row shape is known once the node writing it is mapped) and shape arithmetic on such values."""
        ins = [x for x in node.input if x]
        if node.op_type == "Constant":
            self.consts[node.output[0]] = self._constant_value(node)
            return True
        if node.op_type == "Shape" and ins and ins[0] not in self.consts:
            if not shapes:
                return False
            source = self._resolve(ins[0])
            if source not in self.g.shapes:
                self.refuse(node, index, "reads the shape of a tensor fusedserve does not compute")
            full = np.array([BATCH, *self.g.shapes[source]], dtype=np.int64)
            attrs = self._attrs(node)
            self.consts[node.output[0]] = full[attrs.get("start", 0) : attrs.get("end")]
            self.symbolic.add(node.output[0])
            return True
        if node.op_type == "CastLike" and ins and ins[0] in self.consts and ins[1] not in self.consts:
            # A constant cast to the type of a data tensor (exporters cast scalars so): data is floating point, and
            # computed in the model's dtype, so the constant stays a float constant.
            self.consts[node.output[0]] = self.consts[ins[0]].astype(np.float32)
            return True
        if not ins or not all(x in self.consts for x in ins):
            return False
        symbolic = any(x in self.symbolic for x in ins)
        if symbolic and node.op_type not in SHAPE_OPS:
            return False
        from onnx.reference import ReferenceEvaluator

        try:
            evaluator = ReferenceEvaluator(node, opsets={"": self.opset})
            values = evaluator.run(None, {x: self.consts[x] for x in ins})
        except Exception as e:  # noqa: BLE001 (the reference evaluator raises anything on a node it cannot run)
            self.refuse(node, index, f"its inputs are constants, but evaluating it at import failed: {e}")
        for out, v in zip(node.output, values, strict=False):
            v = np.asarray(v)
            if v.size > MAX_FOLDED:
                self.refuse(node, index, f"makes a constant of {v.size} elements at import; too large")
            self.consts[out] = v
            if symbolic:
                self.symbolic.add(out)
        return True

    def _constant_value(self, node) -> np.ndarray:
        numpy_helper = self.onnx.numpy_helper
        for a in node.attribute:
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
        raise _Refused(f"{self.path}: Constant node {node.name!r} has no value fusedserve reads")

    def _resolve(self, t: str) -> str:
        while t in self.alias:
            t = self.alias[t]
        return t

    def _attrs(self, node) -> dict:
        return {a.name: self.onnx.helper.get_attribute_value(a) for a in node.attribute}

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
        live = self._live(output)
        # Readers of each tensor among the live nodes (and the graph's output), for the one-reader rules.
        self.readers: dict[str, list[int]] = {output: [-1]}
        for i in live:
            for x in self.nodes[i].input:
                if x:
                    self.readers.setdefault(x, []).append(i)
        # 1. Fold the constants; set aside shape arithmetic (evaluated once the shapes it reads are known); the rest
        #    computes data, and must be supported.
        shape_like: set[str] = set()
        deferred, data = set(), []
        for i in live:
            node = self.nodes[i]
            if self._fold(node, i, shapes=False):
                continue
            ins = [x for x in node.input if x]
            if node.op_type == "Shape" or (
                ins and node.op_type in SHAPE_OPS and all(x in self.consts or x in shape_like for x in ins)
            ):
                shape_like.update(node.output)
                deferred.add(i)
            else:
                data.append(i)
        self._unsupported(data)
        # 2. Patterns of several nodes that are one activation (SiLU, hard swish, GELU's erf form).
        replaced, absorbed = self._patterns(data)
        # 3. In graph order: shape arithmetic, and each data node mapped to ops.
        for i in live:
            node = self.nodes[i]
            if i in deferred:
                if not self._fold(node, i, shapes=True):
                    self.refuse(node, index=i, why="computes a shape fusedserve cannot evaluate at import")
            elif i in replaced:
                kind, x, out, slope = replaced[i]
                self._emit_activation(node, i, kind, x, out, slope)
            elif i in data and i not in absorbed:
                self._map(node, i)
        final = self._resolve(output)
        if final == self.input_name or final not in self.g.producer:
            raise ModelFormatError(f"{self.path}: the output {output!r} is not computed from the input by any node")
        if self.g.ops[-1]["output"] != final:  # cannot happen for a graph whose nodes all lead to the output
            raise ModelFormatError(f"{self.path}: the output {output!r} is not written by the graph's last node")
        return self.g

    def _unsupported(self, data: list[int]) -> None:
        known = set(SUPPORTED) | {"Mul", "Erf", "HardSigmoid", "Div"}  # the patterns' parts: checked there
        bad = [i for i in data if self.nodes[i].op_type not in known or self.nodes[i].domain not in ("", "ai.onnx")]
        if not bad:
            return
        listed = []
        for i in bad[:8]:
            n = self.nodes[i]
            domain = f", domain {n.domain}" if n.domain not in ("", "ai.onnx") else ""
            listed.append(f"node {_node_label(n, i)} ({n.op_type}{domain})")
        more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
        what = "this op is" if len(bad) == 1 else "these ops are"
        raise _Refused(
            f"{self.path}: {'; '.join(listed)}{more}: {what} not supported. fusedserve imports "
            f"{', '.join(SUPPORTED)}, and {PATTERNS}"
        )

    # ---- patterns of several nodes ----

    def _producers(self) -> dict[str, int]:
        if not hasattr(self, "_producer_of"):
            self._producer_of = {o: i for i, n in enumerate(self.nodes) for o in n.output}
        return self._producer_of

    def _sole_reader(self, t: str) -> int | None:
        """The node that reads `t`, if it is its only reader and `t` is not the graph's output."""
        readers = self.readers.get(t, [])
        return readers[0] if len(readers) == 1 and readers[0] >= 0 else None

    def _scalar(self, t: str) -> float | None:
        v = self.consts.get(t)
        return float(v.reshape(-1)[0]) if v is not None and v.size == 1 else None

    def _is(self, t: str, value: float) -> bool:
        v = self._scalar(t)
        return v is not None and math.isclose(v, value, rel_tol=1e-4)

    def _patterns(self, data: list[int]) -> tuple[dict[int, tuple], set[int]]:
        """{index of a pattern's last node: (activation, its input, its output, slope)}, and the indices of the
        pattern's other nodes, which are not mapped on their own."""
        replaced: dict[int, tuple] = {}
        absorbed: set[int] = set()
        for i in data:
            n = self.nodes[i]
            if n.op_type in ("Sigmoid", "HardSigmoid"):
                if n.op_type == "HardSigmoid":
                    a = self._attrs(n)
                    if not (math.isclose(a.get("alpha", 0.2), 1 / 6, rel_tol=1e-4) and a.get("beta", 0.5) == 0.5):
                        continue
                x, s = n.input[0], n.output[0]
                j = self._sole_reader(s)
                if j is not None and self.nodes[j].op_type == "Mul" and sorted(self.nodes[j].input) == sorted([x, s]):
                    kind = "silu" if n.op_type == "Sigmoid" else "hardswish"
                    replaced[j] = (kind, x, self.nodes[j].output[0], None)
                    absorbed.add(i)
            elif n.op_type == "Erf":
                found = self._gelu(i)
                if found is not None:
                    final, x, parts = found
                    replaced[final] = ("gelu", x, self.nodes[final].output[0], None)
                    absorbed.update(parts)
        return replaced, absorbed

    def _gelu(self, erf: int) -> tuple[int, str, set[int]] | None:
        """x * 0.5 * (1 + erf(x / sqrt(2))) in the orders exporters write it: (final node, x, the other nodes)."""
        nodes, producers = self.nodes, self._producers()
        d = nodes[erf].input[0]
        pd = producers.get(d)
        if pd is None or self._sole_reader(d) != erf:
            return None
        scale = nodes[pd]
        if scale.op_type == "Div" and self._is(scale.input[1], math.sqrt(2)):
            x = scale.input[0]
        elif scale.op_type == "Mul" and any(self._is(t, 1 / math.sqrt(2)) for t in scale.input):
            x = next(t for t in scale.input if not self._is(t, 1 / math.sqrt(2)))
        else:
            return None
        ja = self._sole_reader(nodes[erf].output[0])
        if ja is None or nodes[ja].op_type != "Add" or not any(self._is(t, 1.0) for t in nodes[ja].input):
            return None
        a = nodes[ja].output[0]
        j1 = self._sole_reader(a)
        if j1 is None or nodes[j1].op_type != "Mul":
            return None
        other = next((t for t in nodes[j1].input if t != a), None)
        parts = {pd, erf, ja}
        if other == x or self._is(other, 0.5):  # (x * a) * 0.5, or x * (a * 0.5)
            p = nodes[j1].output[0]
            j2 = self._sole_reader(p)
            if j2 is None or nodes[j2].op_type != "Mul":
                return None
            rest = [t for t in nodes[j2].input if t != p]
            if len(rest) != 1 or not (self._is(rest[0], 0.5) if other == x else rest[0] == x):
                return None
            return j2, x, parts | {j1}
        h = producers.get(other)  # (x * 0.5) * a
        if h is not None and nodes[h].op_type == "Mul" and self._sole_reader(other) == j1:
            ins = list(nodes[h].input)
            if x in ins and any(self._is(t, 0.5) for t in ins if t != x):
                return j1, x, parts | {h}
        return None

    # ---- one node -> ops ----

    def _data(self, node, index: int, k: int) -> str:
        """Input k of a node, which must be data (computed from the model's input)."""
        name = node.input[k] if k < len(node.input) else ""
        t = self._resolve(name)
        if t not in self.g.shapes:
            what = "a constant" if name in self.consts else "missing"
            self.refuse(
                node, index, f"input {k} ({name!r}) is {what}; fusedserve expects a tensor computed from the input"
            )
        return t

    def _weight(self, node, index: int, k: int, role: str, optional: bool = False) -> np.ndarray | None:
        name = node.input[k] if k < len(node.input) else ""
        if not name:
            if optional:
                return None
            self.refuse(node, index, f"has no {role}")
        if name not in self.consts:
            self.refuse(node, index, f"its {role} ({name!r}) is computed from the input; fusedserve needs a constant")
        value = self.consts[name]
        if value.dtype.kind != "f":
            self.refuse(node, index, f"its {role} ({name!r}) has dtype {value.dtype}; fusedserve needs floating point")
        return value.astype(np.float64)

    def _name(self, node, index: int) -> str:
        return self.g.op_name(node.name or f"{node.op_type}_{index}")

    def _emit_activation(self, node, index: int, kind: str, x: str, out: str, slope: float | None) -> None:
        x = self._resolve(x)
        if x not in self.g.shapes:
            self.refuse(node, index, f"reads {x!r}, which is not computed from the input")
        op = {"op": kind, "name": self._name(node, index), "inputs": [x], "output": out}
        if slope is not None:
            op["negative_slope"] = slope
        self.g.add(op, self.g.shapes[x])

    def _unused_extra_outputs(self, node, index: int) -> None:
        for o in node.output[1:]:
            if o and self.readers.get(o):
                self.refuse(node, index, f"its output {o!r} is read; fusedserve computes only the first output")

    def _map(self, node, i: int) -> None:
        kind = node.op_type
        attrs = self._attrs(node)
        out = node.output[0]
        simple = {"Relu": "relu", "Sigmoid": "sigmoid", "Tanh": "tanh", "HardSwish": "hardswish"}
        if kind in simple:
            self._emit_activation(node, i, simple[kind], node.input[0], out, None)
        elif kind == "LeakyRelu":
            self._emit_activation(node, i, "leaky_relu", node.input[0], out, float(attrs.get("alpha", 0.01)))
        elif kind == "Gelu":
            approximate = attrs.get("approximate", b"none")
            approximate = approximate.decode() if isinstance(approximate, bytes) else approximate
            x = self._data(node, i, 0)
            op = {"op": "gelu", "name": self._name(node, i), "inputs": [x], "output": out, "approximate": approximate}
            self.g.add(op, self.g.shapes[x])
        elif kind == "Clip":
            lo = self._weight(node, i, 1, "min", optional=True)
            hi = self._weight(node, i, 2, "max", optional=True)
            lo = -math.inf if lo is None else float(lo.reshape(-1)[0])
            hi = math.inf if hi is None else float(hi.reshape(-1)[0])
            if lo == 0 and hi == 6:
                self._emit_activation(node, i, "relu6", node.input[0], out, None)
            elif lo == 0 and hi == math.inf:
                self._emit_activation(node, i, "relu", node.input[0], out, None)
            else:
                self.refuse(node, i, f"Clip({lo:g}, {hi:g}): only Clip(0, 6) (ReLU6) and Clip(0) (ReLU) are supported")
        elif kind in ("Identity", "Dropout"):
            if kind == "Dropout":
                self._unused_extra_outputs(node, i)
                training = self._weight(node, i, 2, "training_mode", optional=True) if len(node.input) > 2 else None
                if training is not None and bool(training.reshape(-1)[0]):
                    self.refuse(node, i, "training_mode is true; fusedserve runs inference")
            self.alias[out] = self._data(node, i, 0)
        elif kind == "Conv":
            self._conv(node, i, attrs, out)
        elif kind == "BatchNormalization":
            self._batchnorm(node, i, attrs, out)
        elif kind in ("Gemm", "MatMul"):
            self._linear(node, i, attrs, out)
        elif kind == "Add":
            self._add(node, i, out)
        elif kind in ("MaxPool", "AveragePool"):
            self._pool(node, i, attrs, out)
        elif kind in ("GlobalAveragePool", "GlobalMaxPool"):
            x = self._data(node, i, 0)
            c, h, w = self._image(node, i, x)
            pool = "avgpool2d" if kind == "GlobalAveragePool" else "maxpool2d"
            op = {"op": pool, "name": self._name(node, i), "inputs": [x], "output": out, "kernel_size": [h, w]}
            self.g.add(op, (c, 1, 1))
        elif kind == "ReduceMean":
            self._reduce_mean(node, i, attrs, out)
        elif kind in ("Flatten", "Reshape", "Squeeze"):
            self._to_vector(node, i, attrs, out)
        elif kind == "Concat":
            xs = [self._data(node, i, k) for k in range(len(node.input))]
            shapes = [self.g.shapes[x] for x in xs]
            rank = len(shapes[0]) + 1
            axis = attrs.get("axis", 1)
            if (axis + rank if axis < 0 else axis) != 1:
                self.refuse(node, i, f"axis {axis} of rank-{rank} tensors: only concat along channels (axis 1)")
            if any(len(s) != len(shapes[0]) or s[1:] != shapes[0][1:] for s in shapes):
                self.refuse(node, i, f"joins tensors of per-row shapes {shapes}: all but the channels must agree")
            op = {"op": "concat", "name": self._name(node, i), "inputs": xs, "output": out}
            self.g.add(op, (sum(s[0] for s in shapes), *shapes[0][1:]))
        elif kind == "Softmax":
            x = self._data(node, i, 0)
            shape = self.g.shapes[x]
            axis = attrs.get("axis", -1)
            if len(shape) != 1 or axis not in (1, -1):
                self.refuse(node, i, f"axis {axis} of per-row shape {shape}: only softmax over a vector's features")
            if self._resolve(self.output) != out:
                self.refuse(node, i, "Softmax is supported only as the node that gives the model's output")
            self.g.add({"op": "softmax", "name": self._name(node, i), "inputs": [x], "output": out}, shape)
        elif kind in ("Mul", "Erf", "Div", "HardSigmoid"):
            self.refuse(
                node, i, f"{kind} is supported only as part of a pattern: {PATTERNS}; this one is not such a part"
            )
        else:  # _unsupported refused these already
            self.refuse(node, i, f"not supported; fusedserve imports {', '.join(SUPPORTED)}")

    def _image(self, node, index: int, x: str) -> tuple[int, int, int]:
        shape = self.g.shapes[x]
        if len(shape) != 3:
            self.refuse(node, index, f"reads {x!r} of per-row shape {shape}; it needs (channels, height, width)")
        return shape

    def _pads(self, node, index: int, attrs: dict, size, kernel, strides, dilations) -> list[int]:
        """Per-axis padding, the same on both sides (what the kernels and torch's modules do)."""
        auto = attrs.get("auto_pad", b"NOTSET")
        auto = auto.decode() if isinstance(auto, bytes) else auto
        if auto in ("SAME_UPPER", "SAME_LOWER"):
            pads = []
            for n, k, s, d in zip(size, kernel, strides, dilations, strict=True):
                total = max(0, (math.ceil(n / s) - 1) * s + (k - 1) * d + 1 - n)
                if total % 2:
                    self.refuse(node, index, f"auto_pad {auto} pads {total} pixels along an axis, unevenly; "
                                "fusedserve pads both sides alike")  # fmt: skip
                pads.append(total // 2)
            return pads
        if auto == "VALID":
            return [0, 0]
        pads = list(attrs.get("pads", [0, 0, 0, 0]))
        if len(pads) != 4 or pads[:2] != pads[2:]:
            self.refuse(node, index, f"pads {pads} differ between the start and the end of an axis; fusedserve pads "
                        "both sides alike")  # fmt: skip
        return pads[:2]

    def _conv(self, node, i: int, attrs: dict, out: str) -> None:
        x = self._data(node, i, 0)
        w = self._weight(node, i, 1, "weight")
        b = self._weight(node, i, 2, "bias", optional=True)
        if w.ndim != 4:
            self.refuse(node, i, f"weight of shape {w.shape}: only 2-D convolutions are supported")
        c, h, wd = self._image(node, i, x)
        strides = list(attrs.get("strides", [1, 1]))
        dilations = list(attrs.get("dilations", [1, 1]))
        kernel = list(w.shape[2:])
        pads = self._pads(node, i, attrs, (h, wd), kernel, strides, dilations)
        groups = int(attrs.get("group", 1))
        name = self._name(node, i)
        op = {"op": "conv2d", "name": name, "inputs": [x], "output": out, "weight": self.g.weight(name, "weight", w)}
        if b is not None:
            op["bias"] = self.g.weight(name, "bias", b)
        op.update(stride=strides, padding=pads, dilation=dilations, groups=groups)
        sizes = [
            conv_out(n, k, s, p, d) for n, k, s, p, d in zip((h, wd), kernel, strides, pads, dilations, strict=True)
        ]
        self.g.add(op, (w.shape[0], *sizes))

    def _batchnorm(self, node, i: int, attrs: dict, out: str) -> None:
        if attrs.get("training_mode", 0):
            self.refuse(node, i, "training_mode is 1; fusedserve imports inference batch norm")
        self._unused_extra_outputs(node, i)
        x = self._data(node, i, 0)
        name = self._name(node, i)
        op = {"op": "batchnorm", "name": name, "inputs": [x], "output": out}
        for k, role in enumerate(("weight", "bias", "mean", "var"), start=1):
            op[role] = self.g.weight(name, role, self._weight(node, i, k, role))
        op["eps"] = float(attrs.get("epsilon", 1e-5))
        self.g.add(op, self.g.shapes[x])

    def _linear(self, node, i: int, attrs: dict, out: str) -> None:
        x = self._data(node, i, 0)
        shape = self.g.shapes[x]
        if len(shape) != 1:
            self.refuse(node, i, f"reads {x!r} of per-row shape {shape}; it needs (rows, features): flatten first")
        b = None
        if node.op_type == "Gemm":
            if attrs.get("transA", 0):
                self.refuse(node, i, "transA = 1: the input must not be transposed")
            w = self._weight(node, i, 1, "weight (B)")
            w = (w if attrs.get("transB", 0) else w.T) * float(attrs.get("alpha", 1.0))
            c = self._weight(node, i, 2, "bias (C)", optional=True)
            if c is not None:
                b = self._bias_vector(node, i, c, w.shape[0]) * float(attrs.get("beta", 1.0))
        else:
            w = self._weight(node, i, 1, "weight (B)")
            if w.ndim != 2:
                self.refuse(node, i, f"weight of shape {w.shape}: only a 2-D (K, N) weight is supported")
            w = w.T
        if w.shape[1] != shape[0]:
            self.refuse(node, i, f"weight of shape {w.shape} (N, K) for an input of {shape[0]} features")
        name = self._name(node, i)
        op = {"op": "linear", "name": name, "inputs": [x], "output": out, "weight": self.g.weight(name, "weight", w)}
        if b is not None:
            op["bias"] = self.g.weight(name, "bias", b)
        self.g.add(op, (w.shape[0],))

    def _bias_vector(self, node, i: int, c: np.ndarray, n: int) -> np.ndarray:
        """A constant added per output channel, as (n,): a scalar, (n,), or ones around n."""
        if c.size == 1:
            return np.full(n, float(c.reshape(-1)[0]))
        if c.size == n and [d for d in c.shape if d != 1] == [n]:
            return c.reshape(n)
        self.refuse(
            node, i, f"adds a constant of shape {c.shape}; only one value per output channel ({n}) is supported"
        )

    def _add(self, node, i: int, out: str) -> None:
        consts = [t for t in node.input if t in self.consts]
        if not consts:
            a, b = self._data(node, i, 0), self._data(node, i, 1)
            sa, sb = self.g.shapes[a], self.g.shapes[b]
            if sa != sb:
                self.refuse(node, i, f"adds per-row shapes {sa} and {sb}; only tensors of one shape (a residual)")
            self.g.add({"op": "add", "name": self._name(node, i), "inputs": [a, b], "output": out}, sa)
            return
        if len(consts) == 2:  # both constant: folded already
            return
        raw = next(t for t in node.input if t not in self.consts)
        x = self._data(node, i, list(node.input).index(raw))
        producer = self.g.producer.get(x)
        if producer is None or producer["op"] not in ("linear", "conv2d") or self._sole_reader(raw) != i:
            self.refuse(node, i, "adds a constant to a tensor other than a Conv's or Gemm/MatMul's output (read by "
                        "this Add alone); fusedserve supports such adds only as that layer's bias")  # fmt: skip
        channels = self.g.shapes[x][0]
        c = self.consts[consts[0]].astype(np.float64)
        if producer["op"] == "conv2d" and c.ndim >= 3 and c.shape[-2:] != (1, 1):
            self.refuse(node, i, f"adds a constant of shape {c.shape}: only one value per channel is a bias")
        add = self._bias_vector(node, i, c, channels)
        if "bias" in producer:
            add = add + self.g.tensors[producer["bias"]].double().numpy()
        producer["bias"] = self.g.weight(producer["name"], "bias", add)
        self.alias[out] = x

    def _pool(self, node, i: int, attrs: dict, out: str) -> None:
        x = self._data(node, i, 0)
        c, h, w = self._image(node, i, x)
        if node.op_type == "MaxPool":
            self._unused_extra_outputs(node, i)
            if any(d != 1 for d in attrs.get("dilations", [1, 1])):
                self.refuse(node, i, f"dilations {list(attrs['dilations'])}: only 1 is supported")
        kernel = list(attrs["kernel_shape"])
        if len(kernel) != 2:
            self.refuse(node, i, f"kernel_shape {kernel}: only 2-D pooling is supported")
        strides = list(attrs.get("strides", [1, 1]))
        pads = self._pads(node, i, attrs, (h, w), kernel, strides, [1, 1])
        ceil = bool(attrs.get("ceil_mode", 0))
        pool = "maxpool2d" if node.op_type == "MaxPool" else "avgpool2d"
        op = {"op": pool, "name": self._name(node, i), "inputs": [x], "output": out, "kernel_size": kernel,
              "stride": strides, "padding": pads, "ceil_mode": ceil}  # fmt: skip
        if pool == "avgpool2d":
            op["count_include_pad"] = bool(attrs.get("count_include_pad", 0))
        sizes = [pool_out(n, k, s, p, ceil) for n, k, s, p in zip((h, w), kernel, strides, pads, strict=True)]
        self.g.add(op, (c, *sizes))

    def _reduce_mean(self, node, i: int, attrs: dict, out: str) -> None:
        x = self._data(node, i, 0)
        c, h, w = self._image(node, i, x)
        if len(node.input) > 1 and node.input[1]:
            axes = self._weight_int(node, i, 1, "axes")
        else:
            axes = list(attrs.get("axes", []))
        if sorted(a % 4 for a in axes) != [2, 3]:
            self.refuse(node, i, f"axes {axes}: only the mean over height and width (axes 2, 3) is supported")
        keep = attrs.get("keepdims", 1)
        name = self._name(node, i)
        pooled = out if keep else f"{out}:pooled"
        op = {"op": "avgpool2d", "name": name, "inputs": [x], "output": pooled, "kernel_size": [h, w]}
        self.g.add(op, (c, 1, 1))
        if not keep:
            flat = {"op": "flatten", "name": self.g.op_name(f"{name}:flatten"), "inputs": [pooled], "output": out}
            self.g.add(flat, (c,))

    def _weight_int(self, node, i: int, k: int, role: str) -> list[int]:
        name = node.input[k]
        if name not in self.consts:
            self.refuse(node, i, f"its {role} ({name!r}) is computed from the input; fusedserve needs a constant")
        return [int(v) for v in self.consts[name].reshape(-1)]

    def _to_vector(self, node, i: int, attrs: dict, out: str) -> None:
        """Flatten, Reshape or Squeeze that leaves (rows, features): a flatten; one that changes nothing: dropped."""
        x = self._data(node, i, 0)
        shape = self.g.shapes[x]
        features = math.prod(shape)
        if node.op_type == "Flatten":
            axis = attrs.get("axis", 1)
            if (axis + len(shape) + 1 if axis < 0 else axis) != 1:
                self.refuse(node, i, f"axis {axis}: only Flatten(axis=1), to (rows, features), is supported")
            target = (features,)
        elif node.op_type == "Squeeze":
            axes = self._weight_int(node, i, 1, "axes") if len(node.input) > 1 and node.input[1] else None
            axes = list(attrs.get("axes", [])) if axes is None else axes
            rank = len(shape) + 1
            axes = [a % rank for a in axes] if axes else [k for k in range(1, rank) if shape[k - 1] == 1]
            if 0 in axes or any(shape[a - 1] != 1 for a in axes):
                self.refuse(node, i, f"axes {axes} of per-row shape {shape}: only size-1 dimensions after the batch")
            target = tuple(d for k, d in enumerate(shape, start=1) if k not in axes)
        else:
            if node.input[1] not in self.consts:
                self.refuse(node, i, "its target shape is computed from data; fusedserve needs it known at import")
            target = self._reshape_target(node, i, shape, [int(v) for v in self.consts[node.input[1]].reshape(-1)],
                                          bool(attrs.get("allowzero", 0)))  # fmt: skip
        if target == shape:
            self.alias[out] = x
        elif target == (features,):
            self.g.add({"op": "flatten", "name": self._name(node, i), "inputs": [x], "output": out}, target)
        else:
            self.refuse(node, i, f"reshapes per-row {shape} to {target}: only flattening to (rows, features)")

    def _reshape_target(self, node, i: int, shape: tuple, dims: list[int], allowzero: bool) -> tuple[int, ...]:
        """Reshape's per-row target: its first dimension must be the batch (0, -1, or the batch from Shape)."""
        if not dims:
            self.refuse(node, i, "reshapes to a scalar")
        first, rest = dims[0], dims[1:]
        full_in = [BATCH, *shape]
        rest = [full_in[k + 1] if d == 0 and not allowzero and k + 1 < len(full_in) else d for k, d in enumerate(rest)]
        fixed = self.graph.input  # a batch of fixed size may be written as itself
        batch_dims = {0, BATCH, -1} | {d.dim_value for inp in fixed for d in inp.type.tensor_type.shape.dim[:1]}
        if first not in batch_dims or (first == -1 and -1 in rest):
            self.refuse(node, i, f"target shape {dims}: its first dimension is not the batch")
        features = math.prod(shape)
        if rest.count(-1) > 1:
            self.refuse(node, i, f"target shape {dims} has several -1")
        if -1 in rest:
            known = math.prod(d for d in rest if d != -1)
            if known == 0 or features % known:
                self.refuse(node, i, f"target shape {dims} does not fit {features} features per row")
            rest = [features // known if d == -1 else d for d in rest]
        if math.prod(rest) != features:
            self.refuse(node, i, f"target shape {dims} does not keep the {features} features of each row")
        return tuple(rest)


def read_labels(path: Path | str) -> list[str]:
    """Labels from a file: a JSON list, or one label per line."""
    text = Path(path).read_text()
    try:
        value = json.loads(text)
    except ValueError:
        return [line.strip() for line in text.splitlines() if line.strip()]
    if not isinstance(value, list):
        raise ModelFormatError(f"{path}: labels must be a JSON list or one label per line")
    return [str(v) for v in value]
