"""The zoo's CPU check: per (family, exporter), is the model imported, how is it planned, and does each mode agree
with onnxruntime on the same ONNX file?

    record = check(family, exporter, size, workdir, modes=("unfused", "fused"), rows=8, fused_rows=2)

A record (one JSON object of the results file) holds: whether the export and the import worked (the refusal
message when the importer refused, its node and op type parsed out), the import + load seconds, the plan's steps
(how many run as fused kernels, how many as torch ops and which: executors.torch_parts), and per mode the largest
error relative to the reference's largest magnitude and the top-1 agreement over a batch of random N(0, 1) images.
The reference is onnxruntime (CPU provider, fp32) on the very file imported; the torch.export route has no ONNX
file, so its reference is the torch module itself in fp32. Everything here runs in fp32 on the CPU; the fused mode
through Triton's interpreter (TRITON_INTERPRET=1 set before the kernels are first imported: cli.run does it).
"""

from __future__ import annotations

import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from . import exporters, families

MODES = ("unfused", "fused")
# Tolerances of the CI check (tests/test_zoo.py) and of the run's verdict: fp32 against onnxruntime's fp32, the
# error relative to the largest logit; every image's top-1 the same.
MAX_REL_ERR = 1e-4
TOP1 = 1.0
# "node 'name' (OpType" in the ONNX importer's refusals, "node 'name' (aten.op.default)" in torch_import's (a node
# without a name is "#index (output 'x')"); "ops[3] (concat 'name')" where the format's checks refuse an imported op.
_NODE = re.compile(r"node (?P<node>'[^']*'|\"[^\"]*\"|#\d+ \(output '[^']*'\)) \((?P<op>[^),;]+)")
_OP = re.compile(r"ops\[\d+\] \((?P<op>\w+) (?P<node>'[^']*')\)")


@dataclass
class Built:
    """One family at one size: the module and its exports (exporter -> path, or the exception it raised)."""

    family: str
    size: str
    module: nn.Module
    image: tuple[int, int, int]
    exports: dict[str, Path | BaseException] = field(default_factory=dict)
    export_s: dict[str, float] = field(default_factory=dict)


def build(family: str, size: str, workdir: Path, exporters_: tuple[str, ...], seed: int = 0) -> Built:
    """The family's module and its export through each exporter (a failure kept as the exception)."""
    module = families.build(family, size, seed)
    built = Built(family, size, module, families.image_shape(family, size))
    for exporter in exporters_:
        t = time.perf_counter()
        try:
            built.exports[exporter] = exporters.export(exporter, module, built.image, workdir, f"{family}-{size}")
        except Exception as e:  # a result: this exporter cannot take this family (or the importer refused it)
            built.exports[exporter] = e
        built.export_s[exporter] = round(time.perf_counter() - t, 3)
    return built


def refusal(message: str, path: Path | None = None) -> dict:
    """A refusal message without the temporary path; the first node and op type it names (None if it names none)
    and every op type it names, in order ("these ops are not supported" lists up to 8 nodes)."""
    text = message.replace(f"{path}: ", "").replace(str(path), Path(path).name) if path else message
    found = [(m["node"], m["op"].strip()) for m in _NODE.finditer(text)] or [
        (m["node"], m["op"]) for m in _OP.finditer(text)
    ]
    node, op = found[0] if found else (None, None)
    return {"message": text, "node": node, "op": op, "ops": list(dict.fromkeys(o for _, o in found))}


def images(rows: int, image: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, *image), dtype=np.float32)


def reference(built: Built, exporter: str, x: np.ndarray) -> np.ndarray:
    """onnxruntime (CPU, fp32) on the exported file; for torch.export, the module itself."""
    path = built.exports[exporter]
    if exporter in exporters.ONNX_EXPORTERS:
        import onnxruntime as ort

        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return session.run(None, {session.get_inputs()[0].name: x})[0]
    with torch.no_grad():
        return built.module(torch.from_numpy(x)).numpy()


