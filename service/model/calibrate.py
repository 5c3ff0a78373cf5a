"""Float8 calibration: the per-tensor activation ranges a model needs to be served in float8, measured on samples the
user gives, and the plan of which steps run in float8 with which scales.

`fusedserve calibrate MODEL --samples FILE|DIR` runs the model in float32, unfused (eager torch, on CUDA when there is
one), over the samples and records, for every tensor a step writes (and the input), its largest |value| over all
samples (or a high percentile of |value| with --percentile), then writes CALIBRATION_FILE into the model's directory:

    {"format": "fusedserve-calibration/1", "model": "digits-cnn", "statistic": "absmax", "samples": 360,
     "samples_sha256": "...", "created": "2025-...", "tensors": {"input": 16.0, "conv2d_0_out": 5.1, ...}}

Samples: .npy and .safetensors files (each array one row of the model's input shape, or a batch of them), or, for a
model whose input declares `image`, encoded images (.jpg, .jpeg, .png, .webp) prepared as the service prepares them
(service/images: decode, resize, center crop). A directory is read in name order, its files of those kinds only.

Serving in float8 (FUSEDSERVE_DTYPE=float8) reads the file; without it the executor refuses to start and names the
command to run (`CalibrationMissing`). Each fp8 step's input is quantized with scale = range / 448 (kernels/fp8.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from .float8 import Calibration, calibration_path, gated_name
from .loader import Model
from .spec import ModelFormatError

log = logging.getLogger(__name__)

ARRAY_SUFFIXES = (".npy", ".safetensors")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")
PERCENTILE_SAMPLE = 1 << 20  # elements of a tensor the percentile is taken over per batch (a random subset)


# ---- samples ----


def sample_files(samples: Path) -> list[Path]:
    """The sample files of a file or directory (name order), or ModelFormatError where there are none."""
    samples = Path(samples)
    if samples.is_file():
        return [samples]
    if not samples.is_dir():
        raise ModelFormatError(f"{samples}: no such file or directory of samples")
    files = sorted(p for p in samples.iterdir() if p.is_file() and p.suffix.lower() in ARRAY_SUFFIXES + IMAGE_SUFFIXES)
    if not files:
        kinds = ", ".join(ARRAY_SUFFIXES + IMAGE_SUFFIXES)
        raise ModelFormatError(f"{samples}: no sample files in it ({kinds})")
    return files


def _rows(array: np.ndarray, shape: tuple[int, ...], where: str) -> np.ndarray:
    """An array as (n, *shape): one row of the input's shape, a batch of them, or flat rows of the same size."""
    if tuple(array.shape) == shape:
        return array.reshape(1, *shape)
    if tuple(array.shape[1:]) == shape:
        return array
    size = int(np.prod(shape))
    if array.ndim == 2 and array.shape[1] == size:
        return array.reshape(-1, *shape)
    raise ModelFormatError(f"{where}: array of shape {tuple(array.shape)}; the model takes rows of shape {shape}")


def read_samples(model: Model, files: list[Path], max_pixels: int = 50_000_000) -> Iterator[np.ndarray]:
    """Each file's rows, (n, *input_shape): float32, or uint8 pixels for a model whose input is uint8."""
    shape = tuple(model.input_shape)
    want = np.uint8 if model.input_dtype == torch.uint8 else np.float32
    for f in files:
        suffix = f.suffix.lower()
        if suffix == ".npy":
            yield _rows(np.load(f), shape, str(f)).astype(want, copy=False)
        elif suffix == ".safetensors":
            from safetensors.numpy import load_file

            for name, array in sorted(load_file(str(f)).items()):
                yield _rows(array, shape, f"{f}: {name}").astype(want, copy=False)
        elif suffix in IMAGE_SUFFIXES:
            if model.spec.input.image is None:
                raise ModelFormatError(f"{f}: an image, but model {model.name!r} does not take images (its input "
                                       "declares no `image`); give .npy or .safetensors rows")  # fmt: skip
            from ..images.prepare import prepare
            from ..images.preprocess import Preprocess

            row = prepare(f.read_bytes(), Preprocess.of(model.spec), max_pixels, str(f))
            yield row.reshape(1, *shape).astype(want, copy=False)
        else:
            raise ModelFormatError(f"{f}: not a sample file ({', '.join(ARRAY_SUFFIXES + IMAGE_SUFFIXES)})")


