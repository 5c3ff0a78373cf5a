"""Export a trained torch `nn.Sequential` of Linear / activation / Flatten modules to the model format.

    from service.model.export import export_sequential
    export_sequential(model, "model_weights/my-mlp", input_shape=[64], labels=["cat", "dog"])

Writes config.json + model.safetensors that `fusedserve serve --model model_weights/my-mlp` loads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from .spec import FORMAT


def _op_for(module: nn.Module, index: int, tensors: dict[str, torch.Tensor]) -> dict:
    if isinstance(module, nn.Linear):
        op = {"op": "linear", "weight": f"layers.{index}.weight"}
        tensors[op["weight"]] = module.weight.detach().cpu().contiguous()
        if module.bias is not None:
            op["bias"] = f"layers.{index}.bias"
            tensors[op["bias"]] = module.bias.detach().cpu().contiguous()
        return op
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
    raise ValueError(f"layer {index}: {type(module).__name__} has no fusedserve op (Linear, Flatten, activations)")


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
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
