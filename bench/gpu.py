"""Which GPU a run measured, and where its results go: bench/results/<gpu>/, e.g. bench/results/h100/kernels_h100.md.

Shared by every benchmark and by the probes; imports nothing heavy (the `fusedserve` parser may import its users).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

RESULTS = Path("bench/results")  # relative to the checkout, where the commands are run (as --out DIR is)


def slug_of(gpu_name: str | None) -> str:
    """'NVIDIA H200' -> 'h200'; 'NVIDIA H100 80GB HBM3' -> 'h100'; 'NVIDIA H200 (x2)' -> 'h200'; a name without a
    model number like those: its words joined by dashes; no GPU (None or '') -> 'cpu'."""
    if not gpu_name:
        return "cpu"
    s = re.sub(r"^nvidia\s+", "", gpu_name.strip().lower())
    m = re.match(r"([a-z]+\d+[a-z]*)\b", s)
    return m.group(1) if m else (re.sub(r"[^a-z0-9]+", "-", s).strip("-") or "gpu")


def results_dir(slug: str) -> Path:
    """Where a run on this GPU writes when no --out is given: bench/results/<slug>/."""
    return RESULTS / slug


def gpu_name() -> str | None:
    """The first GPU's name from nvidia-smi, with ' (xN)' when the host has N > 1; else torch's (in a child
    process: the caller stays free of torch and CUDA); None without one."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        )
        names = [n.strip() for n in out.stdout.splitlines() if n.strip()]
        if out.returncode == 0 and names:
            return names[0] + (f" (x{len(names)})" if len(names) > 1 else "")
    except (OSError, subprocess.TimeoutExpired):
        pass
    code = "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None
