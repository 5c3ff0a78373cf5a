"""Does float8 pay on ResNet-50 (or another CNN), and what does it cost in accuracy? (issue 52)

ResNet-50 (bench/resnets.py: torchvision's architecture, random weights with BatchNorm statistics from random
images), or with --model another of torchvision's classifiers (mobilenet_v2, efficientnet_b0: torchvision's where it
imports, else bench/zoo/families.py's copy; random weights and BatchNorm statistics as the zoo sets them), exported to
ONNX and imported as a user's model; calibrated (service/model/calibrate.py, absmax) on --calib random images; then
fused float16 and fused float8 (the first conv, the classifier and convs on a 1x1 map fp16, the other convs e4m3, 52
in ResNet-50: kernels/conv_fp8.py, conv_grouped_fp8.py) each captured as a CUDA graph per batch size and timed: hot
(median of 50 replays, each between two CUDA events) and cold (L2 cleared before each replay, kernels/cold_timing.py).
Accuracy on --check other random images (never the calibration ones): the logits' cosine similarity with float16's
(mean and worst row) and top-1 agreement, beside float16's own against float32 (unfused) for scale, and the floor
any float8 plan has: float32 with only the activations rounded to e4m3 (rounded_activations; bfloat16 beside it).
Then each step at the largest batch in both precisions, summed by kind (step_rows, step_table): where float8 gains.

    python -m bench.probes.fp8_resnet50 --out DIR [--batches 1,256] [--tune-budget 300] [--model mobilenet_v2]
        [--fp16-steps first,last,pooled,gated]

Writes DIR/probe_fp8_<model>.md (the table) and .json (--out ending in .md: that file, the json beside it).
Tuning is on (FUSEDSERVE_TUNING_CACHE keeps picks between runs); --tune-budget bounds the seconds spent timing
candidates, after which the rest take untimed picks (kernels/tuning.py, timing_budget): run once per batch size
within a device call's limit if needed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

IMAGE = (3, 224, 224)
TITLES = {"resnet50": "ResNet-50", "mobilenet_v2": "MobileNetV2", "efficientnet_b0": "EfficientNet-B0"}


def build_model(image: tuple[int, int, int] = IMAGE, out_dir: Path | None = None, name: str = "resnet50"):
    """The model as fusedserve loads it (ONNX import): ResNet-50 from bench/resnets.py, another family as issue 50's
    serve rows build it (bench/serve/issue50.py `build`)."""
    from bench import resnets
    from service.model.loader import load_model

    out_dir = Path(out_dir or tempfile.mkdtemp(prefix=f"fp8-{name}-"))
    if name == "resnet50":
        path, _ = resnets.write("resnet50", out_dir, seed=0, image=image)
    else:
        from bench.serve.issue50 import build

        module, _ = build(name, image[-1])
        path = resnets.export_onnx(module, out_dir / f"{name}.onnx", name, image)
    return load_model(path)


def random_images(n: int, image: tuple[int, int, int], seed: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *image, generator=g).to(device)


def calibration_on(model, images: torch.Tensor, device, batch_size: int = 32):
    """A Calibration from random images (in memory: no file written)."""
    from service.model.calibrate import measure
    from service.model.float8 import Calibration

    rows = images.cpu().numpy()
    ranges, seen = measure(model, iter([rows]), device, batch_size=batch_size)
    return Calibration(ranges, seen, "random-images")


def agreement(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Logits a against b (rows): cosine mean and worst row, top-1 agreement."""
    a, b = a.double(), b.double()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=1)
    return {
        "cosine_mean": float(cos.mean()),
        "cosine_min": float(cos.min()),
        "top1_agree": float((a.argmax(1) == b.argmax(1)).double().mean()),
    }


