"""`fusedserve bench zoo --gpu`: each family at full size in fp16, timed at each batch (1 and 256) by bench/kernels'
timing (timing.measure: cold and hot device time, wall time; the hot time is the one compared), against what a
user would run instead:

    ours         the service's path: the model imported from the family's TorchScript ONNX file (where the importer
                 refuses it, export_module's), Executor("fused") under GraphedExecutor (bench/kernels/models.py's
                 ModelProviders, as it times the ResNets)
    eager-cl     the torch module and its input in channels_last (cuDNN's fastest layout)
    compile      torch.compile of the module with BatchNorm folded, default mode, dynamic=False
    compile-max  the same in max-autotune (only for the families named by --max-autotune: minutes each)
    ort          onnxruntime-gpu's CUDA provider on the family's TorchScript ONNX file exported in fp16: IOBinding on
                 the device's tensors, cuDNN's exhaustive algorithm search, NHWC, its own CUDA graph, run on torch's
                 current stream so the same events time it; only where onnxruntime's CUDA provider can be loaded

Time to ready: ours's first forward at the smallest batch, from an imported model to a captured graph (the
executor's binding, every kernel's tuning for that bucket, the capture): "ready_s" of each case's family. Each family
starts from an empty tuning cache of its own (memory only), as a first start of the service does; Triton's cache of
compiled kernels is the process's, so a family whose layers an earlier family of the same run compiled (VGG-11 BN
after VGG-11: the same convs once BatchNorm is folded) compiles less.

Results merge into zoo_<gpu>.json under --out by family (a later run of some families replaces their cases and
keeps the rest), since one device call of 10 minutes cannot time 21 families: a family takes one to a few minutes
(ours tunes every layer at each batch; max-autotune adds minutes), so name a few per call with --families.
"""

from __future__ import annotations

import copy
import datetime
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.gpu import results_dir, slug_of
from bench.kernels.providers import COMPILE_MODES, NotAvailable, inductor_settings
from bench.kernels.timing import Prepared, Timing, describe, error_bound, measure

from . import exporters, families, report

DTYPE = "float16"
PROVIDERS = ("ours", "eager-cl", "compile", "compile-max", "ort")


