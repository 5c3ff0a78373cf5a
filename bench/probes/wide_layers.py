"""Is an MLP at one batch held back by the tuner's short candidate lists? Every tile, K step, depth, warp count
and split-K of linear.py's kernel on each of the MLP's layers (`--model`: the wide 1024-4096-4096-1024 one, or
mlp-768 and mlp-1000, the widths that are not powers of two), cold and hot as the tuner times them, then the whole
forward with the grid's picks against the tuner's.

(a) Per layer: cuBLASLt's epilogue (`torch._addmm_activation`, whose GELU is the tanh form, or `addmm` for the
    last layer, which has no activation) as a yardstick, the tuner's own candidates, and the grid (GRID_TILES x
    BLOCK_K 64/128 x 3-6 stages x 4 warps, 8 too for tiles of 128x128 and up, x SPLIT_K 1-8 where every split
    keeps 2+ K steps), each timed by kernels/tuning.time_candidates: one CUDA graph of one call, cold (L2 cleared)
    and hot (back to back). Printed: the best 12 by hot time, and the best by each count in the tuner's list
    and in the grid.
(b) The whole forward (kernels/tuning._graph_times on the service's fused executor, fp16) with each layer
    forced to: the tuner's `both` pick from its candidates, the `both` pick from the grid, the grid's best
    hot. Each variant is timed ROUNDS times, taking turns, so that drift over the call hits all alike.

Grid candidates are compiled first by WORKERS processes (Triton's disk cache is shared).

What it found on an H200 (bench/results/h200/probe_wide_layers_h200.txt): the last layer's best is 64x64x128 tiles
split 2 ways, 10.4 us hot against 11.8 for the tuner's 64x128 split 4, and the forward 37.4 us against 39.4;
linear.py now offers it. The first two layers' tuner picks were within 2% of the grid's best.

    python -m bench.probes.wide_layers --out DIR [--batch 256] [--model wide|mlp-768|mlp-1000]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing as mp
import statistics
import tempfile
import time

import torch
import triton

import kernels.linear as linear_mod
from kernels import FusedLinear, tuning
from kernels.tiles import device_limits
from kernels.tuning import LaunchConfig, Times

from .common import forced, main, tuned_by
from .tuner_picks import key_shape, short

GRID_TILES = ((64, 64), (64, 128), (128, 64), (128, 128), (64, 256), (128, 256))
SPLITS = (1, 2, 4, 8)
WORKERS = 14
ROUNDS = 5
MODELS = ("wide", "mlp-768", "mlp-1000")


def layers_of(name: str) -> list[tuple[int, int, str]]:
    """(K, N, activation) of each layer of one of MODELS, as bench/kernels/models.py builds it."""
    from bench.kernels.models import ODD_MLPS, WIDE_DIMS

    dims, act = (WIDE_DIMS, "relu") if name == "wide" else (ODD_MLPS[name][0], ODD_MLPS[name][1].__name__.lower())
    pairs = zip(dims[:-1], dims[1:], strict=True)
    return [(k, n, act if i < len(dims) - 2 else "none") for i, (k, n) in enumerate(pairs)]


def grid(shared_memory: int, element_size: int = 2) -> list[LaunchConfig]:
    out = []
    for bm, bn in GRID_TILES:
        for bk in (64, 128):
            for warps in (4, 8) if bm * bn >= 128 * 128 else (4,):
                for stages in (3, 4, 5, 6):
                    for split in SPLITS:
                        c = LaunchConfig.of(warps, stages, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SPLIT_K=split)
                        if linear_mod.pipeline_shared_memory(c, element_size) <= shared_memory:
                            out.append(c)
    return out


def fits(config: LaunchConfig, K: int) -> bool:
    """At least two K steps per split."""
    return triton.cdiv(K, config["BLOCK_K"]) >= 2 * config["SPLIT_K"]


def _compile_worker(batch: int, layers: list[tuple[int, int, str]], configs: list[dict]) -> int:
    """Run each config once on each layer in a fresh process, so that the timing pass finds it compiled."""
    done = 0
    for K, N, act in layers:
        x = torch.randn(batch, K, device="cuda").half()
        w = torch.randn(N, K, device="cuda").half()
        b = torch.randn(N, device="cuda").half()
        for c in map(LaunchConfig.from_json, configs):
            if not fits(c, K):
                continue
            try:
                with forced(linear_mod, c):
                    FusedLinear(w, b, act)(x)
                done += 1
            except Exception:  # noqa: BLE001 - out of resources and such; the timing pass leaves them out
                pass
    torch.cuda.synchronize()
    return done


def precompile(batch: int, layers: list[tuple[int, int, str]], configs: list[LaunchConfig]) -> None:
    chunks = [[c.to_json() for c in configs[i::WORKERS]] for i in range(WORKERS)]
    spawn = mp.get_context("spawn")
    with cf.ProcessPoolExecutor(WORKERS, mp_context=spawn) as pool:
        list(pool.map(_compile_worker, [batch] * WORKERS, [layers] * WORKERS, chunks))


def cublaslt(batch: int, K: int, N: int, act: str) -> Times:
    x = torch.randn(batch, K, device="cuda").half()
    w = (torch.randn(N, K, device="cuda") / K**0.5).half()
    b = torch.randn(N, device="cuda").half()
    if act in ("relu", "gelu"):
        return tuning._graph_times(lambda: torch._addmm_activation(b, x, w.t(), use_gelu=act == "gelu"))
    return tuning._graph_times(lambda: torch.addmm(b, x, w.t()))


def line(config: LaunchConfig, t: Times, lt: Times, own: bool) -> str:
    return (f"  {short(config):42s} {t.cold_us:8.2f} {t.hot_us:8.2f}   {t.cold_us / lt.cold_us:5.2f}x "
            f"{t.hot_us / lt.hot_us:5.2f}x  {'tuner' if own else ''}")  # fmt: skip


def sweep_layers(executor, x, configs: list[LaunchConfig]) -> list[dict]:
    """(a): every layer's tuner candidates and fitting grid configs, timed; the forward picks the tuner's `both`."""
    record: list[dict] = []

    def tune(scope, key, candidates, run, measure=None):
        own = list(candidates)
        K, N = key_shape(key)
        extra = [c for c in configs if fits(c, K) and c not in own]
        timings = tuning.time_candidates(own + extra, run, measure, f"{scope} {key}")
        record.append({"key": key, "K": K, "N": N, "own": [c for c in own if c in timings], "timings": timings})
        return tuning.pick({c: timings[c] for c in own if c in timings}, "both")

    with tuned_by(linear_mod, tune), torch.inference_mode():
        executor.forward(x)
    torch.cuda.synchronize()
    return record


def forward_times(model, x, picks: dict[str, dict[str, LaunchConfig]]) -> dict[str, list[Times]]:
    """(b): the fused forward with each layer forced to picks[variant][key], ROUNDS times each, in turns."""
    from service.model.executors import Executor

    executors = {}
    for variant, chosen in picks.items():
        ex = Executor(model, "fused", torch.device("cuda"), torch.float16)
        with tuned_by(linear_mod, lambda scope, key, *a, chosen=chosen, **k: chosen[key]), torch.inference_mode():
            ex.forward(x)  # compiles and records each layer's launch for this bucket
        executors[variant] = ex
    out: dict[str, list[Times]] = {v: [] for v in picks}
    for _ in range(ROUNDS):
        for variant, ex in executors.items():
            with torch.inference_mode():
                out[variant].append(tuning._graph_times(lambda ex=ex: ex.forward(x)))
    return out


def sweep(args: argparse.Namespace) -> dict:
    from bench.kernels.models import load_named
    from service.model.executors import Executor

    _, smem = device_limits(torch.device("cuda"))
    configs = grid(smem)
    layers = layers_of(args.model)
    t = time.monotonic()
    precompile(args.batch, layers, configs)
    print(f"grid: {len(configs)} configs compiled in {time.monotonic() - t:.0f} s",
          flush=True)  # fmt: skip
    result: dict = {"model": args.model, "batch": args.batch, "layers": [], "forward": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model = load_named(args.model, tmp, seed=0)
        x = torch.randn(args.batch, model.input_shape[0], device="cuda").half()
        t = time.monotonic()
        record = sweep_layers(Executor(model, "fused", torch.device("cuda"), torch.float16), x, configs)
        print(f"layers timed in {time.monotonic() - t:.0f} s", flush=True)
        picks: dict[str, dict[str, LaunchConfig]] = {"tuner both": {}, "grid both": {}, "grid best hot": {}}
        for i, r in enumerate(record):
            K, N, timings, own = r["K"], r["N"], r["timings"], r["own"]
            act = layers[i][2]
            lt = cublaslt(args.batch, K, N, act)
            mine = {c: timings[c] for c in own}
            chosen = {
                "tuner both": tuning.pick(mine, "both"),
                "grid both": tuning.pick(timings, "both"),
                "grid best hot": min(timings, key=lambda c: timings[c].hot_us),
            }
            for variant, c in chosen.items():
                picks[variant][r["key"]] = c
            print(f"\n{args.model} float16 batch {args.batch} layer {i} ({K}->{N}, {act}): {len(own)} tuner "
                  f"candidates, "
                  f"{len(timings) - len(own)} more from the grid; cuBLASLt cold {lt.cold_us:.2f} us, "
                  f"hot {lt.hot_us:.2f} us", flush=True)  # fmt: skip
            print(f"  {'config':42s} {'cold us':>8s} {'hot us':>8s}   vs cuBLASLt cold, hot", flush=True)
            for c in sorted(timings, key=lambda c: timings[c].hot_us)[:12]:
                print(line(c, timings[c], lt, c in own), flush=True)
            for variant, c in chosen.items():
                print(f"  {variant:13s}: {short(c)}  cold {timings[c].cold_us:.2f} us, hot {timings[c].hot_us:.2f} us",
                      flush=True)  # fmt: skip
            result["layers"].append({
                "K": K, "N": N, "activation": act, "cublaslt": lt._asdict(),
                "chosen": {v: c.to_json() for v, c in chosen.items()},
                "timings": [{"config": c.to_json(), "own": c in own, **timings[c]._asdict()} for c in timings],
            })  # fmt: skip
        t = time.monotonic()
        forward = forward_times(model, x, picks)
    print(f"\n{args.model} forward at batch {args.batch}, fp16, {ROUNDS} rounds in turns "
          f"({time.monotonic() - t:.0f} s):", flush=True)  # fmt: skip
    print(f"  {'layers forced to':15s} {'cold us (median, runs)':>40s} {'hot us (median, runs)':>40s}", flush=True)
    for variant, runs in forward.items():
        cold = [r.cold_us for r in runs]
        hot = [r.hot_us for r in runs]
        print(f"  {variant:15s} {statistics.median(cold):8.2f} ({' '.join(f'{v:.1f}' for v in cold)})"
              f" {statistics.median(hot):8.2f} ({' '.join(f'{v:.1f}' for v in hot)})", flush=True)  # fmt: skip
        result["forward"][variant] = [r._asdict() for r in runs]
    return result


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=256, help="rows per forward [256]")
    p.add_argument("--model", choices=MODELS, default="wide", help="the MLP whose layers are swept [wide]")


if __name__ == "__main__":
    main("wide_layers", sweep, options)
