"""Turn the op graph into fused steps, as TensorRT or torch.compile would.

    conv2d [+ batchnorm] [+ mul] [+ add] [+ activation] -> one Conv2dStep: implicit GEMM + folded BN (and
                                                   layer scale: a mul by a per-channel constant) + bias + residual
                                                   + activation in one kernel (`conv2d_3_bn_add_relu`)
    linear [+ batchnorm] [+ add] [+ activation] -> one LinearStep: GEMM + folded BN + bias + residual + activation
    pool + activation   -> one Pool2dStep (avg or max pooling + activation in one kernel)
    add [+ activation]  -> AddStep, where no conv or linear can take the add in its epilogue
    batchnorm           -> BatchNormStep (a per-channel scale and shift), where no conv or linear comes before it
    other activation    -> ActivationStep (its own elementwise kernel)
    flatten             -> FlattenStep (a view: no kernel, no copy)
    concat, softmax     -> ConcatStep, SoftmaxStep (torch ops in both modes)
    add (broadcast or of a constant), sub, mul, div [+ activation] -> ElementwiseStep (an SE block's scale)
    clip, hardsigmoid (other than torch's)  -> ClampStep
    layernorm, slice, channel_shuffle, pad  -> LayerNormStep, SliceStep, ChannelShuffleStep, PadStep

A conv (groups 1) whose input is a mul of an image by a per-image per-channel gate (a squeeze-and-excitation block:
x * sigmoid(conv(relu(conv(pool(x)))))), read by that conv alone, takes the mul in (`Conv2dStep.gate`,
`conv2d_7_gated_bn`): the kernel multiplies x by the gate as it gathers it, and x * gate is never written.

An input that declares a normalization (spec.Normalize: (x - mean[c]) / std[c]) has it applied by the conv step
that reads it, when that conv (groups 1) is the input's only reader: the kernel normalizes x as it gathers it
(`Conv2dStep.normalize`; the step keeps its name). Otherwise (the first op is not such a conv, or several ops read
the input) a NormalizeStep `normalize_0` runs first and its readers read its output (`attach_normalization`).

A step takes the op after it only where the tensor between them has no other reader: a conv output read by
both an add and a later op stays materialised, and the add becomes its own step. An add whose two inputs both
come from convs rides in the first input's conv (torch's `y + shortcut`: the main branch); the other input is
the residual the kernel reads in its epilogue. A fused step runs where its last op stood in the graph, so every
tensor it reads has been written by then.

A BatchNormStep, with the activation that alone reads it, whose result only convs (groups 1) read as their input
goes into each of those convs (`fold_preactivations`, `conv2d_3_preact_relu`): the kernel applies relu(x * scale[c] +
shift[c]) as it gathers x, 0 in the padding (DenseNet's BN-ReLU-conv, where the BN follows a concat or a pool).

A concat whose inputs are conv or pool outputs read only by it and by steps that take strided tensors gets a buffer
(`place_concats`): fused, each producer writes its channels of it and the concat is a view (`concat_slots`; DenseNet's
nested concats, each the last one and one more feature, share one buffer per dense block).

A channel shuffle (groups g) of a concat of g inputs of equal width gets one buffer too (`place_shuffles`): fused,
input k lives at channels k::g of it (a conv's kernel writes there; another input, ShuffleNet's x1 slice, the concat
copies there, one strided copy), the concat and the shuffle are views, and slices of the shuffle's output (the next
unit's split) are views of channel runs (`shuffle_slots`). Where the concat has two inputs, the slice and a plain
conv's output (or two plain convs' outputs), the (later) conv reads the other input and stores both in whole rows
(`_interleaves`, Conv2dStep.interleave): no copy, no store of every other channel.

Then `group_mlps` turns each chain of 2-8 LinearSteps, each read only by the next, whose widths all fit the
whole-MLP kernel (<= 256 after padding) into one MLPStep (`mlp_0_2`: linear layers 0 to 2, one kernel), and
`group_conv_pools` folds a pool that reads a conv step's output (its only reader) into that conv step when the
conv kernel can pool its own output and adds no residual (`conv2d_1_relu_maxpool2d_0`: conv + bias + act +
pool, one kernel; the (N, OC, OH, OW) conv output is never written).

Each step that launches work has a stable name (`linear_0_relu`, `linear_2`, `conv2d_0_relu`,
`conv2d_3_bn_add_relu`, `maxpool2d_0`, `avgpool2d_1_relu`, `activation_0_tanh`, `add_1_relu`, `concat_0`;
convs, linears, pools, adds, batchnorms and concats numbered per kind in op order, standalone activations in
step order): the `kernel` label in metrics. The plan does not depend on what the kernels can do: both executors
run the same steps, so fused and unfused times line up kernel by kernel, and a step whose kernel lacks a part
(groups, a residual, an activation) runs that part as torch ops in the fused mode too (executors.py says which;
`fused_parts` reports it).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from .spec import (
    DEFAULT_NEGATIVE_SLOPE,
    AddOp,
    AvgPool2dOp,
    BatchNormOp,
    BinaryOp,
    ChannelShuffleOp,
    ClipOp,
    ConcatOp,
    Conv2dOp,
    FlattenOp,
    HardSigmoidOp,
    LayerNormOp,
    LinearOp,
    MaxPool2dOp,
    Op,
    PadOp,
    Pair,
    SliceOp,
    SoftmaxOp,
    activation_of,
    wire,
)


@dataclass(frozen=True)
class InputNorm:
    """The model input's normalization, (x - mean[c]) / std[c] per channel."""

    mean: tuple[float, ...]
    std: tuple[float, ...]


# Graph fields of a step: the tensors it reads (the residual apart) and the one it writes. Left out of equality
# so that a plan compares by what each step computes.
_Inputs = field(default=(), compare=False)
_Output = field(default="", compare=False)


@dataclass(frozen=True)
class BatchNorm:
    """Inference batch norm, y = (x - mean) / sqrt(var + eps) * weight + bias: its tensor names and eps."""

    weight: str
    bias: str
    mean: str
    var: str
    eps: float


@dataclass(frozen=True)
class LinearStep:
    name: str
    weight: str
    bias: str | None
    activation: str
    negative_slope: float
    batchnorm: BatchNorm | None = None  # folded into weight and bias by the fused executor
    residual: str | None = None  # tensor added before the activation (read in the GEMM's epilogue)
    scale: str | None = None  # a stored per-channel (or scalar) constant multiplied after the batch norm: folded
    inputs: tuple[str, ...] = _Inputs
    output: str = _Output


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
    inputs: tuple[str, ...] = _Inputs
    output: str = _Output


