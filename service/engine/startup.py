"""An engine's start, told as it goes: which phase (loading, warming), which mode and batch bucket, which step of
the plan, how many kernel keys were timed, how much is left and about how long it will take.

A start on the GPU compiles and tunes every step at every batch bucket (9 buckets up to 256 images): a minute or
more for a CNN, where the log used to say nothing between "loading" and "warm". So the progress is logged at least
every LOG_EVERY_S by a ticker thread (the warm-up itself runs in kernels, and one step can take seconds), and
published in the run directory (service/link/startup_progress.py) at most every WRITE_EVERY_S for the front ends'
`/health/ready`.

The estimate counts work in step-buckets (one step's warm-up at one bucket): time so far over step-buckets done,
times those left. The first bucket also compiles every kernel, so early estimates run long.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from kernels import tuning

from ..link.startup_progress import PREFIX, write_progress

log = logging.getLogger(__name__)

LOG_EVERY_S = 5.0
WRITE_EVERY_S = 0.25


class StartupProgress:
    """What one engine's start is doing. Updated from the engine's thread, read by the ticker's."""

    def __init__(self, engine: int, run_dir: Path | None = None, log_every_s: float = LOG_EVERY_S):
        self.engine = engine
        self.run_dir = run_dir
        self.started = time.monotonic()
        self._picks_at_start = tuning.picks_timed.value
        self._lock = threading.Lock()
        self._doc: dict = {"phase": "loading"}
        self._total = 0  # step-buckets of every warm-up ahead (plan)
        self._done = 0  # step-buckets finished
        self._steps = 0  # steps of the bucket being warmed
        self._last_write = 0.0
        self._stopped = threading.Event()
        self._ticker = threading.Thread(target=self._tick, args=(log_every_s,), name="startup-progress", daemon=True)
        self._ticker.start()
        self._write(force=True)

    def plan(self, step_buckets: int) -> None:
        """The warm-ups ahead: step-buckets in all (steps times buckets, summed over the modes)."""
        with self._lock:
            self._total = step_buckets
            self._doc = {"phase": "warming"}
        self._write(force=True)

    def bucket(self, mode: str, rows: int, index: int, count: int, steps: int) -> None:
        """The warm-up of `mode` at batch bucket `rows` (the index-th of count) begins; it runs `steps` steps."""
        with self._lock:
            self._steps = steps
            self._doc = {"phase": "warming", "mode": mode, "bucket": rows, "buckets_done": index, "buckets": count,
                         "step": None, "steps_done": 0, "steps": steps}  # fmt: skip
        self._write(force=True)

    def step(self, index: int, name: str | None) -> None:
        """Step `index` (from 0) of the bucket begins; the ones before it are done."""
        with self._lock:
            if index > 0:
                self._done += 1
            self._doc["step"] = name
            self._doc["steps_done"] = index
        self._write()

    def capturing(self) -> None:
        """The bucket's steps ran; its CUDA graph is being captured."""
        with self._lock:
            self._done += 1  # the bucket's last step
            self._doc["steps_done"] = self._steps
            self._doc["step"] = None
            self._doc["capturing"] = True
        self._write(force=True)

    def snapshot(self) -> dict:
        """The progress as /health/ready shows it."""
        with self._lock:
            doc = dict(self._doc)
            done, total = self._done, self._total
        elapsed = time.monotonic() - self.started
        doc["elapsed_s"] = round(elapsed, 1)
        doc["kernel_keys_timed"] = tuning.picks_timed.value - self._picks_at_start
        if total:
            doc["step_buckets_left"] = max(0, total - done)
            if done:
                doc["estimate_left_s"] = round(elapsed / done * max(0, total - done), 1)
        return doc

    def line(self) -> str:
        """One log line of the progress."""
        d = self.snapshot()
        parts = [f"engine {self.engine} {d['phase']}"]
        if "bucket" in d:
            parts.append(f"{d['mode']} batch bucket {d['bucket']} ({d['buckets_done'] + 1} of {d['buckets']})")
            if d.get("capturing"):
                parts.append("capturing its CUDA graph")
            else:
                parts.append(f"step {d['steps_done'] + 1} of {d['steps']}" + (f" ({d['step']})" if d["step"] else ""))
        parts.append(f"{d['kernel_keys_timed']} kernel keys timed")
        if "step_buckets_left" in d:
            parts.append(f"{d['step_buckets_left']} step-buckets left")
        tail = f"{d['elapsed_s']:.0f} s so far"
        if "estimate_left_s" in d:
            tail += f", about {d['estimate_left_s']:.0f} s left"
        return ", ".join(parts) + "; " + tail

    def finish(self) -> None:
        """The start is over (ready or failed): stop logging and withdraw the file."""
        self._stopped.set()
        if self.run_dir is not None:
            (self.run_dir / f"{PREFIX}{self.engine}.json").unlink(missing_ok=True)

    def _tick(self, every_s: float) -> None:
        while not self._stopped.wait(every_s):
            log.info("%s", self.line())

    def _write(self, force: bool = False) -> None:
        if self.run_dir is None:
            return
        now = time.monotonic()
        if not force and now - self._last_write < WRITE_EVERY_S:
            return
        self._last_write = now
        try:
            write_progress(self.run_dir, self.engine, self.snapshot())
        except OSError as e:  # a run directory gone (the service stopping): the log still tells
            log.debug("start-up progress not written (%s)", e)
