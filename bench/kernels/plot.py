"""kernels_<gpu>.png: top row, one panel per model and dtype (cold time vs batch, log-log, a line per
provider, ours highlighted and ours hot dotted, the floor dashed); bottom row, one panel per layer dtype
(ours vs cuBLASLt vs eager per case).

matplotlib is optional (the `tools` extra): without it the plot is skipped with a message and the
markdown and JSON are still written.
"""

from __future__ import annotations

from pathlib import Path

from .results import primary

OURS_STYLE = {"color": "tab:red", "linewidth": 3, "zorder": 5}
# One color per model provider, none of them ours's red but ours-eager's dashed pink.
MODEL_STYLES = {
    "eager": {"color": "tab:gray"},
    "linear": {"color": "tab:orange"},
    "compile": {"color": "tab:green"},
    "compile-max": {"color": "tab:blue"},
    "ours-unfused-graph": {"color": "tab:brown"},
    "ours-eager": {"color": "tab:pink", "linestyle": "--"},
    "ours": OURS_STYLE,
}
LAYER_SERIES = (("eager", "tab:gray", "s"), ("cublaslt", "tab:blue", "^"), ("ours", "tab:red", "o"))


def plot(results: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install -e '.[tools]')", flush=True)
        return None
    cuda = results["meta"]["device"] == "cuda"
    ylabel = "device µs per call (graph replay)" if cuda else "wall µs per call (CPU)"
    models = list(dict.fromkeys((c["model"], c["dtype"]) for c in results["models"]))  # digits MLP: fp16, bf16
    dtypes = list(dict.fromkeys(c["dtype"] for c in results["layers"]))
    rows = [r for r in (models, dtypes) if r]
    if not rows:
        return None
    ncols = max(len(r) for r in rows)
    fig, axes = plt.subplots(len(rows), ncols, figsize=(5.5 * ncols, 4.2 * len(rows)), squeeze=False)
    for ax in axes.flat:
        ax.set_visible(False)
    r = 0
    if models:
        for ax, (model, dtype) in zip(axes[r], models, strict=False):
            cases = [c for c in results["models"] if (c["model"], c["dtype"]) == (model, dtype)]
            _model_panel(ax, cases, model, ylabel)
        r += 1
    if dtypes:
        for ax, dtype in zip(axes[r], dtypes, strict=False):
            _layer_panel(ax, [c for c in results["layers"] if c["dtype"] == dtype], dtype, ylabel)
    fig.suptitle(f"fusedserve bench kernels: {results['meta']['gpu']}, torch {results['meta']['torch']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _model_panel(ax, cases: list[dict], model: str, ylabel: str) -> None:
    ax.set_visible(True)
    providers = list(dict.fromkeys(p for c in cases for p in c["providers"]))
    for p in providers:
        pts = [(c["batch"], primary(c["providers"][p])) for c in cases if p in c["providers"]]
        pts = [(b, t) for b, t in pts if t is not None]
        if pts:
            style = MODEL_STYLES.get(p, {})
            ax.plot(*zip(*pts, strict=True), marker="o", markersize=3, label=p, **style)
    hot = [(c["batch"], (c["providers"].get("ours", {}).get("graph") or {}).get("hot_us")) for c in cases]
    hot = [(b, t) for b, t in hot if t is not None]
    if hot:  # ours back to back (weights warm in L2): what a busy server gets
        ax.plot(*zip(*hot, strict=True), color="tab:red", linestyle=":", linewidth=2, label="ours hot")
    floor = [(c["batch"], c["floor_us"]) for c in cases if c.get("floor_us")]
    if floor:
        ax.plot(*zip(*floor, strict=True), "k--", linewidth=1, label="floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(f"{model} forward, {cases[0]['dtype']}", fontsize=10)
    ax.set_xlabel("batch rows")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)


def _layer_panel(ax, cases: list[dict], dtype: str, ylabel: str) -> None:
    ax.set_visible(True)
    xs = list(range(len(cases)))
    for name, color, marker in LAYER_SERIES:
        pts = [(i, primary(c["providers"].get(name) or {})) for i, c in enumerate(cases)]
        pts = [(i, t) for i, t in pts if t is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), linestyle="none", marker=marker, color=color, label=name, markersize=6)
    ax.plot(xs, [c["floor_us"] for c in cases], "k_", markersize=12, label="floor")
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{c['M']}x{c['K']}x{c['N']}\n{c['act']}" for c in cases], fontsize=6, rotation=60)
    ax.set_yscale("log")
    ax.set_title(f"one layer act(x @ W^T + b), {dtype}", fontsize=10)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, which="both", axis="y")
    ax.legend(fontsize=7)
