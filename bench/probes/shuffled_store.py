"""Development probe (issue 49): why ShuffleNetV2's branch-end 1x1 convs run 2.2x slower fused than unfused at 256
images (the zoo's steps on the H200: 188 against 85 µs at 58 channels and 28x28, 101 against 41 at 116 and 14x14).

Fused, those convs write their outputs straight into their channels of a channel-shuffled buffer
(planner.place_shuffles: the branch's channels at 1::2 of a 2C-channel channels_last buffer, the pass-through half
copied to 0::2 by the concat). Per layer (C -> C, 1x1, bias, ReLU, fp16, 256 images), each a CUDA-graph replay,
µs cold / hot:
    cudnn dense            relu(F.conv2d(x, w, b)), channels_last, x dense
    cudnn, copy to 1::2    the same, then copied into the shuffled buffer's channels 1::2 (the unfused mode's work)
    ours dense             fused_conv2d, x dense, y dense
    ours slice in          x the channels C:2C of a 2C-channel buffer (a split's half), y dense
    ours to 1::2           x dense, y the buffer's channels 1::2 (as place_shuffles writes)
    ours slice in, to 1::2 both (a stride-1 unit's branch end)
    copy half to 0::2      the concat's strided copy of the pass-through half
    ours interleaved       a slice in, its channels and the pass-through half's stored together in whole rows
                           (fused_conv2d interleave=: what the fused plan runs now, with no copy after it)

    python -m bench.probes.shuffled_store --out DIR      # ~1 minute on an H200
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .common import main, replay_cold_hot

LAYERS = [(58, 28), (116, 14), (232, 7)]  # ShuffleNetV2 x1.0's stages 2-4: channels per half, feature map size
BATCH = 256


def sweep() -> dict:
    from kernels import tuning
    from kernels.conv import fused_conv2d

    cache_path = Path(tempfile.mkdtemp()) / "tuning.json"
    tuning.use_cache(cache_path)
    torch.manual_seed(0)
    dt, nhwc = torch.float16, torch.channels_last
    rows, started = [], time.perf_counter()
    for C, S in LAYERS:
        cases = _cases(C, S, dt, nhwc, fused_conv2d)
        row = {"C": C, "size": S, "batch": BATCH, "cases": {}}
        for name, (fn, ref) in cases.items():
            try:
                row["cases"][name] = replay_cold_hot(fn, ref, warmups=2)
            except Exception as e:  # a failing case is a result
                row["cases"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        rows.append(row)
        cells = "  ".join(
            f"{k}: {v['cold_us']:.1f}/{v['hot_us']:.1f} e{v['err']:.0e}" if "cold_us" in v else f"{k}: {v['error']}"
            for k, v in row["cases"].items()
        )
        print(f"C{C} {S}x{S} n={BATCH} [{time.perf_counter() - started:.0f}s] {cells}", flush=True)
    picks = cache_path.read_text() if cache_path.exists() else ""  # each key's pick and its timings
    names = list(rows[0]["cases"])
    print("\n| C, size | " + " | ".join(names) + " |", flush=True)
    print("|---|" + "---:|" * len(names))
    for r in rows:
        cells = [f"{v['cold_us']:.1f} / {v['hot_us']:.1f}" if "cold_us" in v else "error" for v in r["cases"].values()]
        print(f"| {r['C']}, {r['size']}x{r['size']} | " + " | ".join(cells) + " |")
    return {"rows": rows, "picks": picks}


def _cases(C, S, dt, nhwc, fused_conv2d) -> dict:
    """The probe's cases for one layer: name -> (fn, reference)."""
    x = torch.randn(BATCH, C, S, S, device="cuda").to(dt).contiguous(memory_format=nhwc)
    split = torch.randn(BATCH, 2 * C, S, S, device="cuda").to(dt).contiguous(memory_format=nhwc)
    half = split[:, C:]  # a split's second half: channel stride 1, pixel stride 2C
    w = (torch.randn(C, C, 1, 1, device="cuda") / C**0.5).to(dt).contiguous(memory_format=nhwc)
    b = (torch.randn(C, device="cuda") * 0.1).to(dt)
    buf = torch.empty(BATCH, 2 * C, S, S, device="cuda", dtype=dt, memory_format=nhwc)
    dense = torch.empty(BATCH, C, S, S, device="cuda", dtype=dt, memory_format=nhwc)
    ref_dense = torch.relu(F.conv2d(x.float(), w.float(), b.float()))
    ref_half = torch.relu(F.conv2d(half.float(), w.float(), b.float()))

    def cudnn():
        return torch.relu(F.conv2d(x, w, b))

    def cudnn_copy():
        buf[:, 1::2].copy_(torch.relu(F.conv2d(x, w, b)))
        return buf[:, 1::2]

    def ours(src, out):
        return lambda: fused_conv2d(src, w, b, activation="relu", out=out)

    def interleaved():  # the unit's conv storing its channels and x1's in whole rows (fused_conv2d interleave=)
        out, x1 = buf[:, 1::2], split[:, :C]
        return fused_conv2d(half, w, b, activation="relu", out=out, interleave=x1, interleave_index=1)

    def copy_half():
        buf[:, 0::2].copy_(split[:, :C])
        return buf[:, 0::2]

    return {
        "cudnn dense": (cudnn, ref_dense),
        "cudnn, copy to 1::2": (cudnn_copy, ref_dense),
        "ours dense": (ours(x, dense), ref_dense),
        "ours slice in": (ours(half, dense), ref_half),
        "ours to 1::2": (ours(x, buf[:, 1::2]), ref_dense),
        "ours slice in, to 1::2": (ours(half, buf[:, 1::2]), ref_half),
        "copy half to 0::2": (copy_half, split[:, :C].float()),
        "ours interleaved": (interleaved, ref_half),
    }


if __name__ == "__main__":
    main("shuffled_store", sweep)
