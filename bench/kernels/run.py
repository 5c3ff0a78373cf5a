"""Runs `fusedserve bench kernels`: the ceilings, then the layer cases, the conv cases, the model cases.

The report is rewritten after every case (markdown + JSON, a few ms), so a run cut short by the device
call's limit still leaves every finished case behind; the plot is drawn at the end of each section.
One progress line per case, flushed, with the seconds since start.
"""

from __future__ import annotations

import datetime
import functools
import math
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kernels.activations import torch_activation
from kernels.hot_timing import HOT_MAX_REPLAYS, HOT_MIN_REPLAYS, HOT_SPIN_MARGIN, HOT_WINDOW_US, HOT_WINDOWS

from ..gpu import results_dir, slug_of
from .budget import CONV_START_ESTIMATE_S, MODEL_START_ESTIMATE_S, Budget, section_shares
from .providers import COMPILE_MODES, NotAvailable, inductor_settings, layer_provider
from .report import ours_failed, summary, write_report
from .results import hot, primary
from .timing import (
    DTYPES,
    ELEMENT_BYTES,
    WALL_ROUNDS,
    Prepared,
    Timing,
    WallRun,
    describe,
    error_bound,
    floor_us,
    interleave,
    measure,
    measure_ceilings,
)

if TYPE_CHECKING:
    from .models import ModelProviders

TIME_UP = "skipped: --time-limit reached"
CALIBRATION_SEED_OFFSET = 70_000  # ours-float8's calibration rows: past the model cases' seeds (+ 50_000 + case)


@dataclass(frozen=True)
class _Ctx:
    """What every case of one run shares."""

    plan: object  # bench.kernels.cli.Plan
    device: torch.device
    tf32: bool
    timing: Timing
    budget: Budget
    ceilings: dict
    save: Callable[..., list[Path]]

    def floor_us(self, nbytes: float, flops: float, dtype: str) -> float:
        return floor_us(nbytes, flops, self.ceilings["bandwidth"], self.ceilings["matmul_rate"][dtype])


def execute(plan, command: str) -> int:
    """Run the plan (bench.kernels.cli.Plan); 0 when done, 1 when one of ours gave a wrong or non-finite result."""
    device = torch.device(plan.device)
    tf32 = plan.tf32 and device.type == "cuda"
    saved_tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32  # every torch provider; ours gets allow_tf32=tf32 explicitly
    # cuDNN's convs likewise; ours's convs follow this flag (fused_conv2d's allow_tf32=None).
    torch.backends.cudnn.allow_tf32 = tf32
    settings = inductor_settings()
    try:
        with torch.inference_mode(), torch._inductor.config.patch(settings):
            return _execute(plan, command, device, tf32, settings)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved_tf32


