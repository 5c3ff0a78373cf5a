"""Random valid models in the fusedserve-model/1 format, written to a directory, for the tests.

`write_model(dir, widths=[K, N1, N2, ...], activations=[...])` writes config.json + model.safetensors
for linear layers K -> N1 -> N2 ...; `activations[i]` follows layer i and is an op name ("relu"), an
op dict ({"op": "gelu", "approximate": "tanh"}), None (no activation), or a list of those (several in
a row: the first rides in the GEMM epilogue, the rest become standalone activation kernels).
`random_model_spec(rng)` draws the keyword arguments of a varied, awkward architecture.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

FORMAT = "fusedserve-model/1"
# 1, primes, powers of two and one past a block edge: every layer crosses a tile boundary somewhere.
WIDTHS = [1, 2, 7, 13, 16, 37, 64, 130]
ACTIVATION_CHOICES: list[str | dict | None] = [
    None,
    "relu",
    {"op": "leaky_relu", "negative_slope": 0.2},
    {"op": "leaky_relu", "negative_slope": -0.5},
    {"op": "leaky_relu", "negative_slope": 3.0},
    {"op": "gelu"},
    {"op": "gelu", "approximate": "none"},
    {"op": "gelu", "approximate": "tanh"},
    "sigmoid",
    "silu",
    "tanh",
]

Act = str | dict | None


def _as_ops(act: Act | list[Act]) -> list[dict]:
    items = act if isinstance(act, list) else [act]
    return [dict(a) if isinstance(a, dict) else {"op": a} for a in items if a is not None]


def write_model(
    dir: Path | str,
    widths: list[int],
    activations: list[Act | list[Act]],
    bias: list[bool] | bool = True,
    seed: int = 0,
    input_shape: list[int] | None = None,
    extra_ops: list[dict] | None = None,
    *,
    name: str = "test-model",
    labels: list[str] | None = None,
) -> Path:
    """Write a model with len(widths) - 1 linear layers; return its directory.

    extra_ops are placed before the first linear (a {"op": "flatten"} for a multi-dim input_shape,
    or a leading activation, which becomes a standalone kernel). input_shape defaults to [widths[0]].
    Weights are N(0, 1/K), biases N(0, 0.25): every layer's output is O(1), so the activations see
    both signs and their curved parts. Tensors are float32, PyTorch layout (N, K).
    """
    n_layers = len(widths) - 1
    if n_layers < 1 or len(activations) != n_layers:
        raise ValueError(f"need {n_layers} activations for widths {widths}; got {len(activations)}")
    biases = [bias] * n_layers if isinstance(bias, bool) else list(bias)
    gen = torch.Generator().manual_seed(seed)
    ops: list[dict] = list(extra_ops or [])
    tensors: dict[str, torch.Tensor] = {}
    for i in range(n_layers):
        k, n = widths[i], widths[i + 1]
        op = {"op": "linear", "weight": f"layer{i}.weight"}
        tensors[f"layer{i}.weight"] = torch.randn(n, k, generator=gen) / k**0.5
        if biases[i]:
            op["bias"] = f"layer{i}.bias"
            tensors[f"layer{i}.bias"] = torch.randn(n, generator=gen) * 0.5
        ops.append(op)
        ops.extend(_as_ops(activations[i]))
    config = {"format": FORMAT, "name": name, "input": {"shape": list(input_shape or [widths[0]])}, "ops": ops}
    if labels is not None:
        config["labels"] = labels
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    (dir / "config.json").write_text(json.dumps(config, indent=1))
    save_file(tensors, str(dir / "model.safetensors"))
    return dir


def random_model_spec(rng: np.random.Generator) -> dict:
    """Keyword arguments for write_model (without dir): 1-4 layers, awkward widths, mixed activations."""
    depth = int(rng.integers(1, 5))
    flatten = rng.random() < 0.25
    input_shape = [2, 3, 5] if flatten else None
    first = 30 if flatten else int(rng.choice(WIDTHS))
    widths = [first, *(int(w) for w in rng.choice(WIDTHS, size=depth))]
    activations: list[Act | list[Act]] = []
    for _ in range(depth):
        act = ACTIVATION_CHOICES[int(rng.integers(len(ACTIVATION_CHOICES)))]
        if act is not None and rng.random() < 0.2:  # two in a row: the second is a standalone kernel
            second = ACTIVATION_CHOICES[int(rng.integers(1, len(ACTIVATION_CHOICES)))]
            act = [act, second]
        activations.append(act)
    bias = [bool(rng.random() < 0.8) for _ in range(depth)]
    extra_ops = [{"op": "flatten"}] if flatten else []
    if rng.random() < 0.15:  # an activation before any linear: a standalone kernel on the input
        extra_ops.append(_as_ops(ACTIVATION_CHOICES[int(rng.integers(1, len(ACTIVATION_CHOICES)))])[0])
    return {
        "widths": widths,
        "activations": activations,
        "bias": bias,
        "seed": int(rng.integers(2**31)),
        "input_shape": input_shape,
        "extra_ops": extra_ops,
    }


def _act_label(act: Act | list[Act]) -> str:
    parts = []
    for op in _as_ops(act):
        label = op["op"]
        if "negative_slope" in op:
            label += f"{op['negative_slope']:g}"
        if op.get("approximate") == "tanh":
            label += "_tanh"
        parts.append(label)
    return "+".join(parts) or "none"


def spec_id(spec: dict) -> str:
    """A readable test id: 'in2x3x5-flatten-37.relu-13nb.gelu_tanh+sigmoid'."""
    shape = spec.get("input_shape") or [spec["widths"][0]]
    parts = ["in" + "x".join(map(str, shape))]
    parts += [_act_label(op) for op in spec.get("extra_ops") or []]
    bias = spec.get("bias", True)
    for i, (n, act) in enumerate(zip(spec["widths"][1:], spec["activations"], strict=True)):
        has_bias = bias if isinstance(bias, bool) else bias[i]
        parts.append(f"{n}{'' if has_bias else 'nb'}.{_act_label(act)}")
    return "-".join(parts)
