"""Issue 52's end-to-end rows in one run on a GPU host: float8 served against float16, and the two compared live.

    python -m bench.serve.issue52 --out /tmp/i52                    # on the GPU host: ~7 minutes (ResNet-50)
    python -m bench.serve.issue52 --out /tmp/i52 -- --duration 1    # bench serve's args after --
    python -m bench.serve.issue52 --out /tmp/i52 --ab-only          # the live A/B alone (~4 minutes)

Per model (bench/serve/issue50.py's: torchvision's architecture, random weights, imported with uint8 input and
ImageNet's preprocessing):
1. calibrated on CALIBRATION_PHOTOS synthesized photos (`fusedserve calibrate MODEL --samples DIR`), drawn with another
   seed than the requests' photos;
2. two `fusedserve bench serve` runs one after the other on the same host, `fused@8` with `--dtype float16` and then
   `--dtype float8`, 32-image UINT8 and JPEG requests at 64 connections: images/s, p50/p99, the forward per batch,
   and float8 / float16 per form (issue 52: at least 1.3x where the GPU is the limit);
3. the live A/B: one service in float8 with FUSEDSERVE_AB_OTHER=fused:float16 (the shadow runs every
   FUSEDSERVE_SHADOW_EVERY-th batch again in float16 while the engine is idle, and compares the two), loaded at
   --ab-rate requests/s for --ab-seconds (a paced load leaves the engine idle between batches: a closed loop would
   leave the shadow no turn) with each of AB_LOADS in turn: JPEG photos like the calibration's (another seed), then
   UINT8 noise, traffic unlike anything calibrated on; the shadow's counters for each load (batches and rows compared,
   top-1 agreement, the median batch's error from the histogram), then `fusedserve ab-report --url` of the whole.
Then the same live A/B for the shipped digits-resnet, a trained model (random weights leave a ResNet's top-1 to
chance: DIGITS below), calibrated on the training digits and loaded with the held-out ones.

Writes OUT/serve_issue52_<gpu>.{md,json} (and each bench serve run's tables under OUT/<dtype>/<model>, the A/B
report under OUT/ab_<model>.md); the models, photos and tuning cache stay under OUT for a second run.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from bench.serve import issue50

REPO = Path(__file__).resolve().parents[2]
DTYPES = ("float16", "float8")
CALIBRATION_PHOTOS = 64
IMAGES = 32  # per request, as issue 50's rows
AB_ENV = {"FUSEDSERVE_AB_OTHER": "fused:float16", "FUSEDSERVE_SHADOW_EVERY": "4"}
SPEEDUP_TARGET = 1.3  # issue 52: float8 / float16 images/s end to end where the GPU is the limit
# The live A/B's loads, in order: what the shadow reports for traffic like the calibration samples and unlike them.
AB_LOADS = {
    "photos": "JPEG photos like the calibration's, another seed",
    "noise": "UINT8 tensors of uniform noise, unlike any calibration sample",
    "held-out digits": "the 360 held-out digits as FP32 rows, calibrated on the 1,437 training ones",
}
# Random weights leave ResNet-50's top two logits within a few percent of the logits' spread (measured on the CPU: a
# median gap of 0.03 of their standard deviation on the photos), so its top-1 agreement says little; the shipped
# digits-resnet is trained, so its A/B shows what top-1 agreement a real model keeps in float8.
DIGITS = "digits-resnet"
TITLES = {**issue50.TITLES, DIGITS: "digits-resnet (trained)"}
MODEL_LOADS = {"resnet50": ("photos", "noise"), "mobilenet_v2": ("photos", "noise"), DIGITS: ("held-out digits",)}


def calibrate(model_dir: Path, photos: Path, device: str) -> None:
    """The model's calibration.json from CALIBRATION_PHOTOS JPEGs written under `photos` (kept from an earlier run)."""
    from service.model.float8 import CALIBRATION_FILE

    if (model_dir / CALIBRATION_FILE).is_file():
        return
    from bench.serve import images

    photos.mkdir(parents=True, exist_ok=True)
    for i, data in enumerate(images.encoded("v2_jpeg", CALIBRATION_PHOTOS, seed=52, channels=3)):
        (photos / f"{i:03d}.jpg").write_bytes(data)
    cmd = [sys.executable, "-m", "service.cli", "calibrate", str(model_dir), "--samples", str(photos),
           "--device", device]  # fmt: skip
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)


