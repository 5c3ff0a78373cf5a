"""Export a trained torch module to the model format.

    from service.model.export import export_module, export_sequential
    export_module(resnet, torch.randn(2, 3, 32, 32), "model_weights/my-resnet", labels=[...])   # any module
    export_sequential(model, "model_weights/my-mlp", input_shape=[64], labels=["cat", "dog"])
    export_sequential(cnn, "model_weights/my-cnn", input_shape=[1, 8, 8])      # (channels, height, width)

`export_module` traces any forward with torch.export (torch_import.py: residual adds, BatchNorm, concats) and
writes format 2, a graph; `export_sequential` writes an `nn.Sequential` of Linear, Conv2d (groups 1, zero
padding), AvgPool2d, MaxPool2d (dilation 1), Flatten and the activations fusedserve runs as format 1.
Both write config.json + model.safetensors that `fusedserve serve --model model_weights/my-mlp` loads.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .spec import FORMAT
from .writer import write_model, written


def _pair(v) -> int | list[int]:
    """A torch size argument as the config writes it: one int when both sides agree, else [h, w]."""
    h, w = (v, v) if isinstance(v, int) else tuple(v)
    return int(h) if h == w else [int(h), int(w)]


def _weights(module: nn.Module, index: int, op: dict, tensors: dict[str, torch.Tensor]) -> dict:
    op["weight"] = f"layers.{index}.weight"
    tensors[op["weight"]] = module.weight.detach().cpu().contiguous()
    if module.bias is not None:
        op["bias"] = f"layers.{index}.bias"
        tensors[op["bias"]] = module.bias.detach().cpu().contiguous()
    return op


def _conv2d(module: nn.Conv2d, index: int, tensors: dict[str, torch.Tensor]) -> dict:
    name = f"layer {index}: Conv2d"
    if module.groups != 1:
        raise ValueError(f"{name} has groups={module.groups}; only groups=1 is supported")
    if module.padding_mode != "zeros":
        raise ValueError(f"{name} has padding_mode={module.padding_mode!r}; only 'zeros' is supported")
    padding = module.padding
    if isinstance(padding, str):  # 'valid' is 0; 'same' is symmetric for stride 1 when each d*(k-1) is even
        if padding == "valid":
            padding = (0, 0)
        else:
            totals = [d * (k - 1) for d, k in zip(module.dilation, module.kernel_size, strict=True)]
            if any(t % 2 for t in totals):
                raise ValueError(f"{name} has padding='same' with an even kernel: torch pads it unevenly")
            padding = tuple(t // 2 for t in totals)
    op = {"op": "conv2d"}
    _weights(module, index, op, tensors)
    return {**op, "stride": _pair(module.stride), "padding": _pair(padding), "dilation": _pair(module.dilation)}


def _pool2d(module: nn.AvgPool2d | nn.MaxPool2d, index: int) -> dict:
    kind = type(module).__name__
    if isinstance(module, nn.MaxPool2d):
        if _pair(module.dilation) != 1:
            raise ValueError(f"layer {index}: MaxPool2d has dilation={module.dilation}; only 1 is supported")
        if module.return_indices:
            raise ValueError(f"layer {index}: MaxPool2d has return_indices=True; it must return only the values")
    elif module.divisor_override is not None:
        raise ValueError(f"layer {index}: AvgPool2d has divisor_override={module.divisor_override}; not supported")
    op = {
        "op": kind.lower(),
        "kernel_size": _pair(module.kernel_size),
        # torch keeps stride=None as kernel_size already; written out so the config says it
        "stride": _pair(module.stride if module.stride is not None else module.kernel_size),
        "padding": _pair(module.padding),
        "ceil_mode": bool(module.ceil_mode),
    }
    if isinstance(module, nn.AvgPool2d):
        op["count_include_pad"] = bool(module.count_include_pad)
    return op


def _op_for(module: nn.Module, index: int, tensors: dict[str, torch.Tensor]) -> dict:
    if isinstance(module, nn.Linear):
        return _weights(module, index, {"op": "linear"}, tensors)
    if isinstance(module, nn.Conv2d):
        return _conv2d(module, index, tensors)
    if isinstance(module, (nn.AvgPool2d, nn.MaxPool2d)):
        return _pool2d(module, index)
    if isinstance(module, nn.Flatten):
        if module.start_dim != 1 or module.end_dim != -1:
            raise ValueError(f"layer {index}: only Flatten(start_dim=1, end_dim=-1) is supported")
        return {"op": "flatten"}
    if isinstance(module, nn.LeakyReLU):
        return {"op": "leaky_relu", "negative_slope": module.negative_slope}
    if isinstance(module, nn.GELU):
        return {"op": "gelu", "approximate": module.approximate}
    simple = {nn.ReLU: "relu", nn.Sigmoid: "sigmoid", nn.SiLU: "silu", nn.Tanh: "tanh"}
    for cls, name in simple.items():
        if isinstance(module, cls):
            return {"op": name}
    raise ValueError(
        f"layer {index}: {type(module).__name__} has no fusedserve op "
        "(Linear, Conv2d, AvgPool2d, MaxPool2d, Flatten, activations)"
    )


def export_module(module: nn.Module, example_input: torch.Tensor, out_dir: str | Path, **kwargs) -> Path:
    """torch_import.export_module: any module through torch.export, to format 2 (name, labels, description)."""
    from .torch_import import export_module as export

    return export(module, example_input, out_dir, **kwargs)


def export_sequential(
    model: nn.Sequential,
    out_dir: str | Path,
    *,
    input_shape: list[int],
    name: str | None = None,
    labels: list[str] | None = None,
    description: str = "",
) -> Path:
    out = Path(out_dir)
    tensors: dict[str, torch.Tensor] = {}
    ops = [_op_for(m, i, tensors) for i, m in enumerate(model)]
    config = {
        "format": FORMAT,
        "name": name or out.name,
        "description": description,
        "input": {"shape": list(input_shape), "dtype": "float32"},
        **({"labels": list(labels)} if labels is not None else {}),
        "ops": ops,
    }
    write_model(out, config, tensors)
    print(written(out, config, tensors))
    return out
