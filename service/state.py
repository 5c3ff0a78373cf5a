"""What one running app holds: settings, the loaded model, its runner, batcher and metrics."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .batching import Batcher
from .config import Settings
from .metrics import Metrics
from .model.loader import Model
from .model.planner import Conv2dStep, FlattenStep, LinearStep, MLPStep, Pool2dStep
from .model.runner import ModelRunner

# Longest JSON number orjson writes for a float ("-1.2345678901234567e-308," is 25 bytes), rounded up.
BYTES_PER_VALUE = 32


@dataclass
class AppState:
    settings: Settings
    model: Model
    device: torch.device
    runner: ModelRunner
    batcher: Batcher
    metrics: Metrics
    status: str = "loading"  # loading -> warming -> ready | failed
    error: str | None = None

    @property
    def ready(self) -> bool:
        return self.status == "ready"

    @property
    def max_body_bytes(self) -> int:
        return self.settings.max_rows_per_request * self.model.input_features * BYTES_PER_VALUE + 4096

    def predictions(self, indices: np.ndarray) -> list:
        labels = self.model.spec.labels
        return [labels[i] for i in indices.tolist()] if labels else indices.tolist()

    def describe(self) -> dict:
        steps = []

        def linear(s: LinearStep) -> dict:
            w = self.model.tensors[s.weight]
            return {"in": w.shape[1], "out": w.shape[0], "bias": s.bias is not None, "activation": s.activation}

        def pool(s: Pool2dStep) -> dict:
            return {
                "op": f"{s.kind}pool2d", "kernel_size": list(s.kernel_size), "stride": list(s.stride),
                "padding": list(s.padding), "ceil_mode": s.ceil_mode,
                **({"count_include_pad": s.count_include_pad} if s.kind == "avg" else {}),
                "activation": s.activation,
            }  # fmt: skip

        for s in self.runner.executor.steps:
            if isinstance(s, LinearStep):
                steps.append({"kernel": s.name, "op": "linear", **linear(s)})
            elif isinstance(s, MLPStep):
                steps.append({"kernel": s.name, "op": "mlp", "layers": [linear(x) for x in s.layers]})
            elif isinstance(s, Conv2dStep):
                w = self.model.tensors[s.weight]  # (out, in, kh, kw)
                steps.append({
                    "kernel": s.name, "op": "conv2d", "in_channels": w.shape[1], "out_channels": w.shape[0],
                    "kernel_size": [w.shape[2], w.shape[3]], "stride": list(s.stride), "padding": list(s.padding),
                    "dilation": list(s.dilation), "bias": s.bias is not None, "activation": s.activation,
                })  # fmt: skip
                if s.pool is not None:  # pooled in the same kernel
                    steps[-1]["pool"] = pool(s.pool)
            elif isinstance(s, Pool2dStep):
                steps.append({"kernel": s.name, **pool(s)})
            elif isinstance(s, FlattenStep):
                steps.append({"kernel": None, "op": "flatten"})
            else:
                steps.append({"kernel": s.name, "op": "activation", "activation": s.activation})
        return {
            "name": self.model.name,
            "description": self.model.spec.description,
            "input_shape": list(self.model.input_shape),
            "output_features": self.model.output_features,
            "labels": self.model.spec.labels,
            "mode": self.settings.mode,
            "device": str(self.device),
            "dtype": str(self.runner.executor.dtype).removeprefix("torch."),
            "max_batch_size": self.settings.max_batch_size,
            "max_rows_per_request": self.settings.max_rows_per_request,
            "plan": steps,
            "status": self.status,
        }
