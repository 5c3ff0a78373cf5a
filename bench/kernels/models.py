"""Whole-model forwards: the shipped digits MLP and CNN, a wide random MLP and a wider random CNN, as each
provider runs them.

    eager               per layer torch.mm, + b, act (the unfused baseline; 3 kernels a layer); a conv is
                        F.conv2d with its bias (cuDNN) then act, a pool F.max_pool2d / F.avg_pool2d then act:
                        kernels.reference, op by op, as the unfused executor runs them
    linear              per layer F.linear, act; convs and pools as in eager (F.conv2d is already torch's
                        library layer), so for a CNN this differs from eager only in its linear layers
    compile             torch.compile of the F.linear forward, default mode, dynamic=False, per batch size
    compile-max         the same, mode="max-autotune-no-cudagraphs"
    ours                the service's path: Executor(model, "fused") under GraphedExecutor (pads the
                        batch to a power-of-two bucket, replays one CUDA graph per bucket); the input is
                        staged in the graph's input buffer once (where the service's H2D copy writes it)
    ours-eager          Executor(model, "fused").forward: one launch per step from Python, no graph
    ours-unfused-graph  Executor(model, "unfused") under GraphedExecutor: the service's A/B baseline

Every provider except ours-* also runs under a CUDA graph captured here (timing.measure).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kernels import reference
from kernels.activations import torch_activation
from kernels.conv import conv_output_size
from service.model.loader import Model, load_model
from service.model.planner import ActivationStep, Conv2dStep, FlattenStep, LinearStep, Pool2dStep, plan

from .providers import COMPILE_MODES, NotAvailable, compiled
from .timing import ELEMENT_BYTES, Prepared, describe, synchronize

MODEL_PROVIDERS = ("eager", "linear", "compile", "compile-max", "ours-unfused-graph", "ours-eager", "ours")
MODELS = ("digits", "wide", "digits-cnn", "wide-cnn")
WEIGHTS = Path(__file__).resolve().parents[2] / "model_weights"
DIGITS_DIR = WEIGHTS / "digits-mlp"
# conv16 (1 -> 16, 8x8) - conv16 (16 -> 16) - maxpool 2 - fc64 - fc10, ReLU; 3 kernels fused (the pool rides
# in the second conv, the MLP tail is one kernel), 8 unfused.
DIGITS_CNN_DIR = WEIGHTS / "digits-cnn"
# The wide MLP's dims; ReLU after each hidden layer, none after the last (as digits-mlp: logits out).
# At batch 1 it reads 50 MB of fp16 weights: 11.8 us at 4.25 TB/s.
WIDE_DIMS = (1024, 4096, 4096, 1024)
# The wider CNN: 3x32x32 in; (out channels, max pool 2 after) per 3x3 conv (padding 1, ReLU); then
# 128 * 4 * 4 = 2048 -> 256 (ReLU) -> 10. Its convs are bench/probes/conv.py's WIDER layers (64 at 32x32 to
# 64, 64 at 16x16 to 128, 128 at 8x8 to 128) behind a 3 -> 64 stem: 137 MFLOP per image (55% in the 64 -> 64
# conv at 32x32) and 1.6 MB of fp16 weights, so past batch 2 its floor is the matrix units' (at 700 TFLOP/s:
# 12.5 us at batch 64, 0.8 ms at 4096).
WIDE_CNN_INPUT = (3, 32, 32)
WIDE_CNN_CONVS = ((64, False), (64, True), (128, True), (128, True))
WIDE_CNN_HIDDEN = 256


def load_named(name: str, tmpdir: Path, seed: int) -> Model:
    """The shipped models ("digits", "digits-cnn"), or a random one written to tmpdir first ("wide",
    "wide-cnn"): each loaded by the service's loader, so every executor runs it as the service would."""
    if name == "digits":
        return load_model(DIGITS_DIR)
    if name == "digits-cnn":
        return load_model(DIGITS_CNN_DIR)
    if name == "wide":
        return build_wide(tmpdir, seed)
    if name == "wide-cnn":
        return build_wide_cnn(tmpdir, seed)
    raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODELS)}")


