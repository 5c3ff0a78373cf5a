"""The model format: `config.json` beside `model.safetensors` in `model_weights/<name>/`.

Two versions. `fusedserve-model/1`, a sequence: each op reads what the op before it gave.

    {"format": "fusedserve-model/1", "name": "digits-mlp",
     "input": {"shape": [64], "dtype": "float32"},
     "labels": ["0", ..., "9"],                       # optional; one per output column
     "ops": [{"op": "linear", "weight": "fc1.weight", "bias": "fc1.bias"}, {"op": "relu"}, ...]}

Ops, in order: `linear` (weight (N, K) and optional bias (N,), tensor names in the safetensors
file), `conv2d` (weight (out, in, kh, kw), optional bias (out,), stride, padding, dilation; groups 1),
`avgpool2d` and `maxpool2d` (kernel_size, stride (default: kernel_size), padding, ceil_mode, and for
avg count_include_pad, as torch defines them), `flatten`, and activations: `relu`, `leaky_relu`
(negative_slope), `gelu` (approximate: "none" | "tanh"), `sigmoid`, `silu`, `tanh`. A pair field
(stride, padding, dilation, kernel_size) is one int for both sides or `[h, w]`. Image ops take rows of
shape (channels, height, width): `"input": {"shape": [1, 8, 8]}`. Every problem is reported with its
place (`ops[3]`) and what was expected.

The input may declare `"dtype": "uint8"` (pixels 0-255 as clients send them; default "float32") and, for an image
input, `"normalize": {"mean": [...], "std": [...]}` with one value per channel: the model then computes on
(x - mean[c]) / std[c], with the first conv's zero padding after that normalization (torch's
conv2d((x - mean) / std, padding=p)). Both formats take them. An image input may also declare
`"image": {"resize": 256, "interpolation": "bilinear", "channels": "RGB"}` (ImagePreprocess): clients may then send
JPEG, PNG or WebP files, decoded, resized and center-cropped to the input's size by the service.

`fusedserve-model/2`, a graph: the same ops, each of which may name its input tensors and its output, so
residual adds and channel concats can be written, and these ops besides:

    {"format": "fusedserve-model/2", "name": "digits-resnet",
     "input": {"name": "input", "shape": [1, 8, 8], "dtype": "float32"},
     "output": "logits",                              # optional: the last op's output
     "ops": [{"op": "conv2d", "name": "stem", "inputs": ["input"], "output": "t0", "weight": "stem.w"},
             {"op": "batchnorm", "inputs": ["t0"], "output": "t1", "weight": "bn.w", "bias": "bn.b",
              "mean": "bn.mean", "var": "bn.var", "eps": 1e-5},
             {"op": "relu", "inputs": ["t1"], "output": "t2"}, ...
             {"op": "add", "inputs": ["t7", "t2"], "output": "t8"}, ...]}

`name` (default `ops[i]`) names the op in messages; `inputs` (default: the previous op's output, or the model's
input for the first op) and `output` (default: the op's name) are tensor names, each output written once and
read only by later ops. New ops: `batchnorm` (inference: per-channel weight, bias, running mean and var, eps;
the fused executor folds it into the conv or linear before it), `add` (two tensors of one shape), `concat`
(along channels, or features of a vector), `softmax` (over the features of the model's output only), the
activations `relu6` and `hardswish`, and `conv2d` with `groups` > 1 (depthwise and grouped convs). For the CNNs
people deploy (squeeze-and-excitation, ConvNeXt, ShuffleNet, DenseNet): elementwise `add`, `sub`, `mul`, `div`
of two tensors with broadcasting (an SE block's `mul` of an image by a (C, 1, 1) tensor) or of a tensor and a
stored `constant`; `hardsigmoid` (alpha, beta), `clip` (min, max), `layernorm` over the channels, `slice` of a
run of channels, `channel_shuffle` (groups), `pad` (constant, [top, left, bottom, right]). Importers write this
version (onnx_import.py, torch_import.py); the loader follows every tensor's shape through the graph.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Literal

import orjson
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, ValidationError, model_validator

FORMAT = "fusedserve-model/1"  # what export_sequential writes: a sequence of ops
FORMAT_V2 = "fusedserve-model/2"  # a graph of ops: what the importers write
FORMATS = (FORMAT, FORMAT_V2)
# torch.nn.LeakyReLU's default, as kernels.activations.DEFAULT_NEGATIVE_SLOPE (not imported from there:
# importing `kernels` fixes interpreted-vs-compiled, which the service decides later, from its settings).
DEFAULT_NEGATIVE_SLOPE = 0.01


class ModelFormatError(ValueError):
    """The model directory is not a valid model; the message says what and where."""


class _Op(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    # Graph fields (format 2 only; `wire` fills them in for both formats): the op's name for messages and
    # step names' provenance, the tensors it reads and the one it writes.
    name: str | None = None
    inputs: tuple[str, ...] | None = None
    output: str | None = None

    @property
    def input(self) -> str:
        """The op's first (for most ops, only) input tensor; the op must be wired."""
        return self.inputs[0]


