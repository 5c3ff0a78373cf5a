"""The start-up files: an engine that is loading or warming publishes what it is doing (service/engine/startup.py)
in the run directory, and the front ends show it in `/health/ready` until every engine is ready. Files, as the
plan is: written a few times a second at most while an engine starts, read per request of a rarely asked route."""

from __future__ import annotations

import json
from pathlib import Path

PREFIX = "startup-"  # startup-<engine>.json in the run directory


def write_progress(run_dir: Path, engine: int, doc: dict) -> None:
    """Engine side: what its start is doing now (an atomic replace, so a reader never sees half a file)."""
    tmp = run_dir / f"{PREFIX}{engine}.json.tmp"
    tmp.write_text(json.dumps(doc))
    tmp.replace(run_dir / f"{PREFIX}{engine}.json")


def read_progress(run_dir: Path) -> dict[str, dict]:
    """Front end side: {engine index: its latest progress}, for the engines that published one."""
    out: dict[str, dict] = {}
    for path in sorted(run_dir.glob(f"{PREFIX}*.json")):
        try:
            out[path.stem.removeprefix(PREFIX)] = json.loads(path.read_text())
        except (OSError, ValueError):  # replaced or removed while read: the next request reads it
            continue
    return out