def build_wide(tmpdir: Path, seed: int) -> Model:
    """A random 1024-4096-4096-1024 ReLU MLP, exported to the model format and loaded like any other."""
    from service.model.export import export_sequential

    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (k, n) in enumerate(zip(WIDE_DIMS[:-1], WIDE_DIMS[1:], strict=True)):
        lin = nn.Linear(k, n)
        # He init (std sqrt(2/K)) keeps ReLU activations O(1) from layer to layer; nn.Linear's default
        # (std 1/sqrt(3K)) would shrink them ~2.4x per layer.
        nn.init.normal_(lin.weight, std=math.sqrt(2.0 / k))
        nn.init.normal_(lin.bias, std=0.1)
        layers.append(lin)
        if i < len(WIDE_DIMS) - 2:
            layers.append(nn.ReLU())
    out = export_sequential(
        nn.Sequential(*layers), Path(tmpdir) / "wide-mlp", input_shape=[WIDE_DIMS[0]], name="wide-mlp",
        description="random 1024-4096-4096-1024 ReLU MLP for `fusedserve bench kernels`",
    )  # fmt: skip
    return load_model(out)


def build_wide_cnn(tmpdir: Path, seed: int) -> Model:
    """The wider CNN (WIDE_CNN_*) with fixed-seed random weights, exported and loaded like any other model."""
    from service.model.export import export_sequential

    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    c, side = WIDE_CNN_INPUT[0], WIDE_CNN_INPUT[1]
    for oc, pooled in WIDE_CNN_CONVS:
        conv = nn.Conv2d(c, oc, 3, padding=1)
        nn.init.normal_(conv.weight, std=math.sqrt(2.0 / (9 * c)))  # He init, as build_wide: O(1) activations
        nn.init.normal_(conv.bias, std=0.1)
        layers += [conv, nn.ReLU()] + ([nn.MaxPool2d(2)] if pooled else [])
        c, side = oc, side // 2 if pooled else side
    hidden, out = nn.Linear(c * side * side, WIDE_CNN_HIDDEN), nn.Linear(WIDE_CNN_HIDDEN, 10)
    for lin in (hidden, out):
        nn.init.normal_(lin.weight, std=math.sqrt(2.0 / lin.in_features))
        nn.init.normal_(lin.bias, std=0.1)
    layers += [nn.Flatten(), hidden, nn.ReLU(), out]
    path = export_sequential(
        nn.Sequential(*layers), Path(tmpdir) / "wide-cnn", input_shape=list(WIDE_CNN_INPUT), name="wide-cnn",
        description="random 3x32x32 CNN conv64-conv64-pool-conv128-pool-conv128-pool-fc256-fc10 (ReLU) for "
        "`fusedserve bench kernels`",
    )  # fmt: skip
    return load_model(path)


def _walk(model: Model) -> list[tuple[object, tuple[int, ...], tuple[int, ...]]]:
    """(step, input shape, output shape) per layer step of the per-layer plan, one image (no batch dim)."""
    shape: tuple[int, ...] = tuple(model.input_shape)
    out = []
    for s in _per_layer(plan(model.ops)):
        if isinstance(s, FlattenStep):
            new = (math.prod(shape),)
        elif isinstance(s, LinearStep):
            new = (model.tensors[s.weight].shape[0],)
        elif isinstance(s, Conv2dStep):
            oc, _, kh, kw = model.tensors[s.weight].shape
            size = conv_output_size
            new = (oc, *(size(shape[1 + i], (kh, kw)[i], s.stride[i], s.padding[i], s.dilation[i]) for i in (0, 1)))
        elif isinstance(s, Pool2dStep):
            new = (shape[0], *(_pooled(shape[1 + i], s, i) for i in (0, 1)))
        else:
            new = shape
        out.append((s, shape, new))
        shape = new
    return out


