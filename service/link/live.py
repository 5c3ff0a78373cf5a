"""Live settings on their way from the supervisor to the engines and front ends, after a SIGHUP reload.

The supervisor validates the re-read configuration, writes the live settings (service.config.LIVE_SETTINGS) to a
file in the run directory with a generation number, then bumps a shared integer. Engines look at that integer
between batches and front ends every CONFIG_POLL_S on their event loop; one that sees it change reads the file.
The file always holds the newest generation, so a process that sees two bumps at once applies the last.

A file and an integer, not a signal to each child: a child never runs a handler at an awkward moment (an engine
inside a forward, a front end inside uvicorn's loop), and one started again later by the supervisor gets the
current settings with its arguments.
"""

from __future__ import annotations

import json
from pathlib import Path

LIVE_FILE = "live.json"  # in the run directory
CONFIG_POLL_S = 0.05  # how often a front end looks at the generation


def write_live(run_dir: Path, generation: int, live: dict[str, object]) -> None:
    """Supervisor side: publish generation `generation` of the live settings (written whole, then renamed)."""
    tmp = run_dir / (LIVE_FILE + ".tmp")
    tmp.write_text(json.dumps({"generation": generation, "live": live}))
    tmp.replace(run_dir / LIVE_FILE)


def read_live(run_dir: Path) -> tuple[int, dict[str, object]]:
    """Engine and front end side: (generation, live settings) as last published."""
    doc = json.loads((run_dir / LIVE_FILE).read_text())
    return int(doc["generation"]), dict(doc["live"])
