"""Development probe for the kernel work of issue 3: one device call that times the candidates behind
each tuning decision, so the choices in kernels/ rest on numbers. Not the benchmark (bench/kernels.py).

    python -m bench.probe_hopper --out $OUT
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import kernels.linear as linear_mod
import kernels.mlp as mlp_mod
from kernels import FusedLinear
from kernels.mlp import FusedMLP, MLPLayer
from service.model.loader import load_model
from service.model.planner import group_mlps, plan

from .kernel_timing import Timing, capture, device_us

BW = 4.25e12  # H200 device-to-device copy, ../shared/gpu/README.md


@contextlib.contextmanager
def forced(module, cfg):
    """module's kernels take cfg instead of tuning, until the block ends."""
    orig = module.tune
    module.tune = lambda *a, **k: cfg
    try:
        yield
    finally:
        module.tune = orig


def dev_us(fn) -> float:
    return device_us(fn, Timing())


def graph_us(fn) -> float:
    graph, _ = capture(fn)
    return dev_us(graph.replay)


def relu_layer(M, K, N, dtype):
    """x, W, b of one layer (outputs O(1) whatever K) and relu(x W^T + b) in float64, all on the GPU."""
    x = torch.randn(M, K, device="cuda").to(dtype)
    w = (torch.randn(N, K, device="cuda") / K**0.5).to(dtype)
    b = torch.randn(N, device="cuda").to(dtype)
    return x, w, b, torch.relu(F.linear(x.double(), w.double(), b.double()))


def sweep_linear(M, K, N, dtype, act="relu", top=6):
    x, w, b, ref = relu_layer(M, K, N, dtype)
    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for cfg in linear_mod.cuda_configs(linear_mod.m_bucket(M), N, K, sms, x.element_size()):
        try:
            with forced(linear_mod, cfg):
                layer = FusedLinear(w, b, act)
                y = layer(x)
                err = float((y.double() - ref).norm() / ref.norm())
                us = dev_us(lambda layer=layer: layer(x))
            rows.append((us, err, cfg.meta()))
        except Exception as e:  # noqa: BLE001
            rows.append((float("inf"), float("nan"), {**cfg.meta(), "error": str(e)[:80]}))
    rows.sort(key=lambda r: r[0])
    floor = (M * K + K * N + M * N) * x.element_size() / BW * 1e6
    lt = dev_us(lambda: torch._addmm_activation(b, x, w.t()))
    fl = dev_us(lambda: torch.relu(F.linear(x, w, b)))
    print(f"linear M={M} K={K} N={N} {dtype}: floor {floor:.1f} us, cublaslt {lt:.1f}, F.linear+relu {fl:.1f}")
    for us, err, meta in rows[:top]:
        print(f"   {us:7.1f} us  {floor / us * 100:5.1f}% floor  err {err:.1e}  {meta}")
    worst_err = max(r[1] for r in rows if r[1] == r[1])
    print(f"   ({len(rows)} configs, worst err {worst_err:.1e}, slowest {rows[-1][0]:.1f} us)")
    return {"M": M, "K": K, "N": N, "dtype": str(dtype), "floor": floor, "cublaslt": lt, "linear": fl,
            "configs": [(us, err, meta) for us, err, meta in rows]}  # fmt: skip


def small_linear_grid(M: int, N: int, K: int, element_size: int) -> list:
    """Wider than cuda_configs: every BLOCK_M/N/K of 16-256 the shape fills, 2 stages (4 too with 4+ K
    steps), 4 warps (8 too for 128-wide N), no split. For the published small shapes, where cuBLASLt's
    epilogue is 3-12% ahead."""
    configs = []
    for bm in (16, 32, 64):
        for bn in (32, 64, 128):
            for bk in (64, 128, 256):
                if bm > max(16, M) or bn > N or bk > K:
                    continue
                for stages in (2, 4) if K // bk >= 4 else (2,):  # stages beyond the K steps buy nothing
                    for warps in (4, 8) if bn == 128 else (4,):
                        c = linear_mod.LaunchConfig.of(
                            warps, stages, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SPLIT_K=1
                        )
                        if linear_mod.pipeline_shared_memory(c, element_size) <= linear_mod.HOPPER_SHARED_MEMORY:
                            configs.append(c)
    return configs