@dataclass(frozen=True)
class Conv2dStep:
    name: str
    weight: str  # (out, in / groups, kh, kw)
    bias: str | None
    stride: Pair
    padding: Pair
    dilation: Pair
    activation: str
    negative_slope: float
    pool: Pool2dStep | None = None  # pooled in the same kernel, after the activation (group_conv_pools)
    batchnorm: BatchNorm | None = None  # folded into weight and bias by the fused executor
    residual: str | None = None  # tensor added before the activation (read in the conv's epilogue)
    groups: int = 1  # > 1: torch's grouped conv in both modes (the conv kernel has no groups)
    normalize: InputNorm | None = None  # applied to x (the model's input) as the conv reads it
    scale: str | None = None  # a stored per-channel (or scalar) constant multiplied after the batch norm: folded
    # an (N, C, 1, 1) tensor that x is multiplied by before the conv (a squeeze-and-excitation gate), read by the
    # kernel as it gathers x (kernels/conv.py, x_scale): the product x * gate is never written
    gate: str | None = None
    # a batch norm of x, then its activation, applied before the conv (a pre-activation BN + ReLU: fold_preactivations),
    # by the kernel as it gathers x (kernels/conv.py, input_norm + input_activation): relu(bn(x)) is never written
    prenorm: BatchNorm | None = None
    prenorm_activation: str = "none"
    prenorm_slope: float = DEFAULT_NEGATIVE_SLOPE
    # place_shuffles: the other input of the shuffled concat (groups 2) this conv's output goes into, which the fused
    # executor's conv reads and stores beside its own channels (kernels/conv.py, interleave), its own at channels
    # interleave_index::2 of the buffer; the unfused mode reads it not (the concat and the shuffle are torch ops there)
    interleave: str | None = None
    interleave_index: int = 0
    inputs: tuple[str, ...] = _Inputs
    output: str = _Output


@dataclass(frozen=True)
class ActivationStep:
    name: str
    activation: str
    negative_slope: float
    inputs: tuple[str, ...] = _Inputs
    output: str = _Output


@dataclass(frozen=True)
class FlattenStep:
    name: str
    inputs: tuple[str, ...] = _Inputs
    output: str = _Output


@dataclass(frozen=True)
class MLPStep:
    name: str
    layers: tuple[LinearStep, ...]
    inputs: tuple[str, ...] = _Inputs
    output: str = _Output


@dataclass(frozen=True)
class AddStep:
    """inputs[0] + inputs[1], then the activation."""

    name: str
    activation: str
    negative_slope: float
    inputs: tuple[str, ...] = _Inputs
    output: str = _Output


@dataclass(frozen=True)
class BatchNormStep:
    """A batch norm with no conv or linear before it to fold into: a per-channel scale and shift."""

    name: str
    batchnorm: BatchNorm
    inputs: tuple[str, ...] = _Inputs
    output: str = _Output


@dataclass(frozen=True)
class NormalizeStep:
    """The model input's normalization where no conv can take it as it reads x: (x - mean) / std in the compute
    dtype, from x as sent (uint8 or float)."""

    name: str
    normalize: InputNorm
    inputs: tuple[str, ...] = _Inputs
    output: str = _Output


@dataclass(frozen=True)
class ConcatStep:
    name: str
    # its inputs' producers write them into their channels of one buffer (place_concats, place_shuffles): a view in
    # the fused mode
    in_place: bool = False
    # place_shuffles: the inputs whose producers cannot write into the shuffled buffer (slices: views of another
    # buffer), which the concat copies there, each one strided copy; the others' producers write in place
    copied: tuple[str, ...] = ()
    inputs: tuple[str, ...] = _Inputs
    output: str = _Output


@dataclass(frozen=True)
class Slot:
    """Where a tensor lives in a concat buffer (place_concats): channels [offset, offset + channels) of `buffer`
    (channels_last, (N, width, H, W)), which the fused executor allocates when its first writer runs."""

    buffer: str
    offset: int
    channels: int
    width: int
    # channels offset, offset + stride, ... (place_shuffles: a shuffled concat's input k of g is buffer[:, k::g])
    stride: int = 1


@dataclass(frozen=True)
class SoftmaxStep:
    name: str
    inputs: tuple[str, ...] = _Inputs
    output: str = _Output


@dataclass(frozen=True)
class ElementwiseStep:
    """inputs[0] (kind) inputs[1] with broadcasting, or inputs[0] (kind) a stored constant (constant (kind) x when
    `reverse`), then the activation."""

    name: str
    kind: str  # "add" | "sub" | "mul" | "div"
    constant: str | None
    reverse: bool
    activation: str
    negative_slope: float
    inputs: tuple[str, ...] = _Inputs
    output: str = _Output


@dataclass(frozen=True)
class ClampStep:
    """min(max(x * scale + shift, lo), hi): a clip (scale 1, shift 0), or a hard sigmoid of other slopes than
    torch's (which is the `hardsigmoid` activation)."""

    name: str
    scale: float
    shift: float
    lo: float | None
    hi: float | None
    inputs: tuple[str, ...] = _Inputs
    output: str = _Output


@dataclass(frozen=True)
class LayerNormStep:
    """Layer norm over the channels (dim 1), then * weight + bias per channel."""

    name: str
    weight: str
    bias: str | None
    eps: float
    inputs: tuple[str, ...] = _Inputs
    output: str = _Output


@dataclass(frozen=True)
class SliceStep:
    """x[:, start:end] (channels or features)."""

    name: str
    start: int
    end: int
    # of a shuffled buffer (place_shuffles), read only by steps that take strided tensors: a view in the fused mode
    in_place: bool = False
    inputs: tuple[str, ...] = _Inputs
    output: str = _Output


@dataclass(frozen=True)
class ChannelShuffleStep:
    name: str
    groups: int
    # its concat's inputs are written straight into their shuffled channels of one buffer (place_shuffles): fused,
    # the concat and the shuffle are views of that buffer
    in_place: bool = False
    inputs: tuple[str, ...] = _Inputs
    output: str = _Output


