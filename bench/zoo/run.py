"""`fusedserve bench zoo` (the check): every family through every exporter, imported, planned and compared with
its reference (check.py), one family at a time; the JSON and markdown are rewritten after each family, so an
interrupted run keeps what it measured."""

from __future__ import annotations

import datetime
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from . import check, exporters, report


def execute(args, command: str) -> int:
    out = args.out or Path("bench/results/cpu")
    out.mkdir(parents=True, exist_ok=True)
    results = {"meta": meta(args, command), "records": []}
    t0 = time.perf_counter()
    # The dynamo exporter's registry once for the run (exporters.onnx_registry_once: 3-5 s of each export otherwise).
    with tempfile.TemporaryDirectory(prefix="fusedserve-zoo-") as tmp, exporters.onnx_registry_once():
        for i, name in enumerate(args.families):
            t = time.perf_counter()
            built = check.build(name, args.size, Path(tmp) / name, args.exporters, args.seed)
            fused_done = False
            for exporter in args.exporters:
                modes = tuple(m for m in args.modes if m != "fused" or not (args.fused_once and fused_done))
                rec = check.check(built, exporter, modes, args.rows, args.fused_rows, args.seed)
                fused_done |= "fused" in rec.get("modes", {})
                results["records"].append(rec)
            results["meta"]["seconds"] = round(time.perf_counter() - t0, 1)
            report.save(results, out, "cpu")
            recs = results["records"][-len(args.exporters) :]
            status = ", ".join(f"{r['exporter']} {report.verdict(r)}" for r in recs)
            print(f"[{i + 1}/{len(args.families)}] {name}: {status} ({time.perf_counter() - t:.0f} s)", flush=True)
    paths = report.save(results, out, "cpu")
    print()
    print(report.summary(results["records"]))
    print(f"\nwrote {', '.join(map(str, paths))}")
    bad = [r for r in results["records"] for m in r.get("modes", {}).values() if m.get("ok") is False]
    return 1 if bad else 0


def meta(args, command: str) -> dict:
    import onnx
    import onnxruntime
    import triton

    return {
        "command": command, "size": args.size, "families": list(args.families), "exporters": list(args.exporters),
        "modes": list(args.modes), "rows": args.rows, "fused_rows": args.fused_rows, "seed": args.seed,
        "device": "cpu", "dtype": "float32", "torch": torch.__version__, "triton": triton.__version__,
        "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__, "python": platform.python_version(),
        "platform": sys.platform, "max_rel_err": check.MAX_REL_ERR, "top1": check.TOP1,
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }  # fmt: skip