def sweep_small_linear(M, K, N, dtype=torch.float16, top=8) -> dict:
    """Graph-replay device time, L2 flushed (the benchmark's primary figure), of every config of
    small_linear_grid, against cuBLASLt's epilogue timed the same way."""
    x, w, b, ref = relu_layer(M, K, N, dtype)
    offered = {str(c.meta()) for c in linear_mod.cuda_configs(linear_mod.m_bucket(M), N, K, 132, x.element_size())}
    rows = []
    for cfg in small_linear_grid(M, N, K, x.element_size()):
        try:
            with forced(linear_mod, cfg):
                layer = FusedLinear(w, b, "relu")
                err = float((layer(x).double() - ref).norm() / ref.norm())
                us = graph_us(lambda layer=layer: layer(x))
            rows.append((us, err, cfg.meta(), str(cfg.meta()) in offered))
        except Exception as e:  # noqa: BLE001
            rows.append((float("inf"), float("nan"), {**cfg.meta(), "error": str(e)[:80]}, False))
    rows.sort(key=lambda r: r[0])
    lt = graph_us(lambda: torch._addmm_activation(b, x, w.t()))
    print(f"small linear M={M} K={K} N={N} {dtype}, graph replay cold: cublaslt {lt:.2f} us; {len(rows)} configs")
    for us, err, meta, is_offered in rows[:top]:
        print(f"   {us:6.2f} us  err {err:.1e}  {'offered' if is_offered else '       '}  {meta}")
    best_offered = next((r for r in rows if r[3]), None)
    if best_offered:
        print(f"   best offered today: {best_offered[0]:.2f} us  {best_offered[2]}")
    return {"M": M, "K": K, "N": N, "dtype": str(dtype), "cublaslt": lt, "configs": rows}


def sweep_persistent(M, K, N, dtype=torch.float16, act="relu") -> dict:
    """The persistent TMA kernel's configs (kernels/linear_persistent.py) against the tuned linear.py kernel
    and cuBLASLt's epilogue, all as cold graph replays: where the staged kernel would win as a candidate."""
    from kernels.linear_persistent import cuda_configs as persistent_configs
    from kernels.linear_persistent import linear_persistent

    x, w, b, ref = relu_layer(M, K, N, dtype)
    rows = []
    for cfg in persistent_configs(x.element_size()):
        try:
            out = torch.empty(M, N, device="cuda", dtype=dtype)
            y = linear_persistent(x, w, b, act, cfg, out=out)
            err = float((y.double() - ref).norm() / ref.norm())
            us = graph_us(lambda cfg=cfg, out=out: linear_persistent(x, w, b, act, cfg, out=out))
            rows.append((us, err, cfg.meta()))
        except Exception as e:  # noqa: BLE001
            rows.append((float("inf"), float("nan"), {**cfg.meta(), "error": str(e)[:120]}))
    rows.sort(key=lambda r: r[0])
    layer = FusedLinear(w, b, act)  # tuned cold, as the service and the benchmark run it
    ours_err = float((layer(x).double() - ref).norm() / ref.norm())
    ours = graph_us(lambda: layer(x))
    lt = graph_us(lambda: torch._addmm_activation(b, x, w.t()))
    print(f"persistent TMA M={M} K={K} N={N} {dtype}, graph replay cold: cublaslt {lt:.1f} us, "
          f"linear.py tuned {ours:.1f} us (err {ours_err:.1e})")  # fmt: skip
    for us, err, meta in rows:
        print(f"   {us:7.1f} us  {us / lt:5.2f}x cublaslt  err {err:.1e}  {meta}")
    return {"M": M, "K": K, "N": N, "dtype": str(dtype), "cublaslt": lt, "linear": ours, "configs": rows}