@dataclass(frozen=True)
class PadStep:
    name: str
    pads: tuple[int, int, int, int]  # top, left, bottom, right
    value: float
    inputs: tuple[str, ...] = _Inputs
    output: str = _Output


Step = (
    LinearStep | Conv2dStep | Pool2dStep | ActivationStep | FlattenStep | MLPStep | AddStep | BatchNormStep
    | ConcatStep | SoftmaxStep | NormalizeStep | ElementwiseStep | ClampStep | LayerNormStep | SliceStep
    | ChannelShuffleStep | PadStep
)  # fmt: skip
# Steps of the graph-only kinds that read and write tensors with no parameters but their own (GET /model shows
# their inputs and fields): torch ops in both modes unless executors.py says otherwise.
GRAPH_STEPS = (
    AddStep, BatchNormStep, ConcatStep, SoftmaxStep, NormalizeStep, ElementwiseStep, ClampStep, LayerNormStep,
    SliceStep, ChannelShuffleStep, PadStep,
)  # fmt: skip


def reads(step: Step) -> tuple[str, ...]:
    """Every tensor a step reads: its inputs, then its residual, then its gate, then what it interleaves with."""
    extra = tuple(t for t in (getattr(step, name, None) for name in ("residual", "gate", "interleave")) if t)
    return (*step.inputs, *extra) if extra else step.inputs


def _readers(ops_or_steps, reads_of, output: str) -> dict[str, int]:
    """How many times each tensor is read; the model's output counts as one more read."""
    count: dict[str, int] = {output: 1}
    for item in ops_or_steps:
        for t in reads_of(item):
            count[t] = count.get(t, 0) + 1
    return count


def _batchnorm(op: BatchNormOp) -> BatchNorm:
    return BatchNorm(op.weight, op.bias, op.mean, op.var, op.eps)


def is_residual_add(op: Op, shapes: Mapping[str, tuple[int, ...]] | None = None) -> bool:
    """An add of two tensors of one shape (a residual connection), which a conv or linear may take in its epilogue.
    Without `shapes` (ops made in a test), any add of two tensors."""
    if not isinstance(op, AddOp) or op.constant is not None or len(op.inputs) != 2:
        return False
    return shapes is None or shapes.get(op.inputs[0]) == shapes.get(op.inputs[1])


def channel_scale(op: Op, shape: tuple[int, ...], constants: Mapping[str, torch.Tensor] | None) -> bool:
    """Whether `op` multiplies its input (of per-row `shape`) by a stored constant of one value per channel (or one
    in all): a layer scale, which folds into the weights of the conv or linear before it like a batch norm."""
    if not isinstance(op, BinaryOp) or op.op != "mul" or op.constant is None or constants is None:
        return False
    c = tuple(constants[op.constant].shape)
    return math.prod(c) == 1 or (len(c) == len(shape) and c[0] == shape[0] and math.prod(c) == shape[0])


