"""Export a trained torch module to the model format (fusedserve-model/2) through `torch.export`.

    from service.model.export import export_module
    export_module(model, torch.randn(2, 3, 32, 32), "model_weights/my-cnn", labels=["cat", "dog", ...])

`torch.export` traces the module's forward into a graph of ATen ops (residual adds, concats and all), with every
tensor's shape; each node is mapped by the handler its ATen op is registered to (torch_ops/, one module per op
family, `@register`), as the ONNX importer maps ONNX nodes:

    conv.py         conv2d / convolution (groups, dilation, asymmetric kernels)  -> conv2d
                    pad / constant_pad_nd -> pad; symmetric zeros read only by convs -> the convs' own padding
    linear.py       linear, addmm, mm / matmul by a constant weight -> linear; on a channels-last view, a 1x1 conv2d
    norm.py         batch_norm (inference) -> batchnorm; layer_norm over channels -> layernorm
    activations.py  relu, relu6, sigmoid, tanh, silu, gelu, hardswish, hardsigmoid, leaky_relu; hardtanh and clamp
                    -> relu6 / relu, or clip for other bounds; softmax over the output's features (the last op)
    elementwise.py  add, sub, rsub, mul, div, reciprocal, neg of two tensors (broadcasting) or of a tensor and a
                    parameter or number -> add / sub / mul / div (`constant`, `reverse`); add of a per-channel
                    constant to a conv's or linear's output -> its bias
    pool.py         max_pool2d (ceil_mode), avg_pool2d (padding, count_include_pad), adaptive pools to 1x1, to the
                    input's own size (nothing) or to a size that divides it, mean over (H, W) -> pools
    layout.py       flatten / view / reshape / squeeze to (rows, features) -> flatten; cat along channels -> concat
                    (one input: nothing); split / chunk / slice / narrow of channels -> slice; channel_shuffle and
                    view(N, g, C/g, H, W)-transpose(1, 2)-view(N, C, H, W) -> channel_shuffle; permute(0, 2, 3, 1)
                    -> a channels-last view (nothing emitted; see below), permute(0, 3, 1, 2) -> back;
                    dropout, clone, contiguous, detach, alias, _to_copy -> nothing

A channels-last view (ConvNeXt: permute(0, 2, 3, 1), LayerNorm, Linear, GELU, Linear, `gamma * x`, permute back) is
tracked per FX node (torch_ops/registry.py's View) as an alias of the channel-first graph tensor: layer_norm over its
last dim is `layernorm`, linear a 1x1 `conv2d`, an elementwise op by a (C,) parameter one by a (C, 1, 1) constant.
An in-place op (relu_, add_) is its functional op where nothing reads the old value after it. Ops on parameters
alone (a transpose of a weight) are evaluated at export. Anything else is refused naming the node, its ATen op, the
per-row shapes it reads, why, and what would be accepted. The module is exported in eval mode with a dynamic batch
dimension; the example input fixes every other size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
from torch import fx, nn

from .onnx_import import GraphBuilder
from .spec import FORMAT_V2, ModelFormatError, input_fields
from .torch_ops import HANDLERS
from .torch_ops.registry import (
    CHANNELS_LAST,
    GROUPED,
    PADDED,
    PARTS,
    PLAIN,
    RESULT,
    SELECTED,
    SHUFFLED,
    Args,
    View,
    op_name,
)

# What each view kind is, and what reads it, for the refusal of an op that reads it (registry.View).
_VIEW_READERS = {
    CHANNELS_LAST: (
        "a channels-last view (permute(0, 2, 3, 1)) of an image",
        "on such a view fusedserve maps layer_norm over the last dim, linear, activations, elementwise ops, "
        "slices, splits and cats of the last dim, mean over dims (1, 2), and permute(0, 3, 1, 2) back",
    ),
    GROUPED: (
        "a (N, groups, C / groups, H, W) view of an image",
        "fusedserve takes it only as half of a channel shuffle: transpose(1, 2), then a view back to (N, C, H, W)",
    ),
    SHUFFLED: (
        "a channel shuffle's transposed (N, C / groups, groups, H, W) view",
        "fusedserve takes it only viewed (or reshaped) back to (N, C, H, W): channel_shuffle",
    ),
    PARTS: ("the tuple of a split along channels", "fusedserve reads its items (x1, x2 = x.chunk(2, 1))"),
    RESULT: ("an op's tuple of result and statistics", "fusedserve reads its result (item 0)"),
    PADDED: ("a zero-padded image", "fusedserve folds the padding into the convs that read it"),
    SELECTED: ("one channel of an image without its channel dim (x[:, c])", "fusedserve reads it through unsqueeze(1)"),
}
# Ops whose result shares its input's storage: an in-place op on one changes that input too.
_VIEW_OPS = {
    "view", "_unsafe_view", "reshape", "permute", "transpose", "t", "slice", "narrow", "select", "expand", "squeeze",
    "unsqueeze", "flatten", "unflatten", "alias", "detach", "as_strided", "split", "split_with_sizes", "chunk",
    "unbind", "getitem", "contiguous",
}  # fmt: skip


class Exporter:
    """One torch.export program on its way to the format's graph: what each FX node's value is (`vals`: a View of a
    graph tensor; `consts`: parameters, buffers and what was computed from them alone) and the graph so far (`g`).
    Handlers (torch_ops/) read their arguments through `data`, `view` and `const`, and write through `emit`."""

    def __init__(self, program: torch.export.ExportedProgram):
        self.program = program
        self.g = GraphBuilder()
        self.consts: dict[str, Any] = {}  # FX node name -> constant tensor (parameters, buffers, folds)
        self.vals: dict[str, View] = {}  # FX node name -> what its value is in the graph
        self.order: dict[fx.Node, int] = {}
        self.input_name = ""
        self.output = ""
        self.batch = ""  # the batch dimension's symbol, as the example's shapes print it

    # ---- messages ----

    def refuse(self, node: fx.Node, why: str, accepts: str) -> NoReturn:
        """Refuse `node`: its name, its ATen op, the shapes it reads, why, and what would be accepted."""
        reads = [self.describe(a) for a in _node_args(node) if not _is_size(a)]
        reading = f", reading {', '.join(reads)}" if reads else ""
        raise ModelFormatError(f"node {node.name!r} ({node.target}{reading}): {why}; {accepts}")

    def describe(self, arg) -> str:
        """An argument as messages show it: `'conv2d' (N, 4, 8, 8)`, `the constant 'p_fc_weight' (10, 4)`."""
        if not isinstance(arg, fx.Node):
            return repr(arg)
        what = "the constant " if arg.name in self.consts else ""
        return f"{what}{arg.name!r} {self.shape_text(arg.meta.get('val'))}"

    def shape_text(self, val) -> str:
        if isinstance(val, torch.Tensor):
            dims = ["N" if str(d) == self.batch else str(d) for d in val.shape]
            return f"({', '.join(dims)}{',' if len(dims) == 1 else ''})"
        if isinstance(val, (list, tuple)):
            return f"(a tuple of {len(val)})"
        return f"({val!r})"

    # ---- reading a node's arguments ----

    def view(self, node: fx.Node, arg) -> View:
        """What `arg` (an argument of `node`) is in the graph; refuses what is not computed from the input."""
        if not isinstance(arg, fx.Node) or arg.name not in self.vals:
            got = "a constant" if isinstance(arg, fx.Node) and arg.name in self.consts else repr(arg)
            self.refuse(
                node,
                f"reads {got} where it needs a tensor computed from the input",
                "fusedserve maps ops whose data is the input or computed from it (constants as weights)",
            )
        return self.vals[arg.name]

    def data(self, node: fx.Node, arg, accepts: str | None = None) -> str:
        """The graph tensor that `arg` is (a plain view); refuses the other views, saying what would read them."""
        v = self.view(node, arg)
        if v.kind != PLAIN:
            what, readers = _VIEW_READERS[v.kind]
            self.refuse(node, f"reads {self.describe(arg)}, {what}", accepts or readers)
        return v.tensor

    def is_const(self, arg) -> bool:
        """A parameter, buffer or fold (an FX node), or a number."""
        if isinstance(arg, fx.Node):
            return arg.name in self.consts
        return isinstance(arg, (int, float)) and not isinstance(arg, bool)

    def const(self, node: fx.Node, arg, role: str, optional: bool = False) -> np.ndarray | None:
        """A constant argument in float64 (None where optional and absent)."""
        if arg is None and optional:
            return None
        if isinstance(arg, (int, float)) and not isinstance(arg, bool):
            return np.asarray(float(arg))
        if not isinstance(arg, fx.Node) or not isinstance(self.consts.get(arg.name), torch.Tensor):
            self.refuse(
                node,
                f"its {role} {self.describe(arg)} is computed from the input",
                f"fusedserve needs a constant {role} (a parameter, buffer or number)",
            )
        return self.consts[arg.name].detach().to(torch.float64).cpu().numpy()

    def shape(self, tensor: str) -> tuple[int, ...]:
        """A graph tensor's per-row shape (channel first)."""
        return self.g.shapes[tensor]

    def row_shape(self, node: fx.Node) -> tuple[int, ...]:
        """The per-row shape of `node`'s value as torch has it (the batch apart)."""
        return tuple(int(d) for d in node.meta["val"].shape[1:])

    def bind(self, node: fx.Node) -> Args:
        """`node`'s arguments by their names in the op's schema, with the schema's defaults."""
        schema = getattr(node.target, "_schema", None)
        if schema is None:  # operator.getitem and other Python functions
            return {**{f"arg{i}": a for i, a in enumerate(node.args)}, **node.kwargs}
        out: Args = {}
        for i, arg in enumerate(schema.arguments):
            if i < len(node.args) and not arg.kwarg_only:
                out[arg.name] = node.args[i]
            elif arg.name in node.kwargs:
                out[arg.name] = node.kwargs[arg.name]
            elif arg.has_default_value():
                out[arg.name] = arg.default_value
        for one, other in (("self", "input"), ("input", "self")):  # dropout_(self, ...) is dropout(input, ...)
            if one in out and other not in out:
                out[other] = out[one]
        return out

    # ---- writing ----

    def same(self, node: fx.Node, view: View) -> None:
        """`node` is `view` (an alias: nothing emitted)."""
        self.vals[node.name] = view

    def emit(
        self,
        node: fx.Node,
        op: str,
        inputs: list[str],
        *,
        weights: dict[str, np.ndarray | None] | None = None,
        shape: tuple[int, ...] | None = None,
        kind: str = PLAIN,
        item: str = PLAIN,
        output: str | None = None,
        name: str | None = None,
        **fields,
    ) -> str:
        """Add op `op` reading `inputs`, with `weights` stored as `<op name>.<role>` and `fields`; its output (default:
        the node's name, whose value it becomes, as a `kind` view) has per-row `shape` (default: the node's).
        Returns the output's name."""
        name = self.g.op_name(name or node.name)
        out = output or node.name
        spec = {"op": op, "name": name, "inputs": inputs, "output": out}
        for role, value in (weights or {}).items():
            if value is not None:
                spec[role] = self.g.weight(name, role, value)
        self.g.add({**spec, **fields}, self.row_shape(node) if shape is None else tuple(shape))
        if output is None:
            self.vals[node.name] = View(kind, out, item=item)
        return out

    # ---- the walk ----

    def run(self) -> GraphBuilder:
        sig = self.program.graph_signature
        state = {**self.program.state_dict, **self.program.constants}
        by_input = {**sig.inputs_to_parameters, **sig.inputs_to_buffers, **sig.inputs_to_lifted_tensor_constants}
        nodes = list(self.program.graph.nodes)
        self.order = {n: i for i, n in enumerate(nodes)}
        user_inputs = [n for n in nodes if n.op == "placeholder" and n.name in sig.user_inputs]
        if len(user_inputs) != 1:
            names = ", ".join(repr(n.name) for n in user_inputs)
            raise ModelFormatError(f"the module takes {len(user_inputs)} inputs ({names}); fusedserve serves one input")
        for node in nodes:
            if node.op == "placeholder":
                if node in user_inputs:
                    self.input_name = node.name
                    self.batch = str(node.meta["val"].shape[0])
                    self.g.shapes[node.name] = self.row_shape(node)
                    self.vals[node.name] = View(PLAIN, node.name)
                elif node.name in by_input:
                    self.consts[node.name] = state[by_input[node.name]]
            elif node.op == "call_function":
                self._call(node)
            elif node.op == "output":
                self._output(node)
        return self.g

    def _output(self, node: fx.Node) -> None:
        outs = [a for a in node.args[0] if a is not None]
        if len(outs) != 1:
            raise ModelFormatError(f"the module returns {len(outs)} values; fusedserve serves one output")
        out = outs[0]
        if not isinstance(out, fx.Node) or out.name not in self.vals or out.name == self.input_name:
            raise ModelFormatError("the module's output is not computed from its input")
        v = self.vals[out.name]
        if v.kind != PLAIN:
            what, _ = _VIEW_READERS[v.kind]
            raise ModelFormatError(
                f"the module's output {self.describe(out)} is {what}; fusedserve answers with a tensor of the graph "
                "(permute a channels-last view back, flatten it)"
            )
        if v.tensor == self.input_name:
            raise ModelFormatError("the module's output is its input")
        self.output = v.tensor

    def _call(self, node: fx.Node) -> None:
        name = op_name(node.target)
        val = node.meta.get("val")
        if not _tensor_valued(val):
            return  # a size (x.size(0), n // groups) or an assertion: nothing to map
        if all(self.is_const(a) for a in _node_args(node)):
            self._fold(node)
            return
        if isinstance(val, torch.Tensor) and (val.dim() == 0 or str(val.shape[0]) != self.batch):
            self.refuse(
                node,
                f"its result has shape {self.shape_text(val)}: the batch dimension N is not its first alone",
                "fusedserve maps ops that keep each row apart (batch first, never merged with another dimension)",
            )
        base = name
        if name.endswith("_") and not name.startswith("_") and name[:-1] in HANDLERS:
            self._check_in_place(node)
            base = name[:-1]
        handler = HANDLERS.get(base)
        if handler is None:
            self.refuse(node, "not supported", f"fusedserve exports the ATen ops {', '.join(sorted(HANDLERS))}")
        handler(self, node, self.bind(node))

    def _fold(self, node: fx.Node) -> None:
        """An op on constants alone: evaluated now."""

        in_place = op_name(node.target).endswith("_")

        def value(a):  # an in-place op changes a copy, never the module's own parameter
            if not isinstance(a, fx.Node):
                return a
            c = self.consts[a.name]
            return c.clone() if in_place and isinstance(c, torch.Tensor) else c

        args = fx.node.map_arg(node.args, value)
        kwargs = fx.node.map_arg(node.kwargs, value)
        result = node.target(*args, **kwargs)
        if isinstance(result, torch.Tensor):
            result = result.detach()
        self.consts[node.name] = result

    def _check_in_place(self, node: fx.Node) -> None:
        """An in-place op maps to its functional op only where nothing reads the old value (or a tensor sharing its
        storage: the base of a view) after it."""
        src = node.args[0] if node.args else None
        chain = [src]
        while isinstance(chain[-1], fx.Node) and op_name(chain[-1].target) in _VIEW_OPS and chain[-1].args:
            nxt = chain[-1].args[0]
            if not isinstance(nxt, fx.Node) or (op_name(chain[-1].target) == "getitem" and nxt.name in self.vals
                                                 and self.vals[nxt.name].kind == RESULT):  # fmt: skip
                break
            chain.append(nxt)
        for t in chain:
            if not isinstance(t, fx.Node):
                continue
            later = [u for u in t.users if u is not node and self.order.get(u, -1) > self.order[node]]
            later = [u for u in later if u not in chain]
            if later:
                shared = "" if t is src else f" (sharing the storage of {t.name!r})"
                self.refuse(
                    node,
                    f"changes {src.name!r}{shared} in place, and {later[0].name!r} reads that tensor afterwards",
                    "fusedserve maps an in-place op as its functional op, where nothing reads the old value after it",
                )


