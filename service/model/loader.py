"""Load a model directory (config.json + model.safetensors, or an .onnx file imported on the fly) and check
every tensor against the ops.

Shapes are followed through the op graph from the input shape, so each mismatch is reported where it
happens, with what was expected and why: "ops[2] (linear): weight 'fc2.weight' has shape
(256, 255); expected (N, 256) because its input has 256 features", "ops[3] (maxpool2d): kernel_size
(5, 5) with padding (0, 0) does not fit the input's (4, 4) pixels". Image ops (conv2d, pools) take
per-row shapes (channels, height, width) and give the sizes torch would:

    out = floor((in + 2 * padding - dilation * (kernel - 1) - 1) / stride) + 1        (conv2d; pools: dilation 1)

with ceil instead of floor for a pool's ceil_mode, less one where the last window would start in the
right padding, as torch.nn.MaxPool2d documents.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .planner import InputNorm
from .shapes import conv_out, pool_out
from .spec import (
    IMAGE_CHANNELS,
    AddOp,
    BatchNormOp,
    BinaryOp,
    ChannelShuffleOp,
    ConcatOp,
    Conv2dOp,
    FlattenOp,
    LayerNormOp,
    LinearOp,
    ModelFormatError,
    ModelSpec,
    Op,
    PadOp,
    PoolOp,
    SliceOp,
    SoftmaxOp,
    parse_spec,
    read_spec,
    where_op,
)

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
Shape = tuple[int, ...]


@dataclass(frozen=True)
class Model:
    """A validated model: its spec, parsed and wired ops (a graph in op order), tensors (CPU, as stored), and
    the per-row shape of every tensor of the graph (`shapes`, by tensor name: the input's, each op's output)."""

    path: Path
    spec: ModelSpec
    ops: list[Op]
    tensors: dict[str, torch.Tensor]
    input_shape: tuple[int, ...]
    output_features: int
    shapes: dict[str, Shape] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def input_features(self) -> int:
        return math.prod(self.input_shape)

    @property
    def input_name(self) -> str:
        return self.spec.input.name

    @property
    def input_dtype(self) -> torch.dtype:
        """The dtype clients send the input in: torch.uint8 (pixels) or torch.float32."""
        return torch.uint8 if self.spec.input.dtype == "uint8" else torch.float32

    @property
    def normalize(self) -> InputNorm | None:
        """The input's normalization as the planner takes it, or None."""
        norm = self.spec.input.normalize
        return None if norm is None else InputNorm(tuple(norm.mean), tuple(norm.std))


def load_model(path: Path | str) -> Model:
    """Read and validate a model; raise ModelFormatError saying exactly what is wrong. `path`: a model directory
    (config.json + model.safetensors), an .onnx file, or a directory holding one .onnx file and no config.json
    (both imported on the fly: onnx_import.py)."""
    path = Path(path)
    if path.is_file() and path.suffix.lower() == ".onnx":
        return load_onnx(path)
    if not path.is_dir():
        if path.is_file():
            raise ModelFormatError(f"{path}: not a model: give a model directory or an .onnx file")
        what = "no such .onnx file" if path.suffix.lower() == ".onnx" else "no such model directory or .onnx file"
        raise ModelFormatError(f"{path}: {what}")
    if not (path / "config.json").exists():
        onnx_files = sorted(path.glob("*.onnx"))
        if len(onnx_files) == 1:
            return load_onnx(onnx_files[0], name=path.name)
        if len(onnx_files) > 1:
            names = ", ".join(f.name for f in onnx_files)
            raise ModelFormatError(f"{path}: no config.json and several .onnx files ({names}); name one of them")
    spec, ops = read_spec(path)
    tensors = _read_tensors(path / "model.safetensors")
    return model_from(spec, ops, tensors, path, path / "config.json")


def load_onnx(path: Path | str, *, name: str | None = None) -> Model:
    """Import an ONNX file on the fly (no files written) and check it as a model directory is checked."""
    from .onnx_import import import_onnx

    path = Path(path)
    config, tensors = import_onnx(path, name=name)
    return model_from_config(config, tensors, path, path)


def model_from_config(config: dict, tensors: dict[str, torch.Tensor], path: Path, where: object) -> Model:
    """A Model from a config (as importers make it) and its tensors, checked as a model directory is."""
    spec, ops = parse_spec(config, where)
    return model_from(spec, ops, tensors, path, where)