def sweep_gemv(K, N, dtype=torch.float16, act="relu") -> dict:
    """One-row layers (the wide MLP at batch 1): every GEMV candidate (kernels/linear_gemv.py) and some
    neighbours, against the tuned FusedLinear (whose candidates now include them), cuBLASLt's epilogue and
    the bandwidth floor (W's bytes at 4.25 TB/s), all cold graph replays."""
    import kernels.linear_gemv as gemv

    x, w, b, ref = relu_layer(1, K, N, dtype)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = list(gemv.cuda_configs(N, K, sms))
    for bn, bk, warps in ((4, 1024, 4), (8, 512, 4), (16, 256, 4), (16, 1024, 8), (64, 256, 8), (8, 2048, 8)):
        for split in (1, 2, 4, 8, 16):
            if triton.cdiv(K, bk) >= split:
                grid.append(linear_mod.LaunchConfig.of(warps, 1, GEMV=1, BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk,
                                                       GROUP_M=1, SPLIT_K=split))  # fmt: skip
    offered = set(gemv.cuda_configs(N, K, sms))
    rows = []
    for cfg in grid:
        try:
            with forced(linear_mod, cfg):
                layer = FusedLinear(w, b, act)
                err = float((layer(x).double() - ref).norm() / ref.norm())
                us = graph_us(lambda layer=layer: layer(x))
            rows.append((us, err, cfg.meta(), cfg in offered))
        except Exception as e:  # noqa: BLE001
            rows.append((float("inf"), float("nan"), {**cfg.meta(), "error": str(e)[:120]}, cfg in offered))
    rows.sort(key=lambda r: r[0])
    layer = FusedLinear(w, b, act)  # tuned cold, as the service and the benchmark run it
    tuned_err = float((layer(x).double() - ref).norm() / ref.norm())
    tuned = graph_us(lambda: layer(x))
    pick = next(iter(layer.direct.values()))[1].meta() if layer.direct else None  # the one bucket's config
    lt = graph_us(lambda: torch._addmm_activation(b, x, w.t()))
    floor = w.numel() * w.element_size() / BW * 1e6
    print(f"gemv M=1 K={K} N={N} {dtype}, graph replay cold: floor {floor:.1f} us, cublaslt {lt:.1f}, "
          f"FusedLinear tuned {tuned:.1f} (err {tuned_err:.1e}) pick {pick}")  # fmt: skip
    for us, err, meta, is_offered in rows[:12]:
        mark = "offered " if is_offered else ""
        print(f"   {us:7.1f} us  {floor / us * 100:5.1f}% floor  err {err:.1e}  {mark}{meta}")
    return {"K": K, "N": N, "dtype": str(dtype), "floor": floor, "cublaslt": lt, "tuned": tuned, "pick": pick,
            "configs": rows}  # fmt: skip


def sweep_tma_small_tiles(M=1024, K=1024, N=1024, dtype=torch.float16, act="relu") -> dict:
    """1024^3, where 128x128 tiles give 64 programs for 132 SMs and both our kernels trail cuBLASLt (12.4 and
    15.4 against 10.5 us): the TMA kernel with 64- and 128-row, 64- and 128-wide tiles, one program per tile
    or per SM."""
    from kernels.linear_persistent import linear_persistent

    x, w, b, ref = relu_layer(M, K, N, dtype)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for bm, bn, warps in ((128, 64, 4), (64, 128, 4), (64, 64, 4), (128, 128, 8), (64, 256, 8), (128, 64, 8)):
        for stages in (3, 4, 5):
            cfg = linear_mod.LaunchConfig.of(warps, stages, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=64, GROUP_M=8, PERSISTENT=1)
            tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
            for programs in sorted({min(tiles, sms), tiles}):
                try:
                    out = torch.empty(M, N, device="cuda", dtype=dtype)
                    y = linear_persistent(x, w, b, act, cfg, out=out, programs=programs)
                    err = float((y.double() - ref).norm() / ref.norm())
                    us = graph_us(lambda cfg=cfg, out=out, p=programs: linear_persistent(x, w, b, act, cfg, out=out,
                                                                                        programs=p))  # fmt: skip
                    rows.append((us, err, {**cfg.meta(), "programs": programs}))
                except Exception as e:  # noqa: BLE001
                    failed = {**cfg.meta(), "programs": programs, "error": str(e)[:100]}
                    rows.append((float("inf"), float("nan"), failed))
    rows.sort(key=lambda r: r[0])
    layer = FusedLinear(w, b, act)
    tuned = graph_us(lambda: layer(x))
    lt = graph_us(lambda: torch._addmm_activation(b, x, w.t()))
    print(f"TMA small tiles M={M} K={K} N={N} {dtype}, graph replay cold: cublaslt {lt:.1f} us, "
          f"FusedLinear tuned {tuned:.1f} us")  # fmt: skip
    for us, err, meta in rows[:12]:
        print(f"   {us:7.1f} us  {us / lt:5.2f}x cublaslt  err {err:.1e}  {meta}")
    return {"M": M, "K": K, "N": N, "dtype": str(dtype), "cublaslt": lt, "tuned": tuned, "configs": rows}