def serve_rows(name: str, model_dir: Path, out: Path, args, extra: list[str]) -> tuple[list[dict], list[str], dict]:
    """bench serve in float16, then float8: their UINT8 and JPEG rows (with `dtype`), what they skipped, their meta."""
    rows, missing, meta = [], [], {}
    for dtype in DTYPES:
        more = ["--dtype", dtype, "--v2", "binary,jpeg", "--tuning-cache", str(out / "tuning.json"), *extra]
        found = issue50.run_model(name, model_dir, out / dtype, args, more)
        if found is None:
            missing.append(f"{issue50.TITLES[name]} {dtype}: bench serve wrote no results")
            continue
        results = json.loads(found.read_text())
        meta = results["meta"]
        rows += [{**r, "dtype": dtype} for r in issue50.rows_of(name, results)]
        missing += [f"{m} ({dtype})" for m in issue50.skipped_of(name, results)]
    return rows, missing, meta


def speedups(rows: list[dict]) -> list[dict]:
    """float8 / float16 images/s per model and form, where both phases answered every request."""
    index = {(r["model"], r["form"], r["dtype"]): r for r in rows}
    out = []
    for (model, form, dtype), r8 in index.items():
        r16 = index.get((model, form, "float16"))
        if dtype != "float8" or r16 is None:
            continue
        ok = r8["ok"] and r16["ok"] and r8["images_per_s"] and r16["images_per_s"]
        ratio = r8["images_per_s"] / r16["images_per_s"] if ok else None
        out.append({"model": model, "form": form, "float16": r16["images_per_s"], "float8": r8["images_per_s"],
                    "ratio": ratio, "met": ratio is not None and ratio >= SPEEDUP_TARGET})  # fmt: skip
    return out


def _post(port: int, path: str, body: bytes, header: bytes) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        extra = dict(line.split(": ", 1) for line in header.decode().strip().splitlines() if line)
        conn.request("POST", path, body=body, headers={"Content-Type": "application/octet-stream", **extra})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def load_bodies(load: str) -> tuple[list[bytes], bytes]:
    """A load of AB_LOADS: (bodies of IMAGES images each, the HTTP header line they need)."""
    from bench.serve import images, v2

    if load == "photos":  # seed 3: never the calibration's photos (seed 52)
        return images.bodies("v2_jpeg", IMAGES, count=8, seed=3, channels=3), images.header()
    if load == "noise":
        return v2.binary_bodies(IMAGES, count=8, seed=3, shape=(3, 224, 224), datatype="UINT8")
    if load == "held-out digits":
        X = digits_split()[1].astype(np.float32)
        head = v2.binary_header(IMAGES, shape=(1, 8, 8), datatype="FP32")
        header = f"Inference-Header-Content-Length: {len(head)}\r\n".encode()
        bodies = [
            head + np.take(X, range(i, i + IMAGES), axis=0, mode="wrap").tobytes() for i in range(0, len(X), IMAGES)
        ]
        return bodies, header
    raise ValueError(f"load {load!r}: one of {', '.join(AB_LOADS)}")


def digits_split():
    """The shipped digits models' split (X_train, X_test, y_train, y_test) of scikit-learn's digits, as the tests and
    tools/train_digits.py read it (tests/digits.py: the data file is in tests/data)."""
    from tests import digits

    return digits.split()


def prepare_digits(out: Path, device: str) -> Path:
    """The shipped digits-resnet copied under OUT/models (its calibration.json goes there, not into model_weights),
    calibrated on the training digits."""
    import shutil

    from service.model.float8 import CALIBRATION_FILE

    target = out / "models" / DIGITS
    if not (target / CALIBRATION_FILE).is_file():
        shutil.copytree(REPO / "model_weights" / DIGITS, target, dirs_exist_ok=True)
        samples = out / "digits-train"
        samples.mkdir(parents=True, exist_ok=True)
        np.save(samples / "train.npy", digits_split()[0].astype(np.float32))  # rows of 64: read as (1, 8, 8)
        cmd = [sys.executable, "-m", "service.cli", "calibrate", str(target), "--samples", str(samples), "--device",
               device]  # fmt: skip
        print("$ " + " ".join(cmd), flush=True)
        subprocess.run(cmd, cwd=REPO, check=True)
    return target


