"""Load a model directory (config.json + model.safetensors) and check every tensor against the ops.

Shapes are followed through the op list from the input shape, so each mismatch is reported where it
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
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .spec import Conv2dOp, FlattenOp, LinearOp, ModelFormatError, ModelSpec, Op, PoolOp, read_spec

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Model:
    """A validated model: its spec, parsed ops, tensors (CPU, as stored) and feature shapes."""

    path: Path
    spec: ModelSpec
    ops: list[Op]
    tensors: dict[str, torch.Tensor]
    input_shape: tuple[int, ...]
    output_features: int

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def input_features(self) -> int:
        return math.prod(self.input_shape)


def load_model(model_dir: Path | str) -> Model:
    """Read and validate a model directory; raise ModelFormatError saying exactly what is wrong."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelFormatError(f"{model_dir}: no such model directory")
    spec, ops = read_spec(model_dir)
    tensors = _read_tensors(model_dir / "model.safetensors")
    where = model_dir / "config.json"
    try:
        shape = _check_ops(ops, tensors, tuple(spec.input.shape))
    except ModelFormatError as e:
        raise ModelFormatError(f"{where}: {e}") from None
    if len(shape) != 1:
        raise ModelFormatError(
            f"{where}: the last op leaves shape {shape} per row; the output must be a vector (add a flatten op)"
        )
    if spec.labels is not None and len(spec.labels) != shape[0]:
        raise ModelFormatError(f"{where}: {len(spec.labels)} labels but the model outputs {shape[0]} values per row")
    used = {name for op in ops if isinstance(op, (LinearOp, Conv2dOp)) for name in (op.weight, op.bias) if name}
    return Model(
        path=model_dir,
        spec=spec,
        ops=ops,
        tensors={k: v for k, v in tensors.items() if k in used},
        input_shape=tuple(spec.input.shape),
        output_features=shape[0],
    )


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


def _check_ops(ops: list[Op], tensors: dict[str, torch.Tensor], shape: tuple[int, ...]) -> tuple[int, ...]:
    """Follow the per-row feature shape through the ops; return the output shape."""
    for i, op in enumerate(ops):
        where = f"ops[{i}] ({op.op})"
        if isinstance(op, FlattenOp):
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
    return shape


def _image_shape(shape: tuple[int, ...], where: str, kind: str) -> tuple[int, int, int]:
    if len(shape) != 3:
        raise ModelFormatError(
            f"{where}: input has shape {shape} per row; {kind} needs (channels, height, width), "
            f'e.g. "input": {{"shape": [1, 8, 8]}}'
        )
    return shape  # type: ignore[return-value]


def conv_out(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    """torch.nn.Conv2d's output size along one axis (may be < 1: the caller refuses that)."""
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def pool_out(size: int, kernel: int, stride: int, padding: int, ceil_mode: bool) -> int:
    """torch.nn.{Avg,Max}Pool2d's output size along one axis: with ceil_mode a last, partial window
    counts, unless it would start in the right padding."""
    span = size + 2 * padding - kernel
    out = (-(-span // stride) if ceil_mode else span // stride) + 1
    if ceil_mode and (out - 1) * stride >= size + padding:
        out -= 1
    return out


def _check_conv2d(op: Conv2dOp, tensors: dict[str, torch.Tensor], shape: tuple[int, ...], where: str):
    c, h, w_in = _image_shape(shape, where, "conv2d")
    w = _tensor(tensors, op.weight, where, "weight")
    if w.dim() != 4 or w.shape[1] != c:
        raise ModelFormatError(
            f"{where}: weight {op.weight!r} has shape {tuple(w.shape)}; expected (out, {c}, kh, kw) "
            f"because its input has {c} channel{'s' if c != 1 else ''}"
        )
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
