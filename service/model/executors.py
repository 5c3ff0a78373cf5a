"""Two executors, one plan: the fused one swaps each step's implementation, never the model.

    fused:   MLPStep -> kernels.FusedMLP (1 kernel for all its layers), LinearStep -> kernels.FusedLinear
             (1 kernel; with a residual, kernels.fused_linear(residual=)), Conv2dStep -> kernels.conv.fused_conv2d
             (conv + folded batch norm + bias + residual + act [+ pool], 1 kernel), Pool2dStep ->
             kernels.pool.fused_pool2d (pool + act, 1 kernel), ActivationStep -> kernels.fused_activation
    unfused: MLPStep and LinearStep -> kernels.reference.linear per layer (mm, add, act: 3 kernels each),
             Conv2dStep -> F.conv2d with its bias, then the activation (2 kernels, as nn.Conv2d + nn.ReLU)
             [then its pool, as a Pool2dStep], Pool2dStep -> F.avg_pool2d / F.max_pool2d, then the activation,
             ActivationStep -> torch. A batch norm runs as F.batch_norm after its conv or linear, and a
             residual as its own add, as the eager model runs them.
    input:   a declared normalization ((x - mean) / std per channel) runs in the conv that reads the input (fused:
             the conv kernel's input_norm, applied as it gathers x, uint8 or float; unfused: torch's (x.float() -
             mean) / std cast to the compute dtype, then F.conv2d, timed as the same step), or as a NormalizeStep
             (torch ops in both modes: one multiply-add fused, a subtract and a divide unfused). A uint8 input with
             no normalization is cast to the compute dtype before the first step.
    both:    AddStep (torch add, then the activation: in the fused mode by the activation kernel), ElementwiseStep
             (a broadcasting add, sub, mul or div, of two tensors or of a stored constant: torch's, then the
             activation as for AddStep), ClampStep (torch.clamp), LayerNormStep (fused: kernels.layernorm's one kernel;
             unfused: F.layer_norm over the channels),
             SliceStep (a copy of the channels' run), ChannelShuffleStep (one copy), PadStep (F.pad),
             BatchNormStep (fused: one multiply-add with the folded scale and shift; unfused: F.batch_norm),
             ConcatStep (torch.cat), SoftmaxStep (torch.softmax). Fused, an in-place concat (planner.place_concats)
             is a view of the buffer its inputs' producers wrote; an in-place shuffle (planner.place_shuffles) is its
             buffer, its concat a view that copies only the inputs no kernel wrote (x1 slices, strided), and an
             in-place slice a channel run of it.
    pools:   a global pool (one window over the whole image) of more than kernels.pool.UNROLL_TAPS taps runs as
             torch's mean / amax in the fused mode too (an SE block's squeeze: a parallel reduction, where the pool
             kernel walks the window in one program per image and channel block).
    grouped: a Conv2dStep with groups > 1 -> kernels.conv_grouped.fused_conv2d_grouped when fused (depthwise: a
             direct conv; wider groups: an implicit GEMM; folded batch norm, bias, residual and activation in the
             kernel), F.conv2d with its groups and the rest op by op unfused.

Batch norm is folded into the weight and bias of the conv or linear before it when the fused executor binds
the step (in float64, then cast): W' = W * s, b' = (b - mean) * s + beta with s = gamma / sqrt(var + eps) per
output channel. The model keeps the batch norm's own tensors, which the unfused executor runs.

A part of a step that the kernels lack (a `residual=` keyword, an activation missing from
kernels.activations) runs as torch ops after the kernel in the fused mode (`torch_parts` names them, and
`fusedserve check-model` shows them), so the plan and its step names never depend on what the kernels can do.

A fused step whose kernel has no launch config that compiles within the compile deadline
(kernels/compile_deadline.py) runs its unfused op instead: `warm_forward`, the forward of warm-ups, rebinds it as the
unfused executor binds it (output in the layout the fused plan gives that step) and records why in `fallbacks`,
which the plan file, the log and a metric report. So a model that imports always becomes ready.

Each step is bound once, at load, to its tensors and parameters, so a forward is a loop of calls over a
table of live tensors (each dropped after its last reader). Each step can be timed under its plan name: on
CUDA with events recorded on the stream around the step (or captured into a bucket's timed graph) and read
after the batch's own synchronisation (no extra sync); on the CPU with the wall clock.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from .loader import Model
from .planner import (
    ActivationStep,
    AddStep,
    BatchNorm,
    BatchNormStep,
    ChannelShuffleStep,
    ClampStep,
    ConcatStep,
    Conv2dStep,
    ElementwiseStep,
    FlattenStep,
    LayerNormStep,
    LinearStep,
    MLPStep,
    NormalizeStep,
    PadStep,
    Pool2dStep,
    SliceStep,
    SoftmaxStep,
    Step,
    concat_slots,
    fused_steps,
    reads,
    shuffle_slots,
    step_ops,
)

log = logging.getLogger(__name__)

Mode = Literal["fused", "unfused"]
Layer = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class KernelSupport:
    """What the fused kernels of this install can do beyond conv/linear + bias + activation."""

    activations: frozenset[str]
    conv_residual: bool  # kernels.conv.fused_conv2d(..., residual=)
    linear_residual: bool  # kernels.linear.fused_linear(..., residual=)


@functools.cache
def kernel_support() -> KernelSupport:
    # Imported here, not at module top: the service decides interpreter vs compiled (TRITON_INTERPRET) from its
    # settings before the kernels are first defined.
    from kernels.activations import ACTIVATIONS
    from kernels.conv import fused_conv2d
    from kernels.linear import fused_linear

    return KernelSupport(
        activations=frozenset(ACTIVATIONS),
        conv_residual="residual" in inspect.signature(fused_conv2d).parameters,
        linear_residual="residual" in inspect.signature(fused_linear).parameters,
    )


def torch_parts(step: Step, support: KernelSupport | None = None) -> list[str]:
    """The parts of a step that the fused executor runs as torch ops, not in a Triton kernel ([] for none)."""
    support = support or kernel_support()
    if isinstance(step, MLPStep):
        parts = [p for layer in step.layers for p in torch_parts(layer, support)]
        return parts if not parts else ["the whole-MLP kernel (its layers run one by one)", *parts]
    if isinstance(step, (AddStep, ElementwiseStep)):
        kind = "add" if isinstance(step, AddStep) else step.kind
        return [kind] + ([step.activation] if step.activation not in support.activations else [])
    if isinstance(step, LayerNormStep):  # kernels/layernorm.py
        return []
    if isinstance(step, ConcatStep) and step.in_place:  # a view of the buffer its inputs' producers wrote
        return ["concat"] if step.copied else []  # place_shuffles: a strided copy of the inputs it copies
    if isinstance(step, (ChannelShuffleStep, SliceStep)) and step.in_place:  # views of a shuffled buffer
        return []
    if isinstance(step, (BatchNormStep, ConcatStep, SoftmaxStep, NormalizeStep, ClampStep, SliceStep,
                         ChannelShuffleStep, PadStep)):  # fmt: skip
        return step_ops(step)
    if isinstance(step, Conv2dStep) and step.groups > 1:  # kernels/conv_grouped.py: all but the gate
        return ["mul"] if step.gate else []
    parts = []
    if isinstance(step, Conv2dStep) and step.prenorm is not None and step.prenorm_activation not in support.activations:
        parts += ["batchnorm", step.prenorm_activation]  # Executor._bind_conv: before the kernel, as torch ops
    if isinstance(step, Conv2dStep) and step.gate is not None and (step.pool is not None or step.normalize is not None):
        parts.append("mul")  # Executor._gate_in_kernel: the gate as a torch mul before the kernel
    has_residual = isinstance(step, (Conv2dStep, LinearStep)) and step.residual is not None
    if has_residual and not (support.conv_residual if isinstance(step, Conv2dStep) else support.linear_residual):
        parts.append("add")
    activation = getattr(step, "activation", "none")
    if activation != "none" and activation not in support.activations:
        parts.append(activation)
    return parts


def torch_activation(x: torch.Tensor, name: str, negative_slope: float) -> torch.Tensor:
    """One eager activation, including those the kernels' table may lack (relu6, hardswish)."""
    from kernels.activations import ACTIVATIONS
    from kernels.activations import torch_activation as table

    if name in ACTIVATIONS:
        return table(x, name, negative_slope)
    if name == "relu6":
        return F.relu6(x)
    if name == "hardswish":
        return F.hardswish(x)
    if name == "hardsigmoid":
        return F.hardsigmoid(x)
    raise ValueError(f"unknown activation {name!r}")