def agreement(got: np.ndarray, want: np.ndarray) -> dict:
    """max |got - want| / max |want|, and the share of rows whose argmax agrees."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return {"error": f"output shape {got.shape} != the reference's {want.shape}"}
    if not np.isfinite(got).all():
        return {"error": "non-finite outputs", "rows": len(got)}
    rel = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
    top1 = float(np.mean(got.argmax(1) == want.argmax(1)))
    return {"rel_err": rel, "top1": top1, "rows": len(got), "ok": rel <= MAX_REL_ERR and top1 >= TOP1}


def plan_summary(model) -> dict:
    """How the fused executor runs the model's plan: steps that are one Triton kernel each, steps with parts run as
    torch ops (and those parts, counted: "conv2d (groups 32)", "concat", ...), and views (flatten, in-place concats)."""
    from service.model.executors import torch_parts
    from service.model.planner import fused_steps, is_view

    steps = fused_steps(model.ops, model.tensors, normalize=model.normalize, shapes=model.shapes)  # the executors'
    parts: Counter[str] = Counter()
    fused = torch_ops = views = 0
    for s in steps:
        if is_view(s):  # a flatten, or a concat whose inputs' producers write into its buffer
            views += 1
            continue
        p = torch_parts(s)
        if p:
            torch_ops += 1
            parts.update(re.sub(r"\(groups \d+\)", "(grouped)", q) for q in p)
        else:
            fused += 1
    return {"ops": len(model.ops), "steps": len(steps), "fused": fused, "torch": torch_ops, "views": views,
            "torch_parts": dict(parts.most_common())}  # fmt: skip


def run_mode(model, mode: str, x: np.ndarray) -> tuple[np.ndarray, float]:
    """One forward of x through Executor(model, mode) on the CPU in fp32; (output, seconds including binding)."""
    from service.model.executors import Executor

    t = time.perf_counter()
    with torch.inference_mode():
        y = Executor(model, mode, torch.device("cpu"), torch.float32).forward(torch.from_numpy(x)).numpy()
    return y, time.perf_counter() - t


def check(
    built: Built,
    exporter: str,
    modes: tuple[str, ...] = MODES,
    rows: int = 8,
    fused_rows: int = 2,
    seed: int = 0,
) -> dict:
    """The record of one (family, exporter) (module docstring)."""
    from service.model.spec import ModelFormatError

    family = families.FAMILIES[built.family]
    rec: dict = {
        "family": built.family, "title": family.title, "size": built.size, "image": list(built.image),
        "exporter": exporter, "export_s": built.export_s.get(exporter),
        "params": sum(p.numel() for p in built.module.parameters()),
    }  # fmt: skip
    path = built.exports[exporter]
    if isinstance(path, ModelFormatError):  # torch.export's route imports as it exports
        rec.update(exported=True, imported=False, refusal=refusal(str(path)))
        return rec
    if isinstance(path, BaseException):
        rec.update(exported=False, imported=False, export_error=f"{type(path).__name__}: {path}"[:500])
        return rec
    rec["exported"] = True
    if path.suffix == ".onnx":
        rec["onnx_ops"] = onnx_ops(path)
    t = time.perf_counter()
    try:
        model = exporters.load(path)
    except ModelFormatError as e:
        rec.update(imported=False, refusal=refusal(str(e), path), load_s=round(time.perf_counter() - t, 3))
        return rec
    rec.update(imported=True, load_s=round(time.perf_counter() - t, 3))
    try:
        rec["plan"] = plan_summary(model)
    except Exception as e:  # the planner refusing is a finding too; the executors would raise the same
        rec["plan_error"] = f"{type(e).__name__}: {e}"[:500]
    x = images(rows, built.image, seed)
    want = reference(built, exporter, x)
    rec["reference"] = "onnxruntime" if exporter in exporters.ONNX_EXPORTERS else "torch"
    rec["modes"] = {}
    for mode in modes:
        n = rows if mode == "unfused" else min(rows, fused_rows)
        try:
            got, seconds = run_mode(model, mode, x[:n])
        except Exception as e:  # a mode that raises is a result: its cell says why
            rec["modes"][mode] = {"error": f"{type(e).__name__}: {e}"[:500]}
            continue
        rec["modes"][mode] = {**agreement(got, want[:n]), "seconds": round(seconds, 3)}
    return rec


def onnx_ops(path: Path) -> dict[str, int]:
    """Op types of the file's nodes, counted (the exporters differ: Conv + BatchNormalization or folded, Gemm or
    MatMul + Add, HardSigmoid + Mul or HardSwish, ...)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return dict(Counter(n.op_type for n in model.graph.node).most_common())