def _pooled(size: int, s: Pool2dStep, i: int) -> int:
    k, st, p = s.kernel_size[i], s.stride[i], s.padding[i]
    span = size + 2 * p - k
    n = (-(-span // st) if s.ceil_mode else span // st) + 1
    if s.ceil_mode and (n - 1) * st >= size + p:  # torch: the last window must start inside the input
        n -= 1
    return n


def model_dims(model: Model) -> list:
    """The input, then each weighted layer's and pool's output: ints for features ([64, 256, 256, 10] for
    the digits MLP), [C, H, W] lists for feature maps ([[1, 8, 8], [16, 8, 8], [16, 8, 8], [16, 4, 4], 64,
    10] for the digits CNN)."""

    def dim(shape):
        return shape[0] if len(shape) == 1 else list(shape)

    walk = _walk(model)
    dims = [model.input_features if len(model.input_shape) == 1 else list(model.input_shape)]
    return dims + [dim(new) for s, _, new in walk if isinstance(s, LinearStep | Conv2dStep | Pool2dStep)]


def bytes_and_flops(model: Model, rows: int, dtype: str) -> tuple[int, int]:
    """The fewest bytes a forward must move (input read, every weight and bias read once, output
    written; intermediates could stay on chip) and its flops (2 per multiply-add: rows x K x N for a
    linear layer, rows x OH x OW x OC x C x KH x KW for a conv; pools and activations counted as free)."""
    weighted = [s for s in _per_layer(plan(model.ops)) if isinstance(s, LinearStep | Conv2dStep)]
    params = sum(model.tensors[s.weight].numel() + (model.tensors[s.bias].numel() if s.bias else 0) for s in weighted)
    elements = rows * model.input_features + params + rows * model.output_features
    macs = 0
    for s, _, new in _walk(model):
        if isinstance(s, LinearStep):
            macs += model.tensors[s.weight].numel()
        elif isinstance(s, Conv2dStep):
            macs += model.tensors[s.weight].numel() * new[1] * new[2]
    return elements * ELEMENT_BYTES[dtype], 2 * rows * macs


def bound_steps(model: Model, device: torch.device, dtype: torch.dtype) -> list[tuple]:
    """The plan with its tensors cast to dtype once, as the executors cast them."""
    t = {k: v.to(device=device, dtype=dtype).contiguous() for k, v in model.tensors.items()}
    steps = []
    for s in _per_layer(plan(model.ops)):
        if isinstance(s, FlattenStep):
            steps.append(("flatten",))
        elif isinstance(s, LinearStep):
            steps.append(("linear", t[s.weight], t[s.bias] if s.bias else None, s.activation, s.negative_slope))
        elif isinstance(s, Conv2dStep):
            geometry = {"stride": s.stride, "padding": s.padding, "dilation": s.dilation}
            steps.append(("conv", t[s.weight], t[s.bias] if s.bias else None, s.activation, s.negative_slope, geometry))
        elif isinstance(s, Pool2dStep):
            pool = {
                "kind": s.kind, "kernel_size": s.kernel_size, "stride": s.stride, "padding": s.padding,
                "ceil_mode": s.ceil_mode, "count_include_pad": s.count_include_pad,
            }  # fmt: skip
            steps.append(("pool", s.activation, s.negative_slope, pool))
        elif isinstance(s, ActivationStep):
            steps.append(("act", s.activation, s.negative_slope))
        else:
            raise TypeError(f"no benchmark implementation for step {s!r}")
    return steps


def _per_layer(steps: list) -> list:
    """Steps one layer at a time: a grouped step (the planner's whole-MLP step has `.layers`) is expanded,
    since every provider here but ours runs layer by layer."""
    return [layer for s in steps for layer in (getattr(s, "layers", None) or (s,))]


def forward(steps: list[tuple], x: torch.Tensor, how: str) -> torch.Tensor:
    """how: "eager" (mm, add, act: kernels.reference.linear) or "linear" (F.linear, act). Convs and pools
    run as kernels.reference runs them either way: F.conv2d with its bias (cuDNN), then the activation."""
    for op in steps:
        if op[0] == "flatten":
            x = x.reshape(x.shape[0], -1)
        elif op[0] == "linear":
            _, w, b, act, slope = op
            if how == "eager":
                x = reference.linear(x, w, b, act, negative_slope=slope)
            else:
                x = torch_activation(F.linear(x, w, b), act, slope)
        elif op[0] == "conv":
            _, w, b, act, slope, geometry = op
            x = reference.conv2d(x, w, b, act, negative_slope=slope, **geometry)
        elif op[0] == "pool":
            _, act, slope, pool = op
            x = reference.pool2d(x, **pool, activation=act, negative_slope=slope)
        else:
            x = torch_activation(x, op[1], op[2])
    return x


def reference_forward(steps: list[tuple], x: torch.Tensor) -> torch.Tensor:
    """float64 forward from the same dtype-cast input and weights."""

    def up(op):
        if op[0] in ("linear", "conv"):
            return (op[0], op[1].double(), None if op[2] is None else op[2].double(), *op[3:])
        return op

    return forward([up(op) for op in steps], x.double(), "linear")


class ModelProviders:
    """One model's providers on one device and dtype. Executors and graphed executors are built once,
    at first use, and shared by every batch size (ours and ours-eager share one fused Executor, so its
    kernels are tuned once)."""

    def __init__(self, model: Model, device: torch.device, dtype: torch.dtype, max_batch_size: int):
        self.model, self.device, self.dtype, self.max_batch_size = model, device, dtype, max_batch_size
        self.steps = bound_steps(model, device, dtype)
        self._executors: dict[str, object] = {}
        self._graphed: dict[str, object] = {}  # mode -> GraphedExecutor, or the NotAvailable/exception it raised

    def _executor(self, mode: str):
        if mode not in self._executors:
            from service.model.executors import Executor

            self._executors[mode] = Executor(self.model, mode, self.device, self.dtype)
        return self._executors[mode]

    def _graphed_executor(self, mode: str):
        if mode not in self._graphed:
            try:
                self._graphed[mode] = self._make_graphed(mode)
            except NotAvailable as e:
                self._graphed[mode] = e
            except Exception as e:  # remembered: every batch reports it without building again
                self._graphed[mode] = RuntimeError(f"GraphedExecutor: {describe(e)}")
        g = self._graphed[mode]
        if isinstance(g, Exception):
            raise g
        return g

    def _make_graphed(self, mode: str):
        if self.device.type != "cuda":
            raise NotAvailable("CUDA graphs need CUDA")
        try:
            from service.model.graphs import GraphedExecutor
        except ImportError as e:
            raise NotAvailable(f"service.model.graphs: {describe(e)}") from None
        return GraphedExecutor(self._executor(mode), max_batch_size=self.max_batch_size)

    def prepare(self, name: str, x: torch.Tensor) -> Prepared:
        if name == "eager":
            return Prepared(lambda: forward(self.steps, x, "eager"))
        if name == "linear":
            return Prepared(lambda: forward(self.steps, x, "linear"))
        if name in COMPILE_MODES:
            steps = self.steps
            return compiled(lambda x: forward(steps, x, "linear"), name, (x,), self.device)
        if name in ("ours", "ours-unfused-graph"):
            t = time.perf_counter()  # the first batch also pays for building (and warming) the executor
            g = self._graphed_executor("fused" if name == "ours" else "unfused")
            # The input is staged into the bucket's graph input once, as the service's H2D copy puts it
            # there, and each call is one replay: the anchors' graphs likewise read an input already in place.
            rows = g.stage(x)
            return self._warmed(Prepared(lambda: g.replay(rows), graphed=True), t)
        if name == "ours-eager":
            t = time.perf_counter()
            ex = self._executor("fused")
            return self._warmed(Prepared(lambda: ex.forward(x), plain_only=True), t)
        raise ValueError(f"unknown model provider {name!r}; expected one of {', '.join(MODEL_PROVIDERS)}")

    def _warmed(self, prep: Prepared, t0: float) -> Prepared:
        for _ in range(3):  # first calls autotune the bucket (and capture its graph)
            prep.fn()
        synchronize(self.device)
        prep.compile_s = time.perf_counter() - t0
        return prep