def plan(
    ops: list[Op],
    shapes: Mapping[str, tuple[int, ...]] | None = None,
    constants: Mapping[str, torch.Tensor] | None = None,
) -> list[Step]:
    """One step per op or fused group of ops, in an order where each step reads only tensors written before it.
    Unwired ops (format 1, or ops made in a test) are wired first: each reads the op before it. `shapes`: every
    tensor's per-row shape (the loader's), which tells a residual add from a broadcasting one; `constants`: the
    model's tensors, which tell a per-channel scale (folded into the conv or linear before it) from another mul."""
    if any(op.inputs is None or op.output is None for op in ops):
        ops = wire(ops)
    output = ops[-1].output
    readers = _readers(ops, lambda op: op.inputs, output)
    producer = {op.output: i for i, op in enumerate(ops)}
    reader_of: dict[str, int] = {}
    for i, op in enumerate(ops):
        for t in op.inputs:
            reader_of[t] = i

    def sole_reader(t: str) -> int | None:
        """The op that reads `t`, if it is the only reader and `t` is not the model's output."""
        return reader_of[t] if readers.get(t, 0) == 1 and t != output else None

    def feeds_add_from_weighted(t: str, add: int) -> bool:
        """Whether `t` is a conv's or linear's output (after an optional batch norm, then an optional layer scale)
        that only `add` reads."""
        if sole_reader(t) != add or t not in producer:
            return False
        op = ops[producer[t]]
        for folds in (
            lambda o: shapes is not None and channel_scale(o, shapes.get(o.input, ()), constants),
            lambda o: isinstance(o, BatchNormOp),
        ):
            if folds(op):
                inner = op.input
                if inner not in producer or sole_reader(inner) != producer[t]:
                    return False
                t, op = inner, ops[producer[inner]]
        return isinstance(op, (Conv2dOp, LinearOp))

    def gate_of(i: int) -> tuple[int, str, str] | None:
        """For a conv (groups 1) whose input is a mul of an image by a per-image per-channel gate ((C, 1, 1) per
        row: a squeeze-and-excitation block's), read by this conv alone: (the mul's index, the image, the gate)."""
        op = ops[i]
        if shapes is None or not isinstance(op, Conv2dOp) or op.groups != 1 or op.input not in producer:
            return None
        m = producer[op.input]
        mul = ops[m]
        if sole_reader(op.input) != i or not isinstance(mul, BinaryOp) or mul.op != "mul" or mul.constant is not None:
            return None
        for x, g in (mul.inputs, mul.inputs[::-1]):
            sx, sg = shapes.get(x, ()), shapes.get(g, ())
            if len(sx) == 3 and sg == (sx[0], 1, 1) and sx != sg:
                return m, x, g
        return None

    # Each gated conv (the SE block's multiply read as the conv gathers its input): conv index -> (mul, image, gate)
    gated = {i: found for i in range(len(ops)) if (found := gate_of(i)) is not None}

    # Which input of each add rides in its producer's epilogue: the first that can.
    fused_add_input = {
        i: next((t for t in op.inputs if feeds_add_from_weighted(t, i)), None)
        for i, op in enumerate(ops)
        if is_residual_add(op, shapes)
    }
    index_of_kind: dict[int, int] = {}
    seen: dict[str, int] = {}
    for i, op in enumerate(ops):
        kind = "activation" if activation_of(op) else op.op
        index_of_kind[i] = seen.get(kind, 0)
        seen[kind] = seen.get(kind, 0) + 1

    placed: list[tuple[int, Step]] = []  # (index of the step's last op, step)
    taken: set[int] = {m for m, _, _ in gated.values()}
    n_act = n_flat = 0

    def take_activation(t: str) -> tuple[str, float, str, int | None]:
        """The activation that reads `t` alone, if any: (kernel name, slope, name suffix, its op index)."""
        j = sole_reader(t)
        act = activation_of(ops[j]) if j is not None else None
        if act is None:
            return "none", DEFAULT_NEGATIVE_SLOPE, "", None
        return act[0], act[1], f"_{act[0]}", j

    for i, op in enumerate(ops):
        if i in taken:
            continue
        last, t = i, op.output
        if isinstance(op, (LinearOp, Conv2dOp)):
            bn, residual, suffix = None, None, ""
            j = sole_reader(t)
            if j is not None and isinstance(ops[j], BatchNormOp):
                bn, suffix, last, t = _batchnorm(ops[j]), "_bn", j, ops[j].output
                taken.add(j)
            j, scale = sole_reader(t), None
            if j is not None and shapes is not None and t in shapes and channel_scale(ops[j], shapes[t], constants):
                scale, suffix, last, t = ops[j].constant, suffix + "_scale", j, ops[j].output
                taken.add(j)
            j = sole_reader(t)
            if j is not None and fused_add_input.get(j) == t:
                residual = next(x for x in ops[j].inputs if x != t)
                suffix, last, t = suffix + "_add", j, ops[j].output
                taken.add(j)
            name, slope, act_suffix, j = take_activation(t)
            if j is not None:
                last, t = j, ops[j].output
                taken.add(j)
            k = index_of_kind[i]
            graph = {"inputs": op.inputs, "output": t, "batchnorm": bn, "residual": residual, "scale": scale}
            if isinstance(op, LinearOp):
                step = LinearStep(f"linear_{k}{suffix}{act_suffix}", op.weight, op.bias, name, slope, **graph)
            else:
                gate = None
                if i in gated:
                    _, image, gate = gated[i]
                    graph["inputs"], suffix = (image,), "_gated" + suffix
                step = Conv2dStep(
                    f"conv2d_{k}{suffix}{act_suffix}", op.weight, op.bias, op.stride, op.padding, op.dilation, name,
                    slope, groups=op.groups, gate=gate, **graph,
                )  # fmt: skip
        elif isinstance(op, (AvgPool2dOp, MaxPool2dOp)):
            name, slope, act_suffix, j = take_activation(t)
            if j is not None:
                last, t = j, ops[j].output
                taken.add(j)
            kind = "avg" if isinstance(op, AvgPool2dOp) else "max"
            step = Pool2dStep(
                f"{op.op}_{index_of_kind[i]}{act_suffix}", kind, kernel_size=op.kernel_size, stride=op.stride_or_kernel,
                padding=op.padding, ceil_mode=op.ceil_mode, count_include_pad=getattr(op, "count_include_pad", True),
                activation=name, negative_slope=slope, inputs=op.inputs, output=t,
            )  # fmt: skip
        elif isinstance(op, (AddOp, BinaryOp)):
            name, slope, act_suffix, j = take_activation(t)
            if j is not None:
                last, t = j, ops[j].output
                taken.add(j)
            label = f"{op.op}_{index_of_kind[i]}{act_suffix}"
            if is_residual_add(op, shapes):
                step = AddStep(label, name, slope, inputs=op.inputs, output=t)
            else:
                step = ElementwiseStep(label, op.op, op.constant, op.reverse, name, slope, inputs=op.inputs, output=t)
        elif isinstance(op, (ClipOp, HardSigmoidOp)):
            clip = isinstance(op, ClipOp)
            scale, shift = (1.0, 0.0) if clip else (op.alpha, op.beta)
            lo, hi = (op.min, op.max) if clip else (0.0, 1.0)
            step = ClampStep(f"{op.op}_{index_of_kind[i]}", scale, shift, lo, hi, inputs=op.inputs, output=t)
        elif isinstance(op, LayerNormOp):
            k = index_of_kind[i]
            step = LayerNormStep(f"layernorm_{k}", op.weight, op.bias, op.eps, inputs=op.inputs, output=t)
        elif isinstance(op, SliceOp):
            step = SliceStep(f"slice_{index_of_kind[i]}", op.start, op.end, inputs=op.inputs, output=t)
        elif isinstance(op, ChannelShuffleOp):
            step = ChannelShuffleStep(f"channel_shuffle_{index_of_kind[i]}", op.groups, inputs=op.inputs, output=t)
        elif isinstance(op, PadOp):
            step = PadStep(f"pad_{index_of_kind[i]}", tuple(op.pads), op.value, inputs=op.inputs, output=t)
        elif isinstance(op, BatchNormOp):
            step = BatchNormStep(f"batchnorm_{index_of_kind[i]}", _batchnorm(op), inputs=op.inputs, output=t)
        elif isinstance(op, ConcatOp):
            step = ConcatStep(f"concat_{index_of_kind[i]}", inputs=op.inputs, output=t)
        elif isinstance(op, SoftmaxOp):
            step = SoftmaxStep(f"softmax_{index_of_kind[i]}", inputs=op.inputs, output=t)
        elif isinstance(op, FlattenOp):
            step = FlattenStep(f"flatten_{n_flat}", inputs=op.inputs, output=t)
            n_flat += 1
        else:
            name, slope = activation_of(op)
            step = ActivationStep(f"activation_{n_act}_{name}", name, slope, inputs=op.inputs, output=t)
            n_act += 1
        placed.append((last, step))
    return [step for _, step in sorted(placed, key=lambda p: p[0])]


def _step_readers(steps: list[Step]) -> dict[str, int]:
    return _readers(steps, reads, steps[-1].output if steps else "")


def group_mlps(steps: list[Step], tensors: Mapping[str, torch.Tensor]) -> list[Step]:
    """Replace each maximal chain of LinearSteps (each reading the one before it, its only reader) that fits one
    whole-MLP kernel by an MLPStep. A step with a residual stays out (the whole-MLP kernel adds none).

    A chain too long for one kernel is cut into kernels of at most MAX_LAYERS layers; a chain of one layer
    stays a LinearStep (the per-layer kernel is the same single launch).
    """
    from kernels.mlp import MAX_LAYERS, mlp_fits

    readers = _step_readers(steps)

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
                out.append(MLPStep(f"mlp_{first}_{last}", tuple(chunk), chunk[0].inputs, chunk[-1].output))
            else:
                out.extend(chunk)

    for step in steps:
        fits = isinstance(step, LinearStep) and step.residual is None and mlp_fits(widths([step]))
        # widths chain: run + step fits too
        if fits and run and not (step.inputs == (run[-1].output,) and readers.get(run[-1].output) == 1):
            flush()
        if fits:
            run.append(step)
        else:
            flush()
            out.append(step)
    flush()
    return out