class LinearOp(_Op):
    op: Literal["linear"]
    weight: str
    bias: str | None = None


def _pair_of(minimum: int):
    """A (h, w) field given as one int for both sides or as [h, w], each >= minimum; bools and floats refused."""

    def check(v: object) -> tuple[int, int]:
        items = list(v) if isinstance(v, (list, tuple)) else [v, v]
        if len(items) != 2 or not all(isinstance(i, int) and not isinstance(i, bool) and i >= minimum for i in items):
            raise ValueError(f"must be an integer >= {minimum} or a pair [h, w] of them; got {v!r}")
        return items[0], items[1]

    return BeforeValidator(check)


Pair = tuple[int, int]
PositivePair = Annotated[Pair, _pair_of(1)]
NonNegativePair = Annotated[Pair, _pair_of(0)]


class Conv2dOp(_Op):
    """torch.nn.Conv2d with zero padding: weight (out, in / groups, kh, kw), bias (out,). groups 1 in format 1;
    in format 2 any groups that divide both channel counts (depthwise: groups == in channels). Pair fields are
    normalised to (h, w)."""

    op: Literal["conv2d"]
    weight: str
    bias: str | None = None
    stride: PositivePair = (1, 1)
    padding: NonNegativePair = (0, 0)
    dilation: PositivePair = (1, 1)
    groups: Annotated[int, Field(ge=1)] = 1


class _PoolOp(_Op):
    kernel_size: PositivePair
    stride: PositivePair | None = None  # None: kernel_size, as in torch
    padding: NonNegativePair = (0, 0)
    ceil_mode: StrictBool = False

    @property
    def stride_or_kernel(self) -> Pair:
        return self.kernel_size if self.stride is None else self.stride


class AvgPool2dOp(_PoolOp):
    """torch.nn.AvgPool2d (without divisor_override)."""

    op: Literal["avgpool2d"]
    count_include_pad: StrictBool = True


class MaxPool2dOp(_PoolOp):
    """torch.nn.MaxPool2d with dilation 1."""

    op: Literal["maxpool2d"]


class FlattenOp(_Op):
    op: Literal["flatten"]


class SimpleActivationOp(_Op):
    op: Literal["relu", "sigmoid", "silu", "tanh", "relu6", "hardswish"]


class LeakyReluOp(_Op):
    op: Literal["leaky_relu"]
    negative_slope: float = DEFAULT_NEGATIVE_SLOPE


class GeluOp(_Op):
    op: Literal["gelu"]
    approximate: Literal["none", "tanh"] = "none"


class BatchNormOp(_Op):
    """torch.nn.BatchNorm1d/2d in inference: (x - mean) / sqrt(var + eps) * weight + bias per channel (dim 1)."""

    op: Literal["batchnorm"]
    weight: str
    bias: str
    mean: str
    var: str
    eps: Annotated[float, Field(ge=0)] = 1e-5


