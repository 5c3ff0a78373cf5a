"""Reading one case's results: the time each provider is compared by, the best anchor, and how a
time is printed. Shared by the report (report.py), the targets (targets.py) and the plot
(plot.py), which import it and not each other.
"""

from __future__ import annotations

# What a user could run instead of ours (eager-cl and eager-folded: the ResNets' torch modules, bench/kernels/models.py)
ANCHORS = ("eager", "eager-cl", "eager-folded", "linear", "compile", "compile-max")
CUDNN = ("cudnn", "cudnn-fused")  # the conv rows' yardstick: the faster of cuDNN's two ways


def primary(res: dict) -> float | None:
    """The time a provider is compared by: graph-replay device time, else plain device time, else wall
    time (the CPU smoke run has only wall time)."""
    g, p = res.get("graph") or {}, res.get("plain") or {}
    for v in (g.get("device_us"), p.get("device_us"), p.get("wall_us"), g.get("wall_us")):
        if v is not None:
            return v
    return None


def hot(res: dict) -> float | None:
    """Device time per call of back-to-back graph replays (weights warm in L2), or None (no graph cell:
    ours-eager, or the CPU)."""
    return (res.get("graph") or {}).get("hot_us")


def wall(res: dict) -> float | None:
    """Host time per call as the provider is run from Python: plain, or the graphed executor's own call."""
    p, g = res.get("plain") or {}, res.get("graph") or {}
    return p.get("wall_us") if p.get("wall_us") is not None else g.get("wall_us")


def us(v: float | None) -> str:
    if v is None:
        return "—"
    return f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 100 else f"{v:.0f}"


def best_anchor(case: dict, time=primary) -> tuple[str | None, float | None]:
    """The fastest anchor of the case by `time` (primary: cold; or hot) and its time."""
    times = {p: time(r) for p, r in case["providers"].items() if p in ANCHORS}
    times = {p: t for p, t in times.items() if t is not None}
    if not times:
        return None, None
    p = min(times, key=times.get)
    return p, times[p]


def best_cudnn(case: dict, time=primary) -> tuple[str | None, float | None]:
    """The faster of cuDNN's conv + bias + ReLU (two kernels, or its fused op) by `time`, and its time."""
    times = {p: time(case["providers"][p]) for p in CUDNN if p in case["providers"]}
    times = {p: t for p, t in times.items() if t is not None}
    if not times:
        return None, None
    p = min(times, key=times.get)
    return p, times[p]
