"""Random valid models in the fusedserve-model/1 format, written to a directory, for the tests.

`write_model(dir, widths=[K, N1, N2, ...], activations=[...])` writes config.json + model.safetensors
for linear layers K -> N1 -> N2 ...; `activations[i]` follows layer i and is an op name ("relu"), an
op dict ({"op": "gelu", "approximate": "tanh"}), None (no activation), or a list of those (several in
a row: the first rides in the GEMM epilogue, the rest become standalone activation kernels).
`random_model_spec(rng)` draws the keyword arguments of a varied, awkward architecture.
"""

from __future__ import annotations

import json
import math
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


# ---- CNNs ----


def _pair(v) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (v[0], v[1])


def write_cnn_model(
    dir: Path | str,
    input_shape: list[int],
    layers: list[dict],
    seed: int = 0,
    *,
    name: str = "test-cnn",
    labels: list[str] | None = None,
) -> Path:
    """Write a model of image ops; return its directory. input_shape is (channels, height, width).

    layers: {"op": "conv2d", "out": 16, "kernel": 3 or [kh, kw], "bias": True, and stride / padding /
    dilation as the config takes them}, {"op": "linear", "out": 10, "bias": True}, or any other op as the
    config writes it (pools, flatten, activations). In-channels and in-features follow from the shapes,
    worked out with torch (not the loader). Weights N(0, 1/fan_in), biases N(0, 0.25), float32.
    """
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(seed)
    probe = torch.zeros(1, *input_shape)  # follows the shapes through the real torch ops
    ops: list[dict] = []
    tensors: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(layers):
        kind = layer["op"]
        if kind in ("conv2d", "linear"):
            op = {k: v for k, v in layer.items() if k not in ("out", "kernel", "bias")}
            op["weight"] = f"{kind}{i}.weight"
            if kind == "conv2d":
                kh, kw = _pair(layer.get("kernel", 3))
                shape = (layer["out"], probe.shape[1], kh, kw)
            else:
                shape = (layer["out"], probe.shape[1])
            fan_in = math.prod(shape[1:])
            w = tensors[op["weight"]] = torch.randn(*shape, generator=gen) / fan_in**0.5
            b = None
            if layer.get("bias", True):
                op["bias"] = f"{kind}{i}.bias"
                b = tensors[op["bias"]] = torch.randn(layer["out"], generator=gen) * 0.5
            if kind == "conv2d":
                geometry = {k: _pair(layer.get(k, d)) for k, d in (("stride", 1), ("padding", 0), ("dilation", 1))}
                probe = F.conv2d(probe, w, b, **geometry)
            else:
                probe = F.linear(probe, w, b)
            ops.append(op)
            continue
        if kind == "flatten":
            probe = probe.flatten(1)
        elif kind in ("avgpool2d", "maxpool2d"):
            k = _pair(layer["kernel_size"])
            args = dict(stride=_pair(layer.get("stride") or k), padding=_pair(layer.get("padding", 0)),
                        ceil_mode=layer.get("ceil_mode", False))  # fmt: skip
            if kind == "avgpool2d":
                probe = F.avg_pool2d(probe, k, count_include_pad=layer.get("count_include_pad", True), **args)
            else:
                probe = F.max_pool2d(probe, k, **args)
        ops.append(dict(layer))
    if probe.dim() != 2:
        raise ValueError(f"the layers leave shape {tuple(probe.shape[1:])} per row; end with flatten + linear")
    config = {"format": FORMAT, "name": name, "input": {"shape": list(input_shape)}, "ops": ops}
    if labels is not None:
        config["labels"] = labels
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    (dir / "config.json").write_text(json.dumps(config, indent=1))
    save_file(tensors, str(dir / "model.safetensors"))
    return dir


def _cnn_fits(input_shape: list[int], layers: list[dict]) -> bool:
    import torch.nn.functional as F

    x = torch.zeros(1, *input_shape)
    try:
        for layer in layers:
            if layer["op"] == "conv2d":
                kh, kw = _pair(layer.get("kernel", 3))
                w = torch.zeros(layer["out"], x.shape[1], kh, kw)
                geometry = {k: _pair(layer.get(k, d)) for k, d in (("stride", 1), ("padding", 0), ("dilation", 1))}
                x = F.conv2d(x, w, **geometry)
            elif layer["op"] in ("avgpool2d", "maxpool2d"):
                k = _pair(layer["kernel_size"])
                fn = F.avg_pool2d if layer["op"] == "avgpool2d" else F.max_pool2d
                x = fn(x, k, _pair(layer.get("stride") or k), _pair(layer.get("padding", 0)),
                       ceil_mode=layer.get("ceil_mode", False))  # fmt: skip
    except RuntimeError:
        return False
    return x.numel() > 0


