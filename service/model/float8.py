"""The float8 plan: a model's calibration (calibration.json, written by `fusedserve calibrate`: calibrate.py) and
which steps run in float8 with which scales. The executor reads it (executors.py, precision "float8"); a model
without a calibration is refused with the command that makes one (`CalibrationMissing`).

Each fp8 step's input, residual and output are quantized per tensor with scale = calibrated range / 448
(kernels/fp8.py); weights per output channel at load. The first conv (or linear) and the classifier stay in the
compute dtype by default, with the convs on a 1x1 map (`DEFAULT_FP16_STEPS`, FUSEDSERVE_FLOAT8_FP16_STEPS).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .loader import Model
from .planner import Conv2dStep, LinearStep, Pool2dStep, Step, reads
from .spec import ModelFormatError

CALIBRATION_FILE = "calibration.json"
FORMAT = "fusedserve-calibration/1"
# the first conv (or linear), the classifier and the convs on a 1x1 map stay fp16 (kept_fp16)
DEFAULT_FP16_STEPS = ("first", "last", "pooled")


class CalibrationMissing(ModelFormatError):
    """A model asked to serve in float8 has no calibration (or one that lacks a tensor it needs)."""


def calibration_path(model: Model) -> Path:
    """Where a model's calibration lives: CALIBRATION_FILE in its directory (beside its .onnx file for one given
    as a file)."""
    path = Path(model.path)
    return (path if path.is_dir() else path.parent) / CALIBRATION_FILE


@dataclass(frozen=True)
class Calibration:
    """The ranges calibrate() measured, by tensor name."""

    ranges: dict[str, float]
    samples: int
    samples_sha256: str
    statistic: str = "absmax"

    def to_json(self, model_name: str) -> dict:
        return {
            "format": FORMAT,
            "model": model_name,
            "statistic": self.statistic,
            "samples": self.samples,
            "samples_sha256": self.samples_sha256,
            "created": _now(),
            "tensors": self.ranges,
        }


def load_calibration(model: Model) -> Calibration:
    """The model's calibration, or CalibrationMissing naming the command that makes it."""
    path = calibration_path(model)
    if not path.is_file():
        raise CalibrationMissing(
            f"model {model.name!r} has no float8 calibration ({path} is missing): run `fusedserve calibrate "
            f"{model.name} --samples FILE|DIR` with a few hundred representative inputs, then serve it in float8"
        )
    try:
        doc = json.loads(path.read_text())
        if doc.get("format") != FORMAT:
            raise ValueError(f"format {doc.get('format')!r}, expected {FORMAT!r}")
        ranges = {str(k): float(v) for k, v in doc["tensors"].items()}
        return Calibration(ranges, int(doc["samples"]), str(doc["samples_sha256"]), str(doc.get("statistic", "absmax")))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CalibrationMissing(
            f"{path}: unreadable calibration ({e}); run `fusedserve calibrate {model.name} --samples FILE|DIR` again"
        ) from None


# ---- the float8 plan ----


@dataclass(frozen=True)
class Fp8Step:
    """How one step runs in float8: its input's scale, its residual's (None: none), its output's (None: the output
    is written in the compute dtype, for a reader that is not an fp8 step)."""

    x_scale: float
    residual_scale: float | None
    out_scale: float | None


@dataclass(frozen=True)
class Fp8Output:
    """A pool or conv step that computes in the compute dtype and writes its output in e4m3 with `out_scale`, for the
    float8 steps that read it (ResNet's max pool between its float16 stem and its first float8 convs; MobileNetV2's
    float16 stem before its first depthwise conv): they read one byte a value, as e4m3 that TMA can copy, instead of
    quantizing the float16 output as they gather it (a depthwise conv at each of its 9 taps: on the H200 at 256
    images MobileNetV2's first took 351 µs so, against 237 in float16)."""

    out_scale: float


def _weighted(step: Step) -> bool:
    return isinstance(step, (Conv2dStep, LinearStep))


def gated_name(step: Conv2dStep) -> str:
    """The calibration's name for what a gated conv quantizes: its input times its squeeze-excitation gate, a tensor
    no step writes (the kernel multiplies as it reads; calibrate.measure records its range under this name)."""
    return f"{step.inputs[0]}*{step.gate}"


def writes_e4m3_in_kernel(step: Step) -> bool:
    """A conv kept in the compute dtype whose kernel can write e4m3 for its readers (fused_conv2d's out_scale): groups
    1, and no pool, residual, gate or pre-activation batch norm in it."""
    return (
        isinstance(step, Conv2dStep)
        and step.groups == 1
        and step.pool is None
        and step.residual is None
        and step.gate is None
        and step.prenorm is None
        and step.interleave is None
    )


def fp8_eligible(step: Step) -> bool:
    """A step the fp8 kernels can run: a linear, or a conv (groups 1: kernels/conv_fp8.py and conv_tma_fp8.py, with a
    squeeze-excitation gate too; grouped and depthwise: conv_grouped_fp8.py, without one) with no input
    normalization, pre-activation batch norm or pool."""
    if isinstance(step, LinearStep):
        return True
    return (
        isinstance(step, Conv2dStep)
        and (step.gate is None or step.groups == 1)
        and step.normalize is None
        and step.prenorm is None
        and step.pool is None
    )


