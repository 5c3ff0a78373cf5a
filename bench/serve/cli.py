"""End-to-end load benchmark: fusedserve against the empty FastAPI route and a naive eager-torch app, same host.

    fusedserve bench serve                          # the full run on a GPU host: ~8.5 minutes (--time-budget 510)
    fusedserve bench serve --quick --device cpu     # smoke: empty@1, empty_grpc@1 and unfused@1, seconds
    python -m bench.serve ...                       # the same, without the console script

Every system runs as a real server on a free loopback port: `empty` (FastAPI + orjson, no model: the
ceiling) and `eager` (FastAPI, eager torch per request) under uvicorn with 1 and N workers, and fusedserve
`fused` and `unfused` (`python -m service.cli serve --workers N`). Each is loaded closed loop at 1, 4, 64 and
256 connections with 1-row and 64-row /predict bodies, and open loop at fixed rates (latency from each
request's due time, as wrk2 measures it). fusedserve is also loaded through the Open Inference Protocol:
binary REST (/v2/models/digits-mlp/infer, Triton's binary tensors) and gRPC (ModelInfer, raw tensors), with
256-row requests, and gRPC with 1-row requests, closed loop at 64 and 256 connections (those of --connections).
Its single-row gRPC phases have a ceiling too: `empty_grpc` (grpcio's asyncio server with the same service and
options and no model, W processes on one port), loaded with the same 1-row ModelInfer requests at the same
connection counts, and nothing else, at 1 and N workers (left out when --v2 has no grpc).
/metrics is read before and after each phase for the server's
own split (queue wait, forward per batch, rows per batch) and its outcome counters. Nothing may be lost:
requests sent = answers by status + connection errors, no connection error, no unexplained 5xx, and the
server's counters agree; a SIGTERM in the middle of a fused phase must leave every request on an open
connection answered. The run exits 1 if any phase lost anything.

An image model (`--model digits-cnn`, or the path of any model directory or .onnx file whose input is C x H x W):
fused and unfused at N workers through binary REST (`--v2 binary`), `--images` images a request (32) in
`--input-dtype` (FP32; FP16; UINT8 where the model declares uint8 input), closed loop at each --connections
(16,64,256), the pair taking turns, and the empty route with the same requests (it receives each body and drops it:
the ceiling of images in on this host); the JSON /predict, open-loop and eager-app phases, which know only the
digits MLP's rows, are skipped and listed. Each phase reports images/s, MB/s of request bytes, p50/p99, how busy
the GPU was (nvidia-smi sampled every 100 ms over the window; n/a without one) and the client processes' CPU
(cores used of those given; a phase whose clients were above 85% of theirs is flagged client-bound).

perf_analyzer (NVIDIA's, unmodified) runs against fused@N when its binary runs here (--perf-analyzer PATH, else
beside this Python, in its wheel or on the PATH; `none` skips it): HTTP and gRPC as --v2 has them, batch 1 and
--v2-rows/--images, concurrency --connections; its rows, with the server's statistics against its own counts, go
into the same report (bench/serve/perf_analyzer.py).

API keys: the fusedserve servers get this environment, FUSEDSERVE_* included, so FUSEDSERVE_API_KEY (or
FUSEDSERVE_API_KEYS_FILE) turns their keys on; BENCH_API_KEY=KEY then makes every request carry
`Authorization: Bearer KEY` (gRPC: metadata `authorization`), on every system. Without it, such a server answers
401 (gRPC UNAUTHENTICATED, recorded as 401), and every phase of it fails as an unexpected status.
    FUSEDSERVE_API_KEY=$K BENCH_API_KEY=$K fusedserve bench serve     # K=$(openssl rand -hex 16): keys on

Writes serve_<gpu>.md (tables, targets), .json (every number) and .png under --out (bench/results/<gpu>);
prints a summary last.
"""

# This module only parses arguments (the `fusedserve` parser may import it for every command): no numpy,
# no torch. It resolves them into bench/serve/plan.py's Plan; the run is bench/serve/run.py.

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from . import model as served
from .plan import SYSTEMS, Plan, System