def rounded_activations(exact, images: torch.Tensor, fmt: str) -> torch.Tensor:
    """The float32 unfused forward with every conv's output but the last rounded to `fmt` ("e4m3": per tensor, each
    batch's own absmax scale; "bfloat16"), the weights exact: what rounding the activations alone costs, a floor under
    any float8 plan that passes activations between layers in e4m3 (the issue's design), however it quantizes the
    weights or computes."""
    from kernels.fp8 import quantize, scale_of
    from service.model.planner import Conv2dStep

    convs = [s.name for s in exact.steps if isinstance(s, Conv2dStep)][:-1]

    def rounded(y: torch.Tensor) -> torch.Tensor:
        if fmt == "bfloat16":
            return y.bfloat16().float()
        scale = scale_of(y.abs().amax())
        return quantize(y, scale).float() * scale

    live = {exact.input_name: images}
    with torch.no_grad():
        for step, (_, layer), wiring in zip(exact.steps, exact.layers, exact.wiring, strict=True):
            y = layer(*[live[t] for t in wiring.reads])
            live[wiring.output] = rounded(y) if step.name in convs else y
            for t in wiring.frees:
                del live[t]
    return live[exact.wiring[-1].output].float()


def step_kind(model, step) -> str:
    """A conv step as `3x3 dw 144 56x56 s1` / `1x1 144->24 56x56` (its input's channels and size), else its name."""
    from service.model.planner import Conv2dStep

    if not isinstance(step, Conv2dStep):
        return step.name.rsplit("_", 1)[0]
    oc, _, kh, kw = model.tensors[step.weight].shape
    c, h, w = model.shapes[step.inputs[0]]
    kind = "dw" if step.groups == c and step.groups > 1 else f"g{step.groups}" if step.groups > 1 else f"{c}->{oc}"
    extra = "".join(f" {tag}" for tag, on in (("+res", step.residual), ("gated", step.gate)) if on)
    return f"{kh}x{kw} {kind} {h}x{w} s{step.stride[0]}{extra}"


def _graph(fn):
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        fn()
    return graph


def _hot_us(replay, reps: int = 50) -> float:
    replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def run(
    batches: list[int],
    calib: int,
    check: int,
    tune_budget: float | None,
    name: str = "resnet50",
    fp16_steps: tuple[str, ...] | None = None,
) -> dict:
    from kernels import tuning
    from kernels.cold_timing import cold_us
    from kernels.fp8 import fp8_capable
    from service.model.executors import Executor
    from service.model.float8 import Fp8Step

    dev = torch.device("cuda")
    if not fp8_capable(dev):
        raise SystemExit(f"{torch.cuda.get_device_name()}: no fp8 tensor cores (compute capability < 8.9)")
    tuning.timing_budget.set(tune_budget)
    t = time.perf_counter()
    model = build_model(name=name)
    cal = calibration_on(model, random_images(calib, IMAGE, 1, dev), dev)
    print(f"model and calibration: {time.perf_counter() - t:.1f} s ({calib} images)", flush=True)
    executors = {
        "float16": Executor(model, "fused", dev, torch.float16),
        "float8": Executor(
            model,
            "fused",
            dev,
            torch.float16,
            precision="float8",
            calibration=cal,
            fp16_steps=fp16_steps,
        ),
    }
    # the convs and linears run in float8 (a pool writing e4m3 for them, float8.Fp8Output, computes in float16)
    fp8_steps = sum(isinstance(p, Fp8Step) for p in executors["float8"].fp8.values())
    exact = Executor(model, "unfused", dev, torch.float32)
    result = {"gpu": torch.cuda.get_device_name(), "model": name, "fp8_steps": fp8_steps, "steps": len(exact.steps),
              "rows": []}  # fmt: skip
    # accuracy, on images never calibrated on
    images = random_images(check, IMAGE, 2, dev)
    with torch.no_grad():
        ref = torch.cat([exact.forward(images[i : i + 64]) for i in range(0, check, 64)]).float()
        outs = {
            p: torch.cat([e.forward(images[i : i + 64].half()) for i in range(0, check, 64)]).float()
            for p, e in executors.items()
        }
        floors = {
            fmt: torch.cat([rounded_activations(exact, images[i : i + 64], fmt) for i in range(0, check, 64)])
            for fmt in ("e4m3", "bfloat16")
        }
    result["accuracy"] = {
        "float8_vs_float16": agreement(outs["float8"], outs["float16"]),
        "float16_vs_float32": agreement(outs["float16"], ref),
        "float8_vs_float32": agreement(outs["float8"], ref),
        "e4m3_activations_vs_float32": agreement(floors["e4m3"], ref),
        "bfloat16_activations_vs_float32": agreement(floors["bfloat16"], ref),
        "images": check,
    }
    print(json.dumps(result["accuracy"]), flush=True)
    for batch in batches:
        x = random_images(batch, IMAGE, 3, dev).half()
        row = {"batch": batch}
        for p, e in executors.items():
            t = time.perf_counter()
            with torch.no_grad():
                graph = _graph(lambda e=e, x=x: e.forward(x))  # the first calls tune (and compile)
            row[f"{p}_ready_s"] = round(time.perf_counter() - t, 1)
            row[f"{p}_hot_us"] = round(_hot_us(graph.replay), 1)
            row[f"{p}_cold_us"] = round(cold_us(graph.replay, warmup_ms=5, rep_ms=30), 1)
        row["speedup_hot"] = round(row["float16_hot_us"] / row["float8_hot_us"], 3)
        row["speedup_cold"] = round(row["float16_cold_us"] / row["float8_cold_us"], 3)
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    if batches:
        result["step_times"] = step_rows(model, executors, random_images(max(batches), IMAGE, 3, dev).half())
    return result


