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
    ours-float8         Executor(model, "fused", precision="float8") in float16 (its fp16 steps, input and output)
                        under GraphedExecutor as ours, calibrated (service/model/calibrate.measure) on
                        CALIBRATION_ROWS random rows of another seed than the timed input's; its error has its own
                        bound (FLOAT8_ERROR_BOUND). Named only (not in the default providers): GPUs of compute
                        capability 8.9+; on the CPU the executor's forward through Triton's interpreter

The 224x224 CNNs (the ResNets of bench/resnets.py; MobileNetV2 and EfficientNet-B0 as TORCHVISION_CNNS) come as torch
modules, and their anchors are the module as a user runs it:

    eager               the module, NCHW (cuDNN convs, BatchNorm and the residual adds as kernels of their own)
    eager-cl            the module and its input in channels_last (NHWC: cuDNN's fastest tensor-core layout)
    eager-folded        channels_last with every BatchNorm folded into its conv by hand (fuse_conv_bn_eval)
    compile             torch.compile of eager-folded, default mode, dynamic=False, per batch size
    compile-max         the same, mode="max-autotune-no-cudagraphs"

and `linear` does not apply. Ours imports the module's ONNX file, as a user's file is served.

Every provider except ours-* also runs under a CUDA graph captured here (timing.measure).
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kernels import reference
from kernels.activations import torch_activation
from service.model.loader import Model, load_model
from service.model.planner import ActivationStep, Conv2dStep, FlattenStep, LinearStep, Pool2dStep, plan

from .providers import COMPILE_MODES, NotAvailable, compiled
from .timing import ELEMENT_BYTES, Prepared, describe, synchronize, warm_ours

MODEL_PROVIDERS = (
    "eager", "eager-cl", "eager-folded", "linear", "compile", "compile-max", "ours-unfused-graph", "ours-eager", "ours",
    "ours-float8",
)  # fmt: skip
OURS = ("ours", "ours-unfused-graph", "ours-eager", "ours-float8")  # the service's executors (the rest: anchors)
# ours-float8's normwise error bound against the float64 reference. Not fp16's 1e-2: e4m3 keeps 3 mantissa bits, each
# quantized activation and weight is off by up to 2^-4 (6.25%) of itself, and the errors compound over the fp8 steps
# (ResNet-18 at 32x32, 19 fp8 convs, interpreted: 0.089, cosine 0.996). The accuracy contract is the logits' cosine
# >= 0.99 (issue 52; bench/probes/fp8_resnet50.py, tests/test_fp8_gpu.py); a result of the right norm at that cosine
# is 2 sin(theta / 2) = sqrt(2 (1 - 0.99)) = 0.141 away from the reference, so only a larger error is flagged: a
# wrong scale or index (an error of about 1) still is.
FLOAT8_MIN_COSINE = 0.99
FLOAT8_ERROR_BOUND = math.sqrt(2 * (1 - FLOAT8_MIN_COSINE))
FLOAT8_DTYPE = torch.float16  # the dtype float8 runs beside: its fp16 steps (first conv, classifier), input, output
# Random rows calibrate.measure() takes the ranges from (the probe's --calib default), from their own seed
# (ModelProviders' calibration_seed): never the timed inputs.
CALIBRATION_ROWS = 64
MODULE_ONLY = ("eager-cl", "eager-folded")  # anchors of the models built as torch modules (the ResNets)
STEP_REPS = 20  # replays of the timed graph per mode behind each step's median (ModelProviders.step_times)
MODELS = ("digits", "wide", "digits-cnn", "wide-cnn", "mlp-768", "mlp-1000", "resnet18", "resnet50", "mobilenet_v2",
          "efficientnet_b0")  # fmt: skip
# torchvision's classifiers beside the ResNets (bench/serve/issue50.build: torchvision's where it imports, else
# bench/zoo/families.py's copy; random weights, BatchNorm statistics from random images), 224x224
TORCHVISION_CNNS = ("mobilenet_v2", "efficientnet_b0")
WEIGHTS = Path(__file__).resolve().parents[2] / "model_weights"
DIGITS_DIR = WEIGHTS / "digits-mlp"
# conv16 (1 -> 16, 8x8) - conv16 (16 -> 16) - maxpool 2 - fc64 - fc10, ReLU; 3 kernels fused (the pool rides
# in the second conv, the MLP tail is one kernel), 8 unfused.
DIGITS_CNN_DIR = WEIGHTS / "digits-cnn"
# The wide MLP's dims; ReLU after each hidden layer, none after the last (as digits-mlp: logits out).
# At batch 1 it reads 50 MB of fp16 weights: 11.8 us at 4.25 TB/s.
WIDE_DIMS = (1024, 4096, 4096, 1024)
# MLPs whose widths are not multiples of 64 (issue 34): a transformer's feed-forward block (768 -> 3072 -> 768,
# exact GELU between) and a classifier head (1000 -> 2000 -> 500 -> 10, ReLU after each hidden layer).
ODD_MLPS = {"mlp-768": ((768, 3072, 768), nn.GELU), "mlp-1000": ((1000, 2000, 500, 10), nn.ReLU)}
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
    "wide-cnn", the odd-width MLPs, the ResNets): each loaded by the service's loader, so every executor runs it
    as the service would."""
    return load_with_module(name, tmpdir, seed)[0]


def load_with_module(name: str, tmpdir: Path, seed: int) -> tuple[Model, nn.Module | None]:
    """load_named's model, and for the 224x224 CNNs the torch module (eval mode, float32, CPU) its ONNX file came
    from."""
    if name in ("resnet18", "resnet50"):
        from bench import resnets

        path, module = resnets.write(name, Path(tmpdir) / name, seed)
        return load_model(path.parent), module
    if name in TORCHVISION_CNNS:
        from bench import resnets
        from bench.serve.issue50 import build

        module, _ = build(name, resnets.IMAGE[-1], seed)
        path = resnets.export_onnx(module, Path(tmpdir) / name / f"{name}.onnx", name)
        return load_model(path.parent), module
    return _load_named(name, tmpdir, seed), None


def _load_named(name: str, tmpdir: Path, seed: int) -> Model:
    if name in ODD_MLPS:
        return build_mlp(tmpdir, seed, name, *ODD_MLPS[name])
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
    return build_mlp(tmpdir, seed, "wide-mlp", WIDE_DIMS, nn.ReLU)


def build_mlp(tmpdir: Path, seed: int, name: str, dims: tuple[int, ...], act: type[nn.Module]) -> Model:
    """A random MLP of these widths, `act` after each hidden layer (none after the last: logits out), exported
    to the model format and loaded like any other."""
    from service.model.export import export_sequential

    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (k, n) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
        lin = nn.Linear(k, n)
        # He init (std sqrt(2/K)) keeps ReLU activations O(1) from layer to layer; nn.Linear's default
        # (std 1/sqrt(3K)) would shrink them ~2.4x per layer.
        nn.init.normal_(lin.weight, std=math.sqrt(2.0 / k))
        nn.init.normal_(lin.bias, std=0.1)
        layers.append(lin)
        if i < len(dims) - 2:
            layers.append(act())
    widths = "-".join(map(str, dims))
    out = export_sequential(
        nn.Sequential(*layers), Path(tmpdir) / name, input_shape=[dims[0]], name=name,
        description=f"random {widths} {act.__name__} MLP for `fusedserve bench kernels`",
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
    """(step, input shape, output shape) per layer step of the per-layer plan, one image (no batch dim), from the
    loader's shape of every tensor of the graph (a ResNet's shortcut conv reads its block's input, not the
    step before it)."""
    return [(s, tuple(model.shapes[s.inputs[0]]), tuple(model.shapes[s.output])) for s in _per_layer(plan(model.ops))]


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
    kernels are tuned once). With `module` (the ResNets) the anchors run that torch module."""

    def __init__(
        self,
        model: Model,
        device: torch.device,
        dtype: torch.dtype,
        max_batch_size: int,
        module: nn.Module | None = None,
        calibration_seed: int = 1,
    ):
        self.model, self.device, self.dtype, self.max_batch_size = model, device, dtype, max_batch_size
        self.module = module
        self.calibration_seed = calibration_seed  # ours-float8's calibration rows (not the timed inputs' seed)
        self.steps = None if module is not None else bound_steps(model, device, dtype)
        # "eager" (NCHW), "cl", "folded": the module as each anchor runs it; "float64": the reference's
        self._modules: dict[str, nn.Module] = {}
        self._executors: dict[str, object] = {}
        self._graphed: dict[str, object] = {}  # mode -> GraphedExecutor, or the NotAvailable/exception it raised

    def _executor(self, mode: str):
        """mode "fused" or "unfused"; "float8": the fused executor in float8, calibrated (calibration)."""
        if mode not in self._executors:
            from service.model.executors import Executor

            if mode == "float8":
                cal = self.calibration()
                ex = Executor(self.model, "fused", self.device, self.dtype, precision="float8", calibration=cal)
            else:
                ex = Executor(self.model, mode, self.device, self.dtype)
            self._executors[mode] = ex
        return self._executors[mode]

    def calibration(self, rows: int = CALIBRATION_ROWS):
        """The model's float8 Calibration (in memory) from `rows` random rows of calibration_seed, drawn on the CPU
        and rounded to this dtype as the timed inputs are: calibrate.measure(), as `fusedserve calibrate` runs it."""
        from service.model.calibrate import measure
        from service.model.float8 import Calibration

        gen = torch.Generator().manual_seed(self.calibration_seed)
        x = torch.randn((rows, *self.model.input_shape), generator=gen).to(self.dtype).float()
        ranges, seen = measure(self.model, iter([x.numpy()]), self.device, batch_size=rows)
        return Calibration(ranges, seen, f"bench kernels: random normal rows, seed {self.calibration_seed}")

    def float8_unavailable(self) -> str | None:
        """Why ours-float8 cannot run here (NotAvailable's reason), or None."""
        from kernels.fp8 import fp8_capable
        from kernels.runtime import interpreting

        if self.dtype != FLOAT8_DTYPE:
            return "float8 runs beside float16 (its fp16 steps, input and output): --model-dtype float16"
        if self.device.type == "cuda" and not interpreting() and not fp8_capable(self.device):
            major, minor = torch.cuda.get_device_capability(self.device)
            name = torch.cuda.get_device_name(self.device)
            return f"{name}: no fp8 tensor cores (compute capability {major}.{minor} < 8.9)"
        if self.device.type != "cuda" and not interpreting():
            return "the CPU runs the fp8 kernels only through Triton's interpreter (TRITON_INTERPRET=1)"
        return None

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

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """float64 forward from the same dtype-cast input and weights."""
        if self.module is None:
            return reference_forward(self.steps, x)
        with torch.no_grad():
            return self._module_as("float64")(x.double())

    def step_times(self, x: torch.Tensor, reps: int = STEP_REPS) -> list[dict]:
        """Each step of the plan, fused against unfused (both executors run the same steps under the same names),
        timed by executor_step_us."""
        fused, unfused = (executor_step_us(self._executor(mode), x, reps) for mode in ("fused", "unfused"))
        return [{"step": n, "fused_us": t, "unfused_us": unfused.get(n)} for n, t in fused.items()]

    def _module_as(self, kind: str) -> nn.Module:
        """The module in this dtype on this device: "eager" as it is (NCHW), "cl" in channels_last, "folded" in
        channels_last with each BatchNorm folded into its conv (torch.fx's conv-BN fusion, as a user would);
        "float64": its weights cast to this dtype, then computed in float64 (the reference)."""
        if kind not in self._modules:
            m = copy.deepcopy(self.module).eval()
            if kind == "folded":
                from torch.fx.experimental.optimization import fuse

                m = fuse(m)
            m = m.to(self.device, self.dtype)
            if kind == "float64":
                m = m.double()
            self._modules[kind] = m if kind in ("eager", "float64") else m.to(memory_format=torch.channels_last)
        return self._modules[kind]

    def _prepare_module(self, name: str, x: torch.Tensor) -> Prepared:
        if name == "linear":
            raise NotAvailable("a torch module's anchors are eager, eager-cl, eager-folded and torch.compile")
        kind = {"eager": "eager", "eager-cl": "cl"}.get(name, "folded")
        m = self._module_as(kind)
        if kind != "eager":  # the input converted once, outside the timing, as a channels_last pipeline has it
            x = x.contiguous(memory_format=torch.channels_last)
        if name in COMPILE_MODES:
            return compiled(torch.no_grad()(m), name, (x,), self.device)
        return Prepared(torch.no_grad()(lambda: m(x)))

    def prepare(self, name: str, x: torch.Tensor) -> Prepared:
        if self.module is not None and name not in OURS:
            return self._prepare_module(name, x)
        if name in MODULE_ONLY:
            raise NotAvailable("only for the models built as torch modules (the ResNets)")
        if name == "eager":
            return Prepared(lambda: forward(self.steps, x, "eager"))
        if name == "linear":
            return Prepared(lambda: forward(self.steps, x, "linear"))
        if name in COMPILE_MODES:
            steps = self.steps
            return compiled(lambda x: forward(steps, x, "linear"), name, (x,), self.device)
        if name == "ours-float8":
            reason = self.float8_unavailable()
            if reason:
                raise NotAvailable(reason)
            if self.device.type != "cuda":  # the interpreter's smoke run: the executor's forward (no CUDA graphs)
                t = time.perf_counter()  # the first batch also pays for calibrating and building the executor
                ex = self._executor("float8")
                return self._warmed(Prepared(lambda: ex.forward(x), plain_only=True), t)
            return self._replayed("float8", x)
        if name in ("ours", "ours-unfused-graph"):
            return self._replayed("fused" if name == "ours" else "unfused", x)
        if name == "ours-eager":
            t = time.perf_counter()
            ex = self._executor("fused")
            return self._warmed(Prepared(lambda: ex.forward(x), plain_only=True), t)
        raise ValueError(f"unknown model provider {name!r}; expected one of {', '.join(MODEL_PROVIDERS)}")

    def _replayed(self, mode: str, x: torch.Tensor) -> Prepared:
        """The executor of `mode` under its GraphedExecutor, x staged in the bucket's graph input, one replay a call."""
        t = time.perf_counter()  # the first batch also pays for building (and warming) the executor
        g = self._graphed_executor(mode)
        with torch.inference_mode():  # as the service warms: a kernel past the compile deadline runs unfused
            g.executor.warm_forward(x)
        # The input is staged into the bucket's graph input once, as the service's H2D copy puts it
        # there, and each call is one replay: the anchors' graphs likewise read an input already in place.
        rows = g.stage(x)
        return self._warmed(Prepared(lambda: g.replay(rows), graphed=True), t)

    def _warmed(self, prep: Prepared, t0: float) -> Prepared:
        warm_ours(prep.fn, self.device)
        prep.compile_s = time.perf_counter() - t0
        return prep


def executor_step_us(ex, x: torch.Tensor, reps: int = STEP_REPS) -> dict[str, float]:
    """{step name: µs}, the median of `reps` forwards of x: on CUDA replays of the service's timed graph for x's
    batch (CUDA-event nodes around each step, as the service times its kernels: GraphedExecutor(timed=True)); on the
    CPU, wall time around each step of an eager forward."""
    from service.model.executors import StepTimer

    if ex.device.type == "cuda":
        from service.model.graphs import GraphedExecutor

        g = GraphedExecutor(ex, max_batch_size=len(x), host_io=True, timed=True)
        g.host_in[: len(x)].copy_(x.to(g.host_in.dtype).cpu())

        def timed_forward() -> StepTimer:
            return g.replay_host_timed(len(x))[1]
    else:
        timer = StepTimer(ex.device)

        def timed_forward() -> StepTimer:
            ex.forward(x, timer)
            return timer

    samples: dict[str, list[float]] = defaultdict(list)
    for _ in range(reps):
        timer = timed_forward()
        synchronize(ex.device)
        for name, seconds in timer.results():
            samples[name].append(seconds)
    return {name: statistics.median(v) * 1e6 for name, v in samples.items()}
