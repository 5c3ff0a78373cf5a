"""Plot fused vs unfused forward time across batch sizes from a spread table in bench/results.

    python -m bench.plot_forward [bench/results/forward_spread_h200.md] [--out bench/results/forward_spread_h200.png]

Reads the markdown table written alongside the forward timings (dtype, batch, unfused min-max,
fused min-max) and draws one panel per dtype: the range across processes as a band, its
midpoint as a line.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROW = re.compile(r"\| (\w+) \| (\d+) \| (\d+)-(\d+) \| (\d+)-(\d+) \|")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("table", nargs="?", type=Path, default=Path("bench/results/forward_spread_h200.md"))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    data: dict[str, list[tuple[int, float, float, float, float]]] = defaultdict(list)
    for m in ROW.finditer(args.table.read_text()):
        dt, b, ulo, uhi, flo, fhi = m.groups()
        data[dt].append((int(b), float(ulo), float(uhi), float(flo), float(fhi)))
    if not data:
        raise SystemExit(f"{args.table}: no rows like '| float32 | 1 | 72-89 | 122-224 |'")
    fig, axes = plt.subplots(1, len(data), figsize=(4.2 * len(data), 3.6), sharey=True)
    for ax, (dt, rows) in zip(axes if len(data) > 1 else [axes], data.items(), strict=True):
        rows.sort()
        b = [r[0] for r in rows]
        for lo_i, hi_i, label, color in ((1, 2, "unfused (torch: mm, add, act)", "tab:gray"),
                                         (3, 4, "fused (Triton: 1 kernel a layer)", "tab:red")):  # fmt: skip
            lo = [r[lo_i] for r in rows]
            hi = [r[hi_i] for r in rows]
            ax.fill_between(b, lo, hi, color=color, alpha=0.25)
            ax.plot(b, [(x + y) / 2 for x, y in zip(lo, hi, strict=True)], "o-", color=color, label=label)
        ax.set_xscale("log", base=2)
        ax.set_title(dt)
        ax.set_xlabel("batch rows")
        ax.grid(alpha=0.3)
    (axes[0] if len(data) > 1 else axes).set_ylabel("wall us per forward (range over processes)")
    (axes[0] if len(data) > 1 else axes).legend(fontsize=8, loc="upper left")
    fig.suptitle("digits-mlp forward, NVIDIA H200: both modes launch-bound (see README)", fontsize=10)
    fig.tight_layout()
    out = args.out or args.table.with_suffix(".png")
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