def sweep_mlp(widths, M, dtype):
    gen = torch.Generator().manual_seed(0)
    layers = [
        MLPLayer((torch.randn(widths[i + 1], widths[i], generator=gen) / widths[i] ** 0.5).to("cuda", dtype),
                 torch.randn(widths[i + 1], generator=gen).to("cuda", dtype), "relu" if i < len(widths) - 2 else "none")
        for i in range(len(widths) - 1)
    ]  # fmt: skip
    x = torch.randn(M, widths[0], device="cuda").to(dtype)
    h = x.double()
    for la in layers:
        h = F.linear(h, la.weight.double(), la.bias.double())
        h = torch.relu(h) if la.activation == "relu" else h
    rows = []
    for cfg in mlp_mod.cuda_configs(linear_mod.m_bucket(M), widths[1] if widths[1] > 16 else 16):
        try:
            with forced(mlp_mod, cfg):
                m = FusedMLP(layers)
                y = m(x)
                err = float((y.double() - h).norm() / h.norm())
                rows.append((dev_us(lambda m=m: m(x)), graph_us(lambda m=m: m(x)), err, cfg.meta()))
        except Exception as e:  # noqa: BLE001
            rows.append((float("inf"), float("inf"), float("nan"), {**cfg.meta(), "error": str(e)[:80]}))
    rows.sort(key=lambda r: r[0])

    def anchor():
        t = x
        for la in layers:
            t = F.linear(t, la.weight, la.bias)
            t = torch.relu(t) if la.activation == "relu" else t
        return t

    print(f"mlp {widths} M={M} {dtype}: F.linear+relu eager {dev_us(anchor):.1f} us, graph {graph_us(anchor):.1f} us")
    for us, gus, err, meta in rows[:4]:
        print(f"   {us:6.1f} us (graph {gus:6.1f})  err {err:.1e}  {meta}")
    return {"widths": widths, "M": M, "configs": rows}


@triton.jit
def _one_store(y_ptr):
    tl.store(y_ptr, 1.0)