class _ElementwiseOp(_Op):
    """x (op) y elementwise, with numpy's broadcasting of per-row shapes (right-aligned; the batch is never
    broadcast): two tensors (`inputs` [x, y]), or one tensor and a stored constant (`inputs` [x], `constant` the
    tensor's name in model.safetensors, of a per-row shape that broadcasts against x's without growing it, such as
    (C, 1, 1) for one value per channel of an image, or () for a scalar). `reverse`: constant (op) x."""

    constant: str | None = None
    reverse: StrictBool = False


class AddOp(_ElementwiseOp):
    """a + b: two tensors of one shape (a residual connection), or broadcast, or a tensor and a constant."""

    op: Literal["add"]


class BinaryOp(_ElementwiseOp):
    """a - b, a * b, a / b (a squeeze-and-excitation block's per-image per-channel scale is a `mul` of an image by a
    (C, 1, 1) tensor; a layer scale, a `mul` by a constant)."""

    op: Literal["sub", "mul", "div"]


class HardSigmoidOp(_Op):
    """max(0, min(1, alpha * x + beta)); torch's nn.Hardsigmoid is alpha 1/6, beta 0.5 (ONNX's default is 0.2)."""

    op: Literal["hardsigmoid"]
    alpha: float = 1 / 6
    beta: float = 0.5


class ClipOp(_Op):
    """min(max(x, min), max); either bound may be left out (null)."""

    op: Literal["clip"]
    min: float | None = None
    max: float | None = None


class LayerNormOp(_Op):
    """Layer norm over the channels (dim 1): each pixel's channels of an image, or a vector's features, normalised
    to zero mean and unit variance (biased, + eps), then * weight + bias per channel. ConvNeXt's LayerNorm2d, and a
    LayerNorm applied to channels-last activations, are this op on the channel-first tensor."""

    op: Literal["layernorm"]
    weight: str
    bias: str | None = None
    eps: Annotated[float, Field(ge=0)] = 1e-5


class SliceOp(_Op):
    """x[:, start:end]: a contiguous run of channels (of an image) or features (of a vector); ONNX's Split and
    Slice along channels, torch's chunk and split."""

    op: Literal["slice"]
    start: Annotated[int, Field(ge=0)]
    end: Annotated[int, Field(ge=1)]


class ChannelShuffleOp(_Op):
    """ShuffleNet's channel shuffle: (N, C, H, W) viewed as (N, groups, C / groups, H, W), the two channel axes
    swapped, viewed back as (N, C, H, W) (torch.nn.ChannelShuffle)."""

    op: Literal["channel_shuffle"]
    groups: Annotated[int, Field(ge=1)]


_Pixels = Annotated[int, Field(ge=0)]


class PadOp(_Op):
    """Constant padding of an image's height and width: pads [top, left, bottom, right] pixels of `value`."""

    op: Literal["pad"]
    pads: tuple[_Pixels, _Pixels, _Pixels, _Pixels]
    value: float = 0.0


class ConcatOp(_Op):
    """torch.cat(inputs, dim=1): along the channels of images, or the features of vectors."""

    op: Literal["concat"]
    axis: Literal[1] = 1


class SoftmaxOp(_Op):
    """torch.softmax(x, dim=1) over the features of the model's output (only as the op that gives it)."""

    op: Literal["softmax"]


