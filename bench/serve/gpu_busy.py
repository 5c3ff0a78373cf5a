"""How busy the GPUs were over one `bench serve` phase: nvidia-smi's utilization.gpu, sampled every 100 ms from the
bench process while the phase runs, the samples inside the measured window averaged per GPU.

utilization.gpu is the share of the driver's last sample period in which any kernel ran, so it says whether the GPU
waited for work (the front ends or the client are the limit), not how well the kernels use it. The sampler is a
child process (no NVML binding, no CUDA context in the process that forks the clients); its lines are stamped with
nvidia-smi's own timestamp, so a pipe that delivers them late does not move them in or out of the window.
Without nvidia-smi (a CPU run) there is nothing to sample: the report says n/a.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
import time
from datetime import datetime

QUERY = ["--query-gpu=timestamp,index,utilization.gpu", "--format=csv,noheader,nounits", "-lms", "100"]


class GpuSampler:
    """nvidia-smi sampling from start() to stop(); window() averages the samples between two time.monotonic()s."""

    def __init__(self, binary: str | None = None) -> None:
        self.binary = binary or shutil.which("nvidia-smi")
        self.samples: list[tuple[float, int, float]] = []  # (monotonic time, GPU index, utilization %)
        self.proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        # nvidia-smi's timestamps are the host's local wall clock: this maps them to time.monotonic().
        self._offset = time.time() - time.monotonic()

    @property
    def available(self) -> bool:
        return self.binary is not None

    def start(self) -> GpuSampler:
        if not self.available:
            return self
        argv = [self.binary, *QUERY]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
        if visible and all(v.strip().isdigit() for v in visible.split(",")):
            argv.append(f"--id={visible}")  # only the GPUs the servers may use
        try:
            self.proc = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True
            )
        except OSError:
            self.binary = None
            return self
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            sample = self.parse(line, time.monotonic())
            if sample is not None:
                self.samples.append(sample)

    def parse(self, line: str, arrived: float) -> tuple[float, int, float] | None:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            return None
        stamp, index, util = parts
        try:
            gpu, value = int(index), float(util)
        except ValueError:
            return None  # "[N/A]" or a header
        try:
            at = datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp() - self._offset
        except ValueError:
            at = arrived
        return at, gpu, value

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        if self._reader is not None:
            self._reader.join(5)
        self.proc = None

    def window(self, start: float, end: float) -> dict | None:
        """{"mean": the GPUs' mean utilization %, "per_gpu": {index: mean %}, "samples": n} over [start, end]; None
        without nvidia-smi, or without a sample in the window."""
        if not self.available:
            return None
        per: dict[int, list[float]] = {}
        for at, gpu, value in self.samples:
            if start <= at <= end:
                per.setdefault(gpu, []).append(value)
        if not per:
            return None
        means = {gpu: round(sum(v) / len(v), 1) for gpu, v in sorted(per.items())}
        return {
            "mean": round(sum(means.values()) / len(means), 1),
            "per_gpu": means,
            "samples": sum(len(v) for v in per.values()),
        }


def text(util: dict | None) -> str:
    """A table cell: '87' for one GPU, '87 (88/86)' for several, 'n/a' without a reading."""
    if not util:
        return "n/a"
    per = list(util["per_gpu"].values())
    return f"{util['mean']:.0f}" + ("" if len(per) < 2 else " (" + "/".join(f"{v:.0f}" for v in per) + ")")
