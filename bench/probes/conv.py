"""Development probe (issue 20): are the fused CNN kernels where the issue's targets want them, and does fusing
the pool into the conv pay?

For the digits CNN's conv layers (8x8 and 4x4 inputs, 1 -> 16 -> 32 channels, 3x3, ReLU, 2x2 max pool; the
layer shapes are assumed here, pass --digits to change them) and the wider CNN's (channels 64-128, 32x32 down
to 8x8, 3x3, ReLU: the stem, then three convs each pooled), fp16, every provider captured in a CUDA graph and
timed as its replay, cold (L2 cleared by reads before each replay: kernels/cold_timing.py) and hot (replays
back to back):
    cudnn          F.conv2d (bias inside) + torch.relu [+ F.max_pool2d]: the unfused path (kernels.reference)
    cudnn-nhwc     the same on channels_last x and weight
    compile        torch.compile (dynamic=False, per shape) of the cudnn function
    ours           fused_conv2d [then fused_pool2d]: NCHW in and out
    ours-nhwc      the same, channels_last x and weight (the layout a model would convert to once)
    ours-pool      fused_conv2d(..., pool=("max", 2)): as the service runs it, conv + bias + ReLU + pool in one
                   kernel, or (the tuner's APART candidates, where the pooled tiles leave SMs idle) the conv
                   then fused_pool2d (NCHW)
    ours-pool-nhwc the same, channels_last
The targets: the wider CNN's conv layers within 10% of cuDNN's conv + bias + activation; the digits CNN no
slower than torch.compile and cuDNN at any batch.

    python3 -m bench.probes.conv --out $OUT            # ~3-4 minutes on an H100/H200; --no-compile: ~1
    python3 -m bench.probes.conv --out $OUT --models wider   # the wider CNN's layers only
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

DIGITS = [(1, 8, 8, 16, True), (16, 4, 4, 32, True)]  # (C, H, W, O, pooled after)
WIDER = [
    (3, 32, 32, 64, False),
    (64, 32, 32, 64, True),
    (64, 16, 16, 128, True),
    (128, 8, 8, 128, True),
]  # = the model's
DIGITS_BATCHES = (1, 32, 256, 4096)
WIDER_BATCHES = (1, 32, 256)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probes.conv", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="output directory [bench/results/<gpu>]")
    p.add_argument("--no-compile", action="store_true", help="leave out torch.compile (a compile per shape)")
    p.add_argument("--quick", action="store_true", help="one batch per model")
    p.add_argument("--models", default="digits,wider", help="digits,wider [both]")
    args = p.parse_args(argv)

    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        print("probe_conv needs CUDA", file=sys.stderr)
        return 2
    from kernels.conv import fused_conv2d
    from kernels.pool import fused_pool2d

    from .common import replay_cold_hot, write_named_by_gpu

    torch.manual_seed(0)
    dtype = torch.float16
    rows = []
    started = time.perf_counter()

    models = [("digits", DIGITS, DIGITS_BATCHES[-2:-1] if args.quick else DIGITS_BATCHES)]
    models.append(("wider", WIDER, WIDER_BATCHES[-1:] if args.quick else WIDER_BATCHES))
    models = [m for m in models if m[0] in args.models.split(",")]
    for model, layers, batches in models:
        for C, H, W, OC, pooled in layers:
            w = (torch.randn(OC, C, 3, 3, device="cuda") / (9 * C) ** 0.5).to(dtype)
            b = torch.randn(OC, device="cuda").to(dtype)
            w_nhwc = w.to(memory_format=torch.channels_last)
            for n in batches:
                x = torch.randn(n, C, H, W, device="cuda").to(dtype)
                x_nhwc = x.to(memory_format=torch.channels_last)

                def cudnn(x=x, w=w, b=b, pooled=pooled):
                    y = torch.relu(F.conv2d(x, w, b, padding=1))
                    return F.max_pool2d(y, 2) if pooled else y

                def cudnn_nhwc(x=x_nhwc, w=w_nhwc, b=b, pooled=pooled):
                    y = torch.relu(F.conv2d(x, w, b, padding=1))
                    return F.max_pool2d(y, 2) if pooled else y

                def ours(x=x, w=w, b=b, pooled=pooled):
                    y = fused_conv2d(x, w, b, padding=1, activation="relu")
                    return fused_pool2d(y, "max", 2) if pooled else y

                def ours_nhwc(x=x_nhwc, w=w_nhwc, b=b, pooled=pooled):
                    y = fused_conv2d(x, w, b, padding=1, activation="relu")
                    return fused_pool2d(y, "max", 2) if pooled else y

                providers = {"cudnn": cudnn, "cudnn-nhwc": cudnn_nhwc, "ours": ours, "ours-nhwc": ours_nhwc}
                if pooled:
                    providers["ours-pool"] = lambda x=x, w=w, b=b: fused_conv2d(
                        x, w, b, padding=1, activation="relu", pool=("max", 2)
                    )
                    providers["ours-pool-nhwc"] = lambda x=x_nhwc, w=w_nhwc, b=b: fused_conv2d(
                        x, w, b, padding=1, activation="relu", pool=("max", 2)
                    )
                if not args.no_compile:
                    torch._dynamo.reset()
                    providers["compile"] = torch.compile(cudnn, dynamic=False)
                ref = torch.relu(F.conv2d(x.float(), w.float(), b.float(), padding=1))
                ref = F.max_pool2d(ref, 2) if pooled else ref
                row = {"model": model, "layer": [C, H, W, OC, pooled], "batch": n, "providers": {}}
                for name, fn in providers.items():
                    try:
                        row["providers"][name] = replay_cold_hot(fn, ref, warmups=3)
                    except Exception as e:  # a failing provider is a result
                        row["providers"][name] = {"error": f"{type(e).__name__}: {e}"[:200]}
                rows.append(row)
                cells = "  ".join(
                    f"{k} {v.get('cold_us', float('nan')):7.1f}/{v.get('hot_us', float('nan')):6.1f}"
                    for k, v in row["providers"].items()
                )
                print(f"{model} C{C} {H}x{W} O{OC} pool={pooled} n={n}: {cells}  (cold/hot us)", flush=True)
                torch.cuda.empty_cache()

    lines = [f"# probe_conv on {torch.cuda.get_device_name()}, fp16, CUDA-graph replays, µs cold / hot", ""]
    names = ["cudnn", "cudnn-nhwc", "compile", "ours", "ours-nhwc", "ours-pool", "ours-pool-nhwc"]
    lines.append("| model | C→O, H×W | pool | batch | " + " | ".join(names) + " | best ours / cudnn (cold) |")
    lines.append("|---|---|---|---|" + "---|" * (len(names) + 1))
    for r in rows:
        p = r["providers"]
        cells = []
        for name in names:
            v = p.get(name)
            cells.append("—" if v is None else v.get("error", "")[:20] or f"{v['cold_us']:.1f} / {v['hot_us']:.1f}")
        ours_best = min((v["cold_us"] for k, v in p.items() if k.startswith("ours") and "cold_us" in v), default=None)
        base = min((p[k]["cold_us"] for k in ("cudnn", "cudnn-nhwc") if "cold_us" in p.get(k, {})), default=None)
        ratio = f"{ours_best / base:.2f}" if ours_best and base else "—"
        C, H, W, OC, pooled = r["layer"]
        head = f"| {r['model']} | {C}→{OC}, {H}×{W} | {pooled} | {r['batch']} | "
        lines.append(head + " | ".join(cells) + f" | {ratio} |")
    lines.append("")
    lines.append(f"{time.perf_counter() - started:.0f} s. Errors (normwise vs fp32 torch) are in the JSON.")
    text = "\n".join(lines) + "\n"
    print(text)
    write_named_by_gpu(args.out, "probe_conv", text, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