def _execute(plan, command: str, device: torch.device, tf32: bool, settings: dict) -> int:
    import triton

    import kernels

    cuda = device.type == "cuda"
    timing = Timing(*plan.timing)
    budget = Budget(plan.time_limit)
    name = torch.cuda.get_device_name() if cuda else f"CPU ({platform.processor() or platform.machine()})"
    slug = slug_of(name) if cuda else "cpu"
    n_layers = len(plan.dtypes) * len(plan.shapes) * len(plan.acts) if "layers" in plan.sections else 0
    n_models = sum(len(b) for _, _, b in plan.model_runs) if "models" in plan.sections else 0
    n_convs = len(plan.conv_layers) * len(plan.conv_batches) if "convs" in plan.sections else 0
    limit = f"{plan.time_limit:.0f} s" if plan.time_limit > 0 else "none"
    counts = f"{n_layers} layer cases, {n_models} model cases, {n_convs} conv cases"
    _say(budget, f"{name}: {counts}; time limit {limit}; command: {command}")

    needed = {*plan.dtypes} if n_layers else set()
    needed |= {d for _, d, _ in plan.model_runs} if n_models else set()
    needed = sorted(needed | ({plan.model_dtype} if n_convs else set()))
    ceilings = measure_ceilings(device, needed, timing)
    rates = ", ".join(f"{k} {v / 1e12:.1f}" for k, v in ceilings["matmul_rate"].items())
    _say(budget, f"ceilings: copy {ceilings['bandwidth'] / 1e9:.0f} GB/s; matmul TFLOP/s {rates}")
    results = {
        "meta": {
            "gpu": name, "device": device.type, "slug": slug,
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "tf32": tf32, "interpreter": kernels.interpreting(),
            "quick": plan.quick, "command": command, "time_limit_s": plan.time_limit,
            "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "timing": {
                "warmup_ms": timing.warmup_ms, "rep_ms": timing.rep_ms, "wall_target_s": timing.wall_target_s,
                "wall_rounds": WALL_ROUNDS, "wall_interleaved": True, "l2_clear": "read",
                "hot": {
                    "window_us": HOT_WINDOW_US, "windows": HOT_WINDOWS, "min_replays": HOT_MIN_REPLAYS,
                    "max_replays": HOT_MAX_REPLAYS, "spin_margin": HOT_SPIN_MARGIN,
                },
            },
            "inductor_settings": settings, "ceilings": ceilings, "model_dtype": plan.model_dtype,
            "tuning_cache": _tuning_cache(),
        },
        "layers": [],
        "models": [],
        "convs": [],
    }  # fmt: skip

    def save(png: bool = False) -> list[Path]:
        results["meta"]["elapsed_s"] = round(budget.elapsed(), 1)
        return write_report(results, plan.out or results_dir(slug), slug, png=png)

    ctx = _Ctx(plan, device, tf32, timing, budget, ceilings, save)
    # The convs run before the models: 12 cases that carry issue 20's conv target, which the models' last
    # cases (the wider CNN's, no target of their own) could otherwise squeeze out at the hard limit.
    shares = section_shares({"layers": n_layers, "convs": n_convs, "models": n_models})
    if n_layers:
        budget.start_section(shares["layers"])
        _layers(ctx, results["layers"])
        save(png=True)
    if n_convs:
        budget.start_section(shares["convs"], CONV_START_ESTIMATE_S)
        _convs(ctx, results["convs"])
    if n_models:
        budget.start_section(shares["models"], MODEL_START_ESTIMATE_S)
        _models(ctx, results["models"])
    paths = save(png=True)
    print(summary(results), flush=True)
    print("wrote " + ", ".join(str(p) for p in paths), flush=True)
    return 1 if ours_failed(results) else 0


def _tuning_cache() -> str | None:
    """Where ours keeps tuned configs (a hit there makes ours's first call cheap), if this version has one."""
    try:
        from kernels import tuning

        path = tuning.cache().path
        return str(path) if path else None
    except Exception:  # no kernels.tuning (older kernels) or no cache: nothing to report
        return None


def _say(budget: Budget, line: str) -> None:
    print(f"[{budget.elapsed():6.1f}s] {line}", flush=True)


def _layers(ctx: _Ctx, out: list) -> None:
    plan, device, budget = ctx.plan, ctx.device, ctx.budget
    cases = [(dt, s, a) for dt in plan.dtypes for s in plan.shapes for a in plan.acts]
    for i, (dtype, (M, K, N), act) in enumerate(cases):
        nbytes = ELEMENT_BYTES[dtype] * (M * K + N * K + N + M * N)
        flops = 2 * M * N * K
        case = {
            "M": M, "K": K, "N": N, "dtype": dtype, "act": act, "bytes": nbytes, "flops": flops,
            "floor_us": ctx.floor_us(nbytes, flops, dtype), "error_bound": error_bound(dtype, ctx.tf32),
            "providers": {},
        }  # fmt: skip
        label = f"{M}x{K}x{N} {dtype} {act}"
        if budget.expired():
            case["providers"] = {p: {"skipped": TIME_UP} for p in plan.layer_providers}
        else:
            gen = torch.Generator(device=device).manual_seed(plan.seed * 100_003 + i)
            dt = DTYPES[dtype]
            # Unit-scale x, W scaled by 1/sqrt(K): pre-activations ~N(0, 1) plus a bias of 0.5 scale.
            x = torch.randn(M, K, device=device, generator=gen).to(dt)
            w = (torch.randn(N, K, device=device, generator=gen) / math.sqrt(K)).to(dt)
            b = (0.5 * torch.randn(N, device=device, generator=gen)).to(dt)
            ref = torch_activation(x.double() @ w.double().t() + b.double(), act)
            prepare = functools.partial(layer_provider, x=x, w=w, b=b, act=act, tf32=ctx.tf32, device=device)
            _run_case(ctx, case, plan.layer_providers, prepare, ref, len(cases) - i - 1)
            del x, w, b, ref, prepare
        out.append(case)
        ctx.save()
        _say(budget, f"layers {i + 1}/{len(cases)} {label}: {_progress(case)}")


