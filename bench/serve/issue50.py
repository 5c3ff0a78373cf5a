"""Issue 50's serve rows in one run on a GPU host: ResNet-50 and MobileNetV2 (torchvision's architectures, random
weights, exported to ONNX and imported with uint8 input, ImageNet's mean and std, resize 256 and crop 224), each
loaded at 64 connections with 32-image requests as UINT8 tensors, JPEG photos (about 500x375, quality 90,
synthesized: bench/serve/images.py) and the same pixels as PNG, by fusedserve (fused, N workers; JPEGs decoded on the
GPU where FUSEDSERVE_IMAGE_DECODE=auto finds nvJPEG) and by the `pil` peer (Pillow in a Python front end, tensors to
its own fusedserve: bench/serve/apps/pil.py).

    python -m bench.serve.issue50 --out /tmp/issue50            # on the GPU host: ~10 minutes (5 a model)
    python -m bench.serve.issue50 --out /tmp/i50 --models mobilenet_v2 -- --duration 1   # one model; bench serve args

Each model is one `fusedserve bench serve` run (`--systems fused@N,pil@N --v2 binary,jpeg,png --input-dtype UINT8
--connections 64`), its own tables in OUT/<model>/serve_<gpu>.{md,json}; this script then writes
OUT/serve_issue50_<gpu>.{md,json}: per model and form images/s, p50/p99, request bytes in (per request and MB/s),
GPU busy, forward per batch and images per batch, and the issue's targets (JPEG >= 0.8x UINT8 and >= 3x pil; MobileNetV2
JPEG >= 20,000 images/s; ResNet-50 UINT8 p99 <= 2.5x p50). Models, ONNX files and the tuning cache are kept under
OUT/models and OUT/tuning.json, so a second run starts faster.

Every fusedserve start here runs with FUSEDSERVE_MAX_BATCH_SIZE=256 (a 32-image request, 8 in a batch) and
FUSEDSERVE_TUNING_STARTUP_S=45 unless the environment sets them: kernel timing beyond that goes on while idle.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODELS = ("resnet50", "mobilenet_v2")
TITLES = {"resnet50": "ResNet-50", "mobilenet_v2": "MobileNetV2"}
MEAN, STD = "123.675,116.28,103.53", "58.395,57.12,57.375"  # ImageNet's, of 0-255 pixels (bench/resnets.py)
FORMS = {"v2_binary": "UINT8", "v2_jpeg": "JPEG", "v2_png": "PNG"}
ENV_DEFAULTS = {"FUSEDSERVE_MAX_BATCH_SIZE": "256", "FUSEDSERVE_TUNING_STARTUP_S": "45"}
TARGETS = {"jpeg_vs_uint8": 0.8, "jpeg_vs_pil": 3.0, "mobilenet_jpeg": 20_000, "p99_over_p50": 2.5}


def build(name: str, side: int, seed: int = 0):
    """(torchvision's `name` with random weights, calibrated BatchNorm (bench/zoo/families.randomise), in eval mode;
    where it came from). Without torchvision (the CPU machine), the repo's copy of the same architecture."""
    import torch

    from bench.zoo import families

    try:
        import torchvision

        module = getattr(torchvision.models, name)(weights=None)
        source = f"torchvision {torchvision.__version__}"
    except Exception as e:  # noqa: BLE001 - ImportError, or its wheel broken beside this torch
        torch.manual_seed(seed)
        module = families.FAMILIES[name].full(1000) if name in families.FAMILIES else None
        if module is None:
            from bench import resnets

            return resnets.build(name, seed, image=(3, side, side)), f"bench/resnets.py (no torchvision: {e})"
        source = f"bench/zoo/families.py (no torchvision: {type(e).__name__})"
    families.randomise(module, torch.Generator().manual_seed(seed + 1), (3, side, side), batches=2)
    return module.eval(), source


