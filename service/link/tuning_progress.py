"""The tuning files: each engine publishes how far its background tuning has come (kernels/tuning_background.py) in
the run directory, and the front ends sum them for `GET /model`. Files, as the plan is: written once per key timed
(hundreds over minutes, then never), read per request of a rarely asked route."""

from __future__ import annotations

import json
from pathlib import Path

PREFIX = "tuning-"  # tuning-<engine>.json in the run directory


def write_tuning(run_dir: Path, engine: int, pending: int, done: int) -> None:
    """Engine side: the keys it still runs untimed and those it has timed in the background."""
    tmp = run_dir / f"{PREFIX}{engine}.json.tmp"
    tmp.write_text(json.dumps({"pending": pending, "done": done}))
    tmp.replace(run_dir / f"{PREFIX}{engine}.json")


def read_tuning(run_dir: Path) -> dict[str, int]:
    """Front end side: {"pending": keys untimed, "done": keys timed in the background}, summed over engines (zeros
    before any engine wrote, or without background tuning). A file half replaced is read as missing."""
    total = {"pending": 0, "done": 0}
    for path in sorted(run_dir.glob(f"{PREFIX}*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for name in total:
            total[name] += int(doc.get(name, 0))
    return total
