"""`fusedserve` command line: `serve` (the HTTP service), `check-model` (validate a model, print its graph and
fused plan), `import` (an ONNX file into a model directory), `ab-report` (fused against unfused from a service's
metrics) and `docs` (docs/configuration.md and docs/metrics.md from the code, service/docs_gen.py).

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

from . import docs_gen
from .config import ENV_PREFIX, Settings, SettingsError, load_settings


def _add_setting_options(parser: argparse.ArgumentParser) -> None:
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        env = ENV_PREFIX + name.upper()
        default = field.default
        help_text = f"{field.description} [env {env}; default {default}]".replace("%", "%%")  # argparse formats it
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
    from .model.locate import locate_model
    from .model.spec import ModelFormatError

    try:  # found as `serve --model` finds it (FUSEDSERVE_MODEL_DIR included)
        model = load_model(locate_model(args.path, _model_dir()))
    except ModelFormatError as e:
        print(f"invalid model: {e}", file=sys.stderr)
        return 1
    print(describe_model(model))
    return 0


def _model_dir() -> str | None:
    """FUSEDSERVE_MODEL_DIR, from the environment or the configuration file, as `serve` reads it (None: the
    default); read alone, so that check-model and import work beside a configuration that `serve` would refuse."""
    import os

    from dotenv import dotenv_values

    from .config import config_file_of

    name = ENV_PREFIX + "MODEL_DIR"
    env_file = config_file_of()
    from_file = dotenv_values(env_file).get(name) if env_file.is_file() else None
    return os.environ.get(name) or from_file or None


def _onnx_source(found: Path) -> Path:
    """The .onnx file to import: `found` itself, or the one .onnx file of a model directory (digits-resnet)."""
    from .model.spec import ModelFormatError

    if not found.is_dir():
        return found
    onnx_files = sorted(found.glob("*.onnx"))
    if len(onnx_files) != 1:
        raise ModelFormatError(f"{found}: holds {len(onnx_files)} .onnx files; import needs one: name it")
    return onnx_files[0]


def _calibrate(args: argparse.Namespace) -> int:
    import torch

    from .model.calibrate import calibrate, main_progress
    from .model.loader import load_model
    from .model.locate import locate_model
    from .model.spec import ModelFormatError

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)  # fmt: skip
    try:
        model = load_model(locate_model(args.model, _model_dir()))
        path, cal = calibrate(model, Path(args.samples), device, batch_size=args.batch_size,
                              percentile=args.percentile, out=args.out, progress=main_progress())  # fmt: skip
    except (ModelFormatError, OSError) as e:
        print(f"cannot calibrate: {e}", file=sys.stderr)
        return 1
    print(f"wrote {path}: {len(cal.ranges)} tensors' {cal.statistic} over {cal.samples} rows "
          f"(samples sha256 {cal.samples_sha256[:12]}); serve it with --dtype float8")  # fmt: skip
    return 0


def describe_model(model) -> str:
    """check-model's report: a summary line, the fused plan's kernels on one line, then the graph (format 2) and
    each step: the ops it runs, what it reads, and what the fused mode runs as torch ops instead of a kernel."""
    from .model.executors import kernel_support, torch_parts
    from .model.planner import Conv2dStep, FlattenStep, fused_steps, kernel_names, step_ops

    steps = fused_steps(model.ops, model.tensors, normalize=model.normalize)  # what the executors run
    kernels = kernel_names(steps)
    lines = [
        f"{model.name}: input {model.input_shape}{' uint8' if model.spec.input.dtype == 'uint8' else ''} -> "
        f"{model.output_features} outputs; {len(model.ops)} ops",
        f"fused plan ({len(kernels)} kernel{'s' if len(kernels) != 1 else ''}): {', '.join(kernels)}",
    ]
    if model.normalize is not None:
        norm = model.normalize
        lines.append(f"input normalized: (x - mean) / std per channel, mean {list(norm.mean)}, std {list(norm.std)}")
    if model.spec.format != "fusedserve-model/1":
        if model.spec.source:
            lines.append(f"source: {model.spec.source}")
        lines.append(f"graph ({model.spec.format}): input {model.input_name!r} {model.input_shape}")
        for op in model.ops:
            params = [k for k in ("weight", "bias", "mean", "var") if getattr(op, k, None)]
            extra = f" [{', '.join(params)}]" if params else ""
            reads = ", ".join(op.inputs)
            lines.append(f"  {op.op:10s} {op.name}: {reads} -> {op.output} {model.shapes[op.output]}{extra}")
    lines.append("steps (both modes run these, under these names; the `kernel` label of the metrics):")
    support = kernel_support()
    for s in steps:
        ops = " + ".join(step_ops(s))
        reads = ", ".join(s.inputs) + (f"; residual {s.residual}" if getattr(s, "residual", None) else "")
        if isinstance(s, FlattenStep):
            how = "a view, no kernel"
        else:
            slow = torch_parts(s, support)
            how = f"fused mode: {', '.join(slow)} as torch ops" if slow else "fused mode: one kernel"
        normalizes = ", normalizing the input as it loads it" if isinstance(s, Conv2dStep) and s.normalize else ""
        lines.append(f"  {s.name}: {ops} ({how}{normalizes}) <- {reads}")
    if model.spec.format != "fusedserve-model/1":
        lacking = [k for k, ok in (("conv", support.conv_residual), ("linear", support.linear_residual)) if not ok]
        missing = sorted({"relu6", "hardswish"} - support.activations)
        if lacking or missing:
            lines.append(
                "these kernels lack: " + "; ".join(
                    ([f"residual= in the {' and '.join(lacking)} kernel(s)"] if lacking else [])
                    + ([f"activations {', '.join(missing)}"] if missing else [])
                )
            )  # fmt: skip
    return "\n".join(lines)


def _numbers(text: str) -> list[float]:
    """`--mean 123.675,116.28,103.53`: comma-separated numbers."""
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers (123.675,116.28,103.53); got {text!r}"
        ) from None


def _image_fields(args: argparse.Namespace) -> dict | None:
    """`import --image` (or any --resize, --interpolation, --channels): the model also takes encoded images."""
    fields = {"resize": args.resize, "interpolation": args.interpolation, "channels": args.channels}
    return fields if args.image or any(v is not None for v in fields.values()) else None


def _import(args: argparse.Namespace) -> int:
    from .model.locate import locate_model
    from .model.onnx_import import read_labels
    from .model.spec import ModelFormatError
    from .model.writer import import_to_dir

    try:
        labels = read_labels(args.labels) if args.labels else None
        args.model = _onnx_source(locate_model(args.model, _model_dir()))  # found as `serve --model` finds it
        out = import_to_dir(Path(args.model), Path(args.out_dir), name=args.name, labels=labels,
                            input_dtype=args.input_dtype, mean=args.mean, std=args.std,
                            image=_image_fields(args))  # fmt: skip
        from .model.loader import load_model

        model = load_model(out)
    except (ModelFormatError, OSError) as e:
        print(f"cannot import: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}/config.json and model.safetensors")
    print(describe_model(model))
    return 0


def main(argv: list[str] | None = None, extend=None) -> int:
    # The module docstring's first paragraph, whole: its first line alone stopped mid-sentence.
    parser = argparse.ArgumentParser(prog="fusedserve", description=" ".join(__doc__.split("\n\n")[0].split()))
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="serve a model over HTTP",
        description="Serve a model: POST /predict, GET /health/live, /health/ready, /model, /metrics. "
        "Every option can also be set by its FUSEDSERVE_ environment variable or in a .env file.",
    )
    _add_setting_options(serve)
    serve.set_defaults(func=_serve)
    check = sub.add_parser("check-model", help="validate a model and print its graph and fused plan")
    check.add_argument(
        "path",
        help="a model as `serve --model` takes it: a name (looked up in the working directory, then "
        "FUSEDSERVE_MODEL_DIR), a model directory (config.json + model.safetensors) or an .onnx file",
    )
    check.set_defaults(func=_check_model)
    docs = sub.add_parser("docs", help="write docs/configuration.md and docs/metrics.md from the code")
    docs_gen.add_arguments(docs)
    docs.set_defaults(func=docs_gen.run)
    imp = sub.add_parser(
        "import",
        help="import an ONNX file into a model directory",
        description="Import an ONNX file (opset 13+) into a model directory (config.json + model.safetensors, "
        "format fusedserve-model/2); what cannot be served is refused by node name and op type. "
        "`serve --model x.onnx` imports on the fly instead.",
    )
    imp.add_argument(
        "model", help="the .onnx file (or a model name or directory holding one, found as `serve --model` finds it)"
    )
    imp.add_argument("out_dir", help="the model directory to write")
    imp.add_argument("--name", help="the model's name (default: the directory's name)")
    imp.add_argument("--labels", help="a file of output labels: a JSON list or one per line")
    imp.add_argument("--input-dtype", choices=["float32", "uint8"], default="float32",
                     help="what clients send: float32, or uint8 pixels 0-255 (a quarter of the bytes)")  # fmt: skip
    for stat, other in (("mean", "std"), ("std", "mean")):
        imp.add_argument(f"--{stat}", type=_numbers, metavar="A,B,C",
                         help=f"the input's {stat}, one per channel (with --{other}): the model computes on "
                         "(x - mean) / std, normalized as its first conv loads x")  # fmt: skip
    imp.add_argument(
        "--image",
        action="store_true",
        help="clients may also send encoded images (JPEG, PNG, WebP), decoded, resized and center-cropped "
        "to the input's size by the service (implied by --resize, --interpolation, --channels)",
    )
    imp.add_argument("--resize", type=int, metavar="N", help="resize an image's shorter side to N before the crop")
    imp.add_argument(
        "--interpolation", choices=["bilinear", "bicubic"], help="the resize's filter (antialiased; default bilinear)"
    )
    imp.add_argument("--channels", choices=["RGB", "BGR", "L"], help="the channel order the model takes (default: "
                     "RGB for 3 channels, L (gray) for 1)")  # fmt: skip
    imp.set_defaults(func=_import)
    cal = sub.add_parser(
        "calibrate",
        help="measure a model's activation ranges on samples, for serving it in float8",
        description="Run the model (float32, unfused) over sample inputs and write each tensor's largest |value| "
        "(or a percentile) to calibration.json in the model's directory: what `serve --dtype float8` quantizes "
        "activations with. Samples: .npy or .safetensors rows, or, for a model that takes images, image files.",
    )
    cal.add_argument("model", help="a model as `serve --model` takes it")
    cal.add_argument("--samples", required=True, metavar="FILE|DIR",
                     help="a .npy/.safetensors file or an image, or a directory of them (name order)")  # fmt: skip
    cal.add_argument("--batch-size", type=int, default=64, help="rows per forward (default 64)")
    cal.add_argument("--percentile", type=float, default=None,
                     help="record this percentile of |x| (e.g. 99.99) instead of the maximum")  # fmt: skip
    cal.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="where to run (default auto)")
    cal.add_argument("--out", type=Path, default=None, help="the file to write (default: the model's calibration.json)")
    cal.set_defaults(func=_calibrate)
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
