"""Whole-model forwards: the shipped digits MLP and a wide random MLP, as each provider runs them.

    eager               per layer torch.mm, + b, act (the unfused baseline; 3 kernels a layer)
    linear              per layer F.linear, act
    compile             torch.compile of the F.linear forward, default mode, dynamic=False, per batch size
    compile-max         the same, mode="max-autotune-no-cudagraphs"
    ours                the service's path: Executor(model, "fused") under GraphedExecutor (pads the
                        batch to a power-of-two bucket, replays one CUDA graph per bucket); the input is
                        staged in the graph's input buffer once (where the service's H2D copy writes it)
    ours-eager          Executor(model, "fused").forward: one launch per step from Python, no graph
    ours-unfused-graph  Executor(model, "unfused") under GraphedExecutor: the service's A/B baseline

Every provider except ours-* also runs under a CUDA graph captured here (kernel_timing.measure).
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
from service.model.loader import Model, load_model
from service.model.planner import ActivationStep, FlattenStep, LinearStep, plan

from .kernel_providers import COMPILE_MODES, NotAvailable, compiled
from .kernel_timing import ELEMENT_BYTES, Prepared, describe, synchronize

MODEL_PROVIDERS = ("eager", "linear", "compile", "compile-max", "ours-unfused-graph", "ours-eager", "ours")
MODELS = ("digits", "wide")
DIGITS_DIR = Path(__file__).resolve().parents[1] / "model_weights" / "digits-mlp"
# The wide MLP's dims; ReLU after each hidden layer, none after the last (as digits-mlp: logits out).
# At batch 1 it reads 50 MB of fp16 weights: 11.8 us at 4.25 TB/s.
WIDE_DIMS = (1024, 4096, 4096, 1024)


def load_named(name: str, tmpdir: Path, seed: int) -> Model:
    """The shipped model ("digits"), or a random wide MLP written to tmpdir first ("wide")."""
    if name == "digits":
        return load_model(DIGITS_DIR)
    if name == "wide":
        return build_wide(tmpdir, seed)
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


def model_dims(model: Model) -> list[int]:
    dims = [model.input_features]
    dims += [model.tensors[s.weight].shape[0] for s in _per_layer(plan(model.ops)) if isinstance(s, LinearStep)]
    return dims


def bytes_and_flops(model: Model, rows: int, dtype: str) -> tuple[int, int]:
    """The fewest bytes a forward must move (input read, every weight and bias read once, output
    written; intermediates could stay on chip) and its flops (2 per multiply-add)."""
    linears = [s for s in _per_layer(plan(model.ops)) if isinstance(s, LinearStep)]
    params = sum(model.tensors[s.weight].numel() + (model.tensors[s.bias].numel() if s.bias else 0) for s in linears)
    elements = rows * model.input_features + params + rows * model.output_features
    flops = 2 * rows * sum(model.tensors[s.weight].numel() for s in linears)
    return elements * ELEMENT_BYTES[dtype], flops


def bound_steps(model: Model, device: torch.device, dtype: torch.dtype) -> list[tuple]:
    """The plan with its tensors cast to dtype once, as the executors cast them."""
    t = {k: v.to(device=device, dtype=dtype).contiguous() for k, v in model.tensors.items()}
    steps = []
    for s in _per_layer(plan(model.ops)):
        if isinstance(s, FlattenStep):
            steps.append(("flatten",))
        elif isinstance(s, LinearStep):
            steps.append(("linear", t[s.weight], t[s.bias] if s.bias else None, s.activation, s.negative_slope))
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
    """how: "eager" (mm, add, act: kernels.reference.linear) or "linear" (F.linear, act)."""
    for op in steps:
        if op[0] == "flatten":
            x = x.reshape(x.shape[0], -1)
        elif op[0] == "linear":
            _, w, b, act, slope = op
            if how == "eager":
                x = reference.linear(x, w, b, act, negative_slope=slope)
            else:
                x = torch_activation(F.linear(x, w, b), act, slope)
        else:
            x = torch_activation(x, op[1], op[2])
    return x


def reference_forward(steps: list[tuple], x: torch.Tensor) -> torch.Tensor:
    """float64 forward from the same dtype-cast input and weights."""
    steps64 = [
        (op[0], op[1].double(), None if op[2] is None else op[2].double(), *op[3:]) if op[0] == "linear" else op
        for op in steps
    ]
    return forward(steps64, x.double(), "linear")


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
