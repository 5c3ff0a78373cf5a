"""Development probe (issue 49): the few-channel convs at the front of a CNN over 256 images, where the zoo's step
profiles (bench/results/h200/zoo_h200.md) put the largest single steps: Wide ResNet-50-2's 7x7 stem (3 -> 64 at
224x224, stride 2) 946 us of 15,833, Inception v3's first three convs 502 + 526 + 723 us and its 80 -> 192 3x3 at
73x73 2,083 us of 15,976, where torch.compile runs the whole of Inception v3 in 11,473.

Each layer, fp16, bias + ReLU, CUDA-graph replays (cold: L2 cleared; hot: back to back), error against fp32 cuDNN:
    cudnn-cl        F.conv2d on channels_last x and weight, then ReLU (what compile's convs run)
    ours nchw in    fused_conv2d reading NCHW x, writing channels_last (the plan's first conv reads the request so)
    ours cl in      fused_conv2d reading channels_last x
    copy to cl      x.contiguous(channels_last) alone (what reading channels_last would add to the forward)
    ours cl4 in     3-channel x padded to 4 channels (8-byte pixels), weight padded with zeros; the pad not counted
The kernels are tuned as a service tunes them (every candidate timed, an empty cache).

    python3 -m bench.probes.stem_conv --out $OUT     # ~1-2 minutes on an H200 (the tuning's compiles)
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .common import main, replay_cold_hot

BATCH = 256
# (name, C, size, OC, kernel, stride, padding)
LAYERS = [
    ("resnet stem", 3, 224, 64, 7, 2, 3),
    ("inception conv0", 3, 299, 32, 3, 2, 0),
    ("inception conv4", 80, 73, 192, 3, 1, 0),
    ("inception conv2", 32, 147, 64, 3, 1, 1),
]


def sweep() -> dict:
    from kernels import tuning

    cache_path = Path(tempfile.mkdtemp()) / "tuning.json"
    tuning.use_cache(cache_path)
    torch.manual_seed(0)
    rows, started = [], time.perf_counter()
    for layer in LAYERS:
        row = {"layer": layer[0], "shape": layer[1:], "batch": BATCH, "cases": {}}
        for name, (fn, ref) in _cases(*layer[1:]).items():
            try:
                row["cases"][name] = replay_cold_hot(fn, ref, warmups=2)
            except Exception as e:  # a failing case is a result
                row["cases"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            v = row["cases"][name]
            cell = f"{v['cold_us']:.1f}/{v['hot_us']:.1f} e{v['err']:.0e}" if "cold_us" in v else v["error"]
            print(f"{layer[0]} {name}: {cell} [{time.perf_counter() - started:.0f}s]", flush=True)
        rows.append(row)
    names = list(dict.fromkeys(k for r in rows for k in r["cases"]))
    print("\n| layer | " + " | ".join(names) + " |", flush=True)
    print("|---|" + "---:|" * len(names))
    for r in rows:
        cells = []
        for k in names:
            v = r["cases"].get(k)
            cells.append("—" if v is None else f"{v['cold_us']:.1f} / {v['hot_us']:.1f}" if "cold_us" in v else "error")
        print(f"| {r['layer']} | " + " | ".join(cells) + " |")
    picks = cache_path.read_text() if cache_path.exists() else ""
    return {"rows": rows, "picks": picks}


def _cases(C, S, OC, k, s, p) -> dict:
    """name -> (fn, reference) for one layer."""
    from kernels.conv import fused_conv2d

    dt, cl = torch.float16, torch.channels_last
    x = torch.randn(BATCH, C, S, S, device="cuda").to(dt)
    x_cl = x.contiguous(memory_format=cl)
    w = (torch.randn(OC, C, k, k, device="cuda") / (C * k * k) ** 0.5).to(dt)
    w_cl = w.contiguous(memory_format=cl)
    b = (torch.randn(OC, device="cuda") * 0.1).to(dt)
    ref = torch.relu(F.conv2d(x.float(), w.float(), b.float(), stride=s, padding=p))

    def ours(src, weight):
        return lambda: fused_conv2d(src, weight, b, stride=s, padding=p, activation="relu", memory_format=cl)

    cases = {
        "cudnn-cl": (lambda: torch.relu(F.conv2d(x_cl, w_cl, b, stride=s, padding=p)), ref),
        "ours nchw in": (ours(x, w_cl), ref),
        "ours cl in": (ours(x_cl, w_cl), ref),
        "copy to cl": (lambda: x.contiguous(memory_format=cl), x.float()),
    }
    if C == 3:
        x4 = torch.zeros(BATCH, 4, S, S, device="cuda", dtype=dt).contiguous(memory_format=cl)
        x4[:, :3] = x
        w4 = torch.zeros(OC, 4, k, k, device="cuda", dtype=dt).contiguous(memory_format=cl)
        w4[:, :3] = w
        cases["ours cl4 in"] = (ours(x4, w4), ref)
    return cases


if __name__ == "__main__":
    main("stem_conv", sweep)