def prepare_model(name: str, models: Path, side: int, resize: int) -> tuple[Path, str]:
    """OUT/models/<name>-u8, imported (uint8 input, ImageNet normalization, resize then center crop), and where its
    weights came from; kept from an earlier run when there."""
    target = models / f"{name}-u8"
    note = target / "SOURCE"
    if (target / "config.json").is_file() and note.is_file():
        return target, note.read_text().strip()
    from bench import resnets

    t = time.perf_counter()
    module, source = build(name, side)
    onnx_path = resnets.export_onnx(module, models / name / f"{name}.onnx", name, (3, side, side))
    cmd = [sys.executable, "-m", "service.cli", "import", str(onnx_path), str(target), "--name", name,
           "--input-dtype", "uint8", "--mean", MEAN, "--std", STD, "--resize", str(resize)]  # fmt: skip
    subprocess.run(cmd, cwd=REPO, check=True)
    note.write_text(source + "\n")
    print(f"{name}: {source}, exported and imported in {time.perf_counter() - t:.1f} s -> {target}", flush=True)
    return target, source


def run_model(name: str, model_dir: Path, out: Path, args, extra: list[str]) -> Path | None:
    """One `bench serve` run for the model; the path of its JSON, or None where it wrote none."""
    dest = out / name
    cmd = [sys.executable, "-m", "bench.serve", "--model", str(model_dir), "--systems", args.systems, "--images", "32",
           "--input-dtype", "UINT8", "--connections", "64", "--v2", "binary,jpeg,png", "--no-open", "--no-sigterm",
           "--perf-analyzer", "none", "--tuning-cache", str(out / "tuning.json"), "--time-budget",
           str(args.budget), "--out", str(dest), "--device", args.device, *extra]  # fmt: skip
    env = dict(os.environ)
    for k, v in ENV_DEFAULTS.items():
        env.setdefault(k, v)
    print("$ " + " ".join(cmd), flush=True)
    rc = subprocess.run(cmd, cwd=REPO, env=env).returncode
    found = sorted(dest.glob("serve_*.json"), key=lambda p: p.stat().st_mtime)
    if rc != 0:
        print(f"{name}: bench serve exited {rc}", flush=True)
    return found[-1] if found else None


def rows_of(name: str, results: dict) -> list[dict]:
    """The model's closed-loop v2 phases (64 connections in the issue's run), one row per system, form and count."""
    out = []
    for r in results["phases"]:
        if r["kind"] != "closed" or r.get("protocol") not in FORMS:
            continue
        lat, server, gpu = r["latency_ms"], r.get("server") or {}, r.get("gpu_util") or {}
        out.append({
            "model": name, "system": r["system"], "form": FORMS[r["protocol"]], "images": r["rows"],
            "connections": r["connections"], "images_per_s": r["rows_per_s"],
            "p50_ms": lat.get("p50"), "p99_ms": lat.get("p99"), "request_bytes": r["request_bytes"],
            "request_mb_per_s": r["request_mb_per_s"], "gpu_busy": gpu.get("mean"),
            "forward_us": server.get("forward_us"), "images_per_batch": server.get("batch_rows"), "lost": r["lost"],
            # a phase whose answers (warm-up's included) were not all 200 measured refusals, not the model
            "ok": bool(r.get("ok", True)) and set(r.get("status") or {"200": 0}) <= {"200"},
            "problems": (r.get("accounting") or {}).get("problems", []),
        })  # fmt: skip
    return out


def skipped_of(name: str, results: dict) -> list[str]:
    """The issue's phases bench serve skipped for the model (a system's v2 phase, and why: its time budget, a start
    that failed), so that a target they feed reads "not measured", not absent."""
    return [f"{TITLES[name]}: {s['system']} {s['what']} skipped ({s['why']})" for s in results.get("skipped", [])
            if any(form in s["what"] for form in FORMS)]  # fmt: skip