def step_rows(model, executors: dict, x: torch.Tensor) -> list[dict]:
    """Each step of the float8 plan at x's batch in both precisions (bench/kernels/models.executor_step_us: medians of
    the timed graph's per-step CUDA events), with its kind (step_kind) and whether it runs in float8. float16's plan
    runs the last conv and the pool after it as one step (float8 runs them apart): that step's time goes to the
    conv's row, the pool's float16 time reads 0."""
    from bench.kernels.models import executor_step_us

    times = {p: executor_step_us(e, x) for p, e in executors.items()}
    fp16 = times["float16"]
    float8 = executors["float8"]
    precision = float8.precisions()

    def float16_us(name: str) -> float:
        merged = [t for n, t in fp16.items() if n.startswith(f"{name}_") and n not in times["float8"]]
        return fp16.get(name, merged[0] if merged else 0.0)

    return [{"step": s.name, "kind": step_kind(model, s), "float8": precision[s.name] == "float8", "batch": len(x),
             "float16_us": round(float16_us(s.name), 2), "float8_us": round(times["float8"].get(s.name, 0.0), 2)}
            for s in float8.steps]  # fmt: skip


def markdown(result: dict, command: str) -> str:
    acc = result["accuracy"]
    lines = [
        f"# float8 against float16, fused {TITLES.get(result.get('model', 'resnet50'), result.get('model'))} "
        f"({result['gpu']})",
        "",
        f"`{command}`: {result['fp8_steps']} of {result['steps']} steps in float8 (the rest fp16: "
        "float8.DEFAULT_FP16_STEPS); random weights, calibrated on random images other than those checked.",
        "",
        "| batch | float16 hot µs | float8 hot µs | speed-up hot | float16 cold µs | float8 cold µs | speed-up cold |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['batch']} | {r['float16_hot_us']} | {r['float8_hot_us']} | {r['speedup_hot']}x | "
            f"{r['float16_cold_us']} | {r['float8_cold_us']} | {r['speedup_cold']}x |"
        )
    lines += ["", f"Accuracy over {acc['images']} images:", ""]
    lines += ["| pair | cosine mean | cosine worst | top-1 agreement |", "|---|---|---|---|"]
    pairs = ("float8_vs_float16", "float16_vs_float32", "float8_vs_float32", "e4m3_activations_vs_float32",
             "bfloat16_activations_vs_float32")  # fmt: skip
    for pair in (p for p in pairs if p in acc):
        a = acc[pair]
        lines.append(f"| {pair.replace('_', ' ')} | {a['cosine_mean']:.5f} | {a['cosine_min']:.5f} | "
                     f"{a['top1_agree']:.1%} |")  # fmt: skip
    if "e4m3_activations_vs_float32" in acc:
        lines += ["", "e4m3 (bfloat16) activations: float32 with every conv's output but the last rounded to e4m3 per "
                  "tensor (to bfloat16), the weights exact: what the rounding of activations alone costs, the floor "
                  "of any float8 plan that passes e4m3 between layers."]  # fmt: skip
    return "\n".join(lines + step_table(result.get("step_times", []))) + "\n"