def random_cnn_spec(rng: np.random.Generator) -> dict:
    """Keyword arguments for write_cnn_model (without dir): 1-3 conv/pool blocks with awkward geometry
    (1x1 to 5x3 kernels, strides, padding, dilation, avg and max pools with ceil_mode and padding), mixed
    activations, then flatten and 1-2 linear layers."""
    while True:
        channels = int(rng.choice([1, 2, 3]))
        input_shape = [channels, int(rng.integers(5, 13)), int(rng.integers(5, 13))]
        layers: list[dict] = []
        for _ in range(int(rng.integers(1, 4))):
            if rng.random() < 0.75:
                kernel = [int(rng.choice([1, 2, 3, 5])), int(rng.choice([1, 3]))] if rng.random() < 0.3 else int(
                    rng.choice([1, 2, 3])
                )  # fmt: skip
                conv = {"op": "conv2d", "out": int(rng.choice([1, 4, 7, 16])), "kernel": kernel,
                        "bias": bool(rng.random() < 0.8)}  # fmt: skip
                if rng.random() < 0.3:
                    conv["stride"] = int(rng.choice([1, 2]))
                if rng.random() < 0.5:
                    conv["padding"] = int(rng.choice([0, 1, 2]))
                if rng.random() < 0.2:
                    conv["dilation"] = 2
                layers.append(conv)
                act = ACTIVATION_CHOICES[int(rng.integers(len(ACTIVATION_CHOICES)))]
                layers.extend(_as_ops(act))
            if rng.random() < 0.6:
                kind = str(rng.choice(["avgpool2d", "maxpool2d"]))
                k = int(rng.choice([2, 3]))
                pool = {"op": kind, "kernel_size": k}
                if rng.random() < 0.4:
                    pool["stride"] = int(rng.choice([1, 2]))
                if rng.random() < 0.3:
                    pool["padding"] = 1
                if rng.random() < 0.3:
                    pool["ceil_mode"] = True
                if kind == "avgpool2d" and rng.random() < 0.5:
                    pool["count_include_pad"] = False
                layers.append(pool)
                if rng.random() < 0.3:
                    layers.extend(_as_ops(ACTIVATION_CHOICES[int(rng.integers(1, len(ACTIVATION_CHOICES)))]))
        layers.append({"op": "flatten"})
        for _ in range(int(rng.integers(1, 3))):
            layers.append({"op": "linear", "out": int(rng.choice(WIDTHS[1:])), "bias": bool(rng.random() < 0.8)})
            layers.extend(_as_ops(ACTIVATION_CHOICES[int(rng.integers(len(ACTIVATION_CHOICES)))]))
        if _cnn_fits(input_shape, layers):
            return {"input_shape": input_shape, "layers": layers, "seed": int(rng.integers(2**31))}


def _label(v: int | list[int]) -> str:
    return str(v) if isinstance(v, int) else "x".join(map(str, v))


def cnn_spec_id(spec: dict) -> str:
    """A readable test id: 'in1x8x8-c16k3p1.relu-max2-flat-l10'."""
    parts = ["in" + "x".join(map(str, spec["input_shape"]))]
    for layer in spec["layers"]:
        kind = layer["op"]
        if kind == "conv2d":
            k = layer.get("kernel", 3)
            label = f"c{layer['out']}k{_label(k)}"
            label += "".join(
                f"{key[0]}{_label(layer[key])}" for key in ("stride", "padding", "dilation") if key in layer
            )
            parts.append(label + ("" if layer.get("bias", True) else "nb"))
        elif kind in ("avgpool2d", "maxpool2d"):
            label = f"{kind[:3]}{_label(layer['kernel_size'])}"
            label += "".join(f"{key[0]}{_label(layer[key])}" for key in ("stride", "padding") if key in layer)
            label += "ceil" if layer.get("ceil_mode") else ""
            label += "nopad" if layer.get("count_include_pad") is False else ""
            parts.append(label)
        elif kind == "linear":
            parts.append(f"l{layer['out']}" + ("" if layer.get("bias", True) else "nb"))
        elif kind == "flatten":
            parts.append("flat")
        else:
            parts[-1] += "." + _act_label(layer)
    return "-".join(parts)


# ImageNet's mean and std in 0-255 pixels (torchvision's), for 3-channel image models that normalize their input
IMAGENET_MEAN = [123.675, 116.28, 103.53]
IMAGENET_STD = [58.395, 57.12, 57.375]
# a ResNet-like stem on a small image: conv 7x7/2 padding 3 (3x16x16 -> 8x16x8x8) + relu, a global average pool, a
# linear head of 10
STEM_CNN = [
    {"op": "conv2d", "out": 8, "kernel": 7, "stride": 2, "padding": 3}, {"op": "relu"},
    {"op": "avgpool2d", "kernel_size": 8}, {"op": "flatten"}, {"op": "linear", "out": 10},
]  # fmt: skip


def write_pixel_model(
    dir: Path | str,
    layers: list[dict] = STEM_CNN,
    input_shape: list[int] = (3, 16, 16),
    seed: int = 0,
    *,
    dtype: str = "uint8",
    mean: list[float] | None = IMAGENET_MEAN,
    std: list[float] | None = IMAGENET_STD,
    name: str = "pixel-cnn",
) -> Path:
    """write_cnn_model whose input is `dtype` pixels ("uint8" or "float32"), normalized by mean and std (None: not)."""
    dir = write_cnn_model(dir, list(input_shape), layers, seed, name=name)
    config = json.loads((dir / "config.json").read_text())
    config["input"]["dtype"] = dtype
    if mean is not None:
        config["input"]["normalize"] = {"mean": list(mean), "std": list(std)}
    (dir / "config.json").write_text(json.dumps(config, indent=1))
    return dir