def targets(rows: list[dict]) -> list[dict]:
    def get(model, system, form):
        for r in rows:
            if r["model"] == model and r["system"].startswith(system) and r["form"] == form:
                return r
        return None

    out = []
    for model in MODELS:
        title = TITLES[model]
        jpeg, uint8, pil = get(model, "fused", "JPEG"), get(model, "fused", "UINT8"), get(model, "pil", "JPEG")
        failed = [r for r in (jpeg, uint8, pil) if r is not None and not r.get("ok", True)]
        if failed:  # its numbers are refusals' rates: every target of the model reads failed, none met
            why = "; ".join(f"{r['system']} {r['form']}: {', '.join(r.get('problems') or ['answers other than 200'])}"
                            for r in failed)  # fmt: skip
            out.append({"target": f"{title}: every target", "measured": f"failed ({why})", "met": False})
            continue
        if jpeg and uint8:
            ratio = jpeg["images_per_s"] / uint8["images_per_s"]
            out.append({"target": f"{title}: JPEG >= {TARGETS['jpeg_vs_uint8']}x the UINT8 tensor path's images/s",
                        "measured": f"{ratio:.2f}x", "met": ratio >= TARGETS["jpeg_vs_uint8"]})  # fmt: skip
        if jpeg:
            ratio = jpeg["images_per_s"] / pil["images_per_s"] if pil else None
            out.append({"target": f"{title}: JPEG >= {TARGETS['jpeg_vs_pil']}x the pil peer's images/s",
                        "measured": f"{ratio:.2f}x" if pil else "not measured (no pil JPEG phase)",
                        "met": pil is not None and ratio >= TARGETS["jpeg_vs_pil"]})  # fmt: skip
        if model == "mobilenet_v2" and jpeg:
            out.append({"target": f"{title}: JPEG >= {TARGETS['mobilenet_jpeg']:,} images/s",
                        "measured": f"{jpeg['images_per_s']:,.0f}",
                        "met": jpeg["images_per_s"] >= TARGETS["mobilenet_jpeg"]})  # fmt: skip
        if model == "resnet50" and uint8 and uint8["p50_ms"] and uint8["p99_ms"]:
            ratio = uint8["p99_ms"] / uint8["p50_ms"]
            out.append({"target": f"{title}: UINT8 p99 <= {TARGETS['p99_over_p50']}x p50", "measured": f"{ratio:.2f}x",
                        "met": ratio <= TARGETS["p99_over_p50"]})  # fmt: skip
    return out


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def markdown(meta: dict, rows: list[dict], met: list[dict]) -> str:
    lines = [f"# Issue 50's serve rows: {meta['gpu'] or 'no GPU'}", "",
             f"{meta['when']}, commit {meta['commit']}. Command: `{meta['command']}` ({meta['wall_s']:.0f} s).", "",
             "Per model one `fusedserve bench serve` run (its own tables under the model's directory): 32 images a "
             "request, 64 connections, closed loop; UINT8: 3x224x224 tensors (Triton's binary extension); JPEG: "
             "synthesized photos of about 500x375 at quality 90; PNG: the same pixels. fused: fusedserve, N front "
             "ends (JPEGs decoded on the GPU where FUSEDSERVE_IMAGE_DECODE=auto finds nvJPEG); pil: Pillow in a "
             "Python front end, tensors to its own fusedserve. Bytes in: request bytes (header and files or tensor). "
             "GPU busy: nvidia-smi's utilization.gpu over the window.", ""]  # fmt: skip
    for model in MODELS:
        src = meta["sources"].get(model)
        if src:
            lines.append(f"- {TITLES[model]}: weights from {src}.")
    lines += [
        "",
        "| model | system | form | images | conns | images/s | p50 ms | p99 ms | bytes/request | MB/s in | "
        "GPU busy % | forward µs/batch | images/batch | lost |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {TITLES[r['model']]} | {r['system']} | {r['form']} | {r['images']} | {r['connections']} | "
            f"{r['images_per_s']:,.0f} | "
            f"{_f(r['p50_ms'], '.1f')} | {_f(r['p99_ms'], '.1f')} | {r['request_bytes']:,} | "
            f"{r['request_mb_per_s']:,.1f} | "
            f"{_f(r['gpu_busy'], '.0f')} | {_f(r['forward_us'], ',.0f')} | {_f(r['images_per_batch'], '.1f')} | "
            f"{r['lost']} |"
        )  # fmt: skip
    lines += ["", "## Targets (issue 50)", "", "| target | measured | met |", "|---|---:|---|"]
    lines += [f"| {t['target']} | {t['measured']} | {'yes' if t['met'] else 'no'} |" for t in met]
    if meta["missing"]:
        lines += ["", "Not measured: " + "; ".join(meta["missing"]) + "."]
    return "\n".join(lines) + "\n"


