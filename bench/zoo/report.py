"""The zoo's results as JSON and markdown: the check's table per (family, exporter), the importer's worklist (the
refusals grouped by the op they name), and the GPU timing table.

    python -m bench.zoo.report bench/results/cpu/zoo_cpu.json bench/results/h100/zoo_h100.json   # re-render, print
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

EXPORTER_ORDER = ("torchscript", "dynamo", "torch.export")


# ---- one record ----


def verdict(rec: dict) -> str:
    """One word or two: "export failed", "refused (Op)", "ok", "BAD" (an imported model that disagrees), "ERR"."""
    if not rec.get("exported", True):
        return "export failed"
    if not rec.get("imported"):
        op = (rec.get("refusal") or {}).get("op")
        return f"refused ({op})" if op else "refused"
    modes = rec.get("modes", {})
    if any("error" in m for m in modes.values()):
        return "ERR"
    if any(m.get("ok") is False for m in modes.values()):
        return "BAD"
    return "ok" if modes else "imported"


def _err(m: dict | None) -> str:
    if not m:
        return "—"
    if "error" in m:
        return "error: " + m["error"][:80]
    return f"{m['rel_err']:.1e} / {m['top1'] * 100:.0f}%" + ("" if m.get("ok") else " **BAD**")


def _parts(plan: dict | None) -> str:
    if not plan:
        return "—"
    parts = ", ".join(f"{k} x{v}" for k, v in plan.get("torch_parts", {}).items())
    return f"{plan['torch']}" + (f" ({parts})" if parts else "")


def _short(message: str, n: int = 160) -> str:
    message = message.replace("|", "\\|").replace("\n", " ")
    return message if len(message) <= n else message[: n - 1] + "…"


# ---- the check ----


def check_table(records: list[dict]) -> str:
    """Markdown: per (family, exporter), import, plan, agreement per mode, seconds."""
    lines = [
        "| family | exporter | imported | fused steps | torch-op steps (parts) | unfused: rel err / top-1 "
        "| fused: rel err / top-1 | export s | import+load s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        plan = r.get("plan")
        imported = "yes" if r.get("imported") else verdict(r)
        lines.append(
            f"| {r['title']} | {r['exporter']} | {imported} | {plan['fused'] if plan else '—'} | {_parts(plan)} "
            f"| {_err(r.get('modes', {}).get('unfused'))} | {_err(r.get('modes', {}).get('fused'))} "
            f"| {r.get('export_s', '—')} | {r.get('load_s', '—') if r.get('load_s') is not None else '—'} |"
        )
    return "\n".join(lines)


def worklist(records: list[dict]) -> dict[str, list[dict]]:
    """The refusals grouped by the op they name: {op: [record, ...]}, the most common op first."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        if r.get("exported", True) and not r.get("imported"):
            groups[(r.get("refusal") or {}).get("op") or "(no op named)"].append(r)
        elif not r.get("exported", True):
            groups["(export failed)"].append(r)
    return dict(sorted(groups.items(), key=lambda kv: -len(kv[1])))


def worklist_md(records: list[dict]) -> str:
    lines = []
    for op, recs in worklist(records).items():
        pairs = ", ".join(f"{r['family']} ({r['exporter']})" for r in recs)
        also = list(dict.fromkeys(o for r in recs for o in (r.get("refusal") or {}).get("ops", []) if o != op))
        first = recs[0]
        msg = (first.get("refusal") or {}).get("message") or first.get("export_error", "")
        named = f"; their messages also name {', '.join(also)}" if also else ""
        example = f"e.g. {first['family']} ({first['exporter']}): `{_short(msg, 300)}`"
        lines.append(f"- **{op}** ({len(recs)}): {pairs}{named}.  \n  {example}")
    return "\n".join(lines) or "Nothing refused."


def matrix(records: list[dict]) -> str:
    """Plain text, families down, exporters across: each cell's verdict (the short table printed last)."""
    exporters = [e for e in EXPORTER_ORDER if any(r["exporter"] == e for r in records)]
    by = {(r["family"], r["exporter"]): r for r in records}
    fams = list(dict.fromkeys(r["family"] for r in records))
    w = max([len(f) for f in fams] + [6])
    cells = {k: verdict(v) for k, v in by.items()}
    cw = max([len(c) for c in cells.values()] + [len(e) for e in exporters])
    out = [f"{'family':<{w}}  " + "  ".join(f"{e:<{cw}}" for e in exporters)]
    for f in fams:
        out.append(f"{f:<{w}}  " + "  ".join(f"{cells.get((f, e), '-'):<{cw}}" for e in exporters))
    return "\n".join(out)


