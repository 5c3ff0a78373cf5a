"""A wide config sweep of linear.py's MMA kernel at 1024^3, the published shape where cuBLASLt's epilogue
is ahead. cuBLAS runs `nvjet_sm90_hsh_128x64_64x8_1x2_...`: 128x64 tiles, a 64-deep K step and, going by
the name, 8 pipeline stages.

Sweeps tiles 64-256, BLOCK_K 64/128 (32/64 for fp32), 3-8 stages (as shared memory allows), 4 or 8 warps,
for fp16 and fp32 (TF32); bf16 re-times fp16's best ten; GROUP_M 1/4/16 for the best three. For the
best five of each dtype it also times the same config with PDL off and as a plain tile loop (no masks,
no edge clamp, no grouping, no PDL: bench/probes/linear_share.py's kernel), to split what generality
costs. All cold graph replays (L2 flushed), as the benchmark. Candidates are compiled first by 12
processes (Triton's disk cache is shared), so the sweep is mostly timing.

    python -m bench.probes.linear_1024 --out DIR

What it finds (H200, Triton 3.6; bench/results/h200/probe_linear_1024_h200.txt): the tuned kernel takes
what the bare tile loop takes at its tile (fp16 64x128x64: 10.75 against 10.82 us; tuned FusedLinear
10.66, cuBLASLt 9.76); no tile, depth or K step beats 10.6 us. Deeper pipelines help 64x128 (5-6 stages
at BLOCK_K 64, 4 at 128); GROUP_M 1-16 moves <= 0.2 us; PDL off changes 0-0.2 us.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp

import torch

import kernels.linear as linear_mod
from kernels import FusedLinear, pdl
from kernels.tiles import device_limits
from kernels.tuning import LaunchConfig

from .common import forced, graph_us, main, relu_layer

M = K = N = 1024
TILES = ((64, 128), (128, 64), (64, 64), (128, 128), (64, 256), (128, 256))
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def grid(element_size: int, shared_memory: int) -> list[LaunchConfig]:
    out = []
    for bm, bn in TILES:
        for bk in (32, 64) if element_size == 4 else (64, 128):
            for warps in (4, 8) if bm * bn >= 128 * 64 else (4,):
                for stages in (3, 4, 5, 6, 8):
                    cfg = LaunchConfig.of(warps, stages, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SPLIT_K=1)
                    if linear_mod.pipeline_shared_memory(cfg, element_size) <= shared_memory:
                        out.append(cfg)
    return out


def _run_config(cfg: LaunchConfig, x, w, b):
    with forced(linear_mod, cfg):
        layer = FusedLinear(w, b, "relu")
        layer(x)
    return layer


def _compile_worker(dtype_name: str, configs: list[dict]) -> int:
    """Compile (by running once) each config in a fresh process; failures are the sweep's to report."""
    torch.backends.cuda.matmul.allow_tf32 = True
    x, w, b, _ = relu_layer(M, K, N, DTYPES[dtype_name])
    done = 0
    for c in configs:
        try:
            _run_config(LaunchConfig.from_json(c), x, w, b)
            done += 1
        except Exception:  # noqa: BLE001 - out of resources and such; the timing pass records the error
            pass
    torch.cuda.synchronize()
    return done


def precompile(dtype_name: str, configs: list[LaunchConfig], workers: int = 12) -> None:
    chunks = [[c.to_json() for c in configs[i::workers]] for i in range(workers)]
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        list(pool.map(_compile_worker, [dtype_name] * workers, chunks))


def time_configs(graph_us, dtype, configs, x, w, b, ref) -> list[dict]:
    rows = []
    for cfg in configs:
        try:
            layer = _run_config(cfg, x, w, b)
            err = float((layer(x).double() - ref).norm() / ref.norm())
            us = graph_us(lambda layer=layer: layer(x))
            rows.append({"us": us, "err": err, "config": cfg.to_json()})
        except Exception as e:  # noqa: BLE001
            rows.append({"us": float("inf"), "err": float("nan"), "config": cfg.to_json(), "error": str(e)[:100]})
    rows.sort(key=lambda r: r["us"])
    return rows


def describe(c: dict) -> str:
    k = c["kwargs"]
    return f"{k['BLOCK_M']}x{k['BLOCK_N']}x{k['BLOCK_K']} w{c['num_warps']} s{c['num_stages']} g{k['GROUP_M']}"


