"""How fast can one kernel per layer run ResNet-50 at batch 1 (issue 34's 1.5x the best anchor)?

Two measures, fp16, each a CUDA graph timed cold (L2 cleared by reads) and hot (kernels.hot_timing, as the kernel
benchmark's hot column: replays back to back, a spin kernel hiding the host's launch gaps):
- the launch floor: a graph of 56 launches (ResNet-50's steps; 23 for ResNet-18) of a kernel that stores one float,
  launched plainly and as programmatic dependent launches (PDL, as ours are);
- every candidate the tuner may offer (kernels.conv.cuda_configs and conv_tma.cuda_configs) on seven of its batch-1
  layers, as the service runs them (x, weight and y channels_last, folded BatchNorm as bias, ReLU), and cuDNN's
  conv + ReLU on the same tensors. The fastest candidate's hot time is what that layer costs alone at best.

    python -m bench.probes.batch1_floor --out DIR     # ~1 minute on an H100
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from kernels import tuning

from .common import main, one_store, tuned_by

# (C, H, OC, kernel, stride, residual): ResNet-50's last stage (7x7), its third (14x14) and second (28x28) 3x3s, and
# the 1x1s around them
LAYERS = [
    (512, 7, 512, 3, 1, False),
    (2048, 7, 512, 1, 1, False),
    (512, 7, 2048, 1, 1, True),
    (256, 14, 256, 3, 1, False),
    (1024, 14, 256, 1, 1, False),
    (128, 28, 128, 3, 1, False),
    (256, 14, 512, 3, 2, False),
]
STEPS = {"resnet50": 56, "resnet18": 23}


def _graph_times(fn) -> dict:
    """fn captured into a CUDA graph: its replay's cold and hot device µs, as the tuner times its candidates."""
    return tuning._graph_times(fn)._asdict()


def _launch_floor() -> list[dict]:
    y = torch.empty(1, device="cuda")
    rows = []
    for model, steps in STEPS.items():
        for pdl in (False, True):
            options = {"launch_pdl": True} if pdl else {}

            def chain(steps=steps, pdl=pdl, options=options):
                for _ in range(steps):
                    one_store[(1,)](y, PDL=pdl, **options)

            t = _graph_times(chain)
            rows.append({"launches": steps, "as": model, "pdl": pdl, **t, "hot_us_per_launch": t["hot_us"] / steps})
            print(f"{steps} one-store launches (pdl={pdl}): cold {t['cold_us']:.1f} us, hot {t['hot_us']:.1f} us, "
                  f"{t['hot_us'] / steps:.2f} us a launch hot", flush=True)  # fmt: skip
    return rows


def _layer(C, H, OC, k, s, residual) -> dict:
    import kernels.conv as conv_mod
    from kernels import conv_tma

    nhwc = torch.channels_last
    x = torch.randn(1, C, H, H, device="cuda").half().contiguous(memory_format=nhwc)
    w = conv_tma.weight_for((torch.randn(OC, C, k, k, device="cuda") / (C * k * k) ** 0.5).half(), (s, s))
    b = torch.randn(OC, device="cuda").half()
    oh = H // s
    r = torch.randn(1, OC, oh, oh, device="cuda").half().contiguous(memory_format=nhwc) if residual else None
    ref = F.conv2d(x.float(), w.float(), b.float(), stride=s, padding=k // 2)
    ref = torch.relu(ref + r.float() if residual else ref)
    timed = {}

    def every_candidate(scope, key, candidates, run, *args, **kwargs):
        timed.update(tuning.time_candidates(list(candidates), run))
        return min(timed, key=lambda c: timed[c].hot_us)

    conv_mod._configs.clear()
    try:
        with tuned_by(conv_mod, every_candidate):
            y = conv_mod.fused_conv2d(x, w, b, stride=s, padding=k // 2, activation="relu", residual=r,
                                      memory_format=nhwc)  # fmt: skip
    finally:
        conv_mod._configs.clear()
    best = min(timed, key=lambda c: timed[c].hot_us)

    def cudnn():
        out = F.conv2d(x, w, b, stride=s, padding=k // 2)
        return torch.relu(out + r if residual else out)

    row = {
        "layer": f"{C}->{OC} {k}x{k}/{s} at {H}x{H}" + (" + residual" if residual else ""),
        "candidates": len(timed),
        "best": {"config": best.meta(), "cold_us": timed[best].cold_us, "hot_us": timed[best].hot_us},
        "every": [{"config": c.meta(), "cold_us": t.cold_us, "hot_us": t.hot_us} for c, t in timed.items()],
        "cudnn": _graph_times(cudnn),
        "err": float((y.float() - ref).norm() / ref.norm()),
    }
    print(f"{row['layer']}: best of {len(timed)} hot {timed[best].hot_us:.2f} us ({best.meta()}); cuDNN conv + relu "
          f"hot {row['cudnn']['hot_us']:.2f} us; error {row['err']:.1e}", flush=True)  # fmt: skip
    return row


def sweep() -> dict:
    torch.manual_seed(0)
    started = time.perf_counter()
    floor = _launch_floor()
    layers = [_layer(*layer) for layer in LAYERS]
    lines = [
        f"# probe_batch1_floor on {torch.cuda.get_device_name()}, fp16, CUDA-graph replays, µs",
        "",
        "## The launch floor: a graph of N launches of a kernel that stores one float",
        "",
        "| launches | as | PDL | cold | hot | hot per launch |",
        "|---:|---|---|---:|---:|---:|",
        *(
            f"| {r['launches']} | {r['as']} | {'yes' if r['pdl'] else 'no'} | {r['cold_us']:.1f} | {r['hot_us']:.1f} "
            f"| {r['hot_us_per_launch']:.2f} |"
            for r in floor
        ),  # fmt: skip
        "",
        "## ResNet-50's layers at batch 1: the fastest of every candidate, alone",
        "",
        "| layer | candidates | best hot | best cold | its config | cuDNN conv + ReLU hot | error |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    for r in layers:
        cfg = ", ".join(f"{k}={v}" for k, v in r["best"]["config"].items())
        lines.append(
            f"| {r['layer']} | {r['candidates']} | {r['best']['hot_us']:.2f} | {r['best']['cold_us']:.2f} | {cfg} "
            f"| {r['cudnn']['hot_us']:.2f} | {r['err']:.1e} |"
        )
    lines += ["", f"{time.perf_counter() - started:.0f} s; every candidate's times are in the JSON."]
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    return {"launch_floor": floor, "layers": layers, "table": text}


if __name__ == "__main__":
    main("batch1_floor", sweep)
