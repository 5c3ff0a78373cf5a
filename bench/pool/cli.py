"""Pooling study: AvgPool2D + ReLU, fused (ours) against torch on the CPU, torch on the GPU and torch.compile.

    python -m bench.pool                          # the full study: ~4-5 minutes on an H100/H200 (--time-limit 280)
    python -m bench.pool --quick                  # smoke: two sizes, one dtype
    python -m bench.pool --device cpu --quick     # no GPU: wall time only, ours through Triton's interpreter

Cases: avg_pool2d with k8 s8 and k2 s2, then ReLU, over (N, C, S, S) inputs, S = 128 .. 8192, for several
(N, C) (cases past 2**28 elements left out), fp32 and fp16. Providers: `cpu` (torch on the CPU, all cores),
`torch` (F.avg_pool2d then torch.relu on the GPU: two kernels), `compile` (torch.compile of the same, per shape,
dynamic=False; N = C = 1 and S >= 1024 only, a compile each), `ours` (kernels.pool.fused_pool2d: one kernel).
Per GPU provider: device time cold (L2 cleared by reads before each call; kernels/cold_timing.py) and hot (back
to back), and end to end from host memory:
H2D copy, the op, D2H copy, synchronised, from pinned and from pageable buffers (best of a few runs). Reported:
ours' % of the bandwidth floor (input read once + output written once, over a measured 1 GiB copy's rate),
ours against torch's two kernels, and per (N, C, dtype, window) the smallest size from which the GPU end to end
beats the CPU. Writes pool_<gpu>.md, .json and .png under --out (bench/results/<gpu>).
"""

# This module only parses arguments (no torch import: ~2 s, and a CLI builds every parser); the run is
# bench/pool/run.py.

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

SIZES = (128, 256, 512, 1024, 2048, 4096, 8192)
BATCH_CHANNELS = ((1, 1), (4, 8), (32, 16))
WINDOWS = (8, 2)  # kernel = stride
DTYPE_NAMES = ("float32", "float16")
PROVIDERS = ("cpu", "torch", "compile", "ours")
QUICK_SIZES = (128, 1024)
CPU_QUICK_SIZES = (64, 128)


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 128,1024; got {text!r}")
    return values


def _names(allowed: tuple[str, ...], what: str):
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(n.strip() for n in text.split(",") if n.strip())
        bad = [n for n in names if n not in allowed]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(bad) or text!r}; choose from {allowed}")
        return names

    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, help="output directory [bench/results/<gpu>, e.g. bench/results/h100]")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda, or cpu: smoke run [cuda]")
    p.add_argument("--sizes", type=_ints, help=f"input side lengths [{','.join(map(str, SIZES))}]")
    p.add_argument("--windows", type=_ints, help="pooling windows (kernel = stride) [8,2]")
    p.add_argument("--dtypes", type=_names(DTYPE_NAMES, "dtype"), help="float32,float16 [both; --quick: float32]")
    p.add_argument("--providers", type=_names(PROVIDERS, "provider"), help="cpu,torch,compile,ours [all]")
    p.add_argument("--quick", action="store_true", help="two sizes, one (N, C), one dtype, fewer reps")
    p.add_argument(
        "--time-limit", type=float, default=280.0, help="seconds; compile is skipped once 60%% is spent [280]"
    )
    p.add_argument("--seed", type=int, default=0)


def plan_of(args: argparse.Namespace) -> dict:
    """Flags -> what to run; --quick only changes what was not given."""
    cpu = args.device == "cpu"
    quick = args.quick
    sizes = args.sizes or (CPU_QUICK_SIZES if cpu else QUICK_SIZES if quick else SIZES)
    providers = args.providers or (("cpu", "torch", "ours") if cpu else PROVIDERS)
    return {
        "device": args.device,
        "sizes": tuple(sizes),
        "batch_channels": BATCH_CHANNELS[:1] if (quick or cpu) else BATCH_CHANNELS,
        "windows": tuple(args.windows or WINDOWS),
        "dtypes": tuple(args.dtypes or (("float32",) if (quick or cpu) else DTYPE_NAMES)),
        "providers": tuple(providers),
        "quick": quick,
        "time_limit": args.time_limit,
        "seed": args.seed,
        "out": args.out,
    }


def run(args: argparse.Namespace, command: str) -> int:
    """Exit status: 0 done, 1 ours gave a wrong result somewhere, 2 cannot run here."""
    plan = plan_of(args)
    if plan["device"] == "cpu" and "kernels" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # ours on CPU tensors: the interpreter (kernels/runtime.py)
    import torch

    if plan["device"] == "cuda" and not torch.cuda.is_available():
        print("bench pool: no CUDA device; run it on a GPU, or pass --device cpu --quick", file=sys.stderr)
        return 2
    from .run import execute

    return execute(plan, command)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pool", description=__doc__.splitlines()[0])
    add_arguments(parser)
    argv = sys.argv[1:] if argv is None else list(argv)
    return run(parser.parse_args(argv), shlex.join(["python", "-m", "bench.pool", *argv]))
