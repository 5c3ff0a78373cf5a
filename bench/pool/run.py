"""The run behind `python -m bench.pool` (bench/pool/cli.py parses the flags and says what is measured).

Timing: device time cold is kernels.cold_timing.cold_us (L2 cleared by reading 256 MB before each call);
hot is the mean of back-to-back calls between two events after a warm-up (inputs in L2 where they fit, as a
busy server's are); end to end is the host's wall clock around H2D copy + op + D2H copy + synchronize, the
best of a few runs (bench/kernels/timing.timed_run). CPU time is the wall clock, best of a few runs.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.cold_timing import cold_us
from kernels.pool import fused_pool2d

from ..gpu import results_dir, slug_of
from ..kernels.timing import back_to_back_us, timed_run

DTYPES = {"float32": torch.float32, "float16": torch.float16}
ERROR_BOUND = {"float32": 1e-5, "float16": 1e-3}  # normwise, against float64: one rounding of the output


def _torch_op(k: int):
    def op(x):
        return torch.relu(F.avg_pool2d(x, k, k))  # eager: 2 kernels

    return op


def _ours_op(k: int):
    def op(x):
        return fused_pool2d(x, "avg", k, k, activation="relu")

    return op


def _best_wall_us(fn, runs: int, device: torch.device) -> float:
    return min(timed_run(fn, 1, device) for _ in range(runs)) * 1e6


def _copy_bandwidth() -> float:
    """Bytes per second read + written by a 1 GiB device-to-device copy: the floor's rate."""
    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda").normal_()
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / (cold_us(lambda: dst.copy_(src), rep_ms=200) / 1e6)


MAX_ELEMENTS = 1 << 28  # 1 GiB of fp32 input: larger cases are left out


def _cases(plan: dict):
    for dtype in plan["dtypes"]:
        for k in plan["windows"]:
            for n, c in plan["batch_channels"]:
                for s in plan["sizes"]:
                    if n * c * s * s <= MAX_ELEMENTS and s >= k:
                        yield {"dtype": dtype, "k": k, "n": n, "c": c, "size": s}


def _measure_case(case: dict, plan: dict, bandwidth: float | None, started: float, notes: list[str]) -> dict:
    cuda = plan["device"] == "cuda"
    device = torch.device(plan["device"])
    dtype, k, s = DTYPES[case["dtype"]], case["k"], case["size"]
    shape = (case["n"], case["c"], s, s)
    host = torch.randn(shape).to(dtype)
    x = host.to(device)
    ref = torch.relu(F.avg_pool2d(x.double(), k, k))
    out_numel = ref.numel()
    nbytes = (x.numel() + out_numel) * x.element_size()
    row = {**case, "bytes": nbytes, "providers": {}}
    if bandwidth:
        row["floor_us"] = nbytes / bandwidth * 1e6
    quick = plan["quick"]
    reps = 3 if quick else 5
    hosts = {}  # end-to-end buffers, pinned once per case: (input, output) by memory kind
    if cuda:
        hosts["pinned"] = (host.pin_memory(), torch.empty(ref.shape, dtype=dtype, pin_memory=True))
        hosts["pageable"] = (host, torch.empty(ref.shape, dtype=dtype))
    for name in plan["providers"]:
        cell: dict = {}
        try:
            if name == "cpu":
                torch.set_num_threads(os.cpu_count() or 1)
                op = _torch_op(k)
                cell["wall_us"] = _best_wall_us(lambda op=op: op(host), reps, torch.device("cpu"))
                row["providers"][name] = cell
                continue
            if name == "torch" and not cuda:
                continue  # on the CPU it is the `cpu` provider
            if name == "compile":
                if (case["n"], case["c"]) != (1, 1) or (cuda and s < 1024):
                    continue  # a compile per shape (seconds each): the single-plane sizes where bandwidth shows
                if time.perf_counter() - started > 0.6 * plan["time_limit"]:
                    notes.append(f"compile skipped from {case} on: 60% of --time-limit spent")
                    cell["skipped"] = True
                    row["providers"][name] = cell
                    continue
                torch._dynamo.reset()  # per shape, dynamic=False; and never the recompile limit's eager fallback
                op = torch.compile(_torch_op(k), dynamic=False)
            else:
                op = _ours_op(k) if name == "ours" else _torch_op(k)
            t = time.perf_counter()
            y = op(x)  # first call: compile, or our tuning
            if cuda:
                torch.cuda.synchronize()
            cell["first_call_s"] = time.perf_counter() - t
            err = float((y.double() - ref).norm() / ref.norm())
            cell["err"] = err
            cell["bad"] = not math.isfinite(err) or err > ERROR_BOUND[case["dtype"]]
            del y
            if not cuda:
                cell["wall_us"] = _best_wall_us(lambda op=op: op(x), reps, device)
                row["providers"][name] = cell
                continue
            timing = (5, 20) if quick else (10, 50)
            cell["cold_us"] = cold_us(lambda op=op: op(x), warmup_ms=timing[0], rep_ms=timing[1])
            cell["hot_us"] = back_to_back_us(lambda op=op: op(x), 20 if quick else 100, warmups=3)
            for memory, (src, dst) in hosts.items():

                def e2e(op=op, src=src, dst=dst):
                    dst.copy_(op(src.to(device, non_blocking=True)), non_blocking=True)

                cell[f"e2e_{memory}_us"] = _best_wall_us(e2e, reps, device)
        except Exception as e:  # a failing provider is a result, never the end of the run
            cell = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}
        row["providers"][name] = cell
        if cuda:
            torch.cuda.empty_cache()
    return row