def step_table(steps: list[dict]) -> list[str]:
    """The per-step times summed by kind (step_kind), the kinds with the most float16 time first."""
    if not steps:
        return []
    kinds: dict[str, dict] = {}
    for r in steps:
        k = kinds.setdefault(r["kind"], {"n": 0, "fp8": 0, "float16_us": 0.0, "float8_us": 0.0})
        k["n"] += 1
        k["fp8"] += r["float8"]
        k["float16_us"] += r["float16_us"]
        k["float8_us"] += r["float8_us"]
    f16, f8 = sum(r["float16_us"] for r in steps), sum(r["float8_us"] for r in steps)
    head = (f"Steps at batch {steps[0]['batch']} by kind (device µs, the medians of 20 replays of the timed graph; "
            f"sum {f16:.0f} µs float16, {f8:.0f} float8; float16's one step of the last conv and its pool "
            "counted under the conv):")  # fmt: skip
    lines = [
        "",
        head,
        "",
        "| kind | steps (float8) | float16 µs | float8 µs | float16 / float8 |",
        "|---|---|---|---|---|",
    ]
    for kind, k in sorted(kinds.items(), key=lambda kv: -kv[1]["float16_us"]):
        ratio = k["float16_us"] / k["float8_us"] if k["float8_us"] else float("nan")
        cells = (kind, f"{k['n']} ({k['fp8']})", f"{k['float16_us']:.1f}", f"{k['float8_us']:.1f}", f"{ratio:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    import sys

    from service.model.float8 import fp16_steps_of

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/probes"), help="a directory, or a .md file")
    parser.add_argument("--batches", default="1,256", help="comma-separated batch sizes (default 1,256)")
    parser.add_argument("--calib", type=int, default=64, help="random images to calibrate on (default 64)")
    parser.add_argument("--check", type=int, default=256, help="other random images to compare on (default 256)")
    parser.add_argument("--tune-budget", type=float, default=None, help="seconds of candidate timing at most")
    parser.add_argument("--model", choices=sorted(TITLES), default="resnet50", help="the CNN (default resnet50)")
    keep_help = "the steps kept in float16, as FUSEDSERVE_FLOAT8_FP16_STEPS (default: its default)"
    parser.add_argument("--fp16-steps", default=None, help=keep_help)
    args = parser.parse_args()
    keep = None if args.fp16_steps is None else fp16_steps_of(args.fp16_steps)
    result = run([int(b) for b in args.batches.split(",")], args.calib, args.check, args.tune_budget, args.model, keep)
    if args.out.suffix == ".md":
        md_path, json_path = args.out, args.out.with_suffix(".json")
    else:
        md_path, json_path = args.out / f"probe_fp8_{args.model}.md", args.out / f"probe_fp8_{args.model}.json"
    md_path.parent.mkdir(parents=True, exist_ok=True)
    text = markdown(result, "python -m bench.probes.fp8_resnet50 " + " ".join(sys.argv[1:]))
    md_path.write_text(text)
    json_path.write_text(json.dumps(result, indent=1))
    print(text)


if __name__ == "__main__":
    main()