def split_argv(argv: list[str] | None) -> tuple[list[str], list[str]]:
    """A script's own arguments and, after `--`, those it hands to bench serve."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--" not in argv:
        return argv, []
    return argv[: argv.index("--")], argv[argv.index("--") + 1 :]


def script_parser(module: str, doc: str) -> argparse.ArgumentParser:
    """The parser of a GPU-host script (`python -m MODULE`), its help the module docstring's."""
    return argparse.ArgumentParser(
        prog=f"python -m {module}", description=doc.splitlines()[0], epilog=doc.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip


def model_names(p: argparse.ArgumentParser, text: str) -> list[str]:
    """--models' comma-separated names, each one of MODELS (else the parser's error, naming them)."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names or any(m not in MODELS for m in names):
        p.error(f"--models: of {', '.join(MODELS)}")
    return names


def main(argv: list[str] | None = None) -> int:
    argv, extra = split_argv(argv)
    p = script_parser("bench.serve.issue50", __doc__)
    p.add_argument("--out", type=Path, required=True, help="output directory (tables, models, tuning cache)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {','.join(MODELS)} [both]")
    p.add_argument("--systems", default="fused@N,pil@N", help="bench serve's --systems [fused@N,pil@N]")
    budget = "bench serve's --time-budget per model, s [300: the pil peer starts its own fusedserve, ~75 s on a GPU]"
    p.add_argument("--budget", type=float, default=300.0, help=budget)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--side", type=int, default=224, help="the crop (input side); resize to side * 8 / 7 [224]")
    args = p.parse_args(argv)
    names = model_names(p, args.models)
    t0 = time.monotonic()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO))
    rows, sources, missing, gpu, slug = [], {}, [], None, "cpu" if args.device == "cpu" else "gpu"
    for name in names:
        try:
            model_dir, sources[name] = prepare_model(name, out / "models", args.side, round(args.side * 8 / 7))
        except Exception as e:  # noqa: BLE001 - say which model and go on with the other
            missing.append(f"{TITLES[name]}: could not build or import it ({type(e).__name__}: {e})")
            continue
        found = run_model(name, model_dir, out, args, extra)
        if found is None:
            missing.append(f"{TITLES[name]}: bench serve wrote no results")
            continue
        results = json.loads(found.read_text())
        gpu, slug = results["meta"].get("gpu") or gpu, results["meta"].get("slug") or slug
        rows += rows_of(name, results)
        missing += skipped_of(name, results)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    meta = {"gpu": gpu, "slug": slug, "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "commit": commit.stdout.strip() or "?", "command": " ".join(["python", "-m", "bench.serve.issue50",
            *argv, *(["--", *extra] if extra else [])]), "wall_s": time.monotonic() - t0, "sources": sources,
            "missing": missing, "env": {k: os.environ.get(k, v) for k, v in ENV_DEFAULTS.items()}}  # fmt: skip
    met = targets(rows)
    stem = out / f"serve_issue50_{slug}"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "targets": met}, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(meta, rows, met))
    print(markdown(meta, rows, met), flush=True)
    print(f"wrote {stem}.md and .json in {meta['wall_s']:.0f} s", flush=True)
    return 0 if rows and not missing and all(r["lost"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