def files_sha256(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0")
        h.update(f.read_bytes())
    return h.hexdigest()


# ---- measuring ----


def _magnitude(t: torch.Tensor, percentile: float | None, generator: torch.Generator) -> float:
    a = t.detach().abs().float().flatten()
    if a.numel() == 0:
        return 0.0
    if percentile is None:
        return float(a.max())
    if a.numel() > PERCENTILE_SAMPLE:
        a = a[torch.randint(0, a.numel(), (PERCENTILE_SAMPLE,), generator=generator, device="cpu").to(a.device)]
    return float(torch.quantile(a, percentile / 100.0))


def measure(
    model: Model,
    batches: Iterator[np.ndarray],
    device: torch.device,
    *,
    batch_size: int = 64,
    percentile: float | None = None,
    progress=None,
) -> tuple[dict[str, float], int]:
    """({tensor: its largest |value| (or percentile) over every batch}, rows seen): the model run unfused in
    float32 (the plan float8 serves: no whole-MLP or conv + pool groups), every tensor a step reads or writes
    measured, and for a gated conv its input times its gate (float8.gated_name: what that conv quantizes).
    `progress(rows)` after each forward."""
    from .executors import Executor

    executor = Executor(model, "unfused", device, torch.float32, whole_mlp=False, conv_pool=False)
    ranges: dict[str, float] = {}
    generator = torch.Generator().manual_seed(0)
    seen = 0

    def record(name: str, t: torch.Tensor) -> None:
        if t.is_floating_point() or t.dtype == torch.uint8:
            ranges[name] = max(ranges.get(name, 0.0), _magnitude(t, percentile, generator))

    def forward(rows: np.ndarray) -> None:
        x = torch.from_numpy(np.ascontiguousarray(rows)).to(device=device, dtype=executor.input_dtype)
        if executor._cast_input:
            x = x.to(executor.dtype)
        live = {executor.input_name: x}
        record(executor.input_name, x)
        with torch.no_grad():
            for step, (_, layer), wiring in zip(executor.steps, executor.layers, executor.wiring, strict=True):
                if getattr(step, "gate", None):  # what a float8 gated conv quantizes: x * gate, never written
                    record(gated_name(step), live[step.inputs[0]] * live[step.gate])
                y = layer(*[live[t] for t in wiring.reads])
                live[wiring.output] = y
                record(wiring.output, y)
                for t in wiring.frees:
                    del live[t]

    pending: list[np.ndarray] = []
    for rows in batches:
        pending.append(rows)
        while sum(len(p) for p in pending) >= batch_size:
            block = np.concatenate(pending)
            forward(block[:batch_size])
            seen += batch_size
            pending = [block[batch_size:]] if len(block) > batch_size else []
            if progress is not None:
                progress(seen)
    if pending and sum(len(p) for p in pending):
        block = np.concatenate(pending)
        forward(block)
        seen += len(block)
        if progress is not None:
            progress(seen)
    if seen == 0:
        raise ModelFormatError("no sample rows to calibrate on")
    return ranges, seen


def calibrate(
    model: Model,
    samples: Path,
    device: torch.device,
    *,
    batch_size: int = 64,
    percentile: float | None = None,
    out: Path | None = None,
    progress=None,
) -> tuple[Path, Calibration]:
    """Measure the model's ranges over `samples` (a file or a directory) and write them to `out` (default:
    calibration_path(model)). Returns (the file, what it holds)."""
    files = sample_files(samples)
    ranges, seen = measure(model, read_samples(model, files), device, batch_size=batch_size, percentile=percentile,
                           progress=progress)  # fmt: skip
    statistic = "absmax" if percentile is None else f"percentile{percentile:g}"
    cal = Calibration(ranges, seen, files_sha256(files), statistic)
    path = Path(out) if out is not None else calibration_path(model)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(cal.to_json(model.name), indent=1, sort_keys=True) + "\n")
    tmp.replace(path)
    return path, cal


def main_progress(total_hint: int | None = None):
    """A progress callback printing rows done to stderr (one line, rewritten on a terminal)."""
    tty = sys.stderr.isatty()

    def progress(rows: int) -> None:
        text = f"calibrate: {rows} rows" + (f" of {total_hint}" if total_hint else "")
        print(("\r" + text) if tty else text, end="" if tty else "\n", file=sys.stderr, flush=True)

    return progress
