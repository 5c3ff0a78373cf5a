"""Export a trained torch module to the model format (fusedserve-model/2) through `torch.export`.

    from service.model.export import export_module
    export_module(model, torch.randn(2, 3, 32, 32), "model_weights/my-cnn", labels=["cat", "dog", ...])

`torch.export` traces the module's forward into a graph of ATen ops (residual adds, concats and all), with
every tensor's shape; each op becomes an op of the format, as the ONNX importer does for ONNX nodes:

    aten.conv2d / convolution (groups allowed)     -> conv2d
    aten.batch_norm, _native_batch_norm_legit_no_training (inference)  -> batchnorm
    aten.linear, addmm, mm / matmul with a parameter    -> linear
    aten.add (two tensors of one shape)             -> add; add of a constant after a conv or linear -> its bias
    relu, leaky_relu, sigmoid, tanh, silu, gelu, hardswish, hardtanh(0, 6) / relu6   -> activations
    max_pool2d, avg_pool2d, adaptive_avg_pool2d to 1x1, mean over (H, W)   -> maxpool2d, avgpool2d
    flatten, view / reshape to (batch, features)    -> flatten
    cat along channels                              -> concat
    dropout, clone, contiguous, detach, alias       -> dropped
    softmax over the output's features              -> softmax (as the last op only)

Ops on parameters alone (a transpose of a weight) are evaluated at export. Anything else is refused with the
node's name and its ATen op. The module is exported in eval mode with a dynamic batch dimension; the example
input fixes every other size.
"""

from __future__ import annotations

import math
import operator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .onnx_import import GraphBuilder
from .spec import FORMAT_V2, ModelFormatError, input_fields

# ATen op -> the _Exporter method that maps it
HANDLERS = {
    "conv2d": "_conv2d", "convolution": "_convolution", "batch_norm": "_batch_norm",
    "_native_batch_norm_legit_no_training": "_native_bn", "linear": "_linear", "addmm": "_addmm", "mm": "_mm",
    "matmul": "_mm", "add": "_add", "hardtanh": "_hardtanh", "leaky_relu": "_leaky_relu", "gelu": "_gelu",
    "max_pool2d": "_max_pool2d", "avg_pool2d": "_avg_pool2d", "adaptive_avg_pool2d": "_adaptive_avg_pool2d",
    "mean": "_mean", "flatten": "_flatten", "view": "_view", "reshape": "_view", "cat": "_cat", "softmax": "_softmax",
    "_softmax": "_softmax",
}  # fmt: skip
_ACTIVATIONS = {"relu": "relu", "relu6": "relu6", "sigmoid": "sigmoid", "tanh": "tanh", "silu": "silu",
                "hardswish": "hardswish"}  # fmt: skip
_DROPPED = {"dropout", "clone", "contiguous", "detach", "alias", "_to_copy", "feature_dropout", "lift_fresh_copy"}
SUPPORTED = (*HANDLERS, *_ACTIVATIONS, *sorted(_DROPPED))


def _op_name(target) -> str:
    """aten.conv2d.default -> conv2d; operator.getitem -> getitem."""
    if target is operator.getitem:
        return "getitem"
    name = getattr(target, "_opname", None) or getattr(target, "__name__", str(target))
    return name.split(".")[0]