def paced_load(port: int, model: str, rate: float, seconds: float, threads: int = 8, load: str = "noise") -> dict:
    """`rate` requests/s of `load` (AB_LOADS) for `seconds`, from `threads` threads, each on its own schedule:
    {status: count}."""
    from bench.serve import v2

    bodies, header = load_bodies(load)
    path = v2.rest_path(model)
    counts: dict[int, int] = {}
    lock = threading.Lock()
    end = time.monotonic() + seconds
    gap = threads / rate

    def worker(k: int) -> None:
        at = time.monotonic() + k * gap / threads
        i = k
        while at < end:
            time.sleep(max(0.0, at - time.monotonic()))
            try:
                status = _post(port, path, bodies[i % len(bodies)], header)
            except OSError:
                status = 0
            with lock:
                counts[status] = counts.get(status, 0) + 1
            at += gap
            i += threads

    pool = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(seconds + 60)
    return counts


def _metric_sum(text: str, name: str) -> float:
    """The sum of a Prometheus text exposition's samples of `name` (all label sets)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            with contextlib.suppress(ValueError):
                total += float(line.rsplit(" ", 1)[1])
    return total


def shadow_counters(text: str) -> dict:
    """The shadow's counters on a metrics page: batches, rows, mismatched rows, and the error histogram's cumulative
    counts by upper bound."""
    buckets: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith("fusedserve_shadow_error_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            bound = float("inf") if le == "+Inf" else float(le)
            buckets[bound] = buckets.get(bound, 0.0) + float(line.rsplit(" ", 1)[1])
    return {"batches": _metric_sum(text, "fusedserve_shadow_batches_total"),
            "rows": _metric_sum(text, "fusedserve_shadow_rows_total"),
            "mismatched": _metric_sum(text, "fusedserve_shadow_argmax_mismatch_total"), "buckets": buckets}  # fmt: skip


def shadow_phase(before: dict, after: dict) -> dict:
    """What the shadow counted between two readings: batches, rows, top-1 agreement, and the upper bound of the
    histogram bucket holding the median batch's error (its largest output's relative difference)."""
    batches = after["batches"] - before["batches"]
    rows = after["rows"] - before["rows"]
    mismatched = after["mismatched"] - before["mismatched"]
    median = None
    for bound in sorted(after["buckets"]):
        if batches and after["buckets"][bound] - before["buckets"].get(bound, 0.0) >= batches / 2:
            median = bound
            break
    return {"shadow_batches": batches, "shadow_rows": rows, "shadow_mismatched_rows": mismatched,
            "top1_agreement": (1 - mismatched / rows) if rows else None, "error_median_below": median}  # fmt: skip


def _metrics(port: int) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def live_ab(name: str, model_dir: Path, out: Path, args) -> dict:
    """One float8 service with the float16 shadow, under each paced load of AB_LOADS in turn; the shadow's counters
    per load and the A/B report."""
    from bench.serve.run import free_port

    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", **AB_ENV)
    for k, v in issue50.ENV_DEFAULTS.items():
        env.setdefault(k, v)
    cmd = [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", str(port), "--mode",
           "fused", "--workers", "8", "--dtype", "float8", "--device", args.device, "--tuning-cache",
           str(out / "tuning.json"), "--model", str(model_dir)]  # fmt: skip
    log_path = out / f"ab_{name}.log"
    result: dict = {"model": name, "env": AB_ENV, "rate": args.ab_rate, "seconds": args.ab_seconds}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline and proc.poll() is None:
                with contextlib.suppress(OSError, http.client.HTTPException):
                    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                    conn.request("GET", "/health/ready")
                    if conn.getresponse().status == 200:
                        break
                time.sleep(1.0)
            else:
                result["error"] = f"not ready (exit {proc.poll()}); its log: {log_path}"
                return result
            result["loads"] = []
            before = shadow_counters(_metrics(port))
            for load in MODEL_LOADS[name]:
                statuses = paced_load(port, _served_name(model_dir), args.ab_rate, args.ab_seconds, load=load)
                after = shadow_counters(_metrics(port))
                result["loads"].append({"load": load, "statuses": statuses, **shadow_phase(before, after)})
                print(f"live A/B {name}, {load}: {result['loads'][-1]}", flush=True)
                before = after
            report = out / f"ab_{name}.md"
            rep = subprocess.run([sys.executable, "-m", "service.cli", "ab-report", "--url",
                                  f"http://127.0.0.1:{port}/metrics", "--out", str(report)], cwd=REPO,
                                 capture_output=True, text=True)  # fmt: skip
            result["report"] = str(report) if rep.returncode == 0 else f"ab-report failed: {rep.stderr[-500:]}"
        finally:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(60)
            if proc.poll() is None:
                proc.kill()
    return result


def _served_name(model_dir: Path) -> str:
    """The Open Inference Protocol's name of the model: its config.json's `name`, or as the service names an ONNX
    model's directory."""
    config = model_dir / "config.json"
    if config.is_file():
        return json.loads(config.read_text()).get("name") or model_dir.name
    from service.model.loader import load_model

    return load_model(model_dir).name