def model_from(spec: ModelSpec, ops: list[Op], tensors: dict[str, torch.Tensor], path: Path, where: object) -> Model:
    try:
        _check_input(spec)
        shapes = _check_ops(ops, tensors, spec.input.name, tuple(spec.input.shape))
    except ModelFormatError as e:
        raise ModelFormatError(f"{where}: {e}") from None
    shape = shapes[ops[-1].output]
    if len(shape) != 1:
        last = "the last op" if spec.format == "fusedserve-model/1" else f"the output {ops[-1].output!r}"
        raise ModelFormatError(
            f"{where}: {last} leaves shape {shape} per row; the output must be a vector (add a flatten op)"
        )
    if spec.labels is not None and len(spec.labels) != shape[0]:
        raise ModelFormatError(f"{where}: {len(spec.labels)} labels but the model outputs {shape[0]} values per row")
    used = {name for op in ops for name in tensor_names(op)}
    return Model(
        path=path,
        spec=spec,
        ops=ops,
        tensors={k: v for k, v in tensors.items() if k in used},
        input_shape=tuple(spec.input.shape),
        output_features=shape[0],
        shapes=shapes,
    )


def _check_input(spec: ModelSpec) -> None:
    """The input's normalization: an image input, one mean and std per channel; its image preprocessing: an image
    input of the channels it names, resized at least to its size."""
    _check_image(spec)
    norm, shape = spec.input.normalize, tuple(spec.input.shape)
    if norm is None:
        return
    if len(shape) != 3:
        raise ModelFormatError(
            f"input.normalize: the input has shape {shape} per row; normalization is per channel of an image "
            f"(channels, height, width)"
        )
    if len(norm.mean) != shape[0]:
        raise ModelFormatError(
            f"input.normalize: {len(norm.mean)} mean and std values but the input has {shape[0]} channel"
            f"{'s' if shape[0] != 1 else ''} (shape {shape}); one of each per channel"
        )


def _check_image(spec: ModelSpec) -> None:
    image, shape = spec.input.image, tuple(spec.input.shape)
    if image is None:
        return
    if len(shape) != 3:
        raise ModelFormatError(
            f"input.image: the input has shape {shape} per row; encoded images need an image input "
            f"(channels, height, width)"
        )
    channels = image_channels(spec)
    if IMAGE_CHANNELS[channels] != shape[0]:
        raise ModelFormatError(
            f"input.image: channels {channels!r} gives {IMAGE_CHANNELS[channels]} channel(s) but the input has "
            f"{shape[0]} (shape {shape}); use RGB or BGR for 3, L for 1"
        )
    if image.resize is not None and image.resize < min(shape[1:]):
        raise ModelFormatError(
            f"input.image: resize {image.resize} makes the shorter side smaller than the center crop {shape[1]}x"
            f"{shape[2]} (the input's height and width); resize to at least {min(shape[1:])}"
        )


def image_channels(spec: ModelSpec) -> str:
    """The channel order an image input takes: as declared, else RGB for 3 channels and L for 1."""
    declared = spec.input.image.channels
    return declared if declared is not None else ("L" if spec.input.shape[0] == 1 else "RGB")


def tensor_names(op: Op) -> list[str]:
    """The safetensors names an op reads."""
    if isinstance(op, (LinearOp, Conv2dOp)):
        return [n for n in (op.weight, op.bias) if n]
    if isinstance(op, BatchNormOp):
        return [op.weight, op.bias, op.mean, op.var]
    if isinstance(op, LayerNormOp):
        return [n for n in (op.weight, op.bias) if n]
    if isinstance(op, (AddOp, BinaryOp)) and op.constant is not None:
        return [op.constant]
    return []


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise ModelFormatError(f"{path}: not found")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except (SafetensorError, OSError, ValueError) as e:
        raise ModelFormatError(f"{path}: not a readable safetensors file: {e}") from None


def _tensor(tensors: dict[str, torch.Tensor], name: str, where: str, role: str) -> torch.Tensor:
    if name not in tensors:
        have = ", ".join(sorted(tensors)) or "nothing"
        raise ModelFormatError(f"{where}: {role} tensor {name!r} is not in model.safetensors (it has: {have})")
    t = tensors[name]
    if t.dtype not in FLOAT_DTYPES:
        raise ModelFormatError(f"{where}: {role} tensor {name!r} has dtype {t.dtype}; expected float32/16 or bfloat16")
    if not torch.isfinite(t).all():
        raise ModelFormatError(f"{where}: {role} tensor {name!r} contains NaN or Inf")
    return t


