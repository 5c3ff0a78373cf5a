"""`fusedserve` command line: `serve` (the HTTP service), `check-model` (validate a model dir) and `ab-report`
(fused against unfused from a service's metrics).
The console script is fusedserve/cli.py, which adds `bench` through `extend`: the service imports
no benchmark.

`serve`'s options are generated from the Settings fields, so --help always lists every setting with
its FUSEDSERVE_ variable and default; an option given on the command line beats the environment.
"""

from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path

from .config import ENV_PREFIX, Settings, SettingsError, load_settings


def _add_setting_options(parser: argparse.ArgumentParser) -> None:
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        env = ENV_PREFIX + name.upper()
        default = field.default
        help_text = f"{field.description} [env {env}; default {default}]"
        choices = typing.get_args(field.annotation) if typing.get_origin(field.annotation) is typing.Literal else None
        if field.annotation is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            metavar = None if choices else name.upper()
            parser.add_argument(flag, dest=name, default=None, choices=choices, metavar=metavar, help=help_text)


def _serve(args: argparse.Namespace) -> int:
    overrides = {name: getattr(args, name, None) for name in Settings.model_fields}
    try:
        settings = load_settings(**overrides)
    except SettingsError as e:
        print(f"fusedserve: {e}", file=sys.stderr)
        return 2
    from .processes import configure_logging

    configure_logging(settings.log_level)

    from .model.spec import ModelFormatError
    from .supervisor import StartError, serve

    try:
        return serve(settings, overrides)
    except (ModelFormatError, StartError, RuntimeError) as e:
        print(f"fusedserve: cannot serve: {e}", file=sys.stderr)
        return 2


def _check_model(args: argparse.Namespace) -> int:
    from .model.loader import load_model
    from .model.planner import fused_steps, kernel_names
    from .model.spec import ModelFormatError

    try:
        model = load_model(Path(args.path))
    except ModelFormatError as e:
        print(f"invalid model: {e}", file=sys.stderr)
        return 1
    kernels = kernel_names(fused_steps(model.ops, model.tensors))  # what the executors run
    print(f"{model.name}: input {model.input_shape} -> {model.output_features} outputs; {len(model.ops)} ops")
    print(f"fused plan ({len(kernels)} kernel{'s' if len(kernels) != 1 else ''}): {', '.join(kernels)}")
    return 0


def main(argv: list[str] | None = None, extend=None) -> int:
    parser = argparse.ArgumentParser(prog="fusedserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="serve a model over HTTP",
        description="Serve a model: POST /predict, GET /health/live, /health/ready, /model, /metrics. "
        "Every option can also be set by its FUSEDSERVE_ environment variable or in a .env file.",
    )
    _add_setting_options(serve)
    serve.set_defaults(func=_serve)
    check = sub.add_parser("check-model", help="validate a model directory and print its fused plan")
    check.add_argument("path", help="a model directory (config.json + model.safetensors)")
    check.set_defaults(func=_check_model)
    from . import ab_report

    report = sub.add_parser(
        "ab-report",
        help="fused against unfused per kernel step, forward and request, from /metrics or Prometheus (markdown)",
        description=ab_report.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ab_report.add_arguments(report)
    report.set_defaults(func=ab_report.run)
    if extend is not None:  # more subcommands: extend(subparsers)
        extend(sub)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv  # the exact command, for reports that must say how they were made
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
