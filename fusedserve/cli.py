"""`fusedserve` command line: `serve` and `check-model` (service/cli.py), and `bench NAME` (bench/).

The service never imports the benchmarks: this entry point dispatches to both. A benchmark module
exposes `add_arguments(parser)` and `run(args, command) -> int`, its docstring is its --help, and
registering it is one line of BENCHMARKS.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import shlex
import sys

from service import cli as service_cli

# `fusedserve bench NAME` -> its argument module, bench/NAME/cli.py. Each imports no torch at module level, so
# building the parser stays cheap for every command.
BENCHMARKS = {
    "kernels": "bench.kernels.cli",
    "serve": "bench.serve.cli",
    "pool": "bench.pool.cli",
    "soak": "bench.soak.cli",
    "ab": "bench.serve.ab",
    "zoo": "bench.zoo.cli",
}


def _bench_missing(why: str, args: argparse.Namespace) -> int:
    print(f"fusedserve: the bench package cannot be imported ({why}); reinstall: pip install -e .", file=sys.stderr)
    return 2


def _run_bench(module, args: argparse.Namespace) -> int:
    return module.run(args, shlex.join(["fusedserve", *args.argv]))


def add_bench(sub) -> None:
    bench = sub.add_parser(
        "bench",
        help="benchmarks (not tests)",
        description="Benchmarks (results: bench/results/<gpu>/; index: bench/README.md).",
    )
    try:
        modules = {name: importlib.import_module(path) for name, path in BENCHMARKS.items()}
    except ImportError as e:  # an install without `bench` (the Docker image): every other command still works
        bench.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        bench.set_defaults(func=functools.partial(_bench_missing, str(e)))
        return
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for name, module in modules.items():
        doc = module.__doc__ or name
        help_line = doc.strip().splitlines()[0]
        parser = bench_sub.add_parser(
            name, help=help_line, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        module.add_arguments(parser)
        parser.set_defaults(func=functools.partial(_run_bench, module))


def main(argv: list[str] | None = None) -> int:
    return service_cli.main(argv, extend=add_bench)


if __name__ == "__main__":
    sys.exit(main())
