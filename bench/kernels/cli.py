"""Kernel benchmark: ours vs what a user would run instead, per layer and per whole model, on this GPU.

    fusedserve bench kernels                      # the full run: ~7 minutes on an H200 (--time-limit 420)
    fusedserve bench kernels --quick              # smoke: one small shape, one dtype, no compile-max
    fusedserve bench kernels --device cpu --quick # no GPU: wall time only, ours through Triton's interpreter
    python -m bench.kernels ...                   # the same, without the console script

Sections: `layers` (y = act(x @ W^T + b) for 6 shapes x 3 dtypes x relu/gelu_tanh; providers eager,
linear, cublaslt, compile, compile-max, ours), `models` (the shipped digits MLP and CNN, a wide
1024-4096-4096-1024 MLP at batch 1..4096 and a wider 3x32x32 CNN at 1, 32, 256; fp16, the digits MLP in bf16 too;
providers eager, linear, compile, compile-max, and the service's executors; by name also ours-float8, the fused
executor in float8 beside float16) and `convs` (the wider CNN's conv layers alone: ours against cuDNN's conv + bias +
ReLU, plain and fused, and torch.compile). Every provider plain and under a CUDA graph; every graph timed cold (L2
cleared) and hot (replays back to back). Writes kernels_<gpu>.md, .json and .png under --out (bench/results/<gpu>)
and prints a summary last. How it measures: bench/kernels/timing.py.
"""

# This module only parses arguments: the `fusedserve` parser imports it for every command, so it
# imports no torch (~2 s). The run itself is bench/kernels/run.py.

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

SECTIONS = ("layers", "models", "convs")
DTYPE_NAMES = ("float16", "bfloat16", "float32")
ACTS = ("relu", "gelu_tanh")
SHAPES = ((64, 256, 128), (128, 256, 256), (1024, 1024, 1024), (1, 4096, 4096), (16, 4096, 4096), (4096, 4096, 4096))
BATCHES = (1, 8, 32, 256, 4096)
# Mirrors of providers.LAYER_PROVIDERS / models.MODEL_PROVIDERS / MODELS (those import torch).
LAYER_PROVIDERS = ("eager", "linear", "cublaslt", "compile", "compile-max", "ours")
MODEL_PROVIDERS = (
    "eager", "eager-cl", "eager-folded", "linear", "compile", "compile-max", "ours-unfused-graph", "ours-eager", "ours",
    "ours-float8",
)  # fmt: skip
# Run only when named in --providers: ours-float8 calibrates and tunes its fp8 kernels per model (issue 52), time the
# default run's budget (budget.py) does not hold; it needs compute capability 8.9+ (else n/a, with the reason).
BY_NAME_ONLY = ("ours-float8",)
MODELS = ("digits", "wide", "digits-cnn", "wide-cnn", "mlp-768", "mlp-1000", "resnet18", "resnet50", "mobilenet_v2",
          "efficientnet_b0")  # fmt: skip
# Run when --models is not given (the 224x224 CNNs and the odd-width MLPs by name: a ResNet-50 case costs minutes).
DEFAULT_MODELS = ("digits", "wide", "digits-cnn", "wide-cnn")
CONV_PROVIDERS = ("cudnn", "cudnn-fused", "compile", "ours")  # mirror of convs.CONV_PROVIDERS
# Issue 19 judges the digits MLP in fp16 and bf16: by default it runs in both, the other models in fp16.
# Issue 34 judges the ResNets in fp16 and bf16 too.
EXTRA_MODEL_DTYPES = {"digits": ("bfloat16",), "resnet18": ("bfloat16",), "resnet50": ("bfloat16",)}
CONV_BATCHES = (1, 32, 256)  # the wider CNN's conv layers alone (bench/probes/conv.py's batches)
# The wider CNN's whole forward carries no target (its convs do, in the convs section) and costs the most
# per case (at 4096: 560 GFLOP, ~1-5 ms a call, a float64 reference of GBs): by default the convs' batches.
# The ResNets at issue 34's batches (224x224 images: batch 256 is 77 MB of fp16 input, 1 TFLOP for ResNet-50).
RESNET_BATCHES = (1, 8, 32, 128, 256)
MODEL_BATCHES = {"wide-cnn": CONV_BATCHES} | dict.fromkeys(
    ("resnet18", "resnet50", "mobilenet_v2", "efficientnet_b0"), RESNET_BATCHES
)
N_CONV_LAYERS = 4  # len(convs.wide_cnn_convs())
QUICK_SHAPE = (64, 256, 128)
TIMING = (10, 50, 0.02)  # do_bench warmup ms, rep ms; seconds per wall-time run
QUICK_TIMING = (5, 20, 0.01)


