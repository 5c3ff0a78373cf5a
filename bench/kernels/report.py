"""The benchmark's outputs: kernels_<gpu>.md (tables), kernels_<gpu>.json (raw results), the summary
printed last (the device call returns only the last 12,000 characters), and the plot (plot.py).

A provider's result: {"plain": cell, "graph": cell, "compile_s", "seconds"} or {"na" | "error" |
"skipped": why}; a cell: {"device_us", "wall_us", "err", "finite", "bad"} or {"error": why}; a graph
cell on CUDA also {"hot_us", "hot_replays", "hot_host_bound"} (timing.py, "hot").
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .plot import plot
from .results import ANCHORS, best_anchor, best_cudnn, hot, primary, us, wall
from .targets import checks
from .targets import table as targets_table


def _cells(res: dict) -> list[dict]:
    return [c for k, c in res.items() if k in ("plain", "graph") and isinstance(c, dict)]


def ours_failed(results: dict) -> bool:
    """True when one of ours computed a wrong or non-finite result anywhere."""
    return any(
        c.get("bad")
        for section in ("layers", "models", "convs")
        for case in results.get(section, [])
        for name, res in case["providers"].items()
        if name.startswith("ours")
        for c in _cells(res)
    )


def max_error(case: dict) -> tuple[float | None, list[str]]:
    """(largest error over every provider and variant but those with a bound of their own (ours-float8:
    case["error_bounds"]), providers over their bound or non-finite)."""
    errs, bad = [], []
    own = case.get("error_bounds", {})
    for name, res in case["providers"].items():
        for c in _cells(res):
            if c.get("err") is not None and name not in own:
                errs.append(c["err"])
            if c.get("bad") and name not in bad:
                bad.append(name)
    return (max(errs) if errs else None), bad


def own_bound_errors(case: dict) -> list[tuple[str, float, float]]:
    """(provider, its largest error, its bound) for each provider measured with a bound of its own (ours-float8)."""
    out = []
    for name, bound in case.get("error_bounds", {}).items():
        errs = [c["err"] for c in _cells(case["providers"].get(name, {})) if c.get("err") is not None]
        if errs:
            out.append((name, max(errs), bound))
    return out


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "—"


def _pct_floor(case: dict, res: dict | None) -> str:
    t = primary(res) if res else None
    if not t or not case.get("floor_us"):
        return "—"
    pct = 100 * case["floor_us"] / t
    # One significant figure below 10%, where .1g would round 9.96 up to "1e+01"; whole percents above.
    return f"{pct:.0f}%" if pct >= 9.5 else f"{pct:.1g}%"


class _Notes:
    """Numbered footnotes for n/a reasons and errors; one number per distinct text."""

    def __init__(self):
        self.items: dict[str, int] = {}

    def ref(self, text: str) -> str:
        n = self.items.setdefault(_md(text), len(self.items) + 1)
        return f"[{n}]"

    def lines(self) -> list[str]:
        return [f"{n}. {text}" for text, n in self.items.items()]


def _md(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def _cell_text(name: str, res: dict, fields: list, notes: _Notes) -> str:
    if "skipped" in res:
        return "skip"
    if "na" in res:
        return "n/a" + notes.ref(f"{name}: {res['na']}")
    if "error" in res:
        return "**ERR**" + notes.ref(f"{name}: {res['error']}")
    parts = []
    for field in fields:
        variant, key = field
        cell = res.get(variant) if variant != "any" else (res.get("plain") or res.get("graph"))
        if not cell:
            parts.append("—")
        elif "error" in cell:
            parts.append("ERR" + notes.ref(f"{name} ({variant}): {cell['error']}"))
        elif "na" in cell:
            parts.append("n/a" + notes.ref(f"{name} ({variant}): {cell['na']}"))
        else:
            host = key == "hot_us" and cell.get("hot_host_bound")
            parts.append(us(cell.get(key)) + (" **host**" if host else ""))
    bad = any(c.get("bad") for c in _cells(res))
    return " / ".join(parts) + (" **!**" if bad else "")


def _err_text(case: dict) -> str:
    m, bad = max_error(case)
    text = f"{m:.1e}" if m is not None else "—"
    text += "".join(f"; {name} {e:.1e} (bound {b:.2g})" for name, e, b in own_bound_errors(case))
    if bad:
        own = case.get("error_bounds", {})
        names = ", ".join(f"{n} (over {own[n]:.2g})" if n in own else n for n in bad)
        text += f" **over {case['error_bound']:.0e} or not finite: {names}**"
    return text


def markdown(results: dict) -> str:
    meta = results["meta"]
    cuda = meta["device"] == "cuda"
    notes = _Notes()
    c = meta["ceilings"]
    rates = " / ".join(
        f"{dt}{' (TF32)' if dt == 'float32' and meta['tf32'] else ''} **{r / 1e12:.1f}**"
        for dt, r in c["matmul_rate"].items()
    )
    side = c["matmul_side"]
    lines = [
        f"# Kernel benchmark: {meta['gpu']}",
        "",
        f"{'GPU' if cuda else 'Device'} **{meta['gpu']}** · torch {meta['torch']} · triton {meta['triton']} · "
        f"CUDA {meta['cuda'] or 'none'} · "
        f"TF32 **{'on' if meta['tf32'] else 'off'}** · copy bandwidth **{c['bandwidth'] / 1e9:.0f} GB/s** · "
        f"matmul ({side}^3, random data) {rates} TFLOP/s · started {meta['started_utc']}, "
        f"took {meta.get('elapsed_s', 0):.0f} s",
        "",
        _command_line(meta),
        "",
    ]
    if cuda:
        # Results written before the wall runs were interleaved (no "wall_interleaved") keep their own method.
        if meta.get("timing", {}).get("wall_interleaved"):
            wall = (
                "GC off, best of 5 runs; a case's providers take turns run by run, so they see the same host "
                "(torch.compile ones: their 5 runs on the spot)"
            )
        else:
            wall = "best of 5 runs (the same rule for every provider)"
        # Results written before cold_timing (no "l2_clear") were timed by do_bench, which zeroes 256 MB.
        if meta.get("timing", {}).get("l2_clear") == "read":
            device = "median, L2 cleared by reading 256 MB before every rep (kernels/cold_timing.py)"
        else:
            device = "median of `triton.testing.do_bench` (L2 flushed by zeroing 256 MB before every rep)"
        hot_text = ""
        if meta.get("timing", {}).get("hot"):
            h = meta["timing"]["hot"]
            hot_text = (
                f"Hot: the same graph replayed back to back, weights warm in L2, as a busy server runs it: "
                f"N replays between two events (N so a window lasts >= {h['window_us'] / 1e3:.0f} ms, "
                f"{h['min_replays']} to {h['max_replays']}), median of {h['windows']} windows, a spin kernel "
                "queued first so that the host's launch gaps stay hidden (**host** marks a cell where they did not). "
            )
        lines.append(
            f"Device time{' (cold)' if hot_text else ''}: {device}; graph: the call "
            f"captured once into a CUDA graph and replayed. {hot_text}"
            "Wall: host time per call, calls back-to-back from "
            f"Python, one synchronize at the end, {wall}. "
            "Floor: max(bytes / copy bandwidth, flops / matmul rate), bytes = inputs and weights read once, "
            "output written once. Error: ||y - ref|| / ||ref|| vs "
            "float64 on the same dtype-cast inputs; **!** marks a result over the bound or not finite."
        )
    else:
        lines.append(
            "CPU smoke run: no CUDA graphs and no device timer, so every time is wall time per call "
            "(ours through Triton's interpreter: it checks the path, not the speed)."
        )

    targets = targets_table(results)
    if targets:
        lines += ["", *targets]
    # Results written before hot timing (no timing "hot") keep their own tables: no hot in them.
    with_hot = cuda and bool(meta.get("timing", {}).get("hot"))
    if results["layers"]:
        lines += ["", *_layer_table(results["layers"], cuda, notes, with_hot)]
    if results["models"]:
        lines += ["", *_model_tables(results["models"], cuda, notes, meta.get("model_dtype", ""), with_hot)]
        steps = _step_tables(results["models"], cuda)
        lines += ["", *steps] if steps else []
    if results.get("convs"):
        lines += ["", *_conv_table(results["convs"], cuda, notes)]
    if notes.items:
        lines += ["", "## Notes", "", *notes.lines()]
    providers = [
        res
        for sec in ("layers", "models", "convs")
        for case in results.get(sec, [])
        for res in case["providers"].values()
    ]
    if any("skipped" in res for res in providers):
        lines += ["", f"skip: left out to stay within --time-limit ({meta['time_limit_s']:.0f} s); the JSON says why."]
    return "\n".join(lines) + "\n"


def _layer_table(cases: list[dict], cuda: bool, notes: _Notes, with_hot: bool = True) -> list[str]:
    providers = list(dict.fromkeys(p for case in cases for p in case["providers"]))
    if with_hot:
        fields = [("graph", "device_us"), ("graph", "hot_us"), ("plain", "device_us"), ("plain", "wall_us")]
        legend = "graph cold / graph hot / plain cold / wall"
    elif cuda:
        fields = [("graph", "device_us"), ("plain", "device_us"), ("plain", "wall_us")]
        legend = "graph device / plain device / wall"
    else:
        fields, legend = [("plain", "wall_us")], "wall"
    head = ["M×K×N", "dtype", "act", "floor µs", *providers]
    head += ["eager wall / ours wall", "ours / cublaslt (device)", *(["ours / cublaslt (hot)"] if with_hot else [])]
    head += ["ours % floor", "max err"]
    lines = [
        "## Layers: y = act(x @ W^T + b)",
        "",
        f"Each provider's cell: {legend} µs per call. Ratios: eager wall / ours wall > 1 and "
        "ours / cublaslt < 1 mean ours is faster.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join(["---"] * 3 + ["---:"] * (len(head) - 3)) + "|",
    ]
    for case in cases:
        ps = case["providers"]
        row = [f"{case['M']}×{case['K']}×{case['N']}", case["dtype"], case["act"], us(case["floor_us"])]
        row += [_cell_text(p, ps[p], fields, notes) if p in ps else "—" for p in providers]
        ours = ps.get("ours")
        row.append(_ratio(wall(ps["eager"]) if "eager" in ps else None, wall(ours) if ours else None))
        row.append(_ratio(primary(ours) if ours else None, primary(ps["cublaslt"]) if "cublaslt" in ps else None))
        if with_hot:
            row.append(_ratio(hot(ours) if ours else None, hot(ps["cublaslt"]) if "cublaslt" in ps else None))
        row += [_pct_floor(case, ours), _err_text(case)]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _model_table(cases: list[dict], cuda: bool, notes: _Notes, dtype: str, with_hot: bool = True) -> list[str]:
    providers = list(dict.fromkeys(p for case in cases for p in case["providers"]))
    if with_hot:
        fields, legend = (
            [("graph", "device_us"), ("graph", "hot_us"), ("any", "wall_us")],
            "graph cold / graph hot / wall",
        )
    elif cuda:
        fields, legend = [("graph", "device_us"), ("any", "wall_us")], "graph device / wall"
    else:
        fields, legend = [("any", "wall_us")], "wall"
    head = ["model", "batch", "floor µs", *providers]
    head += ["best anchor", "ours / best"]
    head += ["best anchor (hot)", "ours / best (hot)"] if with_hot else []
    head += ["eager wall / ours wall", "ours % floor", "max err"]
    ours_name = "ours" if cuda else "ours-eager"  # no graphs on the CPU
    lines = [
        f"## Models: whole forward, {dtype}",
        "",
        f"Each provider's cell: {legend} µs per call (ours and ours-unfused-graph: one replay of "
        "the GraphedExecutor's graph for the bucket, the batch already in the graph's input, where the service's "
        "H2D copy puts it). Best anchor: the fastest of "
        f"{', '.join(p for p in ANCHORS if p in providers)}{' (cold, and separately hot)' if with_hot else ''}; "
        "ours / best < 1 means ours is "
        "faster." + _float8_legend(cases),
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join(["---", "---:"] + ["---:"] * (len(head) - 2)) + "|",
    ]
    for case in cases:
        ps = case["providers"]
        row = [case["model"], str(case["batch"]), us(case.get("floor_us"))]
        row += [_cell_text(p, ps[p], fields, notes) if p in ps else "—" for p in providers]
        ours = ps.get(ours_name)
        for time in (primary, hot) if with_hot else (primary,):
            best, t_best = best_anchor(case, time)
            row.append(f"{best} {us(t_best)}" if best else "—")
            row.append(_ratio(time(ours) if ours else None, t_best))
        row.append(_ratio(wall(ps["eager"]) if "eager" in ps else None, wall(ours) if ours else None))
        row += [_pct_floor(case, ours) if "floor_us" in case else "—", _err_text(case) if ps else "—"]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _float8_legend(cases: list[dict]) -> str:
    """A sentence on ours-float8 for a table that has it: what it runs, and its error bound."""
    with_float8 = [c for c in cases if "ours-float8" in c["providers"]]
    if not with_float8:
        return ""
    bounds = [c["error_bounds"]["ours-float8"] for c in with_float8 if "ours-float8" in c.get("error_bounds", {})]
    bound = f", against its own bound {max(bounds):.2g} (e4m3 is not fp16)" if bounds else ""
    return (" ours-float8: the fused executor in float8 (e4m3 steps; the first conv or linear, the classifier and "
            "convs on a 1x1 map in fp16), calibrated on other random rows than the timed ones, under the "
            f"GraphedExecutor as ours; its error is listed apart in the max err column{bound}.")  # fmt: skip


def _model_tables(cases: list[dict], cuda: bool, notes: _Notes, default_dtype: str, with_hot: bool = True) -> list[str]:
    """One table per model dtype (the digits MLP runs in fp16 and bf16), in the order the run met them."""
    dtypes = list(dict.fromkeys(c.get("dtype", default_dtype) for c in cases))
    lines: list[str] = []
    for dtype in dtypes:
        group = [c for c in cases if c.get("dtype", default_dtype) == dtype]
        lines += ([""] if lines else []) + _model_table(group, cuda, notes, dtype, with_hot)
    return lines


def _step_tables(cases: list[dict], cuda: bool) -> list[str]:
    """Each fused step against the same step unfused, for the cases that timed their steps (the ResNets): per model
    and dtype, the smallest and the largest batch."""
    timed = [c for c in cases if c.get("steps")]
    if not timed:
        return []
    how = ("device µs per step, the median of 20 replays of the service's timed graph (CUDA events around each step)"
           if cuda else "wall µs around each step of an eager forward")  # fmt: skip
    lines = ["## Models: each fused step", "", f"Fused against unfused, step by step ({how}); the unfused step runs "
             "the same ops one torch kernel at a time (conv, BatchNorm, add, activation).", ""]  # fmt: skip
    for key in dict.fromkeys((c["model"], c["dtype"]) for c in timed):
        group = [c for c in timed if (c["model"], c["dtype"]) == key]
        for case in sorted({id(c): c for c in (min(group, key=_batch), max(group, key=_batch))}.values(), key=_batch):
            fused = sum(r["fused_us"] for r in case["steps"])
            unfused = sum(r["unfused_us"] or 0.0 for r in case["steps"])
            lines += [f"{key[0]}, {key[1]}, batch {case['batch']}: {len(case['steps'])} steps, {us(fused)} µs fused "
                      f"against {us(unfused)} unfused ({_ratio(unfused, fused)})", "",
                      "| step | fused µs | unfused µs | unfused / fused |", "|---|---:|---:|---:|"]  # fmt: skip
            for r in case["steps"]:
                f, u = r["fused_us"], r["unfused_us"]
                lines.append(f"| {r['step']} | {us(f)} | {us(u)} | {_ratio(u, f)} |")
            lines.append("")
    return lines[:-1]


def _batch(case: dict) -> int:
    return case["batch"]


def _conv_table(cases: list[dict], cuda: bool, notes: _Notes) -> list[str]:
    providers = list(dict.fromkeys(p for case in cases for p in case["providers"]))
    fields = [("graph", "device_us"), ("graph", "hot_us"), ("plain", "wall_us")] if cuda else [("plain", "wall_us")]
    legend = "graph cold / graph hot / wall" if cuda else "wall"
    head = ["layer C→OC H×W", "batch", "floor µs", *providers, "best cuDNN", "ours / cuDNN"]
    head += ["best cuDNN (hot)", "ours / cuDNN (hot)"] if cuda else []
    head += ["ours % floor", "max err"]
    lines = [
        "## Conv layers of the wider CNN: relu(conv2d(x, W) + b), 3×3, padding 1, x and y channels_last "
        f"(as the fused executor runs them), {cases[0]['dtype']}",
        "",
        f"Each provider's cell: {legend} µs per call. Best cuDNN: the faster of cudnn (F.conv2d with its bias, "
        "then ReLU) and cudnn-fused (torch.cudnn_convolution_add_relu); ours / cuDNN <= 1.10 is issue 20's target.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join(["---", "---:"] + ["---:"] * (len(head) - 2)) + "|",
    ]
    for case in cases:
        ps = case["providers"]
        row = [case["layer"], str(case["batch"]), us(case.get("floor_us"))]
        row += [_cell_text(p, ps[p], fields, notes) if p in ps else "—" for p in providers]
        ours = ps.get("ours")
        for time in (primary, hot) if cuda else (primary,):
            best, t_best = best_cudnn(case, time)
            row.append(f"{best} {us(t_best)}" if best else "—")
            row.append(_ratio(time(ours) if ours else None, t_best))
        row += [_pct_floor(case, ours), _err_text(case)]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def summary(results: dict) -> str:
    """A short fixed-width table for the end of the output."""
    cuda = results["meta"]["device"] == "cuda"
    what = "device us, graph replay" if cuda else "wall us (CPU)"
    out = []
    if results["layers"]:
        out += [f"== layers ({what}; ours/cublaslt < 1 and eager/ours wall > 1: ours faster) =="]
        out.append(
            f"{'case':34s} {'floor':>7s} {'eager':>7s} {'cublaslt':>8s} {'ours':>7s} "
            f"{'ours/lt':>7s} {'hot o/lt':>8s} {'eag/ours wall':>13s} {'%floor':>6s}  err"
        )
        for case in results["layers"]:
            ps = case["providers"]
            ours, lt, eager = ps.get("ours") or {}, ps.get("cublaslt") or {}, ps.get("eager") or {}
            m, bad = max_error(case)
            label = f"{case['M']}x{case['K']}x{case['N']} {case['dtype']} {case['act']}"
            out.append(
                f"{label:34s} {us(case['floor_us']):>7s} {us(primary(eager)):>7s} {us(primary(lt)):>8s} "
                f"{us(primary(ours)):>7s} {_ratio(primary(ours), primary(lt)):>7s} {_ratio(hot(ours), hot(lt)):>8s} "
                f"{_ratio(wall(eager), wall(ours)):>13s} {_pct_floor(case, ours):>6s}  "
                f"{'-' if m is None else f'{m:.0e}'}{' BAD: ' + ','.join(bad) if bad else ''}"
            )
    if results["models"]:
        ours_name = "ours" if cuda else "ours-eager"
        out += ["", f"== models ({what}, cold then hot; {ours_name} / best < 1: ours faster) =="]
        out.append(
            f"{'model':12s} {'dtype':>8s} {'batch':>5s} {'floor':>7s} {'best anchor':>20s} {ours_name:>10s} "
            f"{'ours/best':>9s} {'hot best':>8s} {'hot ours':>8s} {'hot o/b':>7s} {'eag/ours wall':>13s} "
            f"{'%floor':>6s}  err"
        )
        for case in results["models"]:
            ps = case["providers"]
            ours, eager = ps.get(ours_name) or {}, ps.get("eager") or {}
            best, t_best = best_anchor(case)
            _, h_best = best_anchor(case, hot)
            m, bad = max_error(case)
            anchor = f"{best} {us(t_best)}" if best else "-"
            out.append(
                f"{case['model']:12s} {case.get('dtype', ''):>8s} {case['batch']:>5d} {us(case.get('floor_us')):>7s} "
                f"{anchor:>20s} {us(primary(ours)):>10s} {_ratio(primary(ours), t_best):>9s} "
                f"{us(h_best):>8s} {us(hot(ours)):>8s} {_ratio(hot(ours), h_best):>7s} "
                f"{_ratio(wall(eager), wall(ours)):>13s} "
                f"{_pct_floor(case, ours) if 'floor_us' in case else '-':>6s}  "
                f"{'-' if m is None else f'{m:.0e}'}{' BAD: ' + ','.join(bad) if bad else ''}"
                f"{_float8_text(ps, ours, ours_name)}"
            )

    if results.get("convs"):
        out += ["", f"== wider CNN's convs ({what}, cold then hot; ours / cuDNN <= 1.10: the target) =="]
        out.append(
            f"{'layer':16s} {'batch':>5s} {'floor':>7s} {'best cuDNN':>18s} {'ours':>7s} {'o/cuDNN':>7s} "
            f"{'hot cuDNN':>9s} {'hot ours':>8s} {'hot o/c':>7s}  err"
        )
        for case in results["convs"]:
            ours = case["providers"].get("ours") or {}
            best, t_best = best_cudnn(case)
            _, h_best = best_cudnn(case, hot)
            m, bad = max_error(case)
            anchor = f"{best} {us(t_best)}" if best else "-"
            out.append(
                f"{case['layer']:16s} {case['batch']:>5d} {us(case.get('floor_us')):>7s} {anchor:>18s} "
                f"{us(primary(ours)):>7s} {_ratio(primary(ours), t_best):>7s} {us(h_best):>9s} "
                f"{us(hot(ours)):>8s} {_ratio(hot(ours), h_best):>7s}  "
                f"{'-' if m is None else f'{m:.0e}'}{' BAD: ' + ','.join(bad) if bad else ''}"
            )
    targets = checks(results)
    if targets:
        missed = [c for c in targets if c.met is not True]
        out += ["", f"== targets: {len(targets) - len(missed)} of {len(targets)} met =="]
        out += [f"not met: {c.target}, {c.case}: {c.measured} (goal {c.goal}) {c.gap}".rstrip() for c in missed]
    return "\n".join(out)


def _float8_text(ps: dict, ours: dict, ours_name: str) -> str:
    """The summary's float8 cell after a model row, where the run has ours-float8: its time (cold/hot) and its ratio to
    ours in float16 (< 1: float8 faster), its error; or why it did not run."""
    res = ps.get("ours-float8")
    if res is None:
        return ""
    why = res.get("na") or res.get("error") or res.get("skipped")
    if why:
        return f" | float8 {'n/a' if 'na' in res else 'ERR' if 'error' in res else 'skip'}: {why}"
    errs = [c["err"] for c in _cells(res) if c.get("err") is not None]
    h = f"/{us(hot(res))}" if hot(res) is not None else ""
    ratio = _ratio(primary(res), primary(ours)) + (f"/{_ratio(hot(res), hot(ours))}" if h else "")
    return (f" | float8 {us(primary(res))}{h} us, {ratio} {ours_name}, err "
            f"{f'{max(errs):.0e}' if errs else '-'}")  # fmt: skip


def _finite(obj):
    """JSON without NaN/Infinity (not JSON): non-finite floats become null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def write_report(results: dict, out_dir: Path, slug: str, *, png: bool) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / f"kernels_{slug}.md"
    md.write_text(markdown(results))
    js = out_dir / f"kernels_{slug}.json"
    js.write_text(json.dumps(_finite(results), indent=1, allow_nan=False) + "\n")
    paths = [md, js]
    if png:
        p = plot(results, out_dir / f"kernels_{slug}.png")
        if p is not None:
            paths.append(p)
    return paths


