"""The kernel targets (issue 3), checked against one benchmark run's results: met or not, and how far.

    published shapes (64x256x128, 128x256x256, 1024x1024x1024), every dtype and activation:
        eager wall / ours wall >= 2                 (wall time per call from Python)
        ours device <= cuBLASLt epilogue device     (graph-replay device time)
    digits MLP, batch 1-256: ours device <= 6 us, and best anchor / ours >= 2
    wide MLP, batch 1: floor / ours >= 75%;  batch 4096: ours device <= F.linear + relu device

Device times are each provider's primary time (graph replay, kernel_results.primary). A target whose
cases were not measured (skipped, failed) says so instead of passing.
"""

from __future__ import annotations

from dataclasses import dataclass

from .kernel_results import best_anchor, primary, us, wall

PUBLISHED_SHAPES = ((64, 256, 128), (128, 256, 256), (1024, 1024, 1024))
DIGITS_DEVICE_US = 6.0
DIGITS_VS_ANCHOR = 2.0
EAGER_WALL_RATIO = 2.0
WIDE_FLOOR_FRACTION = 0.75


@dataclass(frozen=True)
class Check:
    target: str
    case: str
    measured: str
    goal: str
    met: bool | None  # None: not measured
    gap: str  # how far from the goal ("" when met)


def _need(factor: float) -> str:
    return f"needs {factor:.2f}x"


def _at_most(target: str, case: str, ours: float | None, limit: float | None, what: str) -> Check:
    if ours is None or limit is None:
        return Check(target, case, "not measured", f"<= {what}", None, "")
    met = ours <= limit
    return Check(target, case, f"{us(ours)} us", f"<= {us(limit)} us ({what})", met, "" if met else _need(ours / limit))


def _at_least(target: str, case: str, ratio: float | None, goal: float, fmt: str) -> Check:
    if ratio is None:
        return Check(target, case, "not measured", f">= {fmt.format(goal)}", None, "")
    met = ratio >= goal
    return Check(target, case, fmt.format(ratio), f">= {fmt.format(goal)}", met, "" if met else _need(goal / ratio))


def checks(results: dict) -> list[Check]:
    """Every target's check over the cases this run has (only CUDA runs are judged)."""
    if results["meta"].get("device") != "cuda":
        return []
    out: list[Check] = []
    for case in results["layers"]:
        if (case["M"], case["K"], case["N"]) not in PUBLISHED_SHAPES:
            continue
        ps = case["providers"]
        label = f"{case['M']}x{case['K']}x{case['N']} {case['dtype']} {case['act']}"
        ours, eager, lt = ps.get("ours") or {}, ps.get("eager") or {}, ps.get("cublaslt") or {}
        w_ours, w_eager = wall(ours), wall(eager)
        ratio = w_eager / w_ours if (w_ours and w_eager) else None
        out.append(_at_least("published shape: eager wall / ours wall", label, ratio, EAGER_WALL_RATIO, "{:.2f}x"))
        out.append(_at_most("published shape: device time vs cuBLASLt", label, primary(ours), primary(lt), "cublaslt"))
    for case in results["models"]:
        ps = case["providers"]
        ours = primary(ps.get("ours") or {})
        label = f"{case['model']} batch {case['batch']} {case['dtype']}"
        if case["model"] == "digits-mlp" and case["batch"] <= 256:
            out.append(_at_most("digits MLP: device time", label, ours, DIGITS_DEVICE_US, "6 us"))
            name, t_best = best_anchor(case)
            ratio = t_best / ours if (ours and t_best) else None
            out.append(_at_least(f"digits MLP: best anchor ({name}) / ours", label, ratio, DIGITS_VS_ANCHOR, "{:.2f}x"))
        elif case["model"] == "wide-mlp" and case["batch"] == 1:
            frac = case["floor_us"] / ours if (ours and case.get("floor_us")) else None
            out.append(_at_least("wide MLP batch 1: floor / ours", label, frac, WIDE_FLOOR_FRACTION, "{:.0%}"))
        elif case["model"] == "wide-mlp" and case["batch"] == 4096:
            linear = primary(ps.get("linear") or {})
            out.append(_at_most("wide MLP batch 4096: vs F.linear + relu", label, ours, linear, "linear"))
    return out


def table(results: dict) -> list[str]:
    """Markdown lines: one row per check, and a count of met / not met / not measured."""
    rows = checks(results)
    if not rows:
        return []
    met = sum(c.met is True for c in rows)
    missed = sum(c.met is False for c in rows)
    unmeasured = sum(c.met is None for c in rows)
    lines = [
        "## Targets (issue 3)",
        "",
        f"{met} met, {missed} not met, {unmeasured} not measured. 'needs Nx': how much faster ours must get.",
        "",
        "| target | case | ours | goal | met |",
        "|---|---|---:|---:|---|",
    ]
    for c in rows:
        verdict = "not measured" if c.met is None else "yes" if c.met else f"**no** ({c.gap})"
        lines.append(f"| {c.target} | {c.case} | {c.measured} | {c.goal} | {verdict} |")
    return lines
