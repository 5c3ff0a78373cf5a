"""Development probe (issue 20): the TMA conv kernel (kernels/conv_tma.py), every candidate forced, against cuDNN.

For the wider CNN's convs that the kernel can run (64 -> 64 at 32x32, 64 -> 128 at 16x16, 128 -> 128 at 8x8; 3x3,
padding 1, ReLU; x, weight and y channels_last) and the digits CNN's second conv (16 -> 16 at 8x8, y NCHW as
before its flatten), fp16, without and with the 2x2 max pool the models run after them, each a CUDA-graph replay
timed cold (L2 cleared by reads) and hot (replays back to back):
    cudnn-fused   torch.cudnn_convolution_add_relu (unpooled rows): issue 20's bar
    cudnn         F.conv2d + relu [+ max_pool2d], channels_last
    tma <config>  conv_tma's kernel with that config (every candidate conv_tma.cuda_configs offers)
    best, PDL off the fastest of those (cold) launched without programmatic dependent launch

    python3 -m bench.probes.conv_tma --out $OUT      # ~3 minutes on an H100
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# (C, H, W, OC, pooled, y NHWC)
LAYERS = [
    (64, 32, 32, 64, False, True),
    (64, 16, 16, 128, False, True),
    (128, 8, 8, 128, False, True),
    (64, 32, 32, 64, True, True),
    (64, 16, 16, 128, True, True),
    (128, 8, 8, 128, True, False),
    (16, 8, 8, 16, True, False),
]
BATCHES = (1, 32, 256)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.conv_tma", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="output directory [bench/results/<gpu>]")
    args = p.parse_args(argv)

    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        print("probe_conv_tma needs CUDA", file=sys.stderr)
        return 2
    from kernels import conv_tma
    from kernels.conv import m_bucket
    from kernels.tiles import gemm_flags

    from .common import replay_cold_hot, write_named_by_gpu

    torch.manual_seed(0)
    dtype = torch.float16
    nhwc = torch.channels_last
    started = time.perf_counter()
    rows = []

    fixed = gemm_flags(True, "relu", dtype, False, torch.device("cuda"))
    for C, H, W, OC, pooled, y_last in LAYERS:
        w = (torch.randn(OC, C, 3, 3, device="cuda") / (9 * C) ** 0.5).to(dtype).contiguous(memory_format=nhwc)
        b = torch.randn(OC, device="cuda").to(dtype)
        geometry = dict(C=C, H=H, W=W, KH=3, KW=3, PH=1, PW=1, DH=1, DW=1, OH=H, OW=W)
        window = ("max", 2, 2) if pooled else ("none", 1, 1)
        for n in BATCHES:
            x = torch.randn(n, C, H, W, device="cuda").to(dtype).contiguous(memory_format=nhwc)
            ref = torch.relu(F.conv2d(x.float(), w.float(), b.float(), padding=1))
            ref = F.max_pool2d(ref, 2) if pooled else ref
            fmt = nhwc if y_last else torch.contiguous_format
            out = torch.empty(ref.shape, device="cuda", dtype=dtype).contiguous(memory_format=fmt)
            row = {"layer": [C, H, W, OC, pooled, y_last], "batch": n, "providers": {}}

            def cudnn(x=x, w=w, b=b, pooled=pooled):
                y = torch.relu(F.conv2d(x, w, b, padding=1))
                return F.max_pool2d(y, 2) if pooled else y

            row["providers"]["cudnn"] = replay_cold_hot(cudnn, ref, warmups=2)
            if not pooled:
                z = torch.zeros(ref.shape, device="cuda", dtype=dtype).contiguous(memory_format=nhwc)
                row["providers"]["cudnn-fused"] = replay_cold_hot(
                    lambda x=x, w=w, z=z, b=b: torch.cudnn_convolution_add_relu(
                        x, w, z, 0.0, b, (1, 1), (1, 1), (1, 1), 1
                    ),
                    ref,
                    warmups=2,
                )
            pool = (2, 2) if pooled else (1, 1)
            configs = conv_tma.cuda_configs(m_bucket(n * H * W), OC, C, H, W, pool, 2)
            for cfg in configs:
                label = "tma " + " ".join(f"{k}={v}" for k, v in cfg.meta().items() if k != "TMA")

                def ours(cfg=cfg, x=x, w=w, b=b, out=out, geometry=geometry, window=window):
                    conv_tma.launch(x, w, b, out, 0.01, geometry, window, fixed, cfg)
                    return out

                try:
                    row["providers"][label] = replay_cold_hot(ours, ref, warmups=2) | {"config": cfg.meta()}
                except Exception as e:  # a failing config is a result
                    row["providers"][label] = {"error": f"{type(e).__name__}: {e}"[:300]}
            tma = {k: v for k, v in row["providers"].items() if k.startswith("tma ") and "cold_us" in v}
            if tma:  # the fastest config again, launched without PDL (hot: replays back to back)
                best = next(c for c in configs if tma[min(tma, key=lambda k: tma[k]["cold_us"])]["config"] == c.meta())

                def ours_plain(cfg=best, x=x, w=w, b=b, out=out, geometry=geometry, window=window):
                    conv_tma.launch(x, w, b, out, 0.01, geometry, window, {**fixed, "PDL": False}, cfg)
                    return out

                row["providers"]["best, PDL off"] = replay_cold_hot(ours_plain, ref, warmups=2)
            rows.append(row)
            cells = "  ".join(
                f"{k}: {v['cold_us']:.1f}/{v['hot_us']:.1f} e{v['err']:.0e}" if "cold_us" in v else f"{k}: {v['error']}"
                for k, v in row["providers"].items()
            )
            print(f"C{C} {H}x{W} O{OC} pool={pooled} n={n} [{time.perf_counter() - started:.0f}s] {cells}", flush=True)
            torch.cuda.empty_cache()

    lines = [
        f"# probe_conv_tma on {torch.cuda.get_device_name()}, fp16, CUDA-graph replays, µs cold / hot",
        "",
        "| C→O, H×W | pool | batch | cudnn-fused | cudnn | best tma | its config | best, PDL off"
        " | best tma / cuDNN (cold) |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        p_ = r["providers"]
        tma = {k: v for k, v in p_.items() if k.startswith("tma ") and "cold_us" in v}
        best_label = min(tma, key=lambda k: tma[k]["cold_us"]) if tma else None

        def cell(v):
            return "—" if not v else v.get("error", "")[:30] or f"{v['cold_us']:.1f} / {v['hot_us']:.1f}"

        base = min((p_[k]["cold_us"] for k in ("cudnn-fused", "cudnn") if "cold_us" in p_.get(k, {})), default=None)
        ratio = f"{tma[best_label]['cold_us'] / base:.2f}" if best_label and base else "—"
        C, H, W, OC, pooled, _ = r["layer"]
        lines.append(
            f"| {C}→{OC}, {H}×{W} | {pooled} | {r['batch']} | {cell(p_.get('cudnn-fused'))} | {cell(p_.get('cudnn'))}"
            f" | {cell(tma.get(best_label))} | {best_label[4:] if best_label else '—'}"
            f" | {cell(p_.get('best, PDL off'))} | {ratio} |"
        )
    lines += ["", f"{time.perf_counter() - started:.0f} s. Every config's times and errors are in the JSON."]
    text = "\n".join(lines) + "\n"
    print(text)
    write_named_by_gpu(args.out, "probe_conv_tma", text, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