def fp16_steps_of(text: str) -> tuple[str, ...]:
    """FLOAT8_FP16_STEPS's comma-separated names as kept_fp16 takes them (empty: none kept)."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def kept_fp16(steps: list[Step], fp16_steps: tuple[str, ...], shapes: dict | None = None) -> set[str]:
    """Step names kept in the compute dtype: those named, `first` (the first conv or linear), `last` (the last one:
    the classifier), `gated`: the convs that apply a squeeze-excitation gate as they read (they read float16 x either
    way, so float8 saves only their output's bytes: EfficientNet-B0's 16 took 1,274 µs in float8 against 1,087 in
    float16 at 256 images on the H200; not kept by default, to be measured in a model's context), and `pooled`: the
    convs that read a 1x1 map (`shapes`: per-row shapes by tensor), a squeeze-excitation's two FCs on pooled
    channels. There e4m3 halves a few kilobytes while its kernel runs slower than fp16's on the skinny GEMM
    (EfficientNet-B0 at 256 images, H200: its 32 SE convs 356 µs in float8 against 196 in float16, and the 16 pools
    that fed them e4m3 642 against 528)."""
    weighted = [s.name for s in steps if _weighted(s)]
    keep = {n for n in fp16_steps if n not in ("first", "last", "pooled", "gated")}
    if "first" in fp16_steps and weighted:
        keep.add(weighted[0])
    if "last" in fp16_steps and weighted:
        keep.add(weighted[-1])
    if "gated" in fp16_steps:
        keep.update(s.name for s in steps if getattr(s, "gate", None) is not None)
    if "pooled" in fp16_steps and shapes:
        on_1x1 = (
            s.name for s in steps if isinstance(s, Conv2dStep) and tuple(shapes.get(s.inputs[0], ()))[1:] == (1, 1)
        )
        keep.update(on_1x1)
    return keep


def plan_float8(
    steps: list[Step],
    calibration: Calibration,
    model_name: str,
    fp16_steps: tuple[str, ...] = DEFAULT_FP16_STEPS,
    shapes: dict | None = None,
) -> dict[str, Fp8Step | Fp8Output]:
    """{step name: Fp8Step} for the steps that run in float8: every fp8_eligible step not kept fp16. A step writes e4m3
    where every reader of its output is an fp8 step (as input or residual) and the output is not the model's; so does
    a pool step, or a conv kept in the compute dtype whose kernel can (writes_e4m3_in_kernel: the stem), ({name:
    Fp8Output}), with the scale its readers take."""
    from kernels.fp8 import scale_of

    keep = kept_fp16(steps, fp16_steps, shapes)
    # a gated conv calibrated before gates ran in float8 has no range for x * gate: it stays in the compute dtype
    names = {s.name for s in steps if fp8_eligible(s) and s.name not in keep
             and (getattr(s, "gate", None) is None or gated_name(s) in calibration.ranges)}  # fmt: skip
    readers: dict[str, list[Step]] = {}
    for s in steps:
        for t in reads(s):
            readers.setdefault(t, []).append(s)
    final = steps[-1].output if steps else ""

    def scale(tensor: str) -> float:
        if tensor not in calibration.ranges:
            raise CalibrationMissing(
                f"model {model_name!r}: the calibration has no range for tensor {tensor!r} (made for another version "
                f"of the model?); run `fusedserve calibrate {model_name} --samples FILE|DIR` again"
            )
        return scale_of(calibration.ranges[tensor])

    def takes_e4m3(reader: Step, tensor: str) -> bool:
        """A float8 step reading `tensor` as e4m3: not as a gate, nor as a gated conv's x (it multiplies x by its
        gate before quantizing, so it reads x in the compute dtype)."""
        gated = getattr(reader, "gate", None) is not None
        return reader.name in names and not (gated and tensor in (reader.inputs[0], reader.gate))

    def fp8_readers(s: Step) -> bool:
        return s.output != final and bool(readers.get(s.output)) and all(takes_e4m3(r, s.output)
                                                                          for r in readers[s.output])  # fmt: skip

    plan: dict[str, Fp8Step | Fp8Output] = {}
    for s in steps:
        if (isinstance(s, Pool2dStep) or (s.name not in names and writes_e4m3_in_kernel(s))) and fp8_readers(s):
            plan[s.name] = Fp8Output(out_scale=scale(s.output))
        if s.name not in names:
            continue
        fp8_out = fp8_readers(s)
        plan[s.name] = Fp8Step(
            x_scale=scale(gated_name(s) if getattr(s, "gate", None) else s.inputs[0]),
            residual_scale=scale(s.residual) if s.residual else None,
            out_scale=scale(s.output) if fp8_out else None,
        )
    return plan


def _now() -> str:
    import datetime

    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
