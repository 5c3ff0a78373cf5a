"""What a front end holds (settings, what the model takes and gives, its engine link, its metrics), and the plan
description an engine publishes for `GET /model`."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from . import wire
from .config import Settings
from .engine_client import EngineClient
from .metrics import RequestMetrics

# Longest JSON number orjson writes for a float ("-1.2345678901234567e-308," is 25 bytes), rounded up.
BYTES_PER_VALUE = 32
PLAN_FILE = "model.json"  # in the run directory: engine 0's description of what it serves


def body_limit(max_rows: int, input_features: int) -> int:
    """The largest request body (or gRPC message) a front end reads: max_rows rows of JSON numbers, plus 4 KiB."""
    return max_rows * input_features * BYTES_PER_VALUE + 4096


@dataclass(frozen=True)
class ModelInfo:
    """What a front end must know of the model to validate requests and label answers (no tensors, no torch)."""

    name: str
    description: str | None
    input_shape: tuple[int, ...]
    output_features: int
    labels: list[str] | None

    @classmethod
    def of(cls, model) -> ModelInfo:
        spec = model.spec
        return cls(model.name, spec.description, tuple(model.input_shape), model.output_features, spec.labels)

    @property
    def input_features(self) -> int:
        return math.prod(self.input_shape)


def describe_plan(steps, tensors) -> list[dict]:
    """The fused plan as JSON: one entry per step, with its kernel name (the `kernel` metric label)."""
    from .model import planner as p
    from .model.planner import Conv2dStep, FlattenStep, LinearStep, MLPStep, Pool2dStep

    def linear(s: LinearStep) -> dict:
        w = tensors[s.weight]
        return {"in": w.shape[1], "out": w.shape[0], "bias": s.bias is not None, "activation": s.activation,
                **p.step_extras(s)}  # fmt: skip

    def pool(s: Pool2dStep) -> dict:
        return {
            "op": f"{s.kind}pool2d", "kernel_size": list(s.kernel_size), "stride": list(s.stride),
            "padding": list(s.padding), "ceil_mode": s.ceil_mode,
            **({"count_include_pad": s.count_include_pad} if s.kind == "avg" else {}),
            "activation": s.activation,
        }  # fmt: skip

    out = []
    for s in steps:
        if not isinstance(s, (LinearStep, MLPStep, Conv2dStep, Pool2dStep, FlattenStep, p.ActivationStep)):
            out.append({"kernel": s.name, **p.describe_step(s)})  # a graph's add, batchnorm, concat, softmax
        elif isinstance(s, LinearStep):
            out.append({"kernel": s.name, "op": "linear", **linear(s)})
        elif isinstance(s, MLPStep):
            out.append({"kernel": s.name, "op": "mlp", "layers": [linear(x) for x in s.layers]})
        elif isinstance(s, Conv2dStep):
            w = tensors[s.weight]  # (out, in, kh, kw)
            out.append({
                "kernel": s.name, "op": "conv2d", "in_channels": w.shape[1], "out_channels": w.shape[0],
                "kernel_size": [w.shape[2], w.shape[3]], "stride": list(s.stride), "padding": list(s.padding),
                "dilation": list(s.dilation), "bias": s.bias is not None, "activation": s.activation,
                **p.step_extras(s),
            })  # fmt: skip
            if s.pool is not None:  # pooled in the same kernel
                out[-1]["pool"] = pool(s.pool)
        elif isinstance(s, Pool2dStep):
            out.append({"kernel": s.name, **pool(s)})
        elif isinstance(s, FlattenStep):
            out.append({"kernel": None, "op": "flatten"})
        else:
            out.append({"kernel": s.name, "op": "activation", "activation": s.activation})
    return out


def write_plan(run_dir: Path, executor, device: str) -> None:
    """Engine side: publish what this engine runs, for the front ends' `GET /model`."""
    doc = {
        "plan": describe_plan(executor.steps, executor.tensors),
        "dtype": str(executor.dtype).removeprefix("torch."),
        "device": device,
    }
    tmp = run_dir / (PLAN_FILE + ".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(run_dir / PLAN_FILE)


@dataclass
class FrontendState:
    settings: Settings
    model: ModelInfo
    engines: EngineClient
    metrics: RequestMetrics
    run_dir: Path
    draining: bool = False  # SIGTERM came: answers close their connections, /health/ready reads 503
    _plan: dict | None = None

    @property
    def ready(self) -> bool:
        return not self.draining and self.engines.ready()

    @property
    def status(self) -> str:
        """draining, or the least advanced engine's state: loading, warming, ready, failed, broken or stopped."""
        if self.draining:
            return "draining"
        states = self.engines.states()
        worst = next((s for s in (wire.FAILED_START, wire.BROKEN, wire.STOPPED) if s in states), min(states))
        return wire.ENGINE_STATES[worst]

    @property
    def max_body_bytes(self) -> int:
        return body_limit(self.settings.max_rows_per_request, self.model.input_features)

    def predictions(self, indices: np.ndarray) -> list:
        labels = self.model.labels
        return [labels[i] for i in indices.tolist()] if labels else indices.tolist()

    def plan(self) -> dict:
        if self._plan is None:
            path = self.run_dir / PLAN_FILE
            if not path.is_file():
                return {}
            self._plan = json.loads(path.read_text())
        return self._plan

    def describe(self) -> dict:
        plan = self.plan()
        s = self.settings
        return {
            **{k: v for k, v in asdict(self.model).items() if k != "input_shape"},
            "input_shape": list(self.model.input_shape),
            "mode": s.mode,
            "device": plan.get("device"),
            "dtype": plan.get("dtype"),
            "engines": len(self.engines.states()),
            "max_batch_size": s.max_batch_size,
            "max_rows_per_request": s.max_rows_per_request,
            "plan": plan.get("plan"),
            "status": self.status,
        }