def _models(ctx: _Ctx, out: list) -> None:
    # Imported here: the models need the service's loader (pydantic, safetensors), the layers only torch.
    from .models import ModelProviders, load_with_module

    plan, device = ctx.plan, ctx.device
    total = sum(len(b) for _, _, b in plan.model_runs)
    done = 0
    with tempfile.TemporaryDirectory(prefix="fusedserve-bench-") as tmp:
        for run, (name, dtype, batches) in enumerate(plan.model_runs):
            # ours-float8 calibrates on rows of their own seed, apart from every timed input's (+ 50_000 + case)
            calibration_seed = plan.seed * 100_003 + CALIBRATION_SEED_OFFSET + run
            try:
                model, module = load_with_module(name, Path(tmp), plan.seed)
                providers = ModelProviders(model, device, DTYPES[dtype], max(batches), module, calibration_seed)
            except Exception as e:  # every batch of this model reports it; the other models still run
                model, providers, failure = None, None, describe(e)
            for batch in batches:
                done += 1
                if providers is None:
                    case = {"model": name, "batch": batch, "dtype": dtype, "providers": {}}
                    case["providers"] = {p: {"error": failure} for p in plan.model_providers}
                else:
                    seed = plan.seed * 100_003 + 50_000 + done
                    case = _model_case(ctx, providers, batch, dtype, seed, total - done)
                out.append(case)
                ctx.save()
                label = f"{case['model']} batch {batch} {dtype}"
                _say(ctx.budget, f"models {done}/{total} {label}: {_progress(case)}")
            providers = None  # frees this model's executors, graphs and weights before the next model
            if device.type == "cuda":
                torch.cuda.empty_cache()


def _convs(ctx: _Ctx, out: list) -> None:
    from .convs import NHWC, conv_bytes_and_flops, conv_label, conv_provider, reference_conv, wide_cnn_convs

    plan, device, budget = ctx.plan, ctx.device, ctx.budget
    dtype = plan.model_dtype
    layers = wide_cnn_convs()
    cases = [(layers[i], n) for i in plan.conv_layers for n in plan.conv_batches]
    for i, ((C, H, W, OC), batch) in enumerate(cases):
        nbytes, flops = conv_bytes_and_flops(batch, C, H, W, OC, dtype)
        case = {
            "layer": conv_label(C, H, W, OC), "C": C, "H": H, "W": W, "OC": OC, "batch": batch, "dtype": dtype,
            "bytes": nbytes, "flops": flops, "floor_us": ctx.floor_us(nbytes, flops, dtype),
            "error_bound": error_bound(dtype, ctx.tf32), "providers": {},
        }  # fmt: skip
        if budget.expired():
            case["providers"] = {p: {"skipped": TIME_UP} for p in plan.conv_providers}
        else:
            gen = torch.Generator(device=device).manual_seed(plan.seed * 100_003 + 90_000 + i)
            dt = DTYPES[dtype]
            # Unit-scale x, w scaled by 1/sqrt(9C): pre-activations ~N(0, 1), plus a bias of 0.5 scale.
            # x channels_last, as the fused executor hands it between convs (convs.py says why)
            x = torch.randn(batch, C, H, W, device=device, generator=gen).to(dt).contiguous(memory_format=NHWC)
            w = (torch.randn(OC, C, 3, 3, device=device, generator=gen) / math.sqrt(9 * C)).to(dt)
            b = (0.5 * torch.randn(OC, device=device, generator=gen)).to(dt)
            ref = reference_conv(x, w, b)
            prepare = functools.partial(conv_provider, x=x, w=w, b=b, device=device)
            _run_case(ctx, case, plan.conv_providers, prepare, ref, len(cases) - i - 1)
            del x, w, b, ref, prepare
            if device.type == "cuda":
                torch.cuda.empty_cache()
        out.append(case)
        ctx.save()
        _say(budget, f"convs {i + 1}/{len(cases)} {case['layer']} batch {batch} {dtype}: {_progress(case)}")