# The gRPC ceiling before fusedserve, so that a run short of time keeps it with fused@N's gRPC phases; dropped from
# the defaults when --v2 has no grpc.
DEFAULT_SYSTEMS = "empty@1,empty@N,empty_grpc@1,empty_grpc@N,fused@1,fused@N,unfused@1,unfused@N,eager@N,eager@1"
QUICK_SYSTEMS = "empty@1,empty_grpc@1,unfused@1"
DEFAULT_OPEN = "empty@N,fused@N,unfused@N"
# The eager app knows only the digits MLP; the empty route takes any body; pil prepares files for fused (apps/pil.py).
IMAGE_SYSTEMS = "empty@N,fused@N,unfused@N,pil@N"
QUICK_IMAGE_SYSTEMS = "fused@1,unfused@1"
IMAGE_CONNECTIONS = (16, 64, 256)
IMAGES = 32  # a request's images: issue 34's case (32-image binary requests at 64 connections)
DATATYPES = ("FP32", "FP16", "UINT8")


def host_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def default_workers(cores: int | None = None) -> int:
    """What fusedserve picks for FUSEDSERVE_WORKERS: one front end per core the host can spare, at most 8."""
    cores = host_cores() if cores is None else cores
    return max(1, min(8, cores - 2))


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        vals = ()
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,4,64; got {text!r}")
    return vals


def _rates(text: str) -> tuple[float, ...] | None:
    if text.strip() == "auto":
        return None
    try:
        vals = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        vals = ()
    if any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"rates are requests/s like 10000,20000 (or auto, or none); got {text!r}")
    return vals