def markdown(meta: dict, rows: list[dict], ratios: list[dict], abs_: list[dict]) -> str:
    lines = [f"# Issue 52's serve rows: {meta['gpu'] or 'no GPU'}", "",
             f"{meta['when']}, commit {meta['commit']}. Command: `{meta['command']}` ({meta['wall_s']:.0f} s).", "",
             f"fusedserve fused@8 in float16, then in float8 (calibrated on {CALIBRATION_PHOTOS} synthesized photos), "
             f"one `fusedserve bench serve` run each on the same host: {IMAGES} images a request, 64 connections, "
             "closed loop; UINT8: 3x224x224 tensors; JPEG: photos of about 500x375 decoded on the GPU.", "",
             "| model | dtype | form | images/s | p50 ms | p99 ms | GPU busy % | forward µs/batch | images/batch | "
             "lost |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {issue50.TITLES[r['model']]} | {r['dtype']} | {r['form']} | {r['images_per_s']:,.0f} | "
                     f"{issue50._f(r['p50_ms'], '.1f')} | {issue50._f(r['p99_ms'], '.1f')} | "
                     f"{issue50._f(r['gpu_busy'], '.0f')} | {issue50._f(r['forward_us'], ',.0f')} | "
                     f"{issue50._f(r['images_per_batch'], '.1f')} | {r['lost']} |")  # fmt: skip
    lines += ["", f"## float8 / float16 (issue 52: at least {SPEEDUP_TARGET}x)", "",
              "| model | form | float16 images/s | float8 images/s | float8 / float16 | met |",
              "|---|---|---:|---:|---:|---|"]  # fmt: skip
    for s in ratios:
        ratio = "-" if s["ratio"] is None else f"{s['ratio']:.2f}x"
        lines.append(f"| {issue50.TITLES[s['model']]} | {s['form']} | {s['float16']:,.0f} | {s['float8']:,.0f} | "
                     f"{ratio} | {'yes' if s['met'] else 'no'} |")  # fmt: skip
    lines += ["", "## Live: float8 served, float16 as its shadow", "",
              f"FUSEDSERVE_DTYPE=float8 with {', '.join(f'{k}={v}' for k, v in AB_ENV.items())}; {IMAGES}-image "
              "requests at a paced rate, each load in turn: "
              + "; ".join(f"{k}: {v}" for k, v in AB_LOADS.items()) + ". Batch error: the shadow's measure, the "
              "largest difference over the largest float16 output, its median batch's histogram bucket.", "",
              "| model | load | requests/s x s | answers | shadow batches | rows compared | top-1 agreement | "
              "batch error p50 | report |", "|---|---|---|---|---:|---:|---:|---:|---|"]  # fmt: skip
    for a in abs_:
        title = TITLES[a["model"]]
        if "error" in a:
            lines.append(f"| {title} | | {a['rate']} x {a['seconds']} | {a['error']} | | | | | |")
            continue
        for phase in a["loads"]:
            agree = "-" if phase["top1_agreement"] is None else f"{100 * phase['top1_agreement']:.2f}%"
            median = phase["error_median_below"]
            median = "-" if median is None else f"<= {median:.3g}"
            lines.append(f"| {title} | {phase['load']} | {a['rate']} x {a['seconds']} | {phase['statuses']} | "
                         f"{phase['shadow_batches']:.0f} | {phase['shadow_rows']:.0f} | {agree} | {median} | "
                         f"{a.get('report', '-')} |")  # fmt: skip
    if meta["missing"]:
        lines += ["", "Not measured: " + "; ".join(meta["missing"]) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv, extra = issue50.split_argv(argv)
    p = issue50.script_parser("bench.serve.issue52", __doc__)
    p.add_argument("--out", type=Path, required=True, help="output directory (tables, models, photos, tuning cache)")
    p.add_argument("--models", default="resnet50", help=f"comma-separated, of {','.join(issue50.MODELS)} [resnet50]")
    p.add_argument("--systems", default="fused@N", help="bench serve's --systems [fused@N]")
    p.add_argument("--budget", type=float, default=240.0, help="bench serve's --time-budget per run, s [240]")
    p.add_argument("--device", choices=("cuda",), default="cuda", help="float8 runs on Hopper GPUs only")
    p.add_argument("--ab-rate", type=float, default=100.0, help="requests/s of the live A/B's load [100]")
    p.add_argument("--ab-seconds", type=float, default=20.0, help="seconds of the live A/B's load [20]")
    p.add_argument("--no-ab", dest="ab", action="store_false", help="skip the live A/B")
    p.add_argument("--ab-only", action="store_true", help="the live A/B alone, without the bench serve runs")
    args = p.parse_args(argv)
    names = issue50.model_names(p, args.models)
    t0 = time.monotonic()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows, missing, abs_, gpu, slug = [], [], [], None, "gpu"
    for name in names:
        try:
            model_dir, _ = issue50.prepare_model(name, out / "models", 224, 256)
            calibrate(model_dir, out / "photos" / name, args.device)
        except Exception as e:  # noqa: BLE001 - say which model and go on with the other
            missing.append(f"{issue50.TITLES[name]}: could not build, import or calibrate it ({type(e).__name__}: {e})")
            continue
        if not args.ab_only:
            got, skipped, meta = serve_rows(name, model_dir, out, args, extra)
            rows += got
            missing += skipped
            gpu, slug = meta.get("gpu") or gpu, meta.get("slug") or slug
        if args.ab or args.ab_only:
            abs_.append(live_ab(name, model_dir, out, args))
    if args.ab or args.ab_only:
        try:
            abs_.append(live_ab(DIGITS, prepare_digits(out, args.device), out, args))
        except Exception as e:  # noqa: BLE001 - the ResNet rows stand without it
            missing.append(f"{TITLES[DIGITS]}'s live A/B ({type(e).__name__}: {e})")
    if gpu is None and abs_:  # --ab-only: no bench serve run named the GPU
        import torch

        from bench.gpu import slug_of

        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        slug = slug_of(gpu) if gpu else slug
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    meta = {"gpu": gpu, "slug": slug, "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "commit": commit.stdout.strip() or "?", "command": " ".join(["python", "-m", "bench.serve.issue52", *argv,
            *(["--", *extra] if extra else [])]), "wall_s": time.monotonic() - t0, "missing": missing}  # fmt: skip
    ratios = speedups(rows)
    stem = out / (f"serve_issue52_ab_{slug}" if args.ab_only else f"serve_issue52_{slug}")
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "speedups": ratios, "ab": abs_},
                                                    indent=1) + "\n")  # fmt: skip
    text = markdown(meta, rows, ratios, abs_)
    stem.with_suffix(".md").write_text(text)
    print(text, flush=True)
    print(f"wrote {stem}.md and .json in {meta['wall_s']:.0f} s", flush=True)
    served = bool(rows) or args.ab_only
    live = all("error" not in a for a in abs_) and (bool(abs_) or not args.ab_only)
    return 0 if served and live and not missing and all(r["lost"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