@dataclass(frozen=True)
class Plan:
    """What one run does, resolved from the flags (--quick defaults, filters, device)."""

    device: str
    sections: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, int, int], ...]
    acts: tuple[str, ...]
    layer_providers: tuple[str, ...]
    model_providers: tuple[str, ...]
    conv_providers: tuple[str, ...]
    models: tuple[str, ...]
    batches: tuple[int, ...]
    conv_batches: tuple[int, ...]
    conv_layers: tuple[int, ...]  # indices into convs.wide_cnn_convs()
    model_dtype: str  # the first of the models' dtypes (the report's default)
    model_runs: tuple[tuple[str, str, tuple[int, ...]], ...]  # (model, dtype, batches) in run order
    tf32: bool
    quick: bool
    time_limit: float
    seed: int
    out: Path | None  # None: bench/results/<gpu>
    timing: tuple[int, int, float]


def _names(allowed: tuple[str, ...], what: str):
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(n.strip() for n in text.split(",") if n.strip())
        unknown = [n for n in names if n not in allowed]
        if unknown or not names:
            got = ", ".join(unknown) or repr(text)
            raise argparse.ArgumentTypeError(f"unknown {what} {got}; choose from {', '.join(allowed)}")
        return names

    return parse


def _shapes(text: str) -> tuple[tuple[int, int, int], ...]:
    try:
        shapes = tuple(tuple(int(v) for v in s.lower().split("x")) for s in text.split(",") if s.strip())
    except ValueError:
        shapes = ()
    if not shapes or any(len(s) != 3 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"shapes are MxKxN lists like 64x256x128,1x4096x4096; got {text!r}")
    return shapes


def parse_batches(text: str) -> tuple[int, ...]:
    """--batches: comma-separated positive integers (bench zoo's too)."""
    try:
        batches = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        batches = ()
    if not batches or min(batches) < 1:
        raise argparse.ArgumentTypeError(f"batches are positive integers like 1,8,32; got {text!r}")
    return batches