def _protocols(text: str) -> tuple[str, ...]:
    if text.strip() == "none":
        return ()
    names = tuple(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    if not names or any(n not in ("binary", "grpc", "jpeg", "png") for n in names):
        raise argparse.ArgumentTypeError(
            f"expected binary, grpc, jpeg, png (comma-separated: binary,grpc) or none; got {text!r}"
        )
    return tuple(f"v2_{n}" for n in names)


def parse_systems(text: str, workers: int) -> tuple[System, ...]:
    """'empty@1,fused@N,unfused' -> Systems (a bare name: at 1 and N workers; N: --workers); duplicates dropped."""
    out: list[System] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        name, _, count = item.partition("@")
        if name not in SYSTEMS:
            raise argparse.ArgumentTypeError(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)} (as NAME@W)")
        if not count:
            counts = [1, workers]
        elif count.upper() == "N":
            counts = [workers]
        elif count.isdigit() and int(count) >= 1:
            counts = [int(count)]
        else:
            raise argparse.ArgumentTypeError(f"bad worker count in {item!r}: a number or N")
        out += [System(name, c) for c in counts]
    return tuple(dict.fromkeys(out))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, help="output directory [bench/results/<gpu>, e.g. bench/results/h100]")
    p.add_argument(
        "--model",
        help="what fusedserve serves: a name under model_weights/ (digits-mlp, digits-cnn, digits-resnet) or the "
        "path of a model directory or .onnx file; an image model (input C x H x W) runs the image phases [digits-mlp]",
    )
    p.add_argument(
        "--images",
        type=int,
        help=f"images per request of an image model's v2 phases (the same as --v2-rows for it) [{IMAGES}]",
    )
    p.add_argument(
        "--input-dtype",
        type=str.upper,
        choices=DATATYPES,
        default="FP32",
        help="datatype of the v2 tensors sent: FP32, FP16, or UINT8 (only a model whose config.json declares "
        "uint8 input) [FP32]",
    )
    p.add_argument(
        "--perf-analyzer",
        metavar="PATH",
        help="perf_analyzer's binary, or none to skip its phases [beside this Python, in its wheel, else on the PATH]",
    )
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda (default) or cpu (smoke runs)")
    p.add_argument(
        "--dtype",
        choices=("float16", "bfloat16", "float32", "float8"),
        help="fusedserve and eager dtype [float16; cpu: float32]; float8 (Hopper, a calibrated model): fusedserve's "
        "systems and the empty route only",
    )
    p.add_argument(
        "--systems",
        help=f"NAME@W list, NAME in {','.join(SYSTEMS)}, W a count or N; a bare NAME runs at 1 and N "
        f"[{DEFAULT_SYSTEMS}; --quick: {QUICK_SYSTEMS}; an image model: {IMAGE_SYSTEMS}, --quick: "
        f"{QUICK_IMAGE_SYSTEMS}]",
    )
    p.add_argument("--workers", type=int, help="N: worker processes of the N-worker systems [min(8, cores-2)]")
    p.add_argument(
        "--connections",
        type=_ints,
        help="closed-loop connection counts [1,4,64,256; an image model: 16,64,256; --quick: 1,4]",
    )
    p.add_argument("--rows", type=_ints, help="rows per JSON /predict request [1,64; --quick: 1; an image model: none]")
    p.add_argument("--duration", type=float, help="seconds measured per phase [2.5; --quick: 0.5]")
    p.add_argument("--warmup", type=float, help="seconds of load before each phase, not measured [0.75; --quick: 0.2]")
    p.add_argument(
        "--rates",
        type=_rates,
        default="auto",
        help="open-loop rates, 1-row requests/s, comma-separated; auto: 25,50,75%% of the empty route's closed-loop "
        "peak at N workers (rounded); a rate above 1.1x a system's own peak is skipped [auto; --quick: 40]",
    )
    p.add_argument("--no-open", dest="open_loop", action="store_false", help="skip the open-loop phases")
    p.add_argument(
        "--open-systems", help=f"HTTP systems run open loop [{DEFAULT_OPEN}; --quick: the quick HTTP systems]"
    )
    p.add_argument("--open-connections", type=int, help="connections of the open-loop phases [256; --quick: 8]")
    p.add_argument(
        "--clients",
        type=int,
        help="client processes [cores - N - 2, between 2 and 4: the raw client takes ~22 µs of CPU a request]",
    )
    p.add_argument(
        "--client",
        choices=("raw", "aiohttp"),
        default="raw",
        help="raw: asyncio protocol, pre-encoded HTTP/1.1 (default: light on CPU); aiohttp: ClientSession",
    )
    p.add_argument("--no-sigterm", dest="sigterm", action="store_false", help="skip the SIGTERM phase")
    p.add_argument(
        "--time-budget",
        type=float,
        default=510.0,
        help="seconds for the whole run; phases that do not fit are skipped and listed [510; 0 = none]",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=10.0,
        help="seconds to wait after a window for the answers still outstanding; later ones count as lost [10]",
    )
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds a server may take to be ready [300]")
    p.add_argument(
        "--tuning-cache",
        type=Path,
        help="fusedserve's tuning cache for every start of the run [a file in the run's temp dir]",
    )
    p.add_argument(
        "--v2",
        type=_protocols,
        help="Open Inference Protocol phases of fusedserve: binary REST and/or gRPC, or none; without grpc the "
        "default systems leave out empty_grpc; jpeg, png: binary REST of encoded files (a BYTES tensor, "
        "bench/serve/images.py), for a model that declares its image preprocessing [binary,grpc; an image model: "
        "binary]",
    )
    p.add_argument(
        "--v2-rows", type=int, help=f"rows per request of the v2 phases (gRPC: and 1) [256; an image model: {IMAGES}]"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="times fused and unfused (at the same worker count) run each phase they share, taking turns; the "
        "report compares them on the median of the rounds [1]",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: few systems and phases, short windows")
    p.add_argument("--seed", type=int, default=0, help="seed of the request bodies [0]")


def resolve_model(args: argparse.Namespace) -> tuple[served.ModelInfo, int, tuple[str, ...]]:
    """(the model, rows per v2 request, the v2 protocols), or SystemExit saying what does not fit."""
    try:
        model = served.resolve(args.model)
        model.check_datatype(args.input_dtype)
    except served.ModelError as e:
        raise SystemExit(f"fusedserve bench serve: {e}") from None
    if not model.image and args.images:
        raise SystemExit(f"fusedserve bench serve: --images: {model.name} takes rows of {model.input_shape}, not "
                         "images; --v2-rows sets its rows per request")  # fmt: skip
    if args.images and args.v2_rows and args.images != args.v2_rows:
        raise SystemExit("fusedserve bench serve: --images and --v2-rows differ; give one")
    v2_rows = args.images or args.v2_rows or (IMAGES if model.image else 256)
    v2 = args.v2 if args.v2 is not None else (_protocols("binary") if model.image else _protocols("binary,grpc"))
    if model.image and not v2:
        raise SystemExit("fusedserve bench serve: an image model runs only the v2 phases: give --v2 binary or grpc")
    if any(p in ("v2_jpeg", "v2_png") for p in v2) and not model.takes_files:
        raise SystemExit(f"fusedserve bench serve: --v2 jpeg/png: {model.name} declares no image preprocessing "
                         "(config.json's input.image; fusedserve import --resize N)")  # fmt: skip
    return model, v2_rows, v2


def _check_float8(systems, model) -> None:
    """float8 is fusedserve's (the comparison apps have no float8 forward), and a model serves it calibrated only."""
    others = sorted({s.name for s in systems if not (s.fusedserve or s.name.startswith("empty"))})
    if others:
        raise SystemExit(f"fusedserve bench serve: --dtype float8 runs fusedserve's systems only; {', '.join(others)} "
                         "cannot (give --systems without them)")  # fmt: skip
    from service.model.float8 import calibration_path

    path = calibration_path(model)  # beside a model's .onnx file, or in its directory: where fusedserve reads it
    if not path.is_file():
        raise SystemExit(f"fusedserve bench serve: --dtype float8: {model.path} has no {path.name}; run "
                         f"`fusedserve calibrate {model.path} --samples DIR` first")  # fmt: skip


def resolve(args: argparse.Namespace) -> Plan:
    cores = host_cores()
    quick = args.quick
    workers = args.workers or default_workers(cores)
    model, v2_rows, v2 = resolve_model(args)
    if model.image:
        default_systems, default_open = (QUICK_IMAGE_SYSTEMS if quick else IMAGE_SYSTEMS), ""
    else:
        default_systems = QUICK_SYSTEMS if quick else DEFAULT_SYSTEMS
        default_open = QUICK_SYSTEMS if quick else DEFAULT_OPEN
    try:
        systems = parse_systems(args.systems or default_systems, workers)
        open_text = args.open_systems or default_open
        open_systems = parse_systems(open_text, workers) if args.open_loop and open_text else ()
    except argparse.ArgumentTypeError as e:
        raise SystemExit(f"fusedserve bench serve: {e}") from None
    if "v2_grpc" not in v2:
        if args.systems and any(s.grpc_only for s in systems):
            raise SystemExit("fusedserve bench serve: empty_grpc runs only gRPC phases: give --v2 with grpc")
        systems = tuple(s for s in systems if not s.grpc_only)
    open_systems = tuple(s for s in open_systems if s in systems and not s.grpc_only and not model.image)
    if args.dtype == "float8":
        _check_float8(systems, model)
    rates = args.rates
    if quick and rates is None:
        rates = (40.0,)
    clients = args.clients or max(2, min(4, cores - workers - 2))
    return Plan(
        device=args.device,
        dtype=args.dtype or ("float32" if args.device == "cpu" else "float16"),
        systems=systems,
        workers=workers,
        connections=args.connections or ((1, 4) if quick else IMAGE_CONNECTIONS if model.image else (1, 4, 64, 256)),
        rows=() if model.image else args.rows or ((1,) if quick else (1, 64)),
        duration_s=args.duration if args.duration is not None else (0.5 if quick else 2.5),
        warmup_s=args.warmup if args.warmup is not None else (0.2 if quick else 0.75),
        rates=rates,
        open_systems=open_systems,
        open_connections=args.open_connections or (8 if quick else 256),
        clients=clients,
        client=args.client,
        sigterm=args.sigterm,
        time_budget_s=args.time_budget,
        drain_timeout_s=args.drain_timeout,
        ready_timeout_s=args.ready_timeout,
        tuning_cache=args.tuning_cache,
        v2=v2,
        v2_rows=v2_rows,
        rounds=max(1, args.rounds),
        quick=quick,
        seed=args.seed,
        out=args.out,
        model=model,
        input_dtype=args.input_dtype,
        perf_analyzer="" if (args.perf_analyzer or "").lower() == "none" else args.perf_analyzer,
    )


def run(args: argparse.Namespace, command: str) -> int:
    """Exit status: 0 every phase accounted for, 1 something was lost (or a server failed), 2 cannot run here."""
    plan = resolve(args)
    from .run import execute

    return execute(plan, command)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.serve",
        description=__doc__.splitlines()[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    argv = sys.argv[1:] if argv is None else list(argv)
    return run(parser.parse_args(argv), shlex.join(["python", "-m", "bench.serve", *argv]))