def fold_batchnorm(
    weight: torch.Tensor, bias: torch.Tensor | None, bn: BatchNorm, tensors: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(W', b') of a conv or linear followed by inference batch norm `bn`, in float64: W' = W * s per output
    channel, b' = (b - mean) * s + beta, s = gamma / sqrt(var + eps)."""
    gamma, beta, mean, var = (tensors[n].double() for n in (bn.weight, bn.bias, bn.mean, bn.var))
    s = gamma / torch.sqrt(var + bn.eps)
    w = weight.double() * s.reshape(-1, *([1] * (weight.dim() - 1)))
    b = (bias.double() if bias is not None else torch.zeros_like(mean)) - mean
    return w, b * s + beta


def scale_shift(bn: BatchNorm, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch norm as y = x * scale + shift per channel, in float64."""
    gamma, beta, mean, var = (tensors[n].double() for n in (bn.weight, bn.bias, bn.mean, bn.var))
    scale = gamma / torch.sqrt(var + bn.eps)
    return scale, beta - mean * scale


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


@dataclass(frozen=True)
class Wiring:
    """Where a bound step takes its arguments from and puts its result, in the forward's table of tensors."""

    reads: tuple[str, ...]  # the step's inputs, then its residual
    output: str
    frees: tuple[str, ...]  # tensors no later step reads: dropped once this step ran
    # a concat buffer this step allocates before it runs (its first writer): (name, per-row shape (width, H, W))
    alloc: tuple[str, tuple[int, ...]] | None = None
    # (buffer, offset, channels, stride): the step writes its output there (out=): channels offset, offset + stride, ...
    into: tuple[str, int, int, int] | None = None


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
        precision: str | None = None,
        calibration=None,
        fp16_steps: tuple[str, ...] | None = None,
    ):
        if mode not in ("fused", "unfused"):
            raise ValueError(f"unknown mode {mode!r}; expected 'fused' or 'unfused'")
        self.model = model
        self.mode = mode
        self.device = device
        self.dtype = dtype
        self.support = kernel_support()
        # float8 (service/model/float8.py): the steps the fp8 kernels can run, but for those kept in `dtype` (the
        # first conv and the classifier by default), run with e4m3 weights (per output channel) and activations (per
        # tensor, calibrated); the rest in `dtype`. Layer by layer: the whole-MLP kernel has no fp8 variant.
        self.precision = precision or str(dtype).removeprefix("torch.")
        if self.precision not in ("float8", str(dtype).removeprefix("torch.")):
            raise ValueError(f"precision {precision!r}: float8, or the dtype {dtype}")
        if self.precision == "float8":
            whole_mlp = conv_pool = False  # a pooled conv would stay fp16: the pool runs apart instead
        # Both modes run one plan, so their per-step timings line up under the same names.
        self.steps: list[Step] = fused_steps(
            model.ops,
            model.tensors,
            whole_mlp=whole_mlp,
            conv_pool=conv_pool,
            normalize=model.normalize,
            shapes=model.shapes,
        )
        # Weights are cast and placed once, contiguous, as the kernels require.
        self.tensors = {k: v.to(device=device, dtype=dtype).contiguous() for k, v in model.tensors.items()}
        # Fused, a conv or pool step whose output only image steps read writes channels_last (channels_last_outputs).
        nhwc = channels_last_outputs(self.steps) if mode == "fused" else [False] * len(self.steps)
        self.channels_last = nhwc
        self.fp8: dict = {}  # step name -> float8.Fp8Step (run in float8) or Fp8Output (a pool writing e4m3)
        if self.precision == "float8":
            from .float8 import DEFAULT_FP16_STEPS, load_calibration, plan_float8

            calibration = calibration if calibration is not None else load_calibration(model)
            keep = DEFAULT_FP16_STEPS if fp16_steps is None else tuple(fp16_steps)
            self.fp8 = plan_float8(self.steps, calibration, model.name, keep, model.shapes)
        # Fused, the concats that place_concats put in buffers: each of their tensors (concat_slots) as a channel run of
        # its buffer, which the first writer's step allocates (per forward, so a captured graph holds it in its pool).
        self.slots = {}
        if mode == "fused" and self.precision != "float8":
            self.slots = concat_slots(self.steps, model.shapes, self.steps[-1].output)
            # and the shuffles that place_shuffles put in buffers: their concat's inputs at strided channels of them
            self.slots |= shuffle_slots(self.steps, model.shapes, self.steps[-1].output)
        # (name to time under, or None for a view; the bound layer), and where each takes its tensors from
        self.layers: list[tuple[str | None, Layer]] = [
            self._into_slot(s, self._bind(s, cl)) for s, cl in zip(self.steps, nhwc, strict=True)
        ]
        # step name -> why it runs its unfused op in this fused executor (warm_forward)
        self.fallbacks: dict[str, str] = {}
        self.input_name = model.input_name if self.steps[0].inputs else "input"
        self.output_name = self.steps[-1].output
        self.wiring = _wire(self.steps, self.input_name, self.slots, model.shapes)
        # The dtype forward takes: the model's uint8 pixels, else the compute dtype. A normalizing step reads them as
        # sent; without one, forward casts them first.
        self.input_dtype = model.input_dtype if model.input_dtype == torch.uint8 else dtype
        self._cast_input = self.input_dtype != dtype and model.normalize is None

    def _into_slot(self, step: Step, bound: tuple[str | None, Layer]) -> tuple[str | None, Layer]:
        """A step whose output lives in a concat buffer (not a concat: those are views), bound to write it there."""
        name, layer = bound
        interleave = isinstance(step, Conv2dStep) and step.interleave is not None
        if interleave and step.output not in self.slots:  # unfused (or float8): the concat reads the partner itself
            return name, functools.partial(_without_partner, layer=layer)
        if step.output not in self.slots or isinstance(step, (ConcatStep, ChannelShuffleStep)):
            return bound
        from kernels.conv import fused_conv2d
        from kernels.pool import fused_pool2d

        writes = isinstance(layer, functools.partial) and layer.func in (fused_conv2d, fused_pool2d)
        if interleave:  # its output and the partner side by side in the shuffled buffer (place_shuffles)
            writes = writes and layer.func is fused_conv2d
            return name, functools.partial(_written_interleaved, layer=layer, writes_out=writes,
                                           k=step.interleave_index)  # fmt: skip
        return name, functools.partial(_written_into, layer=layer, writes_out=writes)

    def example_input(self, rows: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Random rows as forward takes them, on the device: pixels 0-255 for a uint8 input, else N(0, 1) in the
        compute dtype (warm-ups and graph captures)."""
        shape = (rows, *self.model.input_shape)
        if self.input_dtype == torch.uint8:
            return torch.randint(0, 256, shape, generator=generator, device=self.device, dtype=torch.uint8)
        return torch.randn(shape, generator=generator, device=self.device).to(self.dtype)

    def _buffer(self, rows: int, shape: tuple[int, ...]) -> torch.Tensor:
        """A concat buffer for `rows` images, (rows, *shape) channels_last, written by its concat's producers."""
        return torch.empty((rows, *shape), device=self.device, dtype=self.dtype, memory_format=torch.channels_last)

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.device, dtype=self.dtype).contiguous()

    def _weights(self, step: LinearStep | Conv2dStep) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's weight and bias as its mode runs them: with the batch norm and the layer scale folded in when
        fused (in float64, then cast)."""
        if self.mode == "fused" and (step.batchnorm is not None or step.scale is not None):
            src = self.model.tensors
            w, b = src[step.weight].double(), src[step.bias].double() if step.bias else None
            if step.batchnorm is not None:
                w, b = fold_batchnorm(w, b, step.batchnorm, src)
            if step.scale is not None:
                s = src[step.scale].double().reshape(-1)
                s = s.expand(w.shape[0]) if s.numel() == 1 else s
                w, b = w * s.reshape(-1, *([1] * (w.dim() - 1))), None if b is None else b * s
            return self._cast(w), None if b is None else self._cast(b)
        return self.tensors[step.weight], self.tensors[step.bias] if step.bias else None

    def _post(self, step: LinearStep | Conv2dStep) -> Layer | None:
        """What the unfused mode runs after a conv or linear and before its residual: the batch norm, then the layer
        scale (a torch mul by the stored constant), as the eager model runs them; None for neither."""
        bn = self._batch_norm(step.batchnorm)
        if step.scale is None:
            return bn
        constant = self.tensors[step.scale]
        return functools.partial(_scaled, first=bn or _identity, scale=constant)

    def _bind(self, step: Step, channels_last: bool = False) -> tuple[str | None, Layer]:
        # Imported here, not at module top: the service decides interpreter vs compiled
        # (TRITON_INTERPRET) from its settings before the kernels are first defined.
        from kernels import FusedLinear, fused_activation, reference
        from kernels.mlp import FusedMLP, MLPLayer

        fused = self.mode == "fused"
        support = self.support
        if isinstance(step, (LinearStep, Conv2dStep)) and self._runs_fp8(step):
            return step.name, self._bind_fp8(step, channels_last)
        if isinstance(step, FlattenStep):
            return None, _flatten
        if isinstance(step, MLPStep):
            if fused and not torch_parts(step, support):
                layers = []
                for s in step.layers:
                    w, b = self._weights(s)
                    layers.append(MLPLayer(w, b, s.activation, s.negative_slope))
                return step.name, FusedMLP(layers)
            per_layer = [self._bind(s)[1] for s in step.layers]
            return step.name, functools.partial(_chain, layers=per_layer)
        if isinstance(step, LinearStep):
            w, b = self._weights(step)
            act = {"activation": step.activation, "negative_slope": step.negative_slope}
            if not fused:
                post = self._post(step)
                if post is None and step.residual is None and step.activation in support.activations:
                    return step.name, functools.partial(reference.linear, weight=w, bias=b, **act)
                mm = functools.partial(reference.linear, weight=w, bias=b)
                return step.name, functools.partial(_unfused_tail, first=mm, bn=post, **act)
            kernel_act = step.activation in support.activations
            if step.residual is not None and support.linear_residual:
                from kernels.linear import fused_linear

                if kernel_act:
                    return step.name, functools.partial(_residual_kw, fn=fused_linear, weight=w, bias=b, **act)
                gemm = functools.partial(_residual_kw, fn=fused_linear, weight=w, bias=b)
                return step.name, functools.partial(_then_activation, first=gemm, **act)
            if kernel_act and step.residual is None:
                return step.name, FusedLinear(w, b, step.activation, negative_slope=step.negative_slope)
            # What the kernel lacks (the residual, the activation) runs after it as torch ops.
            gemm = FusedLinear(w, b, "none")
            return step.name, functools.partial(_fused_tail, first=gemm, add=step.residual is not None, **act)
        if isinstance(step, Conv2dStep):
            return step.name, self._bind_conv(step, channels_last)
        if isinstance(step, Pool2dStep):
            pool = {
                "kind": step.kind, "kernel_size": step.kernel_size, "stride": step.stride, "padding": step.padding,
                "ceil_mode": step.ceil_mode, "count_include_pad": step.count_include_pad,
                "activation": step.activation, "negative_slope": step.negative_slope,
            }  # fmt: skip
            act = {"activation": step.activation, "negative_slope": step.negative_slope}
            known = step.activation in support.activations
            # float8: its readers are float8 steps, so it writes e4m3 with their input's scale (float8.Fp8Output)
            out_scale = self.fp8[step.name].out_scale if step.name in self.fp8 else None
            quant = {"out_scale": out_scale} if out_scale is not None else {}
            if not fused:
                if known:
                    return step.name, functools.partial(reference.pool2d, **pool, **quant)
                pooled = functools.partial(reference.pool2d, **{**pool, "activation": "none"})
                return step.name, _quantized(functools.partial(_unfused_tail, first=pooled, bn=None, **act), out_scale)
            from kernels.pool import UNROLL_TAPS, fused_pool2d

            fmt = _memory_format(channels_last)
            if self._global_pool(step) and step.kernel_size[0] * step.kernel_size[1] > UNROLL_TAPS.value:
                # A large global pool (an SE block's squeeze over 112x112): torch's reduction spreads the window
                # over the GPU, where the pool kernel loops over it in one program per (image, channel block): 2.4
                # ms for 32 channels of 112x112 at batch 1 (H200), against a few us.
                return step.name, _quantized(functools.partial(_global_pool, kind=step.kind, kernel=True, **act),
                                             out_scale)  # fmt: skip
            if known:
                return step.name, functools.partial(fused_pool2d, **pool, memory_format=fmt, **quant)
            pooled = functools.partial(fused_pool2d, **{**pool, "activation": "none"}, memory_format=fmt)
            return step.name, _quantized(functools.partial(_then_activation, first=pooled, **act), out_scale)
        if isinstance(step, ActivationStep):
            act = {"activation": step.activation, "negative_slope": step.negative_slope}
            if fused and step.activation in support.activations:
                return step.name, functools.partial(_contiguous_then, fn=fused_activation, **act)
            fn = reference.activation if step.activation in support.activations else torch_activation
            return step.name, functools.partial(_contiguous_then, fn=fn, **act)
        if isinstance(step, AddStep):
            act = {"activation": step.activation, "negative_slope": step.negative_slope}
            return step.name, functools.partial(_add_then, kernel=fused, **act)
        if isinstance(step, BatchNormStep):
            if fused:
                scale, shift = scale_shift(step.batchnorm, self.model.tensors)
                return step.name, functools.partial(_scale_shift, scale=self._cast(scale), shift=self._cast(shift))
            return step.name, self._batch_norm(step.batchnorm)
        if isinstance(step, NormalizeStep):
            norm = step.normalize
            if fused:
                from kernels.conv import input_norm_of

                scale, shift = input_norm_of(norm.mean, norm.std, self.device)
                return step.name, functools.partial(_normalize_fused, scale=scale, shift=shift, dtype=self.dtype)
            return step.name, functools.partial(reference.normalize_input, mean=self._stat(norm.mean),
                                                std=self._stat(norm.std), dtype=self.dtype)  # fmt: skip
        if isinstance(step, ElementwiseStep):
            act = {"activation": step.activation, "negative_slope": step.negative_slope}
            const = self.tensors[step.constant] if step.constant is not None else None
            return step.name, functools.partial(_elementwise_then, op=_ELEMENTWISE[step.kind], constant=const,
                                                reverse=step.reverse, kernel=fused, **act)  # fmt: skip
        if isinstance(step, ClampStep):
            return step.name, functools.partial(_clamp, scale=step.scale, shift=step.shift, lo=step.lo, hi=step.hi)
        if isinstance(step, LayerNormStep):
            w, b = self.tensors[step.weight], self.tensors[step.bias] if step.bias else None
            if fused:  # kernels/layernorm.py: one read and one write of x, in x's memory format
                from kernels.layernorm import fused_layernorm_channels

                return step.name, functools.partial(fused_layernorm_channels, weight=w, bias=b, eps=step.eps)
            return step.name, functools.partial(reference.layernorm_channels, weight=w, bias=b, eps=step.eps)
        if isinstance(step, SliceStep):
            if step.in_place and step.inputs[0] in self.slots:  # a channel run of a shuffled buffer: a view
                return None, functools.partial(_channels, offset=step.start, channels=step.end - step.start)
            return step.name, functools.partial(_slice_channels, start=step.start, end=step.end)
        if isinstance(step, ChannelShuffleStep):
            if step.output in self.slots:  # its concat's inputs were written into their shuffled channels: the buffer
                return None, functools.partial(_channels, offset=0, channels=self.slots[step.output].width)
            return step.name, functools.partial(_channel_shuffle, groups=step.groups)
        if isinstance(step, PadStep):
            top, left, bottom, right = step.pads
            return step.name, functools.partial(F.pad, pad=(left, right, top, bottom), value=step.value)
        if isinstance(step, ConcatStep):
            if step.output in self.slots and step.copied:  # place_shuffles: it copies these inputs, then the buffer
                places = tuple(_place(self.slots, step, t) for t in step.copied)
                return step.name, functools.partial(_copy_into, places=places)
            if step.output in self.slots:  # its inputs were written into their channels of the buffer: a view of it
                slot = self.slots[step.output]
                return None, functools.partial(_channels, offset=slot.offset, channels=slot.channels)
            return step.name, _concat
        if isinstance(step, SoftmaxStep):
            return step.name, _softmax
        raise TypeError(f"no implementation for step {step!r}")

    def _runs_fp8(self, step: Step) -> bool:
        """Whether the step runs in float8 (float8.Fp8Step), not in the compute dtype writing e4m3 (Fp8Output)."""
        from .float8 import Fp8Step

        return isinstance(self.fp8.get(step.name), Fp8Step)

    def precisions(self) -> dict[str, str]:
        """Each step's precision by name: float8 for the fp8 steps, else the compute dtype, that of a step writing e4m3
        for them too (float8.Fp8Output: it computes in the compute dtype) (GET /model)."""
        other = str(self.dtype).removeprefix("torch.")
        return {s.name: "float8" if self._runs_fp8(s) else other for s in self.steps}

    def _bind_fp8(self, step: LinearStep | Conv2dStep, channels_last: bool) -> Layer:
        """A conv or linear step in float8: e4m3 weights per output channel (batch norm and layer scale folded in
        float64 first, in both modes), the calibrated scales of its input, residual and output (calibrate.Fp8Step).
        Fused: kernels/conv_fp8.py (grouped and depthwise: conv_grouped_fp8.py), kernels/linear_fp8.py; unfused: their
        torch references (dequantize, fp32, round)."""
        from kernels import reference
        from kernels.fp8 import dequant_scale, quantize_weight

        plan = self.fp8[step.name]
        src = self.model.tensors
        w, b = src[step.weight].double(), src[step.bias].double() if step.bias else None
        if step.batchnorm is not None:
            w, b = fold_batchnorm(w, b, step.batchnorm, src)
        if step.scale is not None:
            s = src[step.scale].double().reshape(-1)
            s = s.expand(w.shape[0]) if s.numel() == 1 else s
            w, b = w * s.reshape(-1, *([1] * (w.dim() - 1))), None if b is None else b * s
        wq, w_scale = quantize_weight(w)
        conv = isinstance(step, Conv2dStep)
        grouped = conv and step.groups > 1
        if grouped and self.mode == "fused":
            from kernels.conv_grouped_fp8 import prepare_weight

            wq = prepare_weight(wq.to(self.device))
        else:
            wq = wq.to(self.device).contiguous(memory_format=torch.channels_last if conv else torch.contiguous_format)
        kw = {
            "weight": wq,
            "scale": dequant_scale(plan.x_scale, w_scale).to(self.device),
            "bias": None if b is None else b.float().to(self.device),
            "activation": step.activation,
            "negative_slope": step.negative_slope,
            "x_scale": plan.x_scale,
            "residual_scale": plan.residual_scale or 1.0,
            "out_scale": plan.out_scale,
            "out_dtype": self.dtype,
        }
        if conv:
            kw.update(stride=step.stride, padding=step.padding, dilation=step.dilation)
        if grouped:
            kw["groups"] = step.groups
        if self.mode == "unfused":
            fn = reference.conv2d_fp8 if conv else reference.linear_fp8
        elif conv:
            if grouped:
                from kernels.conv_grouped_fp8 import fused_conv2d_grouped_fp8 as fn
            else:
                from kernels.conv_fp8 import fused_conv2d_fp8 as fn
            kw["memory_format"] = _memory_format(channels_last)
        else:
            from kernels.linear_fp8 import fused_linear_fp8 as fn
        if conv and step.gate is not None:  # x * gate quantized as it is read (kernels/conv_fp8.py's gate)
            return functools.partial(_fp8_gated_layer, fn=fn, **kw)
        return functools.partial(_fp8_layer, fn=fn, **kw)

    def _global_pool(self, step: Pool2dStep) -> bool:
        """Whether a pool step reduces each channel's whole image to one value (no padding, one window)."""
        shape = self.model.shapes.get(step.inputs[0]) if step.inputs else None
        return (
            shape is not None
            and len(shape) == 3
            and tuple(step.kernel_size) == tuple(shape[1:])
            and tuple(step.padding) == (0, 0)
        )

    def _batch_norm(self, bn: BatchNorm | None) -> Layer | None:
        """F.batch_norm with the model's running statistics, in inference (the unfused mode's batch norm)."""
        if bn is None:
            return None
        t = self.tensors
        return functools.partial(_batch_norm, weight=t[bn.weight], bias=t[bn.bias], mean=t[bn.mean], var=t[bn.var],
                                 eps=bn.eps)  # fmt: skip

    def _stat(self, values: tuple[float, ...]) -> torch.Tensor:
        """A normalization's mean or std as the unfused mode's torch ops take it: fp32 on the device."""
        return torch.tensor(values, dtype=torch.float32, device=self.device)

    def _bind_conv(self, step: Conv2dStep, channels_last: bool) -> Layer:
        # float8: a conv in the compute dtype whose readers are float8 steps writes e4m3 (float8.Fp8Output); its kernel
        # quantizes in its epilogue where it runs the whole step (fused_conv2d's out_scale), else a quantizing pass
        out_scale = self.fp8[step.name].out_scale if step.name in self.fp8 else None
        layer = self._bind_conv_itself(step, channels_last, out_scale)
        if out_scale is not None and not (isinstance(layer, functools.partial) and "out_scale" in layer.keywords):
            return _quantized(self._bind_conv_outer(step, layer), out_scale)
        return self._bind_conv_outer(step, layer)

    def _bind_conv_outer(self, step: Conv2dStep, layer: Layer) -> Layer:
        """The conv layer with what runs around it: the pre-activation batch norm, the gate or the input's
        normalization where its kernel does not apply them."""
        if step.prenorm is not None and not self._prenorm_in_kernel(step):
            # unfused (or an activation the kernel lacks): F.batch_norm, then the activation, then the conv
            pre = functools.partial(_then_torch_activation, first=self._batch_norm(step.prenorm),
                                    activation=step.prenorm_activation, negative_slope=step.prenorm_slope)  # fmt: skip
            return functools.partial(_normalized_then, normalize=pre, layer=layer)
        if step.gate is not None:  # the SE gate: in the kernel's gather (x_scale) where it can, else a torch mul
            return functools.partial(_gated_conv, layer=layer, kernel=self._gate_in_kernel(step))
        norm = step.normalize
        if norm is None or (self.mode == "fused" and step.groups == 1):  # fused: the kernel normalizes as it loads
            return layer
        from kernels import reference

        first = functools.partial(reference.normalize_input, mean=self._stat(norm.mean), std=self._stat(norm.std),
                                  dtype=self.dtype)  # fmt: skip
        return functools.partial(_normalized_then, normalize=first, layer=layer)

    def _prenorm_in_kernel(self, step: Conv2dStep) -> bool:
        """Whether the fused conv kernel applies the step's pre-activation batch norm as it gathers x (input_norm,
        input_activation): groups 1 and an activation of the kernels' table."""
        return self.mode == "fused" and step.groups == 1 and step.prenorm_activation in self.support.activations

    def _gate_in_kernel(self, step: Conv2dStep) -> bool:
        """Whether the fused conv kernel applies the step's gate (x_scale): the layer is then one fused_conv2d call
        that forwards keywords (groups 1, its activation and residual in the kernel, no pool)."""
        support = self.support
        return (
            self.mode == "fused"
            and step.groups == 1
            and step.pool is None
            and step.normalize is None
            and step.activation in support.activations
            and (step.residual is None or support.conv_residual)
        )

    def _bind_conv_itself(self, step: Conv2dStep, channels_last: bool, out_scale: float | None = None) -> Layer:
        """The conv itself; `out_scale` (an e4m3 output) taken by the fused kernel where it runs the whole step."""
        from kernels import reference

        w, b = self._weights(step)
        geometry = {"stride": step.stride, "padding": step.padding, "dilation": step.dilation}
        act = {"activation": step.activation, "negative_slope": step.negative_slope}
        pool = step.pool
        if self.mode == "fused" and step.groups > 1:  # grouped and depthwise: kernels/conv_grouped.py
            from kernels.conv_grouped import fused_conv2d_grouped

            fmt = _memory_format(channels_last)
            geometry["groups"] = step.groups
            if step.residual is None:
                return functools.partial(fused_conv2d_grouped, weight=w, bias=b, **geometry, **act, memory_format=fmt)
            return functools.partial(_residual_kw, fn=fused_conv2d_grouped, weight=w, bias=b, **geometry, **act,
                                     memory_format=fmt, layout=fmt)  # fmt: skip
        if self.mode == "unfused":
            # Unfused: eager torch ops (F.conv2d with its groups).
            post = self._post(step)
            if step.groups > 1:
                conv = functools.partial(F.conv2d, weight=w, bias=b, groups=step.groups, **geometry)
            elif post is None and step.residual is None and step.activation in self.support.activations:
                conv = functools.partial(reference.conv2d, weight=w, bias=b, **geometry, **act)
                if pool is None:
                    return conv
                return functools.partial(_chain, layers=[conv, self._bind(pool)[1]])
            else:
                conv = functools.partial(reference.conv2d, weight=w, bias=b, **geometry)
            tail = functools.partial(_unfused_tail, first=conv, bn=post, **act)
            return tail if pool is None else functools.partial(_chain_first, first=tail, then=self._bind(pool)[1])
        from kernels.conv import fused_conv2d, input_norm_of
        from kernels.conv_tma import weight_for

        support = self.support
        fmt = _memory_format(channels_last)
        if step.normalize is not None:  # x as sent (uint8 or float), normalized as the kernel gathers it
            fused_conv2d = functools.partial(
                fused_conv2d, input_norm=input_norm_of(step.normalize.mean, step.normalize.std, self.device)
            )
        elif step.prenorm is not None and self._prenorm_in_kernel(step):  # relu(bn(x)) as the kernel gathers x
            scale, shift = scale_shift(step.prenorm, self.model.tensors)
            norm = tuple(t.to(device=self.device, dtype=torch.float32) for t in (scale, shift))
            fused_conv2d = functools.partial(fused_conv2d, input_norm=norm, input_activation=step.prenorm_activation,
                                             input_negative_slope=step.prenorm_slope)  # fmt: skip
        else:
            w = weight_for(w, step.stride)  # channels_last where the TMA kernel can run the layer (never normalizing)
        kernel_act = step.activation in support.activations
        kernel_residual = step.residual is not None and support.conv_residual
        if pool is not None and kernel_act:  # group_conv_pools checked that the kernel can: floor mode, no padding
            geometry["pool"] = (pool.kind, pool.kernel_size, pool.stride)
        if step.residual is None and kernel_act:
            quant = {"out_scale": out_scale} if out_scale is not None and pool is None else {}
            return functools.partial(fused_conv2d, weight=w, bias=b, **geometry, **act, memory_format=fmt, **quant)
        if kernel_residual:
            conv = functools.partial(_residual_kw, fn=fused_conv2d, weight=w, bias=b, **geometry,
                                     **(act if kernel_act else {}), memory_format=fmt, layout=fmt)  # fmt: skip
            if kernel_act:
                return conv
            return self._then_pool(functools.partial(_then_activation, first=conv, **act), pool, channels_last)
        # The kernel lacks the residual (then there is no pool: group_conv_pools) or the activation (then the
        # pool, which comes after it, runs apart): conv + bias in the kernel, the rest as torch ops and kernels.
        conv = functools.partial(fused_conv2d, weight=w, bias=b, **geometry, memory_format=fmt)
        tail = functools.partial(_fused_tail, first=conv, add=step.residual is not None, **act)
        return self._then_pool(tail, pool, channels_last)

    def _then_pool(self, layer: Layer, pool: Pool2dStep | None, channels_last: bool) -> Layer:
        if pool is None:
            return layer
        return functools.partial(_chain_first, first=layer, then=self._bind(pool, channels_last)[1])

    def warm_forward(self, x: torch.Tensor, on_step: Callable[[int, str | None], None] | None = None) -> torch.Tensor:
        """`forward` for warm-ups, where kernels compile and tune: on_step(index, name) before each step (start-up
        progress), and a fused step whose kernel could not compile within the deadline rebound to its unfused op
        (`fallbacks`) and run again, so the warm-up goes on."""
        from kernels.compile_deadline import CompileDeadlineExceeded

        if self._cast_input:
            x = x.to(self.dtype)
        live = {self.input_name: x}
        for i, wiring in enumerate(self.wiring):
            name, layer = self.layers[i]
            if on_step is not None:
                on_step(i, name)
            args, kw = self._inputs(wiring, live, x.shape[0])
            try:
                y = layer(*args, **kw)
            except Exception as e:
                late = _deadline_cause(e, CompileDeadlineExceeded)
                if late is None or self.mode != "fused":
                    raise
                y = self._fall_back(i, late)(*args, **kw)
            live[wiring.output] = y
            for t in wiring.frees:
                del live[t]
        return live[self.output_name]

    def _fall_back(self, index: int, why: Exception) -> Layer:
        """Rebind step `index` as the unfused executor binds it, its output in the layout the fused plan gives it."""
        step = self.steps[index]
        self.mode = "unfused"  # _bind and its helpers read the mode: bind this one step as the unfused executor does
        try:
            name, unfused = self._bind(step, False)
        finally:
            self.mode = "fused"
        layer = functools.partial(_in_layout_after, layer=unfused, channels_last=self.channels_last[index])
        name, layer = self._into_slot(step, (name, layer))
        self.layers[index] = (name, layer)
        self.fallbacks[step.name] = f"runs its unfused op: {why}"
        log.warning("step %s (%s) runs its unfused op: %s", step.name, type(step).__name__, why)
        return layer

    def _inputs(self, wiring: Wiring, live: dict, rows: int) -> tuple[list, dict]:
        """A step's inputs from `live` and its out= (its channels of a buffer), the buffer it starts allocated first:
        a shuffled concat with no writer before it reads its own buffer."""
        if wiring.alloc is not None:
            live[wiring.alloc[0]] = self._buffer(rows, wiring.alloc[1])
        kw = {} if wiring.into is None else {"out": _slot_view(live[wiring.into[0]], *wiring.into[1:])}
        return [live[t] for t in wiring.reads], kw

    def forward(self, x: torch.Tensor, timer: StepTimer | None = None) -> torch.Tensor:
        """x: (rows, *input_shape) on the executor's device, in `input_dtype` -> (rows, output_features)."""
        if self._cast_input:
            x = x.to(self.dtype)
        live = {self.input_name: x}
        for (name, layer), wiring in zip(self.layers, self.wiring, strict=True):
            args, kw = self._inputs(wiring, live, x.shape[0])
            if timer is None or name is None:
                y = layer(*args, **kw)
            else:
                timer.start(name)
                y = layer(*args, **kw)
                timer.stop(name)
            live[wiring.output] = y
            for t in wiring.frees:
                del live[t]
        return live[self.output_name]


def _written_into(*args, out, layer, writes_out):
    """A step writing its output into `out`, its channels of a concat buffer: the kernel's out= where its launcher
    takes one (writes_out), else a copy after it (a step bound otherwise, or fallen back to its unfused op)."""
    if writes_out:
        return layer(*args, out=out)
    return out.copy_(layer(*args))


def _written_interleaved(x, partner, *, out, layer, writes_out, k):
    """A conv whose output goes to channels k::2 of a shuffled buffer (`out`) beside `partner`'s, which the concat
    no longer copies: both in the conv kernel's store where its launcher takes them (writes_out), else the step's
    output and the partner each copied into their channels (a step bound otherwise, or fallen back)."""
    if writes_out:
        return layer(x, out=out, interleave=partner, interleave_index=k)
    from kernels.conv import other_half

    out.copy_(layer(x))
    other_half(out, k).copy_(partner)
    return out


def _without_partner(x, partner, *, layer):
    """An interleaving conv (place_shuffles) where the concat copies the partner itself (unfused, float8): the conv."""
    return layer(x)


def _channels(buffer, *, offset, channels):
    """An in-place concat: its run of its buffer's channels, a view (no kernel)."""
    return buffer.narrow(1, offset, channels)


def _slot_view(buffer, offset, channels, stride=1):
    """A slot's channels of its buffer: offset, offset + stride, ... (channels of them), a view."""
    if stride == 1:
        return buffer.narrow(1, offset, channels)
    return buffer[:, offset : offset + stride * (channels - 1) + 1 : stride]


def _place(slots: dict, step, t: str) -> tuple[int, int, int]:
    """Where a shuffled concat's input `t` goes in its buffer: (offset, channels, stride), input k at k::groups."""
    k, g = step.inputs.index(t), len(step.inputs)
    return (k, slots[step.output].width // g, g)


def _copy_into(buffer, *inputs, places):
    """A shuffled concat (place_shuffles): each input its producer could not write in place (a slice, a view of the
    last buffer) copied into its strided channels of the buffer, one copy each; the buffer, a view, is the result."""
    for x, place in zip(inputs, places, strict=True):
        _slot_view(buffer, *place).copy_(x)
    return buffer


def _quantized(layer: Layer, out_scale: float | None) -> Layer:
    """`layer`, its output quantized to e4m3 with `out_scale` after it (None: as it is): the pool paths whose kernel
    does not quantize (a large global pool's torch reduction, an activation the kernels lack)."""
    if out_scale is None:
        return layer
    return functools.partial(_then_quantize, first=layer, out_scale=out_scale)


def _then_quantize(*args, first, out_scale):
    from kernels.fp8 import quantize

    y = first(*args)
    fmt = torch.channels_last if _is_channels_last(y) else torch.contiguous_format
    return quantize(y.float(), out_scale).contiguous(memory_format=fmt)


def _fp8_layer(x, residual=None, *, fn, weight, scale, bias, activation, **kw):
    """An fp8 step: its input (and residual) as the wiring gives them, the rest bound."""
    if x.dim() == 2:
        x = x.contiguous()
    return fn(x, weight, scale, bias, activation=activation, residual=residual, **kw)


def _fp8_gated_layer(x, *rest, fn, weight, scale, bias, activation, **kw):
    """A gated fp8 conv: x, then its residual where it has one, then the gate (planner.reads' order)."""
    *rest, gate = rest
    return fn(x, weight, scale, bias, activation=activation, residual=rest[0] if rest else None, gate=gate, **kw)


def _deadline_cause(e: BaseException, kind: type[Exception]) -> Exception | None:
    """e, or the exception it was raised from or during, if it is of `kind` (a tuner that found no candidate in time
    raises one; a kernel may wrap it)."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, kind):
            return e
        e = e.__cause__ or e.__context__
        seen += 1
    return None


def _in_layout_after(*args, layer, channels_last):
    """A fallen-back step's output in its fused layout, so the fused steps after it read what they were bound for."""
    y = layer(*args)
    if y.dim() == 4:
        return y.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    return y


def _wire(steps: list[Step], input_name: str, slots: dict | None = None, shapes=None) -> list[Wiring]:
    """Each step's reads and output, and what can be dropped after it. Steps without graph fields (made in a test)
    form a chain. With concat `slots` (planner.concat_slots): a concat in a buffer reads the buffer alone (its view),
    each other step whose output has a slot writes into it (`into`), the first of them allocates the buffer (`alloc`,
    its per-row shape from `shapes`), and the buffer is dropped after its last writer or reader (the views of it that
    steps still read keep its memory)."""
    if not steps[0].inputs:
        names = [input_name] + [f"s{i}" for i in range(len(steps))]
        return [Wiring((names[i],), names[i + 1], (names[i],)) for i in range(len(steps))]
    slots = slots or {}

    def reads_of(s: Step) -> tuple[str, ...]:
        if isinstance(s, ConcatStep) and s.output in slots:  # its buffer (then the inputs it copies there)
            return (slots[s.output].buffer, *s.copied)
        if isinstance(s, ChannelShuffleStep) and s.output in slots:
            return (slots[s.output].buffer,)
        return reads(s)

    def writes_into(s: Step):
        slot = slots.get(s.output) if not isinstance(s, (ConcatStep, ChannelShuffleStep)) else None
        return None if slot is None else (slot.buffer, slot.offset, slot.channels, slot.stride)

    last_read: dict[str, int] = {}
    allocated: dict[int, tuple[str, tuple[int, ...]]] = {}
    seen: set[str] = set()
    for i, s in enumerate(steps):
        into = writes_into(s)
        for t in (*reads_of(s), *((into[0],) if into else ())):
            last_read[t] = i
        buffer = into[0] if into else None
        if buffer is None and isinstance(s, ConcatStep) and s.output in slots:  # a shuffled concat with no writer first
            buffer = slots[s.output].buffer
        if buffer is not None and buffer not in seen:
            seen.add(buffer)
            slot = slots[s.output]
            allocated[i] = (slot.buffer, (slot.width, *shapes[s.output][1:]))
    out = []
    for i, s in enumerate(steps):
        into = writes_into(s)
        used = (*reads_of(s), *((into[0],) if into else ()))
        frees = tuple(t for t in dict.fromkeys(used) if last_read[t] == i and t != steps[-1].output)
        out.append(Wiring(reads_of(s), s.output, frees, allocated.get(i), into))
    return out


def channels_last_outputs(steps: list[Step]) -> list[bool]:
    """Per step: whether the fused executor has it write channels_last (NHWC). A conv or pool step whose
    output only image steps read (convs, pools, adds, concats, and the torch-op steps that keep a tensor's memory
    format: elementwise, batch norm, layer norm, slice, pad, clamp) does: the next conv then gathers each pixel's
    channels as one contiguous run, 2x faster than NCHW at 256 images of 64 -> 64 channels at 32x32
    (docs/performance.md). Every other step keeps NCHW, so the model reads NCHW rows and its
    flatten (a view) sees torch's feature order; the first conv reads NCHW and writes NHWC in the same kernel."""
    image_steps = (
        Conv2dStep, Pool2dStep, AddStep, ConcatStep, ElementwiseStep, BatchNormStep, LayerNormStep, SliceStep, PadStep,
        ClampStep,
    )  # fmt: skip
    if not steps or not steps[0].inputs:  # no graph fields (made in a test): a chain
        return [
            isinstance(step, (Conv2dStep, Pool2dStep)) and i + 1 < len(steps) and isinstance(steps[i + 1], image_steps)
            for i, step in enumerate(steps)
        ]
    readers: dict[str, list[Step]] = {}
    for s in steps:
        for t in reads(s):
            readers.setdefault(t, []).append(s)
    return [
        isinstance(s, (Conv2dStep, Pool2dStep))
        and s.output != steps[-1].output
        and bool(readers.get(s.output))
        and all(isinstance(r, image_steps) for r in readers[s.output])
        for s in steps
    ]


def _memory_format(channels_last: bool) -> torch.memory_format:
    return torch.channels_last if channels_last else torch.contiguous_format


def _in_layout(t: torch.Tensor, fmt: torch.memory_format) -> torch.Tensor:
    """t in memory format `fmt` (itself when it already is: no copy)."""
    return t if t.is_contiguous(memory_format=fmt) else t.contiguous(memory_format=fmt)


def _chain(x, *, layers):
    for layer in layers:
        x = layer(x)
    return x


def _chain_first(*args, first, then):
    return then(first(*args))


def _contiguous_then(x, *, fn, activation, negative_slope):
    if _is_channels_last(x):
        # An elementwise kernel on channels_last memory: run it on the NHWC view (contiguous) and view back.
        y = fn(x.permute(0, 2, 3, 1), activation, negative_slope=negative_slope)
        return y.permute(0, 3, 1, 2)
    return fn(x.contiguous(), activation, negative_slope=negative_slope)


def _then_activation(*args, first, activation, negative_slope):
    """first(*args), then the activation: the kernel's where the table has it, else torch's."""
    from kernels import fused_activation
    from kernels.activations import ACTIVATIONS

    y = first(*args)
    if activation == "none":
        return y
    fn = fused_activation if activation in ACTIVATIONS else torch_activation
    return _contiguous_then(y, fn=fn, activation=activation, negative_slope=negative_slope)


def _residual_kw(x, residual, *, fn, layout=None, **kwargs):
    """A kernel that reads the residual in its epilogue (`residual=`), given it in the output's layout."""
    if layout is not None:
        residual = _in_layout(residual, layout)
    elif x.dim() == 2:
        residual = residual.contiguous()
    return fn(x, residual=residual, **kwargs)


def _fused_tail(x, residual=None, *, first, add, activation, negative_slope):
    """A kernel that lacks the residual or the activation: first(x) (conv or GEMM + bias), then the residual as
    a torch add and the activation (the activation kernel where the table has it)."""
    y = first(x)
    if add:
        y = y + residual
    return _then_activation(y, first=_identity, activation=activation, negative_slope=negative_slope)


def _unfused_tail(x, residual=None, *, first, bn, activation, negative_slope):
    """Eager torch, one op at a time: first(x) (conv or linear with its bias), batch norm, the residual add, the
    activation."""
    y = first(x)
    if bn is not None:
        y = bn(y)
    if residual is not None:
        y = y + residual
    return torch_activation(y, activation, negative_slope)


def _add_then(a, b, *, kernel, activation, negative_slope, op=torch.add):
    y = op(a, b)
    if activation == "none":
        return y
    if kernel:
        return _then_activation(y, first=_identity, activation=activation, negative_slope=negative_slope)
    return torch_activation(y, activation, negative_slope)


def _identity(x):
    return x


def _global_pool(x, *, kind, kernel, activation, negative_slope):
    """Each channel's mean (or max) over its whole image, (N, C, 1, 1), then the activation."""
    y = x.mean((2, 3), keepdim=True) if kind == "avg" else x.amax((2, 3), keepdim=True)
    if kernel:
        return _then_activation(y, first=_identity, activation=activation, negative_slope=negative_slope)
    return torch_activation(y, activation, negative_slope)


def _gated_conv(x, *rest, layer, kernel):
    """A conv of x * gate (the gate last among the step's reads): the kernel's x_scale, or a torch mul first."""
    *rest, gate = rest
    if kernel:
        return layer(x, *rest, x_scale=gate)
    return layer(x * gate, *rest)


def _scaled(x, *, first, scale):
    """first(x) (the batch norm, or nothing), then * the layer scale (its per-row shape broadcasts)."""
    y = first(x)
    return y * (scale.reshape(-1, *([1] * (y.dim() - 2))) if scale.numel() > 1 else scale.reshape(()))


def _batch_norm(x, *, weight, bias, mean, var, eps):
    return F.batch_norm(x, mean, var, weight, bias, training=False, eps=eps)


def _scale_shift(x, *, scale, shift):
    """x * scale + shift per channel (dim 1) in one kernel (addcmul)."""
    shape = (-1,) + (1,) * (x.dim() - 2)
    return torch.addcmul(shift.reshape(shape), x, scale.reshape(shape))


def _then_torch_activation(x, *, first, activation, negative_slope):
    """first(x) (the batch norm), then the activation as one eager torch op."""
    return torch_activation(first(x), activation, negative_slope)


def _normalized_then(x, *rest, normalize, layer):
    """The unfused mode's normalizing conv: normalize x (torch ops), then the conv step as it runs unnormalized."""
    return layer(normalize(x), *rest)


def _normalize_fused(x, *, scale, shift, dtype):
    """(x - mean) / std as x * scale + shift in fp32 (one multiply-add from x as sent), rounded once to dtype."""
    shape = (-1,) + (1,) * (x.dim() - 2)
    return torch.addcmul(shift.reshape(shape), x.float(), scale.reshape(shape)).to(dtype)


def _concat(*xs):
    return torch.cat(xs, dim=1)


def _softmax(x):
    return torch.softmax(x, dim=1)


_ELEMENTWISE = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}


def _elementwise_then(a, b=None, *, op, constant, reverse, kernel, activation, negative_slope):
    """a (op) b, or a (op) the constant (constant (op) a when reversed), broadcast; then the activation."""
    if constant is not None:
        a, b = (constant, a) if reverse else (a, constant)
    return _add_then(a, b, kernel=kernel, activation=activation, negative_slope=negative_slope, op=op)


def _clamp(x, *, scale, shift, lo, hi):
    if scale != 1.0 or shift != 0.0:
        x = x * scale + shift
    return torch.clamp(x, lo, hi)


def _slice_channels(x, *, start, end):
    """x[:, start:end], copied so that the next step reads a dense tensor (in x's memory format)."""
    fmt = torch.channels_last if _is_channels_last(x) else torch.contiguous_format
    return x[:, start:end].contiguous(memory_format=fmt)


def _is_channels_last(x) -> bool:
    """x is a 4-D batch in channels_last memory and not also contiguous NCHW."""
    return x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)


def _channel_shuffle(x, *, groups):
    n, c, h, w = x.shape
    return x.reshape(n, groups, c // groups, h, w).transpose(1, 2).reshape(n, c, h, w)
