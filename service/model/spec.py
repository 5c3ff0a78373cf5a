"""The model format: `config.json` beside `model.safetensors` in `model_weights/<name>/`.

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
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import orjson
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, ValidationError

FORMAT = "fusedserve-model/1"
# torch.nn.LeakyReLU's default, as kernels.activations.DEFAULT_NEGATIVE_SLOPE (not imported from there:
# importing `kernels` fixes interpreted-vs-compiled, which the service decides later, from its settings).
DEFAULT_NEGATIVE_SLOPE = 0.01


class ModelFormatError(ValueError):
    """The model directory is not a valid model; the message says what and where."""


class _Op(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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
    """torch.nn.Conv2d with zero padding and groups 1: weight (out, in, kh, kw), bias (out,).
    Pair fields are normalised to (h, w)."""

    op: Literal["conv2d"]
    weight: str
    bias: str | None = None
    stride: PositivePair = (1, 1)
    padding: NonNegativePair = (0, 0)
    dilation: PositivePair = (1, 1)
    groups: Literal[1] = 1


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
    op: Literal["relu", "sigmoid", "silu", "tanh"]


class LeakyReluOp(_Op):
    op: Literal["leaky_relu"]
    negative_slope: float = DEFAULT_NEGATIVE_SLOPE


class GeluOp(_Op):
    op: Literal["gelu"]
    approximate: Literal["none", "tanh"] = "none"


Op = LinearOp | Conv2dOp | AvgPool2dOp | MaxPool2dOp | FlattenOp | SimpleActivationOp | LeakyReluOp | GeluOp
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
}


def activation_of(op: Op) -> tuple[str, float] | None:
    """(kernel activation name, negative_slope) if `op` is an activation, else None."""
    if isinstance(op, SimpleActivationOp):
        return op.op, DEFAULT_NEGATIVE_SLOPE
    if isinstance(op, LeakyReluOp):
        return "leaky_relu", op.negative_slope
    if isinstance(op, GeluOp):
        return ("gelu_tanh" if op.approximate == "tanh" else "gelu"), DEFAULT_NEGATIVE_SLOPE
    return None


class InputSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    shape: Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=1, max_length=4)]
    dtype: Literal["float32"] = "float32"


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    format: Literal["fusedserve-model/1"]
    name: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str = ""
    input: InputSpec
    labels: list[str] | None = None
    ops: Annotated[list[dict], Field(min_length=1)]

    def parsed_ops(self) -> list[Op]:
        return [parse_op(raw, i) for i, raw in enumerate(self.ops)]


def parse_op(raw: object, index: int) -> Op:
    where = f"ops[{index}]"
    if not isinstance(raw, dict) or not isinstance(raw.get("op"), str):
        raise ModelFormatError(f"{where}: each op must be an object with a string 'op' field; got {raw!r}")
    kind = raw["op"]
    if kind not in OP_TYPES:
        raise ModelFormatError(f"{where}: unknown op {kind!r}; expected one of {', '.join(OP_TYPES)}")
    try:
        return OP_TYPES[kind].model_validate(raw)
    except ValidationError as e:
        raise ModelFormatError(f"{where} ({kind}): {_describe(e)}") from None


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
    if isinstance(raw, dict) and raw.get("format") not in (None, FORMAT):
        raise ModelFormatError(f"{path}: format {raw.get('format')!r} is not supported; expected {FORMAT!r}")
    try:
        spec = ModelSpec.model_validate(raw)
    except ValidationError as e:
        raise ModelFormatError(f"{path}: {_describe(e)}") from None
    try:
        return spec, spec.parsed_ops()
    except ModelFormatError as e:
        raise ModelFormatError(f"{path}: {e}") from None
