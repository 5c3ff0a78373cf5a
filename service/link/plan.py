"""The plan file: engine 0 publishes what it runs (steps, dtype, device) in the run directory, and every front end
reads it for `GET /model`. A file rather than a message: it is written before the engine warms, and again after
if a step fell back to its unfused op (a kernel that did not compile within the deadline); readers reread it when
it changes."""

from __future__ import annotations

import json
from pathlib import Path

from ..model.describe import describe_plan

PLAN_FILE = "model.json"  # in the run directory


def write_plan(run_dir: Path, executor, device: str) -> None:
    """Engine side: publish what this engine runs, for the front ends' `GET /model`."""
    plan = describe_plan(executor.steps, executor.tensors)
    fallbacks = getattr(executor, "fallbacks", {})
    precisions = executor.precisions() if hasattr(executor, "precisions") else {}
    for entry in plan:  # steps whose kernel did not compile within the deadline (Executor.warm_forward)
        if entry.get("kernel") in fallbacks:
            entry["unfused_fallback"] = fallbacks[entry["kernel"]]
        if entry.get("kernel") in precisions:  # float8: which steps run in e4m3 (service/model/float8.py)
            entry["precision"] = precisions[entry["kernel"]]
    doc = {
        "plan": plan,
        "dtype": str(executor.dtype).removeprefix("torch."),
        "device": device,
    }
    tmp = run_dir / (PLAN_FILE + ".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(run_dir / PLAN_FILE)


def read_plan(run_dir: Path) -> dict | None:
    """Front end side: what engine 0 published, or None before it has."""
    path = run_dir / PLAN_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text())