def _model_case(ctx: _Ctx, providers: ModelProviders, batch: int, dtype: str, seed: int, cases_after: int) -> dict:
    from .models import FLOAT8_ERROR_BOUND, bytes_and_flops, model_dims

    plan, device = ctx.plan, ctx.device
    model = providers.model
    nbytes, flops = bytes_and_flops(model, batch, dtype)
    case = {
        "model": model.name, "batch": batch, "dtype": dtype, "dims": model_dims(model), "bytes": nbytes,
        "flops": flops, "floor_us": ctx.floor_us(nbytes, flops, dtype), "error_bound": error_bound(dtype, ctx.tf32),
        "providers": {},
    }  # fmt: skip
    if "ours-float8" in plan.model_providers:  # float8 is not float16: its own bound (models.FLOAT8_ERROR_BOUND)
        case["error_bounds"] = {"ours-float8": FLOAT8_ERROR_BOUND}
    if ctx.budget.expired():
        case["providers"] = {p: {"skipped": TIME_UP} for p in plan.model_providers}
        return case
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn((batch, *model.input_shape), device=device, generator=gen).to(DTYPES[dtype])
    ref = providers.reference(x)
    prepare = functools.partial(providers.prepare, x=x)
    _run_case(ctx, case, plan.model_providers, prepare, ref, cases_after)
    if providers.module is not None and not ctx.budget.expired():  # the ResNets: each fused step against unfused
        try:
            case["steps"] = providers.step_times(x)
        except Exception as e:  # the forward's own cells stand; the step table says why it is missing
            case["steps_error"] = describe(e)
    return case


def _run_case(
    ctx: _Ctx,
    case: dict,
    names: tuple[str, ...],
    prepare: Callable[[str], Prepared],
    ref: torch.Tensor,
    cases_after: int,
) -> None:
    """Every provider of one case, in order; a failure is recorded in its cell and the case goes on.

    Wall times are taken last, the providers' runs interleaved round by round (timing.py's docstring
    says why), so each provider stays alive until then, held by its WallRuns; a torch.compile provider is
    timed on the spot instead and dropped at once: compiled code kept across the next compiles is unsafe.
    """
    device, budget = ctx.device, ctx.budget
    t_case = time.perf_counter()
    compile_seconds = 0.0
    walls: dict[str, list[WallRun]] = {}
    for name in names:
        reason = budget.skip_reason(name, cases_after)
        if reason:
            case["providers"][name] = {"skipped": reason}
            continue
        t = time.perf_counter()
        try:
            prep = prepare(name)
        except NotAvailable as e:
            res = {"na": str(e)}
        except Exception as e:
            res = {"error": describe(e)}
            if device.type == "cuda":
                torch.cuda.empty_cache()
        else:
            defer = None if name in COMPILE_MODES else walls.setdefault(name, [])
            bound = case.get("error_bounds", {}).get(name, case["error_bound"])  # a provider's own, or the case's
            res = {"compile_s": prep.compile_s, **measure(prep, ref, device, ctx.timing, bound, defer)}
            del prep
        res["seconds"] = round(time.perf_counter() - t, 2)
        case["providers"][name] = res
        if name in COMPILE_MODES:
            compile_seconds += res["seconds"]
            budget.record(name, res["seconds"])
            torch._dynamo.reset()  # drop the compiled code (and what it holds) before the next provider
    interleave([run for runs in walls.values() for run in runs], device)
    for name, runs in walls.items():  # "seconds" stays the time spent on the provider, its wall runs included
        res = case["providers"][name]
        res["seconds"] = round(res["seconds"] + sum(run.spent_s for run in runs), 2)
    budget.record("base", time.perf_counter() - t_case - compile_seconds)


def _progress(case: dict) -> str:
    """One line: each provider's primary time (graph device us; wall on the CPU) and, after a slash, its hot
    time where it has one; compile seconds; max error."""
    parts, comp, errs = [], [], []
    for name, res in case["providers"].items():
        v, h = primary(res), hot(res)
        tag = "skip" if "skipped" in res else "n/a" if "na" in res else "ERR" if "error" in res else "-"
        parts.append((f"{name} {v:.1f}" + (f"/{h:.1f}" if h is not None else "")) if v is not None else f"{name} {tag}")
        if res.get("compile_s") is not None:
            comp.append(f"{name} {res['compile_s']:.1f}s")
        errs += [c["err"] for c in res.values() if isinstance(c, dict) and c.get("err") is not None]
        if any(isinstance(c, dict) and c.get("bad") for c in res.values()):
            parts[-1] += "(BAD)"
    err = f"max err {max(errs):.1e}" if errs else "no error measured"
    unit = " us (cold/hot)" if any(hot(res) is not None for res in case["providers"].values()) else " us"
    return "  ".join(parts) + unit + " | " + err + (" | first calls: " + ", ".join(comp) if comp else "")