def pool_fits_conv(pool: Pool2dStep) -> bool:
    """Whether the conv kernel can pool its output itself (kernels/conv.py, `pool=`): floor mode, no padding,
    no activation after the pool, and windows that do not overlap (stride >= window), so each conv output is
    computed once; overlapping windows would compute shared outputs again, once per window. Small windows only
    (kernels.conv.MAX_POOL_WINDOW: the kernel unrolls its K loop per window element; a global pool stays apart)."""
    from kernels.conv import MAX_POOL_WINDOW

    return (
        pool.kernel_size[0] * pool.kernel_size[1] <= MAX_POOL_WINDOW
        and pool.activation == "none"
        and pool.padding == (0, 0)
        and not pool.ceil_mode
        and all(s >= k for s, k in zip(pool.stride, pool.kernel_size, strict=True))
    )


def fold_preactivations(steps: list[Step], output: str | None = None) -> list[Step]:
    """Fold each BatchNormStep (a batch norm with no conv before it: DenseNet's and pre-activation ResNets' BN after
    a concat or a pool), with the ActivationStep that alone reads it if any, into every conv step that reads the
    result, where only conv steps of groups 1 read it, as their input (not a residual), with no gate, input
    normalization or earlier prenorm: each conv applies act(x * scale[c] + shift[c]) as it gathers x (kernels/conv.py,
    input_norm + input_activation; 0 in the padding, as torch pads relu(bn(x))) and reads the batch norm's input.
    Replaces, per BN: a scale-shift kernel and an activation kernel, each a write and a read of x's size (unfused:
    F.batch_norm, the activation, then the conv). The conv steps keep their place and are renamed
    `conv2d_3_preact_relu` (`_prebn_` for a batch norm without activation); the two steps go. `output`: the model's
    (never folded away; default the last step's)."""
    if not steps or not steps[0].inputs:  # steps made without graph fields (tests): nothing is wired to fold
        return steps
    output = output or steps[-1].output
    readers: dict[str, list[int]] = {}
    for i, step in enumerate(steps):
        for t in dict.fromkeys(reads(step)):
            readers.setdefault(t, []).append(i)

    def foldable_into(i: int, t: str) -> bool:
        conv = steps[i]
        return (
            isinstance(conv, Conv2dStep)
            and conv.groups == 1
            and conv.inputs == (t,)
            and conv.residual != t
            and conv.gate is None
            and conv.normalize is None
            and conv.prenorm is None
        )

    dropped: set[int] = set()
    replaced: dict[int, Step] = {}
    for b, bn in enumerate(steps):
        if not isinstance(bn, BatchNormStep) or bn.output == output:
            continue
        t, act, a = bn.output, None, None
        after = readers.get(t, [])
        if len(after) == 1 and isinstance(steps[after[0]], ActivationStep) and steps[after[0]].output != output:
            a = after[0]
            act, t = steps[a], steps[a].output
        convs = readers.get(t, [])
        if not convs or any(i in replaced or not foldable_into(i, t) for i in convs):
            continue
        activation = act.activation if act is not None else "none"
        slope = act.negative_slope if act is not None else DEFAULT_NEGATIVE_SLOPE
        tag = "preact" if act is not None else "prebn"
        for i in convs:
            conv = steps[i]
            head, k, *rest = conv.name.split("_", 2)
            replaced[i] = dataclasses.replace(
                conv, name="_".join([head, k, tag, *rest]), inputs=bn.inputs, prenorm=bn.batchnorm,
                prenorm_activation=activation, prenorm_slope=slope,
            )  # fmt: skip
        dropped.update(x for x in (b, a) if x is not None)
    return [replaced.get(i, step) for i, step in enumerate(steps) if i not in dropped]


def group_conv_pools(steps: list[Step]) -> list[Step]:
    """Fold each pool whose input is a conv step's output, read by that pool alone, and that `pool_fits_conv`,
    into that conv step (which then runs where the pool stood): 3 kernels -> 1 in the fused plan (conv + act,
    pool: 2 -> 1), one step in both modes. Not a conv with a residual or groups (the kernel cannot pool those)."""
    if steps and not steps[-1].output:  # steps made without graph fields (tests): a chain
        steps = _chain(steps)
    readers = _step_readers(steps)
    out: list[Step | None] = []
    where: dict[str, int] = {}  # conv step output -> its index in out
    for step in steps:
        conv_at = where.get(step.inputs[0]) if isinstance(step, Pool2dStep) and step.inputs else None
        conv = out[conv_at] if conv_at is not None else None
        if (
            isinstance(conv, Conv2dStep)
            and conv.pool is None
            and conv.residual is None
            and conv.gate is None
            and conv.groups == 1
            and readers.get(conv.output) == 1
            and pool_fits_conv(step)
        ):
            out[conv_at] = None
            out.append(dataclasses.replace(conv, name=f"{conv.name}_{step.name}", pool=step, output=step.output))
        else:
            out.append(step)
        if isinstance(out[-1], Conv2dStep):
            where[out[-1].output] = len(out) - 1
    return [s for s in out if s is not None]


def _chain(steps: list[Step]) -> list[Step]:
    """Steps without graph fields, wired as a chain: step i reads step i - 1's output."""
    out, previous = [], "input"
    for i, s in enumerate(steps):
        out.append(dataclasses.replace(s, inputs=(previous,), output=f"s{i}"))
        previous = f"s{i}"
    return out


# Steps that may read a tensor living in a concat buffer, a channel run of a channels_last tensor, not dense: image
# steps (channels_last is what each would get anyway) whose kernels take any strides (conv, grouped conv, pool) or
# that are torch ops.
_READS_SLOTS = (Conv2dStep, Pool2dStep, AddStep, ElementwiseStep, BatchNormStep, ClampStep, SliceStep, PadStep)