def _check_ops(ops: list[Op], tensors: dict[str, torch.Tensor], input_name: str, input_shape: Shape) -> dict:
    """Follow the per-row shapes through the (wired) ops; return every tensor's shape by name."""
    shapes: dict[str, Shape] = {input_name: input_shape}
    for i, op in enumerate(ops):
        where = where_op(op, i)
        shape = shapes[op.input]
        if isinstance(op, (AddOp, BinaryOp)):
            shape = _check_elementwise(op, shapes, tensors, where)
        elif isinstance(op, LayerNormOp):
            channels = shape[0]
            for role in ("weight", "bias"):
                name = getattr(op, role)
                if name is not None and tuple(_tensor(tensors, name, where, role).shape) != (channels,):
                    raise ModelFormatError(
                        f"{where}: {role} {name!r} has shape {tuple(tensors[name].shape)}; expected ({channels},): one "
                        f"per channel of its input of shape {shape}"
                    )
        elif isinstance(op, SliceOp):
            if op.end > shape[0]:
                raise ModelFormatError(
                    f"{where}: slices channels {op.start}:{op.end} of an input of shape {shape} ({shape[0]} channels)"
                )
            shape = (op.end - op.start, *shape[1:])
        elif isinstance(op, ChannelShuffleOp):
            c = _image_shape(shape, where, "channel_shuffle")[0]
            if c % op.groups:
                raise ModelFormatError(f"{where}: groups {op.groups} does not divide the input's {c} channels")
        elif isinstance(op, PadOp):
            c, h, w = _image_shape(shape, where, "pad")
            top, left, bottom, right = op.pads
            shape = (c, h + top + bottom, w + left + right)
        elif isinstance(op, ConcatOp):
            parts = [shapes[t] for t in op.inputs]
            if any(len(p) != len(shape) or p[1:] != shape[1:] for p in parts):
                listed = ", ".join(f"{t!r} {p}" for t, p in zip(op.inputs, parts, strict=True))
                raise ModelFormatError(
                    f"{where}: concatenates {listed} per row; concat joins along channels (or features), so the "
                    "other dimensions must agree"
                )
            shape = (sum(p[0] for p in parts), *shape[1:])
        elif isinstance(op, BatchNormOp):
            channels = shape[0]
            for role in ("weight", "bias", "mean", "var"):
                name = getattr(op, role)
                t = _tensor(tensors, name, where, role)
                if tuple(t.shape) != (channels,):
                    raise ModelFormatError(
                        f"{where}: {role} {name!r} has shape {tuple(t.shape)}; expected ({channels},): one per "
                        f"channel of its input of shape {shape}"
                    )
            if (tensors[op.var] < 0).any():
                raise ModelFormatError(f"{where}: var {op.var!r} has negative values; a variance is >= 0")
        elif isinstance(op, SoftmaxOp):
            if i != len(ops) - 1:
                raise ModelFormatError(f"{where}: softmax is supported only as the op that gives the model's output")
            if len(shape) != 1:
                raise ModelFormatError(f"{where}: input has shape {shape} per row; softmax takes the output vector")
        elif isinstance(op, FlattenOp):
            shape = (math.prod(shape),)
        elif isinstance(op, Conv2dOp):
            shape = _check_conv2d(op, tensors, shape, where)
        elif isinstance(op, PoolOp):
            shape = _check_pool2d(op, shape, where)
        elif isinstance(op, LinearOp):
            if len(shape) != 1:
                raise ModelFormatError(f"{where}: input has shape {shape} per row; linear needs a vector (add flatten)")
            w = _tensor(tensors, op.weight, where, "weight")
            if w.dim() != 2 or w.shape[1] != shape[0]:
                raise ModelFormatError(
                    f"{where}: weight {op.weight!r} has shape {tuple(w.shape)}; expected (N, {shape[0]}) "
                    f"because its input has {shape[0]} features"
                )
            if op.bias is not None:
                b = _tensor(tensors, op.bias, where, "bias")
                if tuple(b.shape) != (w.shape[0],):
                    raise ModelFormatError(
                        f"{where}: bias {op.bias!r} has shape {tuple(b.shape)}; expected ({w.shape[0]},) "
                        f"to match weight {op.weight!r}"
                    )
            shape = (w.shape[0],)
        # activations keep the shape
        shapes[op.output] = shape
    return shapes