SECTIONS = ("layers", "models", "convs")


def _command_line(meta: dict) -> str:
    """The run's command, or for a report merged from several device calls (`merge`) each run's command and its
    commit where recorded."""
    runs = meta.get("merged_from")
    if not runs:
        return f"Command: `{meta['command']}`"
    each = "; ".join(f"`{r['command']}`" + (f" at commit {r['commit']}" if r.get("commit") else "") for r in runs)
    return f"Merged from {len(runs)} runs, their cases kept as each measured them: {each}"


def merge(parts: list[dict]) -> dict:
    """One results dict from runs of the same GPU that split the sections between them (each run ran
    with its own --sections, e.g. in two device calls when one cannot hold everything): the cases of every
    section in the order given, the first run's meta, with each run's command, start and seconds kept under
    "merged_from" and "elapsed_s" their sum. Refuses runs of different GPUs, TF32 settings or versions."""
    if not parts:
        raise ValueError("nothing to merge")
    first = parts[0]["meta"]
    for p in parts[1:]:
        m = p["meta"]
        for key in ("gpu", "device", "tf32", "torch", "triton"):
            if m.get(key) != first.get(key):
                raise ValueError(f"cannot merge runs whose {key} differs: {first.get(key)!r} and {m.get(key)!r}")
    meta = dict(first)
    meta["merged_from"] = [
        {k: p["meta"].get(k) for k in ("command", "commit", "started_utc", "elapsed_s", "time_limit_s")} for p in parts
    ]
    meta["elapsed_s"] = round(sum(p["meta"].get("elapsed_s", 0) for p in parts), 1)
    merged = {"meta": meta}
    for section in SECTIONS:
        merged[section] = [case for p in parts for case in p.get(section, [])]
    return merged


def main(argv: list[str] | None = None) -> int:
    """Re-render a run's markdown (and plot) from its JSON, e.g. after the report gained a section; with
    several JSON files of one GPU, merge them first (see `merge`) and write the merged report to --out."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench.kernels.report", description=main.__doc__)
    parser.add_argument(
        "json", type=Path, nargs="+", help="kernels_<gpu>.json files written by `fusedserve bench kernels`"
    )
    parser.add_argument("--png", action="store_true", help="redraw the plot too (needs matplotlib)")
    parser.add_argument("--out", type=Path, help="where to write [the first JSON's directory]")
    args = parser.parse_args(argv)
    parts = [json.loads(path.read_text()) for path in args.json]
    results = merge(parts) if len(parts) > 1 else parts[0]
    out = args.out or args.json[0].parent
    for path in write_report(results, out, results["meta"]["slug"], png=args.png):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