def sweep(graph_us) -> dict:
    from .linear_share import _tiles

    torch.backends.cuda.matmul.allow_tf32 = True  # fp32 as TF32 on both sides, as the benchmark's fp32 rows
    sms, smem = device_limits(torch.device("cuda"))
    res = {}
    fp16_best: list[LaunchConfig] = []
    for name in ("float16", "bfloat16", "float32"):
        dtype = DTYPES[name]
        x, w, b, ref = relu_layer(M, K, N, dtype)
        configs = fp16_best[:10] if name == "bfloat16" else grid(x.element_size(), smem)
        precompile(name, configs)
        lt = graph_us(lambda b=b, x=x, w=w: torch._addmm_activation(b, x, w.t()))
        tuned = FusedLinear(w, b, "relu")
        tuned(x)
        tuned_us = graph_us(lambda tuned=tuned, x=x: tuned(x))
        rows = time_configs(graph_us, dtype, configs, x, w, b, ref)
        print(f"linear-1024 {name} relu, cold graph replay: cublaslt {lt:.2f} us, FusedLinear tuned {tuned_us:.2f} "
              f"({len(configs)} configs)", flush=True)  # fmt: skip
        if name == "float16":
            fp16_best = [LaunchConfig.from_json(r["config"]) for r in rows if r["us"] < float("inf")]
        # GROUP_M around the best three
        regroup = []
        for r in rows[:3]:
            c = LaunchConfig.from_json(r["config"])
            for g in (1, 4, 16):
                kw = dict(c.kwargs)
                kw["GROUP_M"] = g
                regroup.append(LaunchConfig.of(c.num_warps, c.num_stages, **kw))
        grouped = time_configs(graph_us, dtype, regroup, x, w, b, ref)
        # what generality costs at the best five: PDL off, and the plain tile loop
        splits = []
        for r in rows[:5]:
            c = LaunchConfig.from_json(r["config"])
            pdl.set_enabled(False)
            try:
                no_pdl = time_configs(graph_us, dtype, [c], x, w, b, ref)[0]["us"]
            finally:
                pdl.set_enabled(True)
            y = torch.empty(M, N, device="cuda", dtype=dtype)
            bm, bn, bk = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]

            def plain(y=y, bm=bm, bn=bn, bk=bk, c=c, x=x, w=w, b=b):
                _tiles[(M // bm * (N // bn),)](x, w, b, y, M, N, K, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SHARE=0,
                                               num_warps=c.num_warps, num_stages=c.num_stages)  # fmt: skip

            try:
                plain()
                perr = float((y.double() - ref).norm() / ref.norm())
                plain_us = graph_us(plain)
            except Exception as e:  # noqa: BLE001
                perr, plain_us = float("nan"), float("inf")
                print(f"   plain {describe(r['config'])} failed: {str(e)[:100]}", flush=True)
            splits.append(
                {"config": r["config"], "us": r["us"], "no_pdl": no_pdl, "plain": plain_us, "plain_err": perr}
            )
        for r in rows[:12]:
            print(f"   {r['us']:6.2f} us  {r['us'] / lt:4.2f}x cublaslt  err {r['err']:.1e}  {describe(r['config'])}",
                  flush=True)  # fmt: skip
        failed = [r for r in rows if r["us"] == float("inf")]
        worst = max((r["err"] for r in rows if r["err"] == r["err"]), default=float("nan"))
        print(f"   ... {len(rows) - len(failed)} ran, {len(failed)} failed, worst err {worst:.1e}", flush=True)
        for r in grouped:
            print(f"   regroup {r['us']:6.2f} us  {describe(r['config'])}", flush=True)
        for s in splits:
            print(f"   split {describe(s['config'])}: real {s['us']:.2f} us, PDL off {s['no_pdl']:.2f}, plain loop "
                  f"{s['plain']:.2f} (err {s['plain_err']:.1e})", flush=True)  # fmt: skip
        res[name] = {"cublaslt": lt, "tuned": tuned_us, "rows": rows, "regroup": grouped, "splits": splits}
    return res


if __name__ == "__main__":
    main("linear_1024", lambda: sweep(graph_us))