def summary(records: list[dict]) -> str:
    ok = sum(verdict(r) == "ok" for r in records)
    bad = [r for r in records if verdict(r) in ("BAD", "ERR")]
    lines = [matrix(records), "", f"{ok} of {len(records)} (family, exporter) pairs imported and agree"
             + (f"; {len(bad)} imported but DISAGREE or fail: " + ", ".join(f"{r['family']} ({r['exporter']})"
                                                                           for r in bad) if bad else "")]  # fmt: skip
    return "\n".join(lines)


def check_md(results: dict) -> str:
    meta, records = results["meta"], results["records"]
    return "\n\n".join([
        f"# Model zoo check ({meta.get('size')}, {meta.get('device')}, {meta.get('dtype')})",
        f"`{meta.get('command')}`: torch {meta.get('torch')}, onnx {meta.get('onnx')}, onnxruntime "
        f"{meta.get('onnxruntime')}, triton {meta.get('triton')}; {meta.get('rows')} random images per check "
        f"({meta.get('fused_rows')} through the fused mode, Triton's interpreter), seed {meta.get('seed')}; "
        f"{meta.get('seconds')} s. Rel err: the largest |difference| from the reference (onnxruntime on the same file; "
        f"for torch.export the torch module) over its largest |logit|; pass: <= {meta.get('max_rel_err')} and every "
        "top-1 the same.",
        "```\n" + summary(records) + "\n```",
        "## Per (family, exporter)",
        check_table(records),
        "## Refusals by op (the importer's worklist)",
        worklist_md(records),
    ])  # fmt: skip


# ---- the GPU timing ----


def gpu_table(cases: list[dict]) -> str:
    """Markdown: per family and batch, hot µs of each provider, ours against the best anchor, time to ready."""
    from bench.kernels.results import hot, us

    providers = list(dict.fromkeys(p for c in cases for p in c.get("providers", {})))
    head = "| family | batch | " + " | ".join(providers) + " | ours vs best | ready s |"
    lines = [head, "|---|---|" + "---|" * (len(providers) + 2)]
    for c in cases:
        cells, times = [], {}
        for p in providers:
            res = c.get("providers", {}).get(p)
            t = hot(res) if res else None
            times[p] = t
            if res is None:
                cells.append("")
            elif t is not None:
                cells.append(us(t) + (" **BAD**" if any(isinstance(v, dict) and v.get("bad") for v in res.values())
                                      else ""))  # fmt: skip
            else:
                cells.append("skip" if "skipped" in res else "n/a" if "na" in res else "err")
        anchors = {p: t for p, t in times.items() if p != "ours" and t is not None}
        ratio = "—"
        if times.get("ours") and anchors:
            best = min(anchors, key=anchors.get)
            ratio = f"{anchors[best] / times['ours']:.2f}x vs {best}"
        ready = c.get("ready_s")
        lines.append(f"| {c['title']} | {c['batch']} | " + " | ".join(cells) + f" | {ratio} | "
                     f"{ready if ready is not None else '—'} |")  # fmt: skip
    return "\n".join(lines)


def gpu_md(results: dict) -> str:
    meta = results["meta"]
    errors = [f"- {c['title']} batch {c['batch']} {p}: {r['error']}" for c in results["cases"]
              for p, r in c.get("providers", {}).items() if "error" in r]  # fmt: skip
    skipped = [f"- {f}: {why}" for f, why in results.get("not_run", {}).items()]
    return "\n\n".join([
        f"# Model zoo timing ({meta.get('gpu')}, {meta.get('dtype')})",
        f"Hot device time per forward (µs, CUDA-graph replays back to back; bench/kernels' timing), full-size models, "
        f"torch {meta.get('torch')}, triton {meta.get('triton')}, onnxruntime {meta.get('onnxruntime') or 'absent'}. "
        "ours: the service's GraphedExecutor over the fused executor, the model imported from its TorchScript ONNX "
        "file; eager-cl: the torch module in channels_last; compile / compile-max: torch.compile of it with BatchNorm "
        "folded, default and max-autotune; ort: onnxruntime-gpu's CUDA provider on the same file in fp16. ready: "
        "ours's first forward at batch 1 (executor, tuning, graph capture), seconds.",
        gpu_table(results["cases"]),
        *(["## Errors", "\n".join(errors)] if errors else []),
        *(["## Not run", "\n".join(skipped)] if skipped else []),
    ])  # fmt: skip


# ---- files ----


def save(results: dict, out: Path, slug: str) -> list[Path]:
    """zoo_<slug>.json and zoo_<slug>.md under out; the paths."""
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / f"zoo_{slug}.json", out / f"zoo_{slug}.md"
    js.write_text(json.dumps(results, indent=1) + "\n")
    md.write_text((check_md(results) if "records" in results else gpu_md(results)) + "\n")
    return [js, md]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.zoo.report", description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", type=Path, help="zoo_cpu.json and/or zoo_<gpu>.json")
    args = p.parse_args(argv)
    for f in args.results:
        r = json.loads(f.read_text())
        print(check_md(r) if "records" in r else gpu_md(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