class _Exporter:
    def __init__(self, program: torch.export.ExportedProgram):
        self.program = program
        self.g = GraphBuilder()
        self.consts: dict[str, torch.Tensor] = {}  # FX node name -> constant tensor (parameters, buffers, folds)
        self.alias: dict[str, str] = {}
        self.input_name = ""

    def refuse(self, node, why: str):
        raise ModelFormatError(f"node {node.name!r} ({node.target}): {why}")

    def _resolve(self, name: str) -> str:
        while name in self.alias:
            name = self.alias[name]
        return name

    def _data(self, node, arg) -> str:
        if not isinstance(arg, torch.fx.Node):
            self.refuse(node, f"reads {arg!r} where fusedserve expects a tensor computed from the input")
        name = self._resolve(arg.name)
        if name not in self.g.shapes:
            self.refuse(node, f"reads {arg.name!r}, which is not computed from the input")
        return name

    def _const(self, node, arg, role: str, optional: bool = False) -> np.ndarray | None:
        if arg is None and optional:
            return None
        if not isinstance(arg, torch.fx.Node) or arg.name not in self.consts:
            self.refuse(node, f"its {role} is not a parameter or constant; fusedserve needs constant weights")
        return self.consts[arg.name].detach().to(torch.float64).cpu().numpy()

    @staticmethod
    def _row_shape(node) -> tuple[int, ...]:
        val = node.meta.get("val")
        return tuple(int(d) for d in val.shape[1:])

    def run(self) -> GraphBuilder:
        sig = self.program.graph_signature
        state = {**self.program.state_dict, **self.program.constants}
        by_input = {**sig.inputs_to_parameters, **sig.inputs_to_buffers, **sig.inputs_to_lifted_tensor_constants}
        user_inputs = [n for n in self.program.graph.nodes if n.op == "placeholder" and n.name in sig.user_inputs]
        if len(user_inputs) != 1:
            names = ", ".join(repr(n.name) for n in user_inputs)
            raise ModelFormatError(f"the module takes {len(user_inputs)} inputs ({names}); fusedserve serves one input")
        for node in self.program.graph.nodes:
            if node.op == "placeholder":
                if node in user_inputs:
                    self.input_name = node.name
                    self.g.shapes[node.name] = self._row_shape(node)
                elif node.name in by_input:
                    self.consts[node.name] = state[by_input[node.name]]
            elif node.op == "call_function":
                self._call(node)
            elif node.op == "output":
                outs = [a for a in node.args[0] if a is not None]
                if len(outs) != 1:
                    raise ModelFormatError(f"the module returns {len(outs)} values; fusedserve serves one output")
                self.output = self._resolve(outs[0].name)
        if self.output not in self.g.producer:
            raise ModelFormatError("the module's output is not computed from its input")
        return self.g

    def _call(self, node) -> None:
        name = _op_name(node.target)
        args, kwargs = list(node.args), dict(node.kwargs)
        read: list[torch.fx.Node] = []
        torch.fx.node.map_arg((args, kwargs), read.append)
        if name == "sym_size" or (read and all(a.name in self.consts for a in read)):
            self._fold(node, name, args, kwargs)
            return
        if name == "getitem":  # batch norm's outputs: the first is the result
            source, index = args
            if index != 0:
                self.refuse(node, "reads a batch norm's saved statistics; fusedserve runs inference")
            self.alias[node.name] = self._resolve(source.name)
            return
        if name in _DROPPED:
            if name in ("dropout", "feature_dropout") and len(args) > 2 and args[2]:
                self.refuse(node, "dropout in training mode; call module.eval() before exporting")
            self.alias[node.name] = self._data(node, args[0])
            return
        if name in _ACTIVATIONS:
            self._activation(node, _ACTIVATIONS[name], args[0])
        elif name in HANDLERS:
            getattr(self, HANDLERS[name])(node, args, kwargs)
        else:
            self.refuse(node, f"not supported; fusedserve exports the ATen ops {', '.join(SUPPORTED)}")

    def _fold(self, node, name, args, kwargs) -> None:
        """An op on constants alone (or the batch size): evaluated now."""
        if name == "sym_size":
            return  # the batch size, read by a view that flattens (see _view)

        def value(a):
            return self.consts[a.name] if isinstance(a, torch.fx.Node) else a

        result = node.target(*torch.fx.node.map_arg(args, value), **torch.fx.node.map_arg(kwargs, value))
        if isinstance(result, torch.Tensor):
            self.consts[node.name] = result.detach()

    def _emit(self, node, op: dict, inputs: list[str]) -> None:
        op = {"op": op["op"], "name": self.g.op_name(node.name), "inputs": inputs, "output": node.name,
              **{k: v for k, v in op.items() if k != "op"}}  # fmt: skip
        self.g.add(op, self._row_shape(node))

    def _activation(self, node, kind: str, x_arg, **extra) -> None:
        self._emit(node, {"op": kind, **extra}, [self._data(node, x_arg)])

    # ---- ops ----

    def _conv2d(self, node, args, kwargs) -> None:
        names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
        a = {**dict(zip(names, args, strict=False)), **kwargs}
        self._conv(node, a)

    def _convolution(self, node, args, kwargs) -> None:
        names = ("input", "weight", "bias", "stride", "padding", "dilation", "transposed", "output_padding", "groups")
        a = {**dict(zip(names, args, strict=False)), **kwargs}
        if a.get("transposed"):
            self.refuse(node, "a transposed convolution is not supported")
        self._conv(node, a)

    def _conv(self, node, a: dict) -> None:
        x = self._data(node, a["input"])
        w = self._const(node, a["weight"], "weight")
        if w.ndim != 4:
            self.refuse(node, f"weight of shape {w.shape}: only 2-D convolutions are supported")
        b = self._const(node, a.get("bias"), "bias", optional=True)
        stride, dilation = _pair(a.get("stride") or 1), _pair(a.get("dilation") or 1)
        padding = a.get("padding", 0)
        if isinstance(padding, str):
            if padding == "valid":
                padding = [0, 0]
            else:  # "same": symmetric where each dilation * (kernel - 1) is even
                totals = [d * (k - 1) for d, k in zip(dilation, w.shape[2:], strict=True)]
                if any(t % 2 for t in totals):
                    self.refuse(
                        node, "padding='same' with an even kernel pads unevenly; fusedserve pads both sides alike"
                    )
                padding = [t // 2 for t in totals]
        else:
            padding = _pair(padding)
        name = self.g.op_name(node.name)
        op = {"op": "conv2d", "name": name, "inputs": [x], "output": node.name,
              "weight": self.g.weight(name, "weight", w)}  # fmt: skip
        if b is not None:
            op["bias"] = self.g.weight(name, "bias", b)
        op.update(stride=stride, padding=padding, dilation=dilation, groups=int(a.get("groups", 1) or 1))
        self.g.add(op, self._row_shape(node))

    def _batch_norm(self, node, args, kwargs) -> None:
        names = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps")
        a = {**dict(zip(names, args, strict=False)), **kwargs}
        if a.get("training"):
            self.refuse(node, "batch norm in training mode; call module.eval() before exporting")
        self._bn(node, a)

    def _native_bn(self, node, args, kwargs) -> None:
        names = ("input", "weight", "bias", "running_mean", "running_var", "momentum", "eps")
        self._bn(node, {**dict(zip(names, args, strict=False)), **kwargs})

    def _bn(self, node, a: dict) -> None:
        x = self._data(node, a["input"])
        channels = self.g.shapes[x][0]
        name = self.g.op_name(node.name)
        op = {"op": "batchnorm", "name": name, "inputs": [x], "output": node.name}
        for role, key, default in (("weight", "weight", 1.0), ("bias", "bias", 0.0), ("mean", "running_mean", None),
                                   ("var", "running_var", None)):  # fmt: skip
            value = self._const(node, a.get(key), role, optional=default is not None)
            op[role] = self.g.weight(name, role, np.full(channels, default) if value is None else value)
        op["eps"] = float(a.get("eps", 1e-5))
        self.g.add(op, self.g.shapes[x])

    def _linear_op(self, node, x_arg, w: np.ndarray, b: np.ndarray | None) -> None:
        """A linear layer: w (N, K), b (N,) or None."""
        x = self._data(node, x_arg)
        if len(self.g.shapes[x]) != 1:
            self.refuse(node, f"reads per-row shape {self.g.shapes[x]}; a linear layer needs (rows, features)")
        name = self.g.op_name(node.name)
        op = {"op": "linear", "name": name, "inputs": [x], "output": node.name,
              "weight": self.g.weight(name, "weight", w)}  # fmt: skip
        if b is not None:
            op["bias"] = self.g.weight(name, "bias", np.broadcast_to(b, (w.shape[0],)))
        self.g.add(op, self._row_shape(node))

    def _linear(self, node, args, kwargs) -> None:
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        self._linear_op(node, args[0], self._const(node, args[1], "weight"), self._const(node, bias, "bias", True))

    def _addmm(self, node, args, kwargs) -> None:  # bias + x @ w_t
        beta, alpha = float(kwargs.get("beta", 1)), float(kwargs.get("alpha", 1))
        w = self._const(node, args[2], "weight").T * alpha
        self._linear_op(node, args[1], w, self._const(node, args[0], "bias") * beta)

    def _mm(self, node, args, kwargs) -> None:
        w = self._const(node, args[1], "weight")
        if w.ndim != 2:
            self.refuse(node, f"weight of shape {w.shape}: only a 2-D (K, N) weight is supported")
        self._linear_op(node, args[0], w.T, None)

    def _add(self, node, args, kwargs) -> None:
        alpha = kwargs.get("alpha", 1)
        a, b = args[0], args[1]
        consts = [v for v in (a, b) if not isinstance(v, torch.fx.Node) or v.name in self.consts]
        if not consts:
            if alpha != 1:
                self.refuse(node, f"add with alpha {alpha}: only a plain sum of two tensors")
            xa, xb = self._data(node, a), self._data(node, b)
            if self.g.shapes[xa] != self.g.shapes[xb]:
                self.refuse(node, f"adds per-row shapes {self.g.shapes[xa]} and {self.g.shapes[xb]}; only one shape")
            self._emit(node, {"op": "add"}, [xa, xb])
            return
        data = a if consts[0] is b else b
        x = self._data(node, data)
        c = consts[0]
        c = np.asarray(self.consts[c.name].detach().double().cpu() if isinstance(c, torch.fx.Node) else c)
        producer = self.g.producer.get(x)
        if producer is None or producer["op"] not in ("linear", "conv2d") or len(data.users) != 1:
            self.refuse(node, "adds a constant to a tensor other than a conv's or linear's output (read by this add "
                        "alone); fusedserve supports such adds only as that layer's bias")  # fmt: skip
        channels = self.g.shapes[x][0]
        if c.size == 1:
            add = np.full(channels, float(c.reshape(-1)[0]))
        elif c.size == channels and [d for d in c.shape if d != 1] == [channels]:
            add = c.reshape(channels)
        else:
            self.refuse(node, f"adds a constant of shape {c.shape}: only one value per channel is a bias")
        if "bias" in producer:
            add = add + self.g.tensors[producer["bias"]].double().numpy()
        producer["bias"] = self.g.weight(producer["name"], "bias", add * alpha if data is a else add)
        self.alias[node.name] = x

    def _hardtanh(self, node, args, kwargs) -> None:
        lo = args[1] if len(args) > 1 else kwargs.get("min_val", -1.0)
        hi = args[2] if len(args) > 2 else kwargs.get("max_val", 1.0)
        if (lo, hi) == (0, 6):
            self._activation(node, "relu6", args[0])
        elif lo == 0 and hi == math.inf:
            self._activation(node, "relu", args[0])
        else:
            self.refuse(node, f"hardtanh({lo}, {hi}): only (0, 6), ReLU6, is supported")

    def _leaky_relu(self, node, args, kwargs) -> None:
        slope = args[1] if len(args) > 1 else kwargs.get("negative_slope", 0.01)
        self._activation(node, "leaky_relu", args[0], negative_slope=float(slope))

    def _gelu(self, node, args, kwargs) -> None:
        self._activation(node, "gelu", args[0], approximate=kwargs.get("approximate", "none"))

    def _max_pool2d(self, node, args, kwargs) -> None:
        names = ("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode")
        a = {**dict(zip(names, args, strict=False)), **kwargs}
        if any(d != 1 for d in _pair(a.get("dilation", 1))):
            self.refuse(node, "dilation other than 1 is not supported")
        self._pool(node, "maxpool2d", a)

    def _avg_pool2d(self, node, args, kwargs) -> None:
        names = ("input", "kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override")
        a = {**dict(zip(names, args, strict=False)), **kwargs}
        if a.get("divisor_override") is not None:
            self.refuse(node, "divisor_override is not supported")
        self._pool(node, "avgpool2d", a)

    def _pool(self, node, kind: str, a: dict) -> None:
        kernel = _pair(a["kernel_size"])
        stride = _pair(a.get("stride") or kernel)
        op = {"op": kind, "kernel_size": kernel, "stride": stride, "padding": _pair(a.get("padding", 0)),
              "ceil_mode": bool(a.get("ceil_mode", False))}  # fmt: skip
        if kind == "avgpool2d":
            op["count_include_pad"] = bool(a.get("count_include_pad", True))
        self._emit(node, op, [self._data(node, a["input"])])

    def _adaptive_avg_pool2d(self, node, args, kwargs) -> None:
        x = self._data(node, args[0])
        if _pair(args[1]) != [1, 1]:
            self.refuse(node, f"output size {args[1]}: only adaptive pooling to 1x1 (global) is supported")
        self._emit(node, {"op": "avgpool2d", "kernel_size": list(self.g.shapes[x][1:])}, [x])

    def _mean(self, node, args, kwargs) -> None:
        x = self._data(node, args[0])
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        keep = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        if len(self.g.shapes[x]) != 3 or sorted(d % 4 for d in (dims or [])) != [2, 3]:
            self.refuse(node, f"mean over {dims}: only the mean over height and width (dims 2, 3) is supported")
        c, h, w = self.g.shapes[x]
        name = self.g.op_name(node.name)
        pooled = node.name if keep else f"{node.name}:pooled"
        op = {"op": "avgpool2d", "name": name, "inputs": [x], "output": pooled, "kernel_size": [h, w]}
        self.g.add(op, (c, 1, 1))
        if not keep:
            flat = {"op": "flatten", "name": self.g.op_name(f"{name}:flatten"), "inputs": [pooled], "output": node.name}
            self.g.add(flat, (c,))

    def _flatten(self, node, args, kwargs) -> None:
        x = self._data(node, args[0])
        start = args[1] if len(args) > 1 else kwargs.get("start_dim", 0)
        end = args[2] if len(args) > 2 else kwargs.get("end_dim", -1)
        if start != 1 or end not in (-1, len(self.g.shapes[x])):
            self.refuse(node, f"flatten({start}, {end}): only flatten(1), to (rows, features), is supported")
        self._to_vector(node, x)

    def _view(self, node, args, kwargs) -> None:
        x = self._data(node, args[0])
        shape = self._row_shape(node)
        if shape != (math.prod(self.g.shapes[x]),) and shape != self.g.shapes[x]:
            self.refuse(node, f"reshapes per-row {self.g.shapes[x]} to {shape}: only flattening to (rows, features)")
        self._to_vector(node, x)

    def _to_vector(self, node, x: str) -> None:
        if self._row_shape(node) == self.g.shapes[x]:
            self.alias[node.name] = x
        else:
            self._emit(node, {"op": "flatten"}, [x])

    def _cat(self, node, args, kwargs) -> None:
        xs = [self._data(node, a) for a in args[0]]
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        rank = len(self.g.shapes[xs[0]]) + 1
        if (dim + rank if dim < 0 else dim) != 1:
            self.refuse(node, f"cat along dim {dim}: only along channels (dim 1)")
        self._emit(node, {"op": "concat"}, xs)

    def _softmax(self, node, args, kwargs) -> None:
        x = self._data(node, args[0])
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if len(self.g.shapes[x]) != 1 or dim not in (1, -1):
            self.refuse(node, f"softmax over dim {dim} of per-row shape {self.g.shapes[x]}: only over the features")
        if any(u.op != "output" for u in node.users):
            self.refuse(node, "softmax is supported only as the module's output")
        self._emit(node, {"op": "softmax"}, [x])


def _pair(v) -> list[int]:
    return [int(v), int(v)] if isinstance(v, int) else [int(i) for i in (list(v) * 2)[:2]]


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
    exporter = _Exporter(program)
    g = exporter.run()
    if g.ops[-1]["output"] != exporter.output:
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
    from .writer import write_model

    out = Path(out_dir)
    config, tensors = import_module(module, example_input, name=name or out.name, labels=labels,
                                    description=description, input_dtype=input_dtype, mean=mean,
                                    std=std)  # fmt: skip
    model_from_config(config, tensors, out, f"export of {type(module).__name__}")  # refuse before writing
    write_model(out, config, tensors)
    load_model(out)
    return out
