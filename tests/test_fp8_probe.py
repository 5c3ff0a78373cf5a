"""bench/probes/fp8_resnet50.py's accuracy floor and step table, on the CPU (the probe itself needs fp8 tensor
cores): MobileNetV2 at 32x32 with random weights, as the probe builds it."""

from __future__ import annotations

import torch

from bench.probes.fp8_resnet50 import (
    agreement,
    build_model,
    calibration_on,
    markdown,
    random_images,
    rounded_activations,
    step_rows,
)
from service.model.executors import Executor

IMAGE = (3, 32, 32)


def test_rounded_activations_cost_what_their_format_rounds(tmp_path):
    """bfloat16-rounded activations move the logits a little, e4m3-rounded ones (3 mantissa bits to bfloat16's 7)
    more; neither leaves them unchanged, and an unrounded run through the same loop gives the forward exactly."""
    model = build_model(IMAGE, tmp_path, name="mobilenet_v2")
    exact = Executor(model, "unfused", torch.device("cpu"), torch.float32)
    x = random_images(8, IMAGE, 2, "cpu")
    with torch.no_grad():
        ref = exact.forward(x)
    bf16, e4m3 = (rounded_activations(exact, x, fmt) for fmt in ("bfloat16", "e4m3"))
    err = {fmt: float((y - ref).norm() / ref.norm()) for fmt, y in (("bfloat16", bf16), ("e4m3", e4m3))}
    assert 0 < err["bfloat16"] < err["e4m3"] < 1.0, err
    assert agreement(bf16, ref)["cosine_mean"] > agreement(e4m3, ref)["cosine_mean"]


def test_step_table_sums_every_step_by_kind(tmp_path):
    """step_rows gives each step of the plan once with its kind and both precisions' times (wall time on the CPU),
    and the markdown's table sums them by kind: its step counts add up to the plan's."""
    model = build_model(IMAGE, tmp_path, name="mobilenet_v2")
    dev = torch.device("cpu")
    cal = calibration_on(model, random_images(8, IMAGE, 1, dev), dev, batch_size=8)
    executors = {
        "float16": Executor(model, "unfused", dev, torch.float32),
        "float8": Executor(model, "unfused", dev, torch.float32, precision="float8", calibration=cal),
    }
    rows = step_rows(model, executors, random_images(2, IMAGE, 3, dev))
    assert [r["step"] for r in rows] == [s.name for s in executors["float8"].steps]
    convs = [r for r in rows if r["kind"][0].isdigit()]
    assert convs and all(r["float16_us"] > 0 and r["float8_us"] > 0 for r in convs)
    kinds = {r["kind"] for r in rows}
    assert any(k.startswith("3x3 dw ") for k in kinds) and any(k.startswith("1x1 ") and "->" in k for k in kinds)
    assert sum(r["float8"] for r in rows) == list(executors["float8"].precisions().values()).count("float8")
    acc = {"images": 8, "float8_vs_float16": agreement(torch.randn(8, 10), torch.randn(8, 10))}
    fp8_steps = sum(r["float8"] for r in rows)
    result = {"gpu": "cpu", "model": "mobilenet_v2", "fp8_steps": fp8_steps, "steps": len(rows),
              "rows": [], "accuracy": acc, "step_times": rows}  # fmt: skip
    md = markdown(result, "cmd")
    table = [line for line in md.splitlines() if line.startswith("| ") and ("x3 " in line or "x1 " in line)]
    counted = sum(int(line.split("|")[2].split("(")[0]) for line in table)
    assert counted == len(convs), md
    assert f"{fp8_steps} of {len(rows)} steps in float8" in md