Op = (
    LinearOp | Conv2dOp | AvgPool2dOp | MaxPool2dOp | FlattenOp | SimpleActivationOp | LeakyReluOp | GeluOp
    | BatchNormOp | AddOp | BinaryOp | ConcatOp | SoftmaxOp | HardSigmoidOp | ClipOp | LayerNormOp | SliceOp
    | ChannelShuffleOp | PadOp
)  # fmt: skip
PoolOp = AvgPool2dOp | MaxPool2dOp
OP_TYPES: dict[str, type[_Op]] = {
    "linear": LinearOp,
    "conv2d": Conv2dOp,
    "avgpool2d": AvgPool2dOp,
    "maxpool2d": MaxPool2dOp,
    "flatten": FlattenOp,
    "relu": SimpleActivationOp,
    "sigmoid": SimpleActivationOp,
    "silu": SimpleActivationOp,
    "tanh": SimpleActivationOp,
    "leaky_relu": LeakyReluOp,
    "gelu": GeluOp,
    "relu6": SimpleActivationOp,
    "hardswish": SimpleActivationOp,
    "batchnorm": BatchNormOp,
    "add": AddOp,
    "concat": ConcatOp,
    "softmax": SoftmaxOp,
    "sub": BinaryOp,
    "mul": BinaryOp,
    "div": BinaryOp,
    "hardsigmoid": HardSigmoidOp,
    "clip": ClipOp,
    "layernorm": LayerNormOp,
    "slice": SliceOp,
    "channel_shuffle": ChannelShuffleOp,
    "pad": PadOp,
}
# Format 1 is what it was: a sequence of these ops, without graph fields.
V1_OPS = (
    "linear",
    "conv2d",
    "avgpool2d",
    "maxpool2d",
    "flatten",
    "relu",
    "sigmoid",
    "silu",
    "tanh",
    "leaky_relu",
    "gelu",
)
GRAPH_FIELDS = ("name", "inputs", "output")
# Inputs an op reads: (fewest, most); None: any number from the fewest.
ARITY = {"add": (1, 2), "sub": (1, 2), "mul": (1, 2), "div": (1, 2), "concat": (2, None)}
ELEMENTWISE = ("add", "sub", "mul", "div")
# hardsigmoid's (alpha, beta) as torch's nn.Hardsigmoid has them: the kernels' `hardsigmoid` activation
TORCH_HARDSIGMOID = (1 / 6, 0.5)


def activation_of(op: Op) -> tuple[str, float] | None:
    """(kernel activation name, negative_slope) if `op` is an activation, else None."""
    if isinstance(op, SimpleActivationOp):
        return op.op, DEFAULT_NEGATIVE_SLOPE
    if isinstance(op, LeakyReluOp):
        return "leaky_relu", op.negative_slope
    if isinstance(op, GeluOp):
        return ("gelu_tanh" if op.approximate == "tanh" else "gelu"), DEFAULT_NEGATIVE_SLOPE
    if (
        isinstance(op, HardSigmoidOp)
        and math.isclose(op.alpha, TORCH_HARDSIGMOID[0], rel_tol=1e-6)
        and (op.beta == TORCH_HARDSIGMOID[1])
    ):
        return "hardsigmoid", DEFAULT_NEGATIVE_SLOPE
    return None


class Normalize(BaseModel):
    """An image input's normalization: the model computes on (x - mean[c]) / std[c], x the pixel as sent (uint8
    0-255, or a float). One value per channel; std > 0, every value finite (the loader checks the count)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    mean: Annotated[list[float], Field(min_length=1)]
    std: Annotated[list[float], Field(min_length=1)]

    @model_validator(mode="after")
    def _check(self) -> Normalize:
        for field in ("mean", "std"):
            for i, v in enumerate(getattr(self, field)):
                if not math.isfinite(v) or (field == "std" and v <= 0):
                    want = "> 0 and finite" if field == "std" else "finite"
                    raise ValueError(f"{field}[{i}] is {v!r}; each {field} must be {want}")
        if len(self.mean) != len(self.std):
            raise ValueError(f"mean has {len(self.mean)} values and std {len(self.std)}; one of each per channel")
        return self


class ImagePreprocess(BaseModel):
    """An image input that clients may also send as an encoded file (JPEG, PNG, WebP), and how the service turns
    such a file into the input's (channels, height, width) pixels, as torchvision's transforms would:
    Resize(resize, antialias=True) of the shorter side (aspect kept; none when `resize` is absent), then
    CenterCrop((height, width)) to the input's own size, in `channels` order (RGB, BGR, or L: one gray channel).
    The mean and std are the input's `normalize` (pixel units, 0-255), which the first conv folds as for tensors."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    resize: Annotated[int, Field(ge=1)] | None = None
    interpolation: Literal["bilinear", "bicubic"] = "bilinear"
    channels: Literal["RGB", "BGR", "L"] | None = None  # None: RGB for 3 channels, L for 1


IMAGE_CHANNELS = {"RGB": 3, "BGR": 3, "L": 1}