def concat_slots(steps: list[Step], shapes: Mapping[str, tuple[int, ...]] | None, output: str = "") -> dict[str, Slot]:
    """The concat buffers of a plan (place_concats): each ConcatStep's output, and every input it concatenates, as a
    run of channels of one buffer. Concats that share inputs at consistent offsets share one buffer (DenseNet's block:
    layer k's concat is the block input and the k features before it, so each concat is a prefix of the block's last,
    one buffer per block), and a concat read by another is a run of the outer one's (Inception's nested concats).

    A set of concats gets a buffer where (else each stays a torch.cat, a copy): every concat's output is 4-D and not the
    model's output; every tensor they concatenate that is not itself one of their outputs (a leaf) is the output of a
    conv or pool step without a residual (whose kernel writes any strides); each of these tensors is read by those
    concats and by steps that take strided tensors (_READS_SLOTS) only; and the leaves' channel runs are disjoint (each
    written once, by its producer). {} without shapes."""
    if shapes is None or not steps or not steps[0].inputs:
        return {}
    output = output or steps[-1].output
    producer = {s.output: s for s in steps}
    readers: dict[str, list[Step]] = {}
    for s in steps:
        for t in dict.fromkeys(reads(s)):
            readers.setdefault(t, []).append(s)
    concats = [s for s in steps if isinstance(s, ConcatStep) and len(shapes.get(s.output, ())) == 3]
    # Weighted union-find over tensors: offset[t] is t's first channel relative to its root's.
    parent: dict[str, str] = {}
    offset: dict[str, int] = {}
    broken: set[str] = set()  # roots of sets whose offsets contradict each other

    def find(t: str) -> str:
        parent.setdefault(t, t)
        offset.setdefault(t, 0)
        if parent[t] != t:
            root = find(parent[t])
            offset[t] += offset[parent[t]]
            parent[t] = root
        return parent[t]

    def place(t: str, c: str, rel: int) -> None:
        """Constrain t's first channel to lie `rel` channels after c's."""
        rt, rc = find(t), find(c)
        if rt == rc:
            if offset[t] - offset[c] != rel:
                broken.add(rt)
            return
        parent[rt] = rc  # offset[t] (relative to rt) + offset[rt] = offset[c] + rel
        offset[rt] = offset[c] + rel - offset[t]
        if rt in broken:
            broken.add(rc)

    for c in concats:
        rel = 0
        for t in c.inputs:
            place(t, c.output, rel)
            rel += shapes[t][0]
    sets: dict[str, list[str]] = {}
    for t in list(parent):
        sets.setdefault(find(t), []).append(t)
    outputs = {c.output for c in concats}
    slots: dict[str, Slot] = {}
    for root, members in sets.items():
        if find(root) in broken:
            continue
        leaves = [t for t in members if t not in outputs]
        ok = all(
            isinstance(producer.get(t), (Conv2dStep, Pool2dStep))
            and getattr(producer[t], "residual", None) is None
            and len(shapes.get(t, ())) == 3
            for t in leaves
        ) and all(
            t != output and all(isinstance(r, _READS_SLOTS) or r.output in outputs for r in readers.get(t, []))
            for t in members
        )
        runs = sorted((offset[t], offset[t] + shapes[t][0]) for t in leaves) if ok else []
        ok = ok and all(a[1] <= b[0] for a, b in zip(runs, runs[1:], strict=False))
        if not ok:
            continue
        first = min(offset[t] for t in members)
        width = max(offset[t] + shapes[t][0] for t in members) - first
        buffer = f"{root}:buffer"
        for t in members:
            slots[t] = Slot(buffer, offset[t] - first, shapes[t][0], width)
    return slots


def place_concats(steps: list[Step], shapes: Mapping[str, tuple[int, ...]] | None, output: str = "") -> list[Step]:
    """Mark each ConcatStep that concat_slots puts in a buffer `in_place`: the fused executor has its inputs' producers
    write straight into their channels of the buffer and the concat becomes a view of it (torch.cat: a read and a
    write of the concat's size, gone); the unfused mode still runs torch.cat."""
    slots = concat_slots(steps, shapes, output)
    return [dataclasses.replace(s, in_place=True) if isinstance(s, ConcatStep) and s.output in slots else s
            for s in steps]  # fmt: skip


# Steps that may read a shuffled buffer (dense channels_last, as a conv's output read by image steps is) or a slice
# of it (a channel run, as in a concat buffer): those that take strided tensors, and concats (torch.cat, or the copy
# of place_shuffles).
_READS_SHUFFLED = (*_READS_SLOTS, ConcatStep)