def add_arguments(p: argparse.ArgumentParser) -> None:
    all_providers = tuple(dict.fromkeys(LAYER_PROVIDERS + MODEL_PROVIDERS + CONV_PROVIDERS))
    p.add_argument("--out", type=Path, help="output directory [bench/results/<gpu>, e.g. bench/results/h100]")
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cuda (default; exits 2 without one), or cpu: smoke run, wall time, ours interpreted",
    )
    p.add_argument(
        "--sections", type=_names(SECTIONS, "section"), default=SECTIONS, help="layers,models,convs [all three]"
    )
    p.add_argument(
        "--dtype",
        type=_names(DTYPE_NAMES, "dtype"),
        action="append",
        dest="dtypes",
        help="layer dtypes, comma-separated or repeated [all three; --quick: one]",
    )
    p.add_argument(
        "--shapes", type=_shapes, help="layer shapes MxKxN,... [six from 64x256x128 to 4096^3; --quick: 64x256x128]"
    )
    p.add_argument("--acts", type=_names(ACTS, "activation"), help="relu,gelu_tanh [both]")
    p.add_argument(
        "--providers",
        type=_names(all_providers, "provider"),
        help=f"keep only these of {', '.join(all_providers)} [all but {', '.join(BY_NAME_ONLY)} (float8, issue 52: "
        "by name); --quick: no compile-max]",
    )
    p.add_argument(
        "--models",
        type=_names(MODELS, "model"),
        help=f"{','.join(MODELS)} [{','.join(DEFAULT_MODELS)}; --quick: digits]",
    )
    p.add_argument(
        "--batches",
        type=parse_batches,
        help="model batch sizes, every model [1,8,32,256,4096, the wider CNN 1,32,256, the ResNets 1,8,32,128,256; "
        "--quick: 1,32]",
    )
    p.add_argument("--conv-batches", type=parse_batches, help="batch sizes of the convs section [1,32,256; --quick: 1]")
    p.add_argument(
        "--model-dtype",
        type=_names(DTYPE_NAMES, "dtype"),
        action="append",
        dest="model_dtypes",
        help="dtypes of the models section, every model in each [float16, and the digits MLP also in "
        "bfloat16; --quick: float16; cpu: float32]; the convs section runs in the first",
    )
    p.add_argument(
        "--tf32",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fp32 matmuls in TF32, for every provider alike [on]",
    )
    p.add_argument("--quick", action="store_true", help="tiny subset for smoke runs; fewer reps")
    p.add_argument(
        "--time-limit",
        type=float,
        default=420.0,
        help="seconds for the whole run; compile providers are skipped to fit, 0 = none [420]",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs and the wide MLP's weights [0]")


def resolve(args: argparse.Namespace) -> Plan:
    """Flags -> Plan. --quick only changes what was not given explicitly."""
    cpu = args.device == "cpu"
    quick = args.quick
    dtypes = tuple(dict.fromkeys(d for group in args.dtypes for d in group)) if args.dtypes else None
    default_dtype = "float32" if cpu else "float16"  # CPU fp16/bf16 GEMMs are slow and not what is measured
    if dtypes is None:
        dtypes = (default_dtype,) if quick else DTYPE_NAMES
    providers = args.providers
    if providers is None:
        drop = {"compile-max", *BY_NAME_ONLY} if quick else set(BY_NAME_ONLY)
        if cpu:
            drop |= {"compile", "compile-max"}  # inductor on the CPU builds C++ (minutes); ask for it by name
        providers = tuple(p for p in dict.fromkeys(LAYER_PROVIDERS + MODEL_PROVIDERS + CONV_PROVIDERS) if p not in drop)
    models = args.models or (("digits",) if quick else DEFAULT_MODELS)
    if args.model_dtypes:
        model_dtypes = tuple(dict.fromkeys(d for group in args.model_dtypes for d in group))
        pairs = [(m, d) for m in models for d in model_dtypes]
    else:
        extra = {} if (cpu or quick) else EXTRA_MODEL_DTYPES
        pairs = [(m, d) for m in models for d in (default_dtype, *extra.get(m, ()))]
    batches = args.batches or ((1, 32) if quick else BATCHES)
    own = {} if (args.batches or quick) else MODEL_BATCHES  # --batches: every model at those
    model_runs = tuple((m, d, own.get(m, batches)) for m, d in pairs)
    return Plan(
        device=args.device,
        sections=args.sections,
        dtypes=dtypes,
        shapes=args.shapes or ((QUICK_SHAPE,) if quick else SHAPES),
        acts=args.acts or ACTS,
        layer_providers=tuple(p for p in LAYER_PROVIDERS if p in providers),
        model_providers=tuple(p for p in MODEL_PROVIDERS if p in providers),
        conv_providers=tuple(p for p in CONV_PROVIDERS if p in providers),
        models=models,
        batches=batches,
        conv_batches=args.conv_batches or ((1,) if quick else CONV_BATCHES),
        # --quick: only the last conv (128 -> 128 at 8x8: the fewest output pixels, cheap interpreted)
        conv_layers=(N_CONV_LAYERS - 1,) if quick else tuple(range(N_CONV_LAYERS)),
        model_dtype=model_runs[0][1] if model_runs else default_dtype,
        model_runs=model_runs,
        tf32=args.tf32,
        quick=quick,
        time_limit=args.time_limit,
        seed=args.seed,
        out=args.out,
        timing=QUICK_TIMING if quick else TIMING,
    )


def run(args: argparse.Namespace, command: str) -> int:
    """Check the device, pick the kernels' backend, run. Exit status: 0 done, 1 one of ours gave a wrong
    result, 2 cannot run here."""
    plan = resolve(args)
    if plan.device == "cpu" and "kernels" not in sys.modules:
        # Ours runs on CPU tensors only through Triton's interpreter, which is chosen when the kernels are
        # first defined (kernels/runtime.py); without CUDA it is chosen anyway.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    if plan.device == "cuda" and not torch.cuda.is_available():
        print(
            "fusedserve bench kernels: no CUDA device (torch.cuda.is_available() is False; "
            f"torch {torch.__version__}). Run it on a GPU, or pass --device cpu (add --quick) for a smoke run.",
            file=sys.stderr,
        )
        return 2
    from .run import execute

    return execute(plan, command)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.splitlines()[0])
    add_arguments(parser)
    argv = sys.argv[1:] if argv is None else list(argv)
    return run(parser.parse_args(argv), shlex.join(["python", "-m", "bench.kernels", *argv]))