def input_fields(
    dtype: str = "float32",
    mean: list[float] | None = None,
    std: list[float] | None = None,
    image: dict | None = None,
) -> dict:
    """The `input` fields an importer adds for what the user declared: the dtype clients send, a normalization
    (mean and std, both or neither), and `image` (ImagePreprocess's fields) for a model that takes encoded images.
    The loader checks them as it checks a hand-written config."""
    if (mean is None) != (std is None):
        raise ModelFormatError("input.normalize: give both mean and std (one value of each per channel), or neither")
    fields: dict = {"dtype": dtype}
    if mean is not None:
        fields["normalize"] = {"mean": list(mean), "std": list(std)}
    if image is not None:
        fields["image"] = {k: v for k, v in image.items() if v is not None}
    return fields


class InputSpec(BaseModel):
    """The model's input: its per-row shape and the dtype clients send it in. `uint8` (pixels 0-255): a quarter of
    float32's bytes from the client to the GPU; the first conv (or a normalization step) turns them into the
    compute dtype. `normalize` (image inputs): per-channel mean and std applied as the first conv loads x."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: Annotated[str, Field(min_length=1)] = "input"  # the input tensor's name in a format-2 graph
    shape: Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=1, max_length=4)]
    dtype: Literal["float32", "uint8"] = "float32"
    normalize: Normalize | None = None
    image: ImagePreprocess | None = None


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    format: Literal["fusedserve-model/1", "fusedserve-model/2"]
    name: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str = ""
    input: InputSpec
    output: Annotated[str, Field(min_length=1)] | None = None  # format 2: the tensor the model answers with
    source: str = ""  # format 2: where an importer took the graph from (e.g. "onnx: model.onnx, opset 18")
    labels: list[str] | None = None
    ops: Annotated[list[dict], Field(min_length=1)]

    def parsed_ops(self) -> list[Op]:
        """The ops, validated and wired (every op names its inputs and output)."""
        v1 = self.format == FORMAT
        if v1:
            for field in ("output", "source"):
                if getattr(self, field):
                    raise ModelFormatError(f"{field}: needs format {FORMAT_V2!r} (a graph); this config is {FORMAT!r}")
            if self.input.name != "input":
                raise ModelFormatError(f"input.name: needs format {FORMAT_V2!r} (a graph); this config is {FORMAT!r}")
        ops = [parse_op(raw, i, v1=v1) for i, raw in enumerate(self.ops)]
        return wire(ops, self.input.name, self.output)


def where_op(op: Op, index: int) -> str:
    """How messages name an op: `ops[3] (add)`, or `ops[3] (add '/b1/Add')` when the config names it."""
    named = op.name is not None and op.name != f"ops[{index}]"
    return f"ops[{index}] ({op.op}{f' {op.name!r}' if named else ''})"


def parse_op(raw: object, index: int, *, v1: bool = False) -> Op:
    where = f"ops[{index}]"
    if not isinstance(raw, dict) or not isinstance(raw.get("op"), str):
        raise ModelFormatError(f"{where}: each op must be an object with a string 'op' field; got {raw!r}")
    kind = raw["op"]
    known = V1_OPS if v1 else tuple(OP_TYPES)
    if kind not in known:
        later = f" (op {kind!r} needs format {FORMAT_V2!r})" if kind in OP_TYPES else ""
        raise ModelFormatError(f"{where}: unknown op {kind!r}; expected one of {', '.join(known)}{later}")
    if v1:
        graph = [f for f in GRAPH_FIELDS if f in raw]
        if graph:
            fields = ", ".join(graph)
            raise ModelFormatError(
                f"{where} ({kind}): {fields}: graph fields need format {FORMAT_V2!r}, not {FORMAT!r}"
            )
        if raw.get("groups", 1) != 1 and kind == "conv2d":
            got = raw["groups"]
            raise ModelFormatError(
                f"{where} ({kind}): groups: Input should be 1 in {FORMAT!r} ({FORMAT_V2!r} takes more); got {got!r}"
            )
    try:
        return OP_TYPES[kind].model_validate(raw)
    except ValidationError as e:
        raise ModelFormatError(f"{where} ({kind}): {_describe(e)}") from None


def wire(ops: list[Op], input_name: str = "input", output: str | None = None) -> list[Op]:
    """Fill in each op's graph fields: `name` ops[i], `inputs` the previous op's output (the model's input for the
    first op), `output` the op's name. Checks that every tensor is written once, before it is read, and that
    every op's result reaches the model's output (default: the last op's). Ops already wired pass unchanged."""
    wired: list[Op] = []
    written = {input_name: "the model's input"}
    names: set[str] = set()
    previous = input_name
    for i, op in enumerate(ops):
        name = op.name if op.name is not None else f"ops[{i}]"
        inputs = op.inputs if op.inputs is not None else (previous,)
        out = op.output if op.output is not None else name
        op = op.model_copy(update={"name": name, "inputs": tuple(inputs), "output": out})
        where = where_op(op, i)
        if name in names:
            raise ModelFormatError(f"{where}: name {name!r} is used by an earlier op; names are unique")
        names.add(name)
        fewest, most = ARITY.get(op.op, (1, 1))
        if len(inputs) < fewest or (most is not None and len(inputs) > most):
            want = f"{fewest}" if fewest == most else f"at least {fewest}"
            raise ModelFormatError(f"{where}: reads {len(inputs)} tensor(s) {list(inputs)}; {op.op} reads {want}")
        if op.op in ELEMENTWISE and (len(inputs) == 1) != (op.constant is not None):
            raise ModelFormatError(
                f"{where}: reads {len(inputs)} tensor(s) {list(inputs)}"
                + (f" and the constant {op.constant!r}" if op.constant is not None else "")
                + f"; {op.op} takes two tensors, or one tensor and a constant"
            )
        if isinstance(op, SliceOp) and op.end <= op.start:
            raise ModelFormatError(f"{where}: start {op.start} and end {op.end}: the slice must keep a channel")
        for t in inputs:
            if t not in written:
                later = " (ops must be listed in an order where each reads only tensors written before it)"
                raise ModelFormatError(
                    f"{where}: input {t!r} is not the model's input or an earlier op's output{later}"
                )
        if out in written:
            raise ModelFormatError(f"{where}: output {out!r} is already written by {written[out]}; each tensor once")
        written[out] = where
        wired.append(op)
        previous = out
    final = output if output is not None else previous
    if final not in written or final == input_name:
        raise ModelFormatError(f"output: {final!r} is not an op's output")
    # Every op must contribute to the output: an op whose result nobody reads is a mistake in the graph.
    needed = {final}
    for i in range(len(wired) - 1, -1, -1):
        op = wired[i]
        if op.output in needed:
            needed.update(op.inputs)
        else:
            raise ModelFormatError(
                f"{where_op(op, i)}: its output {op.output!r} is never read on the way to the model's output {final!r}"
            )
    return wired


def graph_output(ops: list[Op]) -> str:
    """The model's output tensor of wired ops: the only output that no op reads (wire checked there is one)."""
    return ops[-1].output


def _describe(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def read_spec(model_dir: Path) -> tuple[ModelSpec, list[Op]]:
    """Parse and validate `config.json` (structure only; tensors are checked by the loader)."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelFormatError(f"{path}: not found (a model directory holds config.json and model.safetensors)")
    try:
        raw = orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as e:
        raise ModelFormatError(f"{path}: not valid JSON: {e}") from None
    return parse_spec(raw, path)


def parse_spec(raw: object, where: object) -> tuple[ModelSpec, list[Op]]:
    """Validate a config (as parsed from JSON, or as an importer made it); messages start with `where`."""
    if isinstance(raw, dict) and raw.get("format") not in (None, *FORMATS):
        expected = " or ".join(map(repr, FORMATS))
        raise ModelFormatError(f"{where}: format {raw.get('format')!r} is not supported; expected {expected}")
    try:
        spec = ModelSpec.model_validate(raw)
    except ValidationError as e:
        raise ModelFormatError(f"{where}: {_describe(e)}") from None
    try:
        return spec, spec.parsed_ops()
    except ModelFormatError as e:
        raise ModelFormatError(f"{where}: {e}") from None
