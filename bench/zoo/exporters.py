"""The three ways a zoo model reaches the service, each as a user would take it:

    torchscript    torch.onnx.export(dynamo=False), opset 17, a dynamic batch (dynamic_axes), constant folding on
                   (torch's default: in eval mode it folds most BatchNorms into the convs before them)
    dynamo         torch.onnx.export(dynamo=True), torch's default exporter, its default opset, a dynamic batch
                   (dynamic_shapes); the file is then read by the ONNX importer, as the TorchScript one is
    torch.export   service.model.export.export_module: torch.export straight to the model format, no ONNX file

`export` writes the file or model directory; `load` reads it the way the service does (load_onnx imports an ONNX
file on the fly, as `fusedserve serve --model x.onnx` and check-model do).
"""

from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path

import torch
from torch import nn

EXPORTERS = ("torchscript", "dynamo", "torch.export")
ONNX_EXPORTERS = ("torchscript", "dynamo")
OPSET = 17  # the TorchScript exporter's; the dynamo exporter keeps its own default
EXAMPLE_BATCH = 2  # a batch of 1 would let torch.export specialise the batch dimension


@contextlib.contextmanager
def onnx_registry_once():
    """Within it, the dynamo exporter builds its registry of ONNX translations once per opset and reuses it.

    torch.onnx.export(dynamo=True) rebuilds that registry from onnxscript's torchlib on every call (parsing the
    source of ~500 functions): 3-5 s of a small model's 5-9 s export on a 2-core machine, the same registry each time
    (no custom_translation_table is passed here, so nothing is added to it). Where this torch has no such method,
    nothing changes."""
    try:
        from torch.onnx._internal.exporter import _registration
    except ImportError:
        yield
        return
    cls = getattr(_registration, "ONNXRegistry", None)
    original = getattr(cls, "from_torchlib", None)
    if original is None:
        yield
        return
    built: dict = {}

    def once(*args, **kwargs):
        key = (args, tuple(sorted(kwargs.items())))
        if key not in built:
            built[key] = original(*args, **kwargs)
        return built[key]

    cls.from_torchlib = staticmethod(once)  # called on the class or on an instance, it gets the same arguments
    try:
        yield
    finally:
        cls.from_torchlib = original


def export(
    exporter: str, module: nn.Module, image: tuple[int, ...], out_dir: Path, name: str, dtype=torch.float32
) -> Path:
    """Export `module` (eval mode) for inputs of shape (batch, *image) in `dtype` on the module's device; returns the
    .onnx file (ONNX exporters) or the model directory (torch.export). The exporters' progress lines and warnings
    are swallowed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    x = torch.randn(EXAMPLE_BATCH, *image, dtype=dtype, device=next(module.parameters()).device)
    quiet = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(quiet), torch.no_grad():
        warnings.simplefilter("ignore")
        if exporter == "torchscript":
            path = out_dir / f"{name}.torchscript.onnx"
            torch.onnx.export(
                module, (x,), str(path), dynamo=False, opset_version=OPSET, input_names=["input"],
                output_names=["logits"], dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
            )  # fmt: skip
            return path
        if exporter == "dynamo":
            path = out_dir / f"{name}.dynamo.onnx"
            batch = torch.export.Dim("batch")
            program = torch.onnx.export(
                module, (x,), dynamo=True, dynamic_shapes=({0: batch},), input_names=["input"],
                output_names=["logits"], verbose=False,
            )  # fmt: skip
            program.save(str(path))
            return path
        if exporter == "torch.export":
            from service.model.export import export_module

            return export_module(module, x, out_dir / f"{name}.torch-export", name=name)
    raise ValueError(f"unknown exporter {exporter!r}; expected one of {', '.join(EXPORTERS)}")


def load(path: Path):
    """The service's Model for an exported file or directory (service.model.loader: ModelFormatError if refused)."""
    from service.model.loader import load_model, load_onnx

    path = Path(path)
    return load_onnx(path) if path.suffix == ".onnx" else load_model(path)
