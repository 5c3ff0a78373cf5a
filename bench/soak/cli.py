"""Soak: minutes of steady mixed traffic, good and hostile, against the real service; nothing lost, nothing grows.

    fusedserve bench soak                                    # on the GPU host: 5 minutes of load, ~5.5 in all
    fusedserve bench soak --quick --device cpu --mode unfused   # smoke: 8 s of load on the CPU

Starts `python -m service.cli serve` on a free loopback port (header and body timeouts of 2 s, so slow clients
are cut during the run) and client processes, each running at once: good clients (keep-alive, 1-8 rows,
expect 200), bad ones (not JSON: 400; a short row: 422), oversized ones (a chunked body past the limit: 413
and the connection closed), slow ones (half a header, then nothing: closed with 408 after the header timeout)
and disconnecting ones (send a request, or half its body, and leave). Every few seconds it samples the RSS of
each front end and engine and, on CUDA, the GPU memory of the engines (nvidia-smi). At the end it reads the
server's request counters.

Fails (exit 1) when anything is lost (a request that should be answered got no answer, or an unexpected
status, or a slow client was held past its timeout) or grows: a process's RSS by more than --rss-bound-mb
or the GPU memory by more than --gpu-bound-mb, from the first samples after the warm-up (the first 20% of the
run) to the last ones. Writes soak_<gpu>.md and .json under --out (bench/results/<gpu>).
"""

# This module only parses arguments (the `fusedserve` parser imports it for every command); the run is
# bench/soak/run.py.

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, help="output directory [bench/results/<gpu>, e.g. bench/results/h100]")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="the server's device [auto]")
    p.add_argument("--mode", choices=("fused", "unfused"), default="fused", help="the server's mode [fused]")
    p.add_argument("--minutes", type=float, default=5.0, help="minutes of load [5; --quick: 8 s]")
    p.add_argument("--workers", type=int, help="front ends [the service's default]")
    p.add_argument("--clients", type=int, default=4, help="client processes [4; --quick: 1]")
    p.add_argument("--rss-bound-mb", type=float, default=48.0, help="most a process's RSS may grow, MB [48]")
    p.add_argument("--gpu-bound-mb", type=float, default=64.0, help="most the engines' GPU memory may grow, MB [64]")
    p.add_argument("--quick", action="store_true", help="8 s of load, one client process, 1 s samples")


def plan_of(args: argparse.Namespace) -> dict:
    quick = args.quick
    duration = 8.0 if quick and args.minutes == 5.0 else args.minutes * 60
    return {
        "out": args.out,
        "device": args.device,
        "mode": args.mode,
        "duration_s": duration,
        "warmup_s": max(2.0, duration * 0.2),
        "sample_s": 1.0 if quick else 5.0,
        "workers": args.workers or (1 if quick else None),
        "clients": 1 if quick and args.clients == 4 else args.clients,
        "rss_bound_mb": args.rss_bound_mb,
        "gpu_bound_mb": args.gpu_bound_mb,
        "quick": quick,
    }


def run(args: argparse.Namespace, command: str) -> int:
    """Exit status: 0 nothing lost or grown, 1 something was, 2 the server did not start."""
    from .run import execute

    return execute(plan_of(args), command)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    return run(args, "python -m bench.soak " + " ".join(argv if argv is not None else sys.argv[1:]))