def _check_elementwise(op: AddOp | BinaryOp, shapes: dict, tensors: dict[str, torch.Tensor], where: str) -> Shape:
    """The per-row shape of x (op) y: both broadcast (numpy's rules) to one of them (neither grows the other's
    dimensions both ways), or a constant that broadcasts against x without growing it."""
    a = shapes[op.inputs[0]]
    if op.constant is not None:
        c = _tensor(tensors, op.constant, where, "constant")
        b, what = tuple(c.shape), f"the constant {op.constant!r}"
    else:
        b, what = shapes[op.inputs[1]], repr(op.inputs[1])
    out = broadcast_shape(a, b)
    if out is None or (op.constant is not None and out != a) or out not in (a, b):
        verb = {"add": "adds", "sub": "subtracts", "mul": "multiplies", "div": "divides"}[op.op]
        joint = {"add": "to", "sub": "and", "mul": "by", "div": "by"}[op.op]
        raise ModelFormatError(
            f"{where}: {verb} {op.inputs[0]!r} of shape {a} {joint} {what} of shape {b} per row; {op.op} takes "
            "tensors of one shape, or shapes that broadcast to one of them (numpy's rules, the batch apart)"
        )
    return out


def broadcast_shape(a: Shape, b: Shape) -> Shape | None:
    """numpy's broadcast of two shapes, or None where they do not broadcast."""
    rank = max(len(a), len(b))
    a, b = (1,) * (rank - len(a)) + tuple(a), (1,) * (rank - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b, strict=True):
        if x != y and 1 not in (x, y):
            return None
        out.append(max(x, y))
    return tuple(out)


def _image_shape(shape: tuple[int, ...], where: str, kind: str) -> tuple[int, int, int]:
    if len(shape) != 3:
        raise ModelFormatError(
            f"{where}: input has shape {shape} per row; {kind} needs (channels, height, width), "
            f'e.g. "input": {{"shape": [1, 8, 8]}}'
        )
    return shape  # type: ignore[return-value]


def _check_conv2d(op: Conv2dOp, tensors: dict[str, torch.Tensor], shape: tuple[int, ...], where: str):
    c, h, w_in = _image_shape(shape, where, "conv2d")
    w = _tensor(tensors, op.weight, where, "weight")
    g = op.groups
    if c % g:
        raise ModelFormatError(f"{where}: groups {g} does not divide the input's {c} channels")
    if w.dim() != 4 or w.shape[1] != c // g:
        per = f" / groups {g}" if g > 1 else ""
        raise ModelFormatError(
            f"{where}: weight {op.weight!r} has shape {tuple(w.shape)}; expected (out, {c // g}, kh, kw) "
            f"because its input has {c} channel{'s' if c != 1 else ''}{per}"
        )
    if w.shape[0] % g:
        raise ModelFormatError(f"{where}: groups {g} does not divide the {w.shape[0]} output channels of {op.weight!r}")
    if op.bias is not None:
        b = _tensor(tensors, op.bias, where, "bias")
        if tuple(b.shape) != (w.shape[0],):
            raise ModelFormatError(
                f"{where}: bias {op.bias!r} has shape {tuple(b.shape)}; expected ({w.shape[0]},) "
                f"to match weight {op.weight!r}"
            )
    kernel = (w.shape[2], w.shape[3])
    out = tuple(
        conv_out(n, k, s, p, d)
        for n, k, s, p, d in zip((h, w_in), kernel, op.stride, op.padding, op.dilation, strict=True)
    )
    if min(out) < 1:
        raise ModelFormatError(
            f"{where}: kernel {kernel} (from weight {op.weight!r}) with dilation {op.dilation} and padding "
            f"{op.padding} does not fit the input's {(h, w_in)} pixels (output would be {out})"
        )
    return (w.shape[0], *out)


def _check_pool2d(op: PoolOp, shape: tuple[int, ...], where: str):
    c, h, w = _image_shape(shape, where, op.op)
    for k, p in zip(op.kernel_size, op.padding, strict=True):
        if 2 * p > k:  # torch refuses this too: a window could then see nothing but padding
            raise ModelFormatError(f"{where}: padding {op.padding} is more than half of kernel_size {op.kernel_size}")
    stride = op.stride_or_kernel
    out = tuple(
        pool_out(n, k, s, p, op.ceil_mode)
        for n, k, s, p in zip((h, w), op.kernel_size, stride, op.padding, strict=True)
    )
    if min(out) < 1:
        raise ModelFormatError(
            f"{where}: kernel_size {op.kernel_size} with padding {op.padding} does not fit the input's "
            f"{(h, w)} pixels (output would be {out})"
        )
    return (c, *out)