def _crossovers(rows: list[dict], key: str) -> dict:
    """Per (N, C, dtype, window): the smallest size from which ours' `key` time beats the CPU at every larger
    size measured (None: never)."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(f"{r['n']}x{r['c']} {r['dtype']} k{r['k']}", []).append(r)
    out = {}
    for name, group in groups.items():
        group.sort(key=lambda r: r["size"])
        wins = [
            (r["providers"].get("ours", {}).get(key) or math.inf) < (r["providers"].get("cpu", {}).get("wall_us") or 0)
            for r in group
        ]
        first = None
        for i in range(len(group)):
            if all(wins[i:]):
                first = group[i]["size"]
                break
        out[name] = first
    return out


def _fmt(v, digits=1) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{digits}f}" if abs(v) < 1e5 else f"{v:.3g}"
    return str(v)


def _markdown(result: dict) -> str:
    rows, cuda = result["rows"], result["device"] != "cpu"
    lines = [
        f"# AvgPool2D + ReLU on {result['gpu']}",
        "",
        f"Command: `{result['command']}`; torch {result['torch']}, triton {result['triton']}.",
        "",
    ]
    if cuda:
        bw = result["bandwidth"] / 1e9
        lines += [
            f"Bandwidth floor: (input + output bytes) / {bw:.0f} GB/s (a 1 GiB device copy, measured in this run).",
            "Device times cold (L2 cleared before each call) and hot (back to back); end to end: H2D + op + D2H,",
            "synchronised, host wall clock. CPU: torch on all cores, wall clock. Times in µs.",
            "",
            "| N×C×S² | dtype | k | floor | cpu | torch cold / hot | compile cold / hot | ours cold / hot "
            "| ours % floor | torch / ours (cold) | e2e pinned torch / ours | e2e pageable torch / ours | ours err |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
    else:
        lines += ["CPU smoke run: wall time per call (µs); ours through Triton's interpreter.", ""]
        lines += ["| N×C×S² | dtype | k | cpu | ours | ours err |", "|---|---|---|---|---|---|"]
    for r in rows:
        p = r["providers"]

        def get(name, key, p=p):
            return p.get(name, {}).get(key)

        shape = f"{r['n']}×{r['c']}×{r['size']}²"
        ours_err = get("ours", "err")
        err = ("**" + _fmt(ours_err, 3) + " WRONG**") if get("ours", "bad") else _fmt(ours_err, 3)
        if ours_err is not None:
            err = f"{ours_err:.1e}" + (" **WRONG**" if get("ours", "bad") else "")
        if not cuda:
            lines.append(f"| {shape} | {r['dtype']} | {r['k']} | {_fmt(get('cpu', 'wall_us'))} | "
                         f"{_fmt(get('ours', 'wall_us'))} | {err} |")  # fmt: skip
            continue
        ours_cold = get("ours", "cold_us")
        pct = 100 * r["floor_us"] / ours_cold if ours_cold else None
        speedup = get("torch", "cold_us") / ours_cold if ours_cold and get("torch", "cold_us") else None

        def pair(name):
            if get(name, "error"):
                return "error"
            if get(name, "skipped"):
                return "skipped"
            return f"{_fmt(get(name, 'cold_us'))} / {_fmt(get(name, 'hot_us'))}"

        lines.append(
            f"| {shape} | {r['dtype']} | {r['k']} | {_fmt(r['floor_us'])} | {_fmt(get('cpu', 'wall_us'))} | "
            f"{pair('torch')} | {pair('compile')} | {pair('ours')} | {_fmt(pct, 0)}% | {_fmt(speedup, 2)}x | "
            f"{_fmt(get('torch', 'e2e_pinned_us'))} / {_fmt(get('ours', 'e2e_pinned_us'))} | "
            f"{_fmt(get('torch', 'e2e_pageable_us'))} / {_fmt(get('ours', 'e2e_pageable_us'))} | {err} |"
        )
    if cuda:
        lines += ["", "## Where the GPU starts beating the CPU, end to end (ours, input and output on the host)", ""]
        for memory in ("pinned", "pageable"):
            for group, size in result[f"crossover_{memory}"].items():
                lines.append(f"- {memory}, {group}: from {size}²" if size else f"- {memory}, {group}: never here")
        lines += ["", "## Targets (issue 20): fused pooling + ReLU at 4096² and above", ""]
        for r in rows:
            ours, torch_cold = r["providers"].get("ours", {}), r["providers"].get("torch", {}).get("cold_us")
            if r["size"] >= 4096 and ours.get("cold_us") and torch_cold:
                pct = 100 * r["floor_us"] / ours["cold_us"]
                ratio = torch_cold / ours["cold_us"]
                ok = "meets" if pct >= 85 and ratio >= 1.6 else "MISSES"
                lines.append(
                    f"- {r['n']}×{r['c']}×{r['size']}² {r['dtype']} k{r['k']}: {pct:.0f}% of floor (>= 85%), "
                    f"{ratio:.2f}x torch (>= 1.6x): {ok}"
                )
    if result["notes"]:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


def _plot(result: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install -e '.[tools]')", flush=True)
        return None
    rows = [r for r in result["rows"] if r["n"] == 1 and r["c"] == 1]
    panels = sorted({(r["dtype"], r["k"]) for r in rows})
    if not panels:
        return None
    cuda = result["device"] != "cpu"
    series = [("cpu", "wall_us", "CPU torch (wall)")]
    if cuda:
        series += [("torch", "cold_us", "torch pool+relu (cold)"), ("compile", "cold_us", "torch.compile (cold)"),
                   ("ours", "cold_us", "ours (cold)"), ("ours", "e2e_pinned_us", "ours e2e, pinned"),
                   ("ours", "e2e_pageable_us", "ours e2e, pageable")]  # fmt: skip
    else:
        series += [("ours", "wall_us", "ours (interpreted)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
    for ax, (dtype, k) in zip(axes[0], panels, strict=True):
        panel = sorted((r for r in rows if r["dtype"] == dtype and r["k"] == k), key=lambda r: r["size"])
        sizes = [r["size"] for r in panel]
        for name, key, label in series:
            ys = [r["providers"].get(name, {}).get(key) for r in panel]
            if any(y is not None for y in ys):
                ax.plot(sizes, [y if y is not None else float("nan") for y in ys], marker="o", label=label)
        if cuda:
            ax.plot(sizes, [r["floor_us"] for r in panel], "k--", label="bandwidth floor")
        ax.set_xscale("log", base=2)
        ax.set(yscale="log", xlabel="S (input S×S, N=C=1)", ylabel="µs", title=f"{dtype}, k{k} s{k}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"AvgPool2D + ReLU on {result['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def execute(plan: dict, command: str) -> int:
    import triton

    torch.manual_seed(plan["seed"])
    cuda = plan["device"] == "cuda"
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    slug = slug_of(gpu) if cuda else "cpu"  # the kernel benchmark's names: "h200", "h100"
    started = time.perf_counter()
    bandwidth = _copy_bandwidth() if cuda else None
    if cuda:
        torch.cuda.empty_cache()  # the copy's 2 GiB
    notes: list[str] = []
    rows = []
    for case in _cases(plan):
        rows.append(_measure_case(case, plan, bandwidth, started, notes))
        print(f"pool {case} done at {time.perf_counter() - started:.0f} s", flush=True)
    result = {
        "command": command,
        "device": plan["device"],
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "bandwidth": bandwidth,
        "rows": rows,
        "notes": notes,
        "seconds": time.perf_counter() - started,
    }
    if cuda:
        result["crossover_pinned"] = _crossovers(rows, "e2e_pinned_us")
        result["crossover_pageable"] = _crossovers(rows, "e2e_pageable_us")
    out = Path(plan["out"] or results_dir(slug))
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"pool_{slug}"
    base.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
    md = _markdown(result)
    base.with_suffix(".md").write_text(md)
    png = _plot(result, base.with_suffix(".png"))
    print(md)
    print(f"wrote {base}.md, {base}.json" + (f", {png}" if png else ""), flush=True)
    wrong = [r for r in rows if r["providers"].get("ours", {}).get("bad")]
    return 1 if wrong else 0
