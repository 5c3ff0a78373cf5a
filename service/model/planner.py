"""Turn the op list into fused steps, as TensorRT or torch.compile would.

    linear + activation -> one LinearStep (GEMM + bias + activation in one kernel)
    linear alone        -> LinearStep with activation "none"
    conv2d + activation -> one Conv2dStep (implicit GEMM + bias + activation in one kernel)
    pool + activation   -> one Pool2dStep (avg or max pooling + activation in one kernel)
    other activation    -> ActivationStep (its own elementwise kernel)
    flatten             -> FlattenStep (a view: no kernel, no copy)

then `group_mlps` turns each run of 2-8 consecutive LinearSteps whose widths all fit the whole-MLP
kernel (<= 256 after padding) into one MLPStep (`mlp_0_2`: linear layers 0 to 2, one kernel), and
`group_conv_pools` folds a pool that follows a conv (+ activation) into the conv's step when the conv
kernel can pool its own output (`conv2d_1_relu_maxpool2d_0`: conv + bias + act + pool, one kernel; the
(N, OC, OH, OW) conv output is never written).

Each step that launches work has a stable name (`linear_0_relu`, `linear_2`, `conv2d_0_relu`,
`maxpool2d_0`, `avgpool2d_1_relu`, `activation_0_tanh`; numbered per kind, in op order):
the `kernel` label in metrics. Both executors run the same plan, so fused and unfused times line
up kernel by kernel.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .spec import (
    DEFAULT_NEGATIVE_SLOPE,
    AvgPool2dOp,
    Conv2dOp,
    FlattenOp,
    LinearOp,
    MaxPool2dOp,
    Op,
    Pair,
    activation_of,
)


@dataclass(frozen=True)
class LinearStep:
    name: str
    weight: str
    bias: str | None
    activation: str
    negative_slope: float


@dataclass(frozen=True)
class Pool2dStep:
    name: str
    kind: str  # "avg" | "max"
    kernel_size: Pair
    stride: Pair  # resolved: kernel_size where the op gives none
    padding: Pair
    ceil_mode: bool
    count_include_pad: bool  # avg only (True for max, where it means nothing)
    activation: str
    negative_slope: float


@dataclass(frozen=True)
class Conv2dStep:
    name: str
    weight: str  # (out, in, kh, kw)
    bias: str | None
    stride: Pair
    padding: Pair
    dilation: Pair
    activation: str
    negative_slope: float
    pool: Pool2dStep | None = None  # pooled in the same kernel, after the activation (group_conv_pools)


@dataclass(frozen=True)
class ActivationStep:
    name: str
    activation: str
    negative_slope: float


@dataclass(frozen=True)
class FlattenStep:
    name: str


@dataclass(frozen=True)
class MLPStep:
    name: str
    layers: tuple[LinearStep, ...]


Step = LinearStep | Conv2dStep | Pool2dStep | ActivationStep | FlattenStep | MLPStep


def plan(ops: list[Op]) -> list[Step]:
    steps: list[Step] = []
    n_linear = n_conv = n_act = n_flat = 0
    n_pool = {"avg": 0, "max": 0}
    i = 0
    while i < len(ops):
        op = ops[i]
        if isinstance(op, (LinearOp, Conv2dOp, AvgPool2dOp, MaxPool2dOp)):
            # The activation right after rides in this op's kernel (its epilogue).
            act = activation_of(ops[i + 1]) if i + 1 < len(ops) else None
            name, slope = act or ("none", DEFAULT_NEGATIVE_SLOPE)
            suffix = "" if name == "none" else f"_{name}"
            i += 2 if act else 1
            if isinstance(op, LinearOp):
                steps.append(LinearStep(f"linear_{n_linear}{suffix}", op.weight, op.bias, name, slope))
                n_linear += 1
            elif isinstance(op, Conv2dOp):
                label = f"conv2d_{n_conv}{suffix}"
                steps.append(Conv2dStep(label, op.weight, op.bias, op.stride, op.padding, op.dilation, name, slope))
                n_conv += 1
            else:
                kind = "avg" if isinstance(op, AvgPool2dOp) else "max"
                label = f"{op.op}_{n_pool[kind]}{suffix}"
                pool = Pool2dStep(
                    label, kind, kernel_size=op.kernel_size, stride=op.stride_or_kernel, padding=op.padding,
                    ceil_mode=op.ceil_mode, count_include_pad=getattr(op, "count_include_pad", True),
                    activation=name, negative_slope=slope,
                )  # fmt: skip
                steps.append(pool)
                n_pool[kind] += 1
        elif isinstance(op, FlattenOp):
            steps.append(FlattenStep(f"flatten_{n_flat}"))
            n_flat += 1
            i += 1
        else:
            name, slope = activation_of(op)
            steps.append(ActivationStep(f"activation_{n_act}_{name}", name, slope))
            n_act += 1
            i += 1
    return steps


def group_mlps(steps: list[Step], tensors: Mapping[str, torch.Tensor]) -> list[Step]:
    """Replace each maximal run of consecutive LinearSteps that fits one whole-MLP kernel by an MLPStep.

    A run too long for one kernel is cut into kernels of at most MAX_LAYERS layers; a run of one layer
    stays a LinearStep (the per-layer kernel is the same single launch).
    """
    from kernels.mlp import MAX_LAYERS, mlp_fits

    def widths(run: list[LinearStep]) -> list[int]:
        return [tensors[run[0].weight].shape[1]] + [tensors[s.weight].shape[0] for s in run]

    out: list[Step] = []
    run: list[LinearStep] = []

    def flush() -> None:
        while run:
            chunk = run[:MAX_LAYERS]
            del run[: len(chunk)]
            if len(chunk) >= 2:
                first, last = chunk[0].name.split("_")[1], chunk[-1].name.split("_")[1]
                out.append(MLPStep(f"mlp_{first}_{last}", tuple(chunk)))
            else:
                out.extend(chunk)

    for step in steps:
        if isinstance(step, LinearStep) and mlp_fits(widths([step])):  # widths chain: run + step fits too
            run.append(step)
        else:
            flush()
            out.append(step)
    flush()
    return out


def pool_fits_conv(pool: Pool2dStep) -> bool:
    """Whether the conv kernel can pool its output itself (kernels/conv.py, `pool=`): floor mode, no padding,
    no activation after the pool, and windows that do not overlap (stride >= window), so each conv output is
    computed once; overlapping windows would compute shared outputs again, once per window."""
    return (
        pool.activation == "none"
        and pool.padding == (0, 0)
        and not pool.ceil_mode
        and all(s >= k for s, k in zip(pool.stride, pool.kernel_size, strict=True))
    )


def group_conv_pools(steps: list[Step]) -> list[Step]:
    """Fold each pool that directly follows a conv step, and that `pool_fits_conv`, into that conv step:
    3 kernels -> 1 in the fused plan (conv + act, pool: 2 -> 1), one step in both modes."""
    out: list[Step] = []
    for step in steps:
        prev = out[-1] if out else None
        if isinstance(step, Pool2dStep) and isinstance(prev, Conv2dStep) and prev.pool is None and pool_fits_conv(step):
            out[-1] = dataclasses.replace(prev, name=f"{prev.name}_{step.name}", pool=step)
        else:
            out.append(step)
    return out


def fused_steps(
    ops: list[Op], tensors: Mapping[str, torch.Tensor], *, whole_mlp: bool = True, conv_pool: bool = True
) -> list[Step]:
    """The plan both executors run: `plan`, then the whole-MLP and conv + pool groupings."""
    steps = plan(ops)
    steps = group_mlps(steps, tensors) if whole_mlp else steps
    return group_conv_pools(steps) if conv_pool else steps


def kernel_names(steps: list[Step]) -> list[str]:
    """The steps that launch work, by name (flatten is a view)."""
    return [s.name for s in steps if not isinstance(s, FlattenStep)]