def shuffle_slots(steps: list[Step], shapes: Mapping[str, tuple[int, ...]] | None, output: str = "") -> dict[str, Slot]:
    """The shuffled buffers of a plan (place_shuffles): for each ChannelShuffleStep (groups g) that reads a concat of
    g inputs of equal width C/g, read by it alone, one channels_last buffer of C channels is the shuffle's output and
    the concat's; input k of the concat lives at the buffer's channels k::g (cat channel j lands at shuffle position
    (j % (C/g)) * g + j // (C/g): for input k's channel i, i * g + k). An input made by a conv or pool step without a
    residual, read by the concat alone, gets that strided slot (its kernel writes any output strides); any other
    input (ShuffleNet's x1, a slice of the last unit's buffer) is copied there by the concat (ConcatStep.copied).

    A shuffle gets a buffer where its concat and output are 4-D, neither is the model's output, and every reader of
    its output takes strided tensors (_READS_SHUFFLED: a flatten or linear would want NCHW). {} without shapes."""
    if shapes is None or not steps or not steps[0].inputs:
        return {}
    output = output or steps[-1].output
    producer = {s.output: s for s in steps}
    readers: dict[str, list[Step]] = {}
    for s in steps:
        for t in dict.fromkeys(reads(s)):
            readers.setdefault(t, []).append(s)
    slots: dict[str, Slot] = {}
    for shuffle in steps:
        if not isinstance(shuffle, ChannelShuffleStep):
            continue
        cat, g = producer.get(shuffle.inputs[0]), shuffle.groups
        # (place_concats never takes such a concat: a shuffle is no reader of _READS_SLOTS)
        if not isinstance(cat, ConcatStep) or readers[cat.output] != [shuffle]:
            continue
        dims = [shapes.get(t, ()) for t in (*cat.inputs, cat.output, shuffle.output)]
        if any(len(d) != 3 for d in dims) or output in (cat.output, shuffle.output):
            continue
        width = dims[-1][0]
        if len(cat.inputs) != g or len(set(cat.inputs)) != g or any(d[0] != width // g for d in dims[:g]):
            continue
        if width % g or not all(isinstance(r, _READS_SHUFFLED) for r in readers.get(shuffle.output, [])):
            continue
        buffer = f"{shuffle.output}:shuffled"
        for k, t in enumerate(cat.inputs):
            if t != output and written_in_place(producer.get(t)) and len(readers[t]) == 1:
                slots[t] = Slot(buffer, k, width // g, width, g)
        slots[cat.output] = slots[shuffle.output] = Slot(buffer, 0, width, width)
    return slots


def written_in_place(step: Step | None) -> bool:
    """A step whose kernel can write its output into any strides of a buffer: a conv or pool without a residual."""
    return isinstance(step, (Conv2dStep, Pool2dStep)) and getattr(step, "residual", None) is None


def place_shuffles(steps: list[Step], shapes: Mapping[str, tuple[int, ...]] | None, output: str = "") -> list[Step]:
    """Mark what shuffle_slots puts in shuffled buffers: each such ChannelShuffleStep and its ConcatStep `in_place`
    (fused: views of the buffer; the concat copies the inputs whose producers do not write there, `copied`), and each
    SliceStep of such a shuffle's output read only by steps that take strided tensors `in_place` (fused: a channel
    run of the buffer, which the conv kernels read as channels_last). Replaces, per ShuffleNet unit: torch.cat, the
    shuffle's copy and the split's copy of the halves (each a read and a write of the feature map) with, at most, one
    strided copy of the half the concat copies. The unfused mode runs them all as torch ops, as before."""
    slots = shuffle_slots(steps, shapes, output)
    if not slots:
        return steps
    readers: dict[str, list[Step]] = {}
    for s in steps:
        for t in dict.fromkeys(reads(s)):
            readers.setdefault(t, []).append(s)
    shuffled = {s.output for s in steps if isinstance(s, ChannelShuffleStep) and s.output in slots}
    pairs = _interleaves(steps, slots, readers)
    partners = {partner for partner, _ in pairs.values()}
    out = []
    for s in steps:
        if isinstance(s, ChannelShuffleStep) and s.output in shuffled:
            s = dataclasses.replace(s, in_place=True)
        elif isinstance(s, ConcatStep) and s.output in slots and not s.in_place:
            copied = tuple(t for t in s.inputs if t not in slots and t not in partners)
            s = dataclasses.replace(s, in_place=True, copied=copied)
        elif isinstance(s, Conv2dStep) and s.output in pairs:
            partner, k = pairs[s.output]
            s = dataclasses.replace(s, interleave=partner, interleave_index=k)
        elif (
            isinstance(s, SliceStep)
            and s.inputs[0] in shuffled
            and len(shapes.get(s.output, ())) == 3
            and s.output != (output or steps[-1].output)
            and all(isinstance(r, _READS_SHUFFLED) for r in readers.get(s.output, []))
        ):
            s = dataclasses.replace(s, in_place=True)
        out.append(s)
    return out


def _interleaves(
    steps: list[Step], slots: Mapping[str, Slot], readers: Mapping[str, list[Step]]
) -> dict[str, tuple[str, int]]:
    """conv output -> (the tensor it is stored beside, the conv output's index in the concat: its channels k::2), for
    shuffled concats of two inputs (groups 2). A stride-1
    ShuffleNet unit's: one input the concat would copy (a split's half, a view of the last unit's buffer) and one made
    by a plain conv (groups 1, no pool, residual or gate) that only the concat reads: the conv stores both. A stride-2
    unit's: two such convs: the later one stores both, the earlier writing its output dense (not into the buffer:
    its second reader, the later conv, keeps it out of shuffle_slots). Either way the buffer is written in whole rows:
    every other channel stored alone costs 6.7x the dense store (H200, ShuffleNetV2's 58 channels at 28x28: 188
    against 28 us), and the concat's strided copy goes (bench.probes.shuffled_store)."""
    producer = {s.output: s for s in steps}
    order = {s.output: i for i, s in enumerate(steps)}

    def plain_conv(t: str, cat: ConcatStep) -> bool:
        conv = producer.get(t)
        return (
            isinstance(conv, Conv2dStep)
            and written_in_place(conv)
            and conv.pool is None
            and conv.groups == 1
            and conv.gate is None
            and readers.get(t, []) == [cat]
        )

    pairs = {}
    for cat in steps:
        if not isinstance(cat, ConcatStep) or cat.output not in slots or len(set(cat.inputs)) != 2:
            continue
        copied = [t for t in cat.inputs if t not in slots]
        made = [t for t in cat.inputs if t in slots and plain_conv(t, cat)]
        if len(copied) == 1 and len(made) == 1:
            pairs[made[0]] = (copied[0], cat.inputs.index(made[0]))
        elif not copied and len(made) == 2:
            earlier, later = sorted(made, key=order.__getitem__)
            pairs[later] = (earlier, cat.inputs.index(later))
    return pairs


def is_view(step: Step) -> bool:
    """A step the fused executor runs without a kernel: a flatten, an in-place concat (a view of its buffer) that
    copies nothing, an in-place shuffle (its buffer) or slice (a channel run of a shuffled buffer)."""
    if isinstance(step, ConcatStep):
        return step.in_place and not step.copied
    return isinstance(step, FlattenStep) or (isinstance(step, (ChannelShuffleStep, SliceStep)) and step.in_place)


def attach_normalization(steps: list[Step], norm: InputNorm, input_name: str) -> list[Step]:
    """The input's normalization in the plan: in the conv step that reads the input, where it is a conv (groups 1)
    and the input's only reader (the usual image model: one stem conv); else a NormalizeStep `normalize_0` first,
    whose output the input's readers read instead."""
    readers = [s for s in steps if input_name in reads(s)]
    if len(readers) == 1 and list(reads(readers[0])).count(input_name) == 1:
        conv = readers[0]
        if isinstance(conv, Conv2dStep) and conv.groups == 1 and conv.inputs == (input_name,) and conv.prenorm is None:
            return [dataclasses.replace(s, normalize=norm) if s is conv else s for s in steps]
    normalized = f"{input_name}:normalized"

    def rewired(s: Step) -> Step:
        if input_name not in reads(s):
            return s
        inputs = tuple(normalized if t == input_name else t for t in s.inputs)
        if getattr(s, "residual", None) == input_name:
            return dataclasses.replace(s, inputs=inputs, residual=normalized)
        return dataclasses.replace(s, inputs=inputs)

    first = NormalizeStep("normalize_0", norm, inputs=(input_name,), output=normalized)
    return [first, *(rewired(s) for s in steps)]


def fused_steps(
    ops: list[Op],
    tensors: Mapping[str, torch.Tensor],
    *,
    whole_mlp: bool = True,
    conv_pool: bool = True,
    normalize: InputNorm | None = None,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
    preact: bool = True,
    concat_in_place: bool = True,
    shuffle_in_place: bool = True,
) -> list[Step]:
    """The plan both executors run: `plan`, then the whole-MLP grouping, the pre-activation folding
    (`fold_preactivations`), the conv + pool grouping, the input's normalization (`attach_normalization`; the
    ops must be wired, as a loaded model's are), the concat buffers (`place_concats`, given `shapes`) and the shuffled
    buffers (`place_shuffles`, given `shapes`)."""
    steps = plan(ops, shapes, tensors)
    steps = group_mlps(steps, tensors) if whole_mlp else steps
    steps = fold_preactivations(steps, ops[-1].output) if preact and steps else steps
    steps = group_conv_pools(steps) if conv_pool else steps
    steps = steps if normalize is None else attach_normalization(steps, normalize, ops[0].inputs[0])
    steps = place_concats(steps, shapes, ops[-1].output) if concat_in_place and steps else steps
    return place_shuffles(steps, shapes, ops[-1].output) if shuffle_in_place and steps else steps


def kernel_names(steps: list[Step]) -> list[str]:
    """The steps that launch work, by name (flatten is a view; an in-place concat keeps its name: unfused, it runs)."""
    return [s.name for s in steps if not isinstance(s, FlattenStep)]


def step_ops(step: Step) -> list[str]:
    """The ops a step runs, in order, as the graph names them (`conv2d`, `batchnorm`, `add`, `relu`, `maxpool2d`)."""
    if isinstance(step, MLPStep):
        return [part for layer in step.layers for part in step_ops(layer)]
    parts: list[str] = []
    if isinstance(step, (LinearStep, Conv2dStep)):
        if getattr(step, "gate", None) is not None:
            parts.append("mul")
        if getattr(step, "prenorm", None) is not None:
            parts.append("batchnorm")
            if step.prenorm_activation != "none":
                parts.append(step.prenorm_activation)
        parts.append("linear" if isinstance(step, LinearStep) else "conv2d")
        if step.batchnorm is not None:
            parts.append("batchnorm")
        if step.scale is not None:
            parts.append("mul")
        if step.residual is not None:
            parts.append("add")
    elif isinstance(step, Pool2dStep):
        parts.append(f"{step.kind}pool2d")
    elif isinstance(step, AddStep):
        parts.append("add")
    elif isinstance(step, ElementwiseStep):
        parts.append(step.kind)
    elif isinstance(step, ClampStep):
        parts.append(step.name.rsplit("_", 1)[0])  # clip | hardsigmoid
    elif isinstance(step, ChannelShuffleStep):
        parts.append("channel_shuffle")
    elif isinstance(step, (BatchNormStep, ConcatStep, SoftmaxStep, FlattenStep, NormalizeStep, LayerNormStep,
                           SliceStep, PadStep)):  # fmt: skip
        parts.append(type(step).__name__.removesuffix("Step").lower())
    activation = getattr(step, "activation", "none")
    if activation != "none":
        parts.append(activation)
    pool = getattr(step, "pool", None)
    if pool is not None:
        parts.append(f"{pool.kind}pool2d")
    return parts


def step_extras(step: LinearStep | Conv2dStep) -> dict:
    """What a conv or linear step fuses beyond the format-1 ops, for `GET /model`'s plan ({} for none)."""
    out: dict = {}
    if step.batchnorm is not None:
        out["batchnorm"] = True
    if step.residual is not None:
        out["residual"] = step.residual
    if step.scale is not None:
        out["scale"] = step.scale
    if getattr(step, "gate", None) is not None:
        out["gate"] = step.gate
    if getattr(step, "groups", 1) != 1:
        out["groups"] = step.groups
    if getattr(step, "normalize", None) is not None:  # the model's input, normalized as the conv loads it
        out["normalize"] = {"mean": list(step.normalize.mean), "std": list(step.normalize.std)}
    if getattr(step, "prenorm", None) is not None:  # a batch norm (+ activation) of x, applied as the conv loads it
        out["prenorm"] = {"activation": step.prenorm_activation}
    if getattr(step, "interleave", None) is not None:  # fused: stored beside it in the shuffled buffer
        out["interleave"] = {"with": step.interleave, "channels": f"{step.interleave_index}::2"}
    return out


def describe_step(step: Step) -> dict:
    """A step of the graph-only kinds (add, batchnorm, concat, softmax, normalize) for `GET /model`'s plan."""
    doc: dict = {"op": step_ops(step)[0], "inputs": list(step.inputs)}
    if isinstance(step, (AddStep, ElementwiseStep)):
        doc["activation"] = step.activation
    if isinstance(step, ElementwiseStep) and step.constant is not None:
        doc.update(constant=step.constant, reverse=step.reverse)
    if isinstance(step, NormalizeStep):
        doc.update(mean=list(step.normalize.mean), std=list(step.normalize.std))
    if isinstance(step, ClampStep):
        doc.update(scale=step.scale, shift=step.shift, min=step.lo, max=step.hi)
    if isinstance(step, LayerNormStep):
        doc.update(eps=step.eps)
    if isinstance(step, SliceStep):
        doc.update(start=step.start, end=step.end)
    if isinstance(step, ChannelShuffleStep):
        doc.update(groups=step.groups)
    if isinstance(step, PadStep):
        doc.update(pads=list(step.pads), value=step.value)
    if isinstance(step, ConcatStep) and step.in_place:
        doc.update(in_place=True)
        if step.copied:
            doc.update(copied=list(step.copied))
    if isinstance(step, (ChannelShuffleStep, SliceStep)) and step.in_place:
        doc.update(in_place=True)
    return doc