def _node_args(node: fx.Node) -> list[fx.Node]:
    read: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), read.append)
    return list(dict.fromkeys(read))


def _tensor_valued(val) -> bool:
    if isinstance(val, torch.Tensor):
        return True
    return isinstance(val, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in val)


def _is_size(arg) -> bool:
    """An FX node whose value is a size (x.size(0)), not a tensor."""
    return isinstance(arg, fx.Node) and not _tensor_valued(arg.meta.get("val")) and arg.op != "placeholder"


def import_module(
    module: nn.Module,
    example_input: torch.Tensor,
    *,
    name: str,
    labels: list[str] | None = None,
    description: str = "",
    input_dtype: str = "float32",
    mean: list[float] | None = None,
    std: list[float] | None = None,
) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, tensors) of the model format for `module` on inputs shaped like `example_input` (any batch).
    input_dtype, mean, std: what clients send ("uint8" pixels) and the per-channel normalization the served model
    applies before `module` (spec.input_fields); `module` itself takes the normalized float input."""
    declared = input_fields(input_dtype, mean, std)
    module = module.eval()
    x = example_input.detach().to("cpu", torch.float32)
    if x.dim() not in (2, 4):
        raise ModelFormatError(f"example input of shape {tuple(x.shape)}: give (batch, features) or (batch, C, H, W)")
    if x.shape[0] < 2:  # torch.export specialises a dimension of size 1: show it two rows
        x = x.expand(2, *x.shape[1:]).clone()
    try:
        with torch.no_grad():
            program = torch.export.export(
                module.to("cpu"), (x,), dynamic_shapes=({0: torch.export.Dim("batch")},), strict=False
            )
    except Exception as e:  # noqa: BLE001 (torch.export raises many kinds; say which step failed)
        raise ModelFormatError(f"torch.export could not trace the module: {type(e).__name__}: {e}") from None
    exporter = Exporter(program)
    g = exporter.run()
    if not g.ops or g.ops[-1]["output"] != exporter.output:
        raise ModelFormatError("the module's output is not written by its last op")
    config = {
        "format": FORMAT_V2,
        "name": name,
        "description": description,
        "source": f"torch.export of {type(module).__name__}, torch {torch.__version__}",
        "input": {"name": exporter.input_name, "shape": list(x.shape[1:]), **declared},
        "output": exporter.output,
        **({"labels": list(labels)} if labels is not None else {}),
        "ops": g.ops,
    }
    return config, g.tensors


def export_module(
    module: nn.Module,
    example_input: torch.Tensor,
    out_dir: str | Path,
    *,
    name: str | None = None,
    labels: list[str] | None = None,
    description: str = "",
    input_dtype: str = "float32",
    mean: list[float] | None = None,
    std: list[float] | None = None,
) -> Path:
    """Write config.json + model.safetensors for `module` (checked by loading them back); returns out_dir.
    input_dtype, mean, std: as import_module takes them."""
    from .loader import load_model, model_from_config
    from .writer import write_model, written

    out = Path(out_dir)
    config, tensors = import_module(module, example_input, name=name or out.name, labels=labels,
                                    description=description, input_dtype=input_dtype, mean=mean,
                                    std=std)  # fmt: skip
    model_from_config(config, tensors, out, f"export of {type(module).__name__}")  # refuse before writing
    write_model(out, config, tensors)
    load_model(out)
    print(written(out, config, tensors))
    return out