def ort_module():
    """onnxruntime with a loadable CUDA provider, or NotAvailable saying why not."""
    try:
        import onnxruntime as ort
    except ImportError as e:
        raise NotAvailable(f"onnxruntime cannot be imported ({e})") from None
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise NotAvailable(f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (the CPU build)")
    return ort


class OrtProvider:
    """onnxruntime-gpu on an fp16 TorchScript export of the module: one session per batch (its CUDA graph is
    captured for one shape), the input and output bound to torch's device tensors."""

    def __init__(self, module: torch.nn.Module, image: tuple[int, ...], workdir: Path, name: str):
        self.ort = ort_module()
        half = copy.deepcopy(module).half().cuda().eval()
        self.path = exporters.export("torchscript", half, image, workdir, f"{name}-fp16", dtype=torch.float16)

    def prepare(self, x: torch.Tensor, classes: int) -> Prepared:
        """Its CUDA graph where onnxruntime can capture one; where it refuses (a node it leaves on the CPU:
        ShuffleNetV2's shape arithmetic), launched run by run, timed as launched ("plain" only)."""
        try:
            return self._prepare(x, classes, graph=True)
        except Exception as e:
            if "graph capture" not in str(e):
                raise
        return self._prepare(x, classes, graph=False)

    def _prepare(self, x: torch.Tensor, classes: int, graph: bool) -> Prepared:
        ort = self.ort
        stream = torch.cuda.current_stream()  # a side stream (cuda graphs are not captured on the legacy one)
        options = {
            "device_id": str(x.device.index or 0), "cudnn_conv_algo_search": "EXHAUSTIVE", "prefer_nhwc": "1",
            "enable_cuda_graph": "1" if graph else "0", "has_user_compute_stream": "1",
            "user_compute_stream": str(stream.cuda_stream),
        }  # fmt: skip
        so = ort.SessionOptions()
        so.log_severity_level = 3
        t = time.perf_counter()
        session = ort.InferenceSession(str(self.path), so, providers=[("CUDAExecutionProvider", options)])
        out = torch.empty(len(x), classes, device=x.device, dtype=torch.float16)
        binding = session.io_binding()
        dev = x.device.index or 0
        binding.bind_input("input", "cuda", dev, np.float16, tuple(x.shape), x.data_ptr())
        binding.bind_output("logits", "cuda", dev, np.float16, tuple(out.shape), out.data_ptr())
        run = ort.RunOptions()
        # Run returns without waiting for the stream, as torch's calls do: the hot timer queues replays back to back.
        run.add_run_config_entry("disable_synchronize_execution_providers", "1")
        for _ in range(3):  # the first run searches cuDNN's algorithms, the second captures the graph
            session.run_with_iobinding(binding, run)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t

        def fn():
            session.run_with_iobinding(binding, run)
            return out

        return Prepared(fn, compile_s=compile_s, graphed=graph, plain_only=not graph)


def execute(args, command: str) -> int:
    from bench.gpu import gpu_name

    name = gpu_name() or torch.cuda.get_device_name()
    slug = slug_of(name)
    out = args.out or results_dir(slug)
    path = out / f"zoo_{slug}.json"
    results = {"meta": {}, "cases": [], "not_run": {}}
    kept: dict[tuple[str, int], dict] = {}  # (family, batch) -> providers an earlier run timed and this one does not
    if path.exists() and not args.fresh:
        results = json.loads(path.read_text())
        for c in results["cases"]:
            if c["family"] in args.families:
                kept[c["family"], c["batch"]] = c
        # A family's earlier cases stay in the file until this run has timed it, so a run cut off mid-way loses none,
        # and a batch this run does not time (--batches) keeps its earlier case
        results.setdefault("not_run", {})
        for f in args.families:
            results["not_run"].pop(f, None)
    results["meta"] = _meta(args, command, name, slug, results["meta"])
    saved_tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # fp16 runs: no effect on them
    bad = False
    try:
        with (
            torch.inference_mode(),
            torch._inductor.config.patch(inductor_settings()),
            tempfile.TemporaryDirectory(prefix="fusedserve-zoo-") as tmp,
        ):
            for i, family in enumerate(args.families):
                t = time.perf_counter()
                try:
                    cases = _family(args, family, Path(tmp) / family)
                except Exception as e:  # this family reports why; the others still run
                    results["not_run"][family] = describe(e)
                    cases = []
                for c in cases:  # what an earlier run timed of providers not named this time, and ours's start
                    old = kept.get((family, c["batch"]), {})
                    earlier = {k: v for k, v in old.get("providers", {}).items() if k not in args.providers}
                    c["providers"] = {**earlier, **c["providers"]}
                    if "ours" not in args.providers:  # ours's start is this run's where it timed ours
                        for key in ("ready_s", "tune_s", "tuning_s", "unfused_fallbacks", "steps"):
                            if key in old:
                                c[key] = old[key]
                    rebound(c)  # against the eager-cl error the case now holds, this run's or an earlier one's
                redone = {c["batch"] for c in cases}  # the batches timed now replace theirs; a family that failed, all
                results["cases"] = [
                    c for c in results["cases"] if c["family"] != family or (cases and c["batch"] not in redone)
                ] + cases
                bad |= any(isinstance(v, dict) and v.get("bad") for c in cases for v in
                           c["providers"].get("ours", {}).values())  # fmt: skip
                report.save(results, out, slug)
                print(f"[{i + 1}/{len(args.families)}] {family}: {_line(cases)} ({time.perf_counter() - t:.0f} s)",
                      flush=True)  # fmt: skip
                torch.cuda.empty_cache()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved_tf32
    order = {f: i for i, f in enumerate(families.FAMILIES)}
    results["cases"].sort(key=lambda c: (order.get(c["family"], 99), c["batch"]))
    paths = report.save(results, out, slug)
    print()
    print(report.gpu_table([c for c in results["cases"] if c["family"] in args.families]))
    print(f"\nwrote {', '.join(map(str, paths))}")
    return 1 if bad else 0


def _family(args, family: str, workdir: Path) -> list[dict]:
    from bench.kernels.models import ModelProviders

    device, dtype = torch.device("cuda"), torch.float16
    module = families.build(family, args.size, args.seed)
    image = families.image_shape(family, args.size)
    model, source, export_s, load_s = _import(module, image, workdir, family)
    providers = ModelProviders(model, device, dtype, max(args.batches), module)
    from kernels import tuning

    tuning.use_cache(None)  # an empty tuning cache per family: its ready_s times every key it tunes
    tuning.timing_budget.set(args.tuning_s)  # per family: None times every key
    names = [p for p in PROVIDERS if p in args.providers and (p != "compile-max" or family in args.max_autotune)]
    ort: OrtProvider | Exception | None = None
    if args.no_ort and "ort" in names:
        names.remove("ort")
    timing = Timing()
    cases = []
    side = torch.cuda.Stream()
    for k, batch in enumerate(args.batches):
        gen = torch.Generator(device=device).manual_seed(args.seed * 100_003 + 70_000 + k)
        x = torch.randn((batch, *image), device=device, generator=gen).to(dtype)
        ref = providers.reference(x)
        case = {"family": family, "title": families.FAMILIES[family].title, "batch": batch, "dtype": DTYPE,
                "image": list(image), "ours_from": source, "export_s": round(export_s, 2), "load_s": round(load_s, 3),
                "error_bound": error_bound(DTYPE, True), "providers": {}}  # fmt: skip
        for name in names:
            t = time.perf_counter()
            try:
                if name == "ort":
                    if ort is None:
                        try:
                            ort = OrtProvider(module, image, workdir, family)
                        except Exception as e:  # NotAvailable, or an export that failed: every batch says so
                            ort = e
                    if isinstance(ort, Exception):
                        raise ort
                    with torch.cuda.stream(side):  # onnxruntime runs on it; the timing's events are recorded on it
                        prep = ort.prepare(x, model.output_features)
                        res = {"compile_s": prep.compile_s, **measure(prep, ref, device, timing, case["error_bound"])}
                    torch.cuda.synchronize()
                else:
                    prep = providers.prepare(name, x)
                    res = {"compile_s": prep.compile_s, **measure(prep, ref, device, timing, case["error_bound"])}
                del prep
            except NotAvailable as e:
                res = {"na": str(e)}
            except Exception as e:  # a provider that fails is a result; the case goes on
                res = {"error": describe(e)}
                torch.cuda.empty_cache()
            res["seconds"] = round(time.perf_counter() - t, 2)
            case["providers"][name] = res
            if name in COMPILE_MODES:
                torch._dynamo.reset()  # drop the compiled code before the next provider (bench/kernels does so)
        if "ours" in names:
            case["tuning_s"] = args.tuning_s
            if args.steps:
                case["steps"] = _slowest_steps(providers, x, args.steps)
            ex = providers._executors.get("fused")
            case["unfused_fallbacks"] = sorted(ex.fallbacks) if ex is not None else []
        rebound(case)
        first = case["providers"].get("ours", {}).get("compile_s")
        # The first bucket's binding, tuning and capture from an imported model: time to ready; a later bucket's own
        # tuning and capture.
        case["ready_s" if k == 0 else "tune_s"] = round(first, 1) if first is not None else None
        cases.append(case)
        del x, ref
    ready = cases[0].get("ready_s") if cases else None
    for c in cases:
        c["ready_s"] = ready
    return cases


def _slowest_steps(providers, x: torch.Tensor, n: int) -> dict:
    """The fused plan's n slowest steps at x's batch, each with its unfused ops' time (ModelProviders.step_times),
    and the sums over every step: where the family's time goes, and what fusion saves step by step."""
    try:
        steps = providers.step_times(x)
    except Exception as e:  # the per-step timing is extra; the case's timings stand without it
        return {"error": describe(e)}
    total = sum(s["fused_us"] for s in steps)
    unfused = sum(s["unfused_us"] or 0.0 for s in steps)
    top = sorted(steps, key=lambda s: -s["fused_us"])[:n]
    rows = [{"step": s["step"], "fused_us": round(s["fused_us"], 2),
             "unfused_us": None if s["unfused_us"] is None else round(s["unfused_us"], 2)} for s in top]  # fmt: skip
    return {"count": len(steps), "fused_us": round(total, 1), "unfused_us": round(unfused, 1), "slowest": rows}


# A whole network in fp16 against the float64 forward of the same weights drifts further than one kernel's 1e-2:
# 50 layers of fp16 rounding gave ResNet-50 2.0e-2 in eager torch (channels_last, cuDNN), 3.2e-2 under torch.compile
# and 3.0e-2 fused (H200). So a provider is flagged when its error passes the larger of the kernels' bound and
# EAGER_ERROR_FACTOR times eager torch's own error on the same input: less accurate than what a user runs today.
EAGER_ERROR_FACTOR = 2.0


def rebound(case: dict) -> None:
    """Set case["error_bound"] from eager-cl's error (see EAGER_ERROR_FACTOR) and flag each provider's timings
    against it; where eager-cl has no error, the kernels' bound stands."""
    eager = case["providers"].get("eager-cl", {})
    errs = [v["err"] for v in eager.values() if isinstance(v, dict) and isinstance(v.get("err"), float)]
    base = case.setdefault("kernel_error_bound", case["error_bound"])
    bound = max(base, EAGER_ERROR_FACTOR * min(errs)) if errs else base
    case["error_bound"] = bound
    for res in case["providers"].values():
        for v in res.values():
            if isinstance(v, dict) and "err" in v:
                v["bad"] = (not v.get("finite", True)) or v["err"] > bound


def _import(module, image, workdir: Path, family: str):
    """(model, exporter, export s, import + load s): the TorchScript ONNX file imported, as a user's file is served;
    where the importer refuses it, export_module (torch.export). The dynamo exporter is not tried: it needs
    onnxscript, which the GPU host lacks. ModelFormatError with both refusals when neither imports."""
    from service.model.spec import ModelFormatError

    refusals = []
    for exporter in ("torchscript", "torch.export"):
        t = time.perf_counter()
        try:
            path = exporters.export(exporter, module, image, workdir, family)
            export_s, t = time.perf_counter() - t, time.perf_counter()
            return exporters.load(path), exporter, export_s, time.perf_counter() - t
        except ModelFormatError as e:
            refusals.append(f"{exporter}: {e}")
    raise ModelFormatError("; ".join(refusals))


def _line(cases: list[dict]) -> str:
    from bench.kernels.results import hot, us

    parts = []
    for c in cases:
        times = " ".join(f"{p} {us(hot(r))}" if hot(r) is not None else f"{p} {'n/a' if 'na' in r else 'err'}"
                         for p, r in c["providers"].items())  # fmt: skip
        parts.append(f"batch {c['batch']}: {times}")
    return "; ".join(parts) or "not run"


def _meta(args, command: str, name: str, slug: str, before: dict) -> dict:
    import triton

    try:
        ort_version = ort_module().__version__
    except NotAvailable:  # the version that timed the onnxruntime cells this file keeps
        ort_version = before.get("onnxruntime")
    commands = [*before.get("commands", []), command]
    return {
        "gpu": name, "slug": slug, "dtype": DTYPE, "size": args.size, "batches": list(args.batches),
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "onnxruntime": ort_version, "python": platform.python_version(), "commands": commands,
        "inductor_settings": inductor_settings(), "max_autotune": sorted(set(before.get("max_autotune", []))
                                                                           | set(args.max_autotune)),
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }  # fmt: skip
