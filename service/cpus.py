"""How many CPUs this process may use: the cores it may run on (sched_getaffinity: `docker run --cpuset-cpus`, taskset,
Kubernetes' static CPU manager), capped by its cgroup's CPU quota (cgroup v2 cpu.max, or v1 cpu.cfs_quota_us:
`docker run --cpus=2`, a Kubernetes CPU limit), rounded up. os.cpu_count() counts the host's, so a container limited
to 2 CPUs on a 64-core host would start 8 front ends, each throttled (issue 51).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def affinity_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def quota_cpus(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup and its ancestors, in CPUs (quota / period, the smallest along the
    path), or None where there is none (or no cgroup to read)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2: 0::/path
            for d in _dirs(root, path):
                limits.append(_v2(d / "cpu.max"))
        elif "cpu" in controllers.split(","):  # cgroup v1: N:cpu,cpuacct:/path
            base = next((root / n for n in ("cpu,cpuacct", "cpu", "cpuacct,cpu") if (root / n).is_dir()), None)
            if base is not None:
                for d in _dirs(base, path):
                    limits.append(_v1(d))
    limits = [x for x in limits if x is not None]
    return min(limits) if limits else None


def usable_cpus() -> int:
    """The CPUs this process may use: affinity, capped by the cgroup quota rounded up (1.5 CPUs: 2), at least 1."""
    cores = affinity_cpus()
    quota = quota_cpus()
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota - 1e-9)))
    return max(1, cores)


def _dirs(base: Path, path: str) -> list[Path]:
    """The cgroup's directory and its ancestors up to `base` (inside a container the path is often just /)."""
    parts = [p for p in path.strip("/").split("/") if p]
    dirs = [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]
    return [d for d in dirs if d.is_dir()]


def _v2(path: Path) -> float | None:
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1(d: Path) -> float | None:
    try:
        quota = int((d / "cpu.cfs_quota_us").read_text())
        period = int((d / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period
