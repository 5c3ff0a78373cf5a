"""Two executors, one plan: the fused one swaps each step's implementation, never the model.

    fused:   MLPStep -> kernels.FusedMLP (1 kernel for all its layers), LinearStep -> kernels.FusedLinear
             (1 kernel), Conv2dStep -> kernels.conv.fused_conv2d (conv + bias + act [+ pool], 1 kernel),
             Pool2dStep -> kernels.pool.fused_pool2d (pool + act, 1 kernel), ActivationStep ->
             kernels.fused_activation
    unfused: MLPStep and LinearStep -> kernels.reference.linear per layer (mm, add, act: 3 kernels each),
             Conv2dStep -> F.conv2d with its bias, then the activation (2 kernels, as nn.Conv2d + nn.ReLU)
             [then its pool, as a Pool2dStep],
             Pool2dStep -> F.avg_pool2d / F.max_pool2d, then the activation, ActivationStep -> torch

Each step is bound once, at load, to its tensors and parameters, so a forward is a loop of calls.
Each step can be timed under its plan name: on CUDA with events recorded on the stream around the
step (or captured into a bucket's timed graph) and read after the batch's own synchronisation (no extra
sync); on the CPU with the wall clock.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Literal

import torch

from .loader import Model
from .planner import (
    ActivationStep,
    Conv2dStep,
    FlattenStep,
    LinearStep,
    MLPStep,
    Pool2dStep,
    Step,
    fused_steps,
)

Mode = Literal["fused", "unfused"]
Layer = Callable[[torch.Tensor], torch.Tensor]


class StepTimer:
    """Times steps of one forward. `results()` may only be called after the output was synchronised.

    `external`: CUDA events that a graph capture records as event-record nodes (cudaEventRecordExternal), so a
    captured forward times its own steps each time it is replayed (service/model/graphs.py, timed graphs)."""

    def __init__(self, device: torch.device, external: bool = False):
        self._cuda = device.type == "cuda"
        self._external = external
        self._events: dict[str, tuple[torch.cuda.Event, torch.cuda.Event]] = {}  # reused across batches
        self._wall: dict[str, float] = {}
        self._order: list[str] = []

    def start(self, name: str) -> None:
        if name not in self._order:
            self._order.append(name)
        if self._cuda:
            pair = self._events.get(name)
            if pair is None:
                pair = self._events[name] = tuple(
                    torch.cuda.Event(enable_timing=True, external=self._external) for _ in range(2)
                )
            pair[0].record()
        else:
            self._wall[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        if self._cuda:
            self._events[name][1].record()
        else:
            self._wall[name] = time.perf_counter() - self._wall[name]

    def results(self) -> list[tuple[str, float]]:
        if self._cuda:
            # The caller already synchronised on the output; the last event is complete, so this waits
            # for nothing. elapsed_time is in milliseconds.
            return [(n, self._events[n][0].elapsed_time(self._events[n][1]) / 1e3) for n in self._order]
        return [(n, self._wall[n]) for n in self._order]


def _flatten(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], -1)  # a view of a contiguous batch: no copy, no kernel


class Executor:
    """Runs the plan of `model` on one device in one dtype, fused or unfused."""

    def __init__(
        self,
        model: Model,
        mode: Mode,
        device: torch.device,
        dtype: torch.dtype,
        *,
        whole_mlp: bool = True,
        conv_pool: bool = True,
    ):
        if mode not in ("fused", "unfused"):
            raise ValueError(f"unknown mode {mode!r}; expected 'fused' or 'unfused'")
        self.model = model
        self.mode = mode
        self.device = device
        self.dtype = dtype
        # Both modes run one plan, so their per-step timings line up under the same names.
        self.steps: list[Step] = fused_steps(model.ops, model.tensors, whole_mlp=whole_mlp, conv_pool=conv_pool)
        # Weights are cast and placed once, contiguous, as the kernels require.
        self.tensors = {k: v.to(device=device, dtype=dtype).contiguous() for k, v in model.tensors.items()}
        # Fused, a conv or pool step that feeds another writes channels_last (see channels_last_outputs).
        nhwc = channels_last_outputs(self.steps) if mode == "fused" else [False] * len(self.steps)
        # (name to time under, or None for a view; the bound layer)
        self.layers: list[tuple[str | None, Layer]] = [
            self._bind(s, cl) for s, cl in zip(self.steps, nhwc, strict=True)
        ]

    def _bind(self, step: Step, channels_last: bool = False) -> tuple[str | None, Layer]:
        # Imported here, not at module top: the service decides interpreter vs compiled
        # (TRITON_INTERPRET) from its settings before the kernels are first defined.
        from kernels import FusedLinear, fused_activation, reference
        from kernels.mlp import FusedMLP, MLPLayer

        if isinstance(step, FlattenStep):
            return None, _flatten
        if isinstance(step, MLPStep):
            if self.mode == "fused":
                layers = [
                    MLPLayer(
                        self.tensors[s.weight], self.tensors[s.bias] if s.bias else None, s.activation, s.negative_slope
                    )
                    for s in step.layers
                ]
                return step.name, FusedMLP(layers)
            per_layer = [self._bind(s)[1] for s in step.layers]
            return step.name, functools.partial(_chain, layers=per_layer)
        if isinstance(step, LinearStep):
            w = self.tensors[step.weight]
            b = self.tensors[step.bias] if step.bias else None
            if self.mode == "fused":
                return step.name, FusedLinear(w, b, step.activation, negative_slope=step.negative_slope)
            return step.name, functools.partial(
                reference.linear, weight=w, bias=b, activation=step.activation, negative_slope=step.negative_slope
            )
        if isinstance(step, Conv2dStep):
            w = self.tensors[step.weight]
            b = self.tensors[step.bias] if step.bias else None
            geometry = {"stride": step.stride, "padding": step.padding, "dilation": step.dilation}
            act = {"activation": step.activation, "negative_slope": step.negative_slope}
            pool = step.pool
            if self.mode == "fused":
                from kernels.conv import fused_conv2d
                from kernels.conv_tma import weight_for

                w = weight_for(w, step.stride)  # channels_last where the TMA kernel can run the layer
                if pool is not None:  # group_conv_pools checked that the kernel can: floor mode, no padding
                    geometry["pool"] = (pool.kind, pool.kernel_size, pool.stride)
                fmt = _memory_format(channels_last)
                return step.name, functools.partial(
                    fused_conv2d, weight=w, bias=b, **geometry, **act, memory_format=fmt
                )
            conv = functools.partial(reference.conv2d, weight=w, bias=b, **geometry, **act)
            if pool is None:
                return step.name, conv
            return step.name, functools.partial(_chain, layers=[conv, self._bind(pool)[1]])
        if isinstance(step, Pool2dStep):
            pool = {
                "kind": step.kind, "kernel_size": step.kernel_size, "stride": step.stride, "padding": step.padding,
                "ceil_mode": step.ceil_mode, "count_include_pad": step.count_include_pad,
                "activation": step.activation, "negative_slope": step.negative_slope,
            }  # fmt: skip
            if self.mode == "fused":
                from kernels.pool import fused_pool2d

                return step.name, functools.partial(fused_pool2d, **pool, memory_format=_memory_format(channels_last))
            return step.name, functools.partial(reference.pool2d, **pool)
        if isinstance(step, ActivationStep):
            fn = fused_activation if self.mode == "fused" else reference.activation
            return step.name, functools.partial(
                _contiguous_then, fn=fn, activation=step.activation, negative_slope=step.negative_slope
            )
        raise TypeError(f"no implementation for step {step!r}")

    def forward(self, x: torch.Tensor, timer: StepTimer | None = None) -> torch.Tensor:
        """x: (rows, *input_shape) on the executor's device and dtype -> (rows, output_features)."""
        for name, layer in self.layers:
            if timer is None or name is None:
                x = layer(x)
            else:
                timer.start(name)
                x = layer(x)
                timer.stop(name)
        return x


def channels_last_outputs(steps: list[Step]) -> list[bool]:
    """Per step: whether the fused executor has it write channels_last (NHWC). A conv or pool step whose output
    goes straight into another conv or pool does: the next one then gathers each pixel's channels as one
    contiguous run, 2x faster than NCHW at 256 images of 64 -> 64 channels at 32x32 on an H100
    (bench/results/h100/probe_conv_h100.txt). Every other step keeps NCHW, so the model reads NCHW rows and its
    flatten (a view) sees torch's feature order; the first conv reads NCHW and writes NHWC in the same kernel."""
    image_steps = (Conv2dStep, Pool2dStep)
    return [
        isinstance(step, image_steps) and i + 1 < len(steps) and isinstance(steps[i + 1], image_steps)
        for i, step in enumerate(steps)
    ]


def _memory_format(channels_last: bool) -> torch.memory_format:
    return torch.channels_last if channels_last else torch.contiguous_format


def _chain(x, *, layers):
    for layer in layers:
        x = layer(x)
    return x


def _contiguous_then(x, *, fn, activation, negative_slope):
    return fn(x.contiguous(), activation, negative_slope=negative_slope)