def hot_graph_us(fn) -> float:
    """Back to back in one graph (do_bench_cudagraph): weights stay in L2 between calls, as in a busy server."""
    return float(triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")) * 1e3


def one_store_floor() -> dict:
    """A kernel that stores one float, replayed from a graph cold and hot: the fixed cost of one graph
    replay under each method, which no forward can go below."""
    y = torch.empty(1, device="cuda")
    floor = {"cold": graph_us(lambda: _one_store[(1,)](y)), "hot": hot_graph_us(lambda: _one_store[(1,)](y))}
    print(f"one-store kernel, graph replay: cold {floor['cold']:.2f} us, hot {floor['hot']:.2f} us", flush=True)
    return floor


def mlp_prefetch_and_floor() -> dict:
    """The whole-MLP kernel with and without its L2 prefetch, cold (L2 flushed, as the benchmark) and hot
    (as a busy server), beside the same measurement of a kernel that stores one float: the
    fixed cost of one graph replay under this method, which no forward can go below."""
    floor = one_store_floor()
    layers = digits_layers()
    rows = []
    for M, bn in ((1, 64), (32, 128), (256, 128)):
        x = torch.randn(M, layers[0].weight.shape[1], device="cuda").to(torch.float16)
        cfg = mlp_mod.LaunchConfig.of(num_warps=4, num_stages=1, BLOCK_M=16, BLOCK_N=bn, STAGES=2, SPLIT=1, LEAD=0)
        for prefetch in (True, False):
            with forced(mlp_mod, cfg):
                m = FusedMLP(layers)
                if not prefetch:
                    m._meta_fixed["PREFETCH_LINES"] = 0
                row = {"M": M, "BLOCK_N": bn, "prefetch": prefetch, "cold": graph_us(lambda m=m, x=x: m(x)),
                       "hot": hot_graph_us(lambda m=m, x=x: m(x))}  # fmt: skip
            print(
                f"digits MLP M={M} BLOCK_N={bn} prefetch={prefetch}: cold {row['cold']:.2f} us, hot {row['hot']:.2f} us"
            )
            rows.append(row)
    return {"one_store": floor, "digits": rows}


def digits_layers(dtype=torch.float16) -> list[MLPLayer]:
    digits = load_model(Path(__file__).resolve().parents[1] / "model_weights" / "digits-mlp")
    steps = [s for step in group_mlps(plan(digits.ops), digits.tensors) for s in getattr(step, "layers", [])]
    t = {k: v.to("cuda", dtype).contiguous() for k, v in digits.tensors.items()}
    return [MLPLayer(t[s.weight], t[s.bias] if s.bias else None, s.activation) for s in steps]


def mlp_split_sweep() -> dict:
    """The digits MLP under every config the tuner may pick for batches 1-256, cold (L2 flushed, as the
    benchmark and now the tuner) and hot (back to back), and what the cold tuner picks; SPLIT > 1 shares the
    first layer pair among programs."""
    floor = one_store_floor()
    layers = digits_layers()
    out = {"one_store": floor, "rows": []}
    for M in (1, 8, 32, 256):
        x = torch.randn(M, layers[0].weight.shape[1], device="cuda").to(torch.float16)
        rows = []
        for cfg in mlp_mod.cuda_configs(linear_mod.m_bucket(M), 256, 2, 256):  # LEAD ones too
            with forced(mlp_mod, cfg):
                m = FusedMLP(layers)
                rows.append((graph_us(lambda m=m, x=x: m(x)), hot_graph_us(lambda m=m, x=x: m(x)), cfg.meta()))
        rows.sort(key=lambda r: r[0])
        tuned = FusedMLP(layers)
        tuned(x)
        pick = tuned._configs[(linear_mod.m_bucket(M), "ieee")].meta()
        print(f"digits MLP M={M}: cold tuner picks {pick}; fastest cold of {len(rows)}:", flush=True)
        for cold, hot, meta in rows[:5]:
            print(f"   cold {cold:6.2f} us  hot {hot:6.2f} us  {meta}")
        best_unsplit = min((r for r in rows if r[2]["SPLIT"] == 1), key=lambda r: r[0])
        print(f"   best SPLIT=1: cold {best_unsplit[0]:6.2f} us  hot {best_unsplit[1]:6.2f} us  {best_unsplit[2]}")
        best_plain = min((r for r in rows if not r[2]["LEAD"]), key=lambda r: r[0])
        print(f"   best LEAD=0:  cold {best_plain[0]:6.2f} us  hot {best_plain[1]:6.2f} us  {best_plain[2]}")
        out["rows"].append({"M": M, "pick": pick, "configs": rows})
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--only", choices=["mlp-prefetch", "mlp-split", "linear-small", "linear-tma", "linear-gemv",
                                      "linear-tma-small", "linear-mid", "mlp-flat", "linear-ws", "gemv-pdl",
                                      "linear-share", "mlp-meet", "linear-1024", "launch-cold", "l2-flush", "stream",
                                      "host-launch", "digits-floor"],
                   help="just this part (mlp-prefetch: with the 1024^3 fp16 config sweep)")  # fmt: skip
    args = p.parse_args()
    t0 = time.time()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    if args.only == "mlp-flat":  # bench/probe_mlp_flat.py: other whole-MLP kernel shapes, and cuBLAS's kernels
        from .probe_mlp_flat import mlp_flat_sweep

        res = mlp_flat_sweep(digits_layers, graph_us, hot_graph_us, one_store_floor)
        (args.out / "probe_mlp_flat.json").write_text(json.dumps(res, default=str, indent=1))
        print(f"[{time.time() - t0:.0f}s]", flush=True)
        return
    if args.only == "linear-ws":  # bench/probe_linear_ws.py: the persistent TMA kernel warp-specialized
        from .probe_linear_ws import sweep

        (args.out / "probe_linear_ws.json").write_text(json.dumps(sweep(graph_us), default=str, indent=1))
        print(f"[{time.time() - t0:.0f}s]", flush=True)
        return
    if args.only == "gemv-pdl":  # bench/probe_gemv_pdl.py: the wide MLP's GEMV chain, double-buffered and PDL
        from .probe_gemv_pdl import sweep as gemv_pdl_sweep

        res = gemv_pdl_sweep(graph_us, one_store_floor)
        (args.out / "probe_gemv_pdl.json").write_text(json.dumps(res, default=str, indent=1))
        print(f"[{time.time() - t0:.0f}s]", flush=True)
        return
    if args.only == "linear-share":  # bench/probe_linear_share.py: 1024^3 with one operand's traffic halved
        from .probe_linear_share import sweep as share_sweep

        (args.out / "probe_linear_share.json").write_text(json.dumps(share_sweep(graph_us), default=str, indent=1))
        print(f"[{time.time() - t0:.0f}s]", flush=True)
        return
    if args.only == "mlp-meet":  # bench/probe_mlp_meet.py: the digits MLP's data movement alone
        from .probe_mlp_meet import sweep as meet_sweep

        res = meet_sweep(graph_us, hot_graph_us, one_store_floor)
        (args.out / "probe_mlp_meet.json").write_text(json.dumps(res, default=str, indent=1))
        print(f"[{time.time() - t0:.0f}s]", flush=True)
        return
    if args.only == "linear-1024":  # bench/probe_linear_1024.py: wide config sweep at 1024^3, every dtype
        from .probe_linear_1024 import sweep as sweep_1024

        (args.out / "probe_linear_1024.json").write_text(json.dumps(sweep_1024(graph_us), default=str, indent=1))
        print(f"[{time.time() - t0:.0f}s]", flush=True)
        return
    if args.only == "launch-cold":  # bench/probe_launch_cold.py: plain launch against graph replay, cold
        from .probe_launch_cold import sweep as launch_sweep

        (args.out / "probe_launch_cold.json").write_text(json.dumps(launch_sweep(), default=str, indent=1))
        print(f"[{time.time() - t0:.0f}s]", flush=True)
        return
    if args.only == "l2-flush":  # bench/probe_l2_flush.py: cold timing with L2 cleared by zeroing and by reading
        from .probe_l2_flush import sweep as flush_sweep

        (args.out / "probe_l2_flush.json").write_text(json.dumps(flush_sweep(), default=str, indent=1))
        print(f"[{time.time() - t0:.0f}s]", flush=True)
        return
    if args.only == "digits-floor":  # bench/probe_digits_floor.py: the least a cold digits forward can take
        from .probe_digits_floor import sweep as digits_floor_sweep

        (args.out / "probe_digits_floor.json").write_text(json.dumps(digits_floor_sweep(), default=str, indent=1))
        print(f"[{time.time() - t0:.0f}s]", flush=True)
        return
    if args.only == "host-launch":  # bench/probe_host_launch.py: a prepared layer's host time per call, by part
        from .probe_host_launch import sweep as host_sweep

        (args.out / "probe_host_launch.json").write_text(json.dumps(host_sweep(), default=str, indent=1))
        print(f"[{time.time() - t0:.0f}s]", flush=True)
        return
    if args.only == "stream":  # bench/probe_stream.py: the fastest cold read of 48 MB, by kernel shape
        from .probe_stream import sweep as stream_sweep

        (args.out / "probe_stream.json").write_text(json.dumps(stream_sweep(), default=str, indent=1))
        print(f"[{time.time() - t0:.0f}s]", flush=True)
        return
    if args.only == "mlp-split":
        (args.out / "probe_mlp_split.json").write_text(json.dumps(mlp_split_sweep(), default=str, indent=1))
        print(f"[{time.time() - t0:.0f}s]", flush=True)
        return
    if args.only == "linear-tma":
        res = []
        shapes = [(1024, 1024, 1024), (4096, 4096, 4096), (256, 4096, 4096), (4096, 1024, 4096), (4096, 4096, 1024)]
        for (M, K, N), dtype in [(s, torch.float16) for s in shapes] + [((4096, 4096, 4096), torch.bfloat16)]:
            res.append(sweep_persistent(M, K, N, dtype))
            (args.out / "probe_linear_tma.json").write_text(json.dumps(res, default=str, indent=1))
            print(f"[{time.time() - t0:.0f}s]", flush=True)
        return
    if args.only == "linear-gemv":
        res = []
        for K, N in ((4096, 4096), (1024, 4096), (4096, 1024)):
            res.append(sweep_gemv(K, N))
            (args.out / "probe_linear_gemv.json").write_text(json.dumps(res, default=str, indent=1))
            print(f"[{time.time() - t0:.0f}s]", flush=True)
        return
    if args.only == "linear-tma-small":
        res = [sweep_tma_small_tiles(), sweep_tma_small_tiles(dtype=torch.bfloat16)]
        (args.out / "probe_linear_tma_small.json").write_text(json.dumps(res, default=str, indent=1))
        print(f"[{time.time() - t0:.0f}s]", flush=True)
        return
    if args.only == "linear-mid":  # the wide MLP's layers at batch 128-256, where 128x128 tiles split along K
        res = []
        for M, K, N in ((256, 4096, 4096), (256, 1024, 4096), (256, 4096, 1024), (128, 4096, 4096)):
            res.append(sweep_linear(M, K, N, torch.float16, top=8))
            (args.out / "probe_linear_mid.json").write_text(json.dumps(res, default=str, indent=1))
            print(f"[{time.time() - t0:.0f}s]", flush=True)
        return
    if args.only == "linear-small":
        res = []
        for M, K, N in ((64, 256, 128), (128, 256, 256)):
            res.append(sweep_small_linear(M, K, N))
            (args.out / "probe_linear_small.json").write_text(json.dumps(res, default=str, indent=1))
            print(f"[{time.time() - t0:.0f}s]", flush=True)
        return
    if args.only == "mlp-prefetch":
        res = {"mlp_prefetch": mlp_prefetch_and_floor(), "linear": [sweep_linear(1024, 1024, 1024, torch.float16)]}
        (args.out / "probe_mlp_prefetch.json").write_text(json.dumps(res, default=str, indent=1))
        print(f"[{time.time() - t0:.0f}s]", flush=True)
        return
    res = {"mlp": [], "linear": []}
    for M in (1, 8, 32, 256, 4096):
        res["mlp"].append(sweep_mlp([64, 256, 256, 10], M, torch.float16))
        print(f"[{time.time() - t0:.0f}s]", flush=True)
    for M, K, N in ((1, 1024, 4096), (1, 4096, 4096), (1, 4096, 1024), (16, 4096, 4096)):
        res["linear"].append(sweep_linear(M, K, N, torch.float16))
        print(f"[{time.time() - t0:.0f}s]", flush=True)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for M, K, N in ((64, 256, 128), (128, 256, 256), (1024, 1024, 1024), (4096, 4096, 4096)):
            res["linear"].append(sweep_linear(M, K, N, dtype, top=2))
            print(f"[{time.time() - t0:.0f}s]", flush=True)
    (args.out / "probe.json").write_text(json.dumps(res, default=str, indent=1))


if __name__ == "__main__":
    main()
