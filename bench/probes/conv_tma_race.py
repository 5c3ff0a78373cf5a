"""Which TMA conv configs give wrong outputs now and then, and when? (kernels/conv_tma.py)

On an H200 (triton 3.6) tests/test_kernels_conv_tma.py::test_gpu_every_candidate[float16] failed once: 128 -> 128
channels at 8x8 over 1025 images, SiLU, 2x2 max pool, y NCHW, one pooled output 1.04 against 1.55; the same test
had passed on an H100. For each layer below and each candidate conv_tma.cuda_configs offers, plus, as controls,
the configs its guard leaves out (`racy_stages`: the same tiles at 3 and 4 stages), the layer runs REPS times on
the same inputs into a NaN-filled y; each run is compared with the float64 reference (an element is wrong past
1e-2 of |ref| + rms(ref), fp16's test bound) and with the first run, bit for bit. `--pdl both` runs each layer
with programmatic dependent launch and without.

Printed per (layer, config, PDL): runs with a wrong or unwritten element, the most wrong elements in one run, runs
that differ from the first, and where the first wrong element sat (image, channel, row, column of y, and the
program's box and channel block).

    python -m bench.probes.conv_tma_race --out DIR [--reps 100] [--pdl on|both]
"""

from __future__ import annotations

import argparse
import time

import torch

from kernels import conv_tma, pdl, reference
from kernels.conv import m_bucket
from kernels.tiles import HOPPER_SHARED_MEMORY, gemm_flags
from kernels.tuning import LaunchConfig

from .common import main
from .tuner_picks import short

NHWC = torch.channels_last
# (N, C, H, W, OC, pool window or 1, y NHWC): the H200's failing layer, its one-wave batch, the same unpooled into
# NHWC, the H100's failing one (64 -> 128 at 16x16), and the wider CNN's first conv, pooled
LAYERS = [
    (1025, 128, 8, 8, 128, 2, False),
    (129, 128, 8, 8, 128, 2, False),
    (1025, 128, 8, 8, 128, 1, True),
    (513, 64, 16, 16, 128, 1, True),
    (257, 64, 32, 32, 64, 2, True),
]
BOUND = 1e-2


def run_layer(layer: tuple, reps: int, use_pdl: bool) -> list[dict]:
    N, C, H, W, OC, win, y_last = layer
    dtype = torch.float16
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(N, C, H, W, device="cuda", generator=g).to(dtype).contiguous(memory_format=NHWC)
    w = (torch.randn(OC, C, 3, 3, device="cuda", generator=g) / (9 * C) ** 0.5).to(dtype).contiguous(memory_format=NHWC)
    b = torch.randn(OC, device="cuda", generator=g).to(dtype)
    want = reference.conv2d(x.double(), w.double(), b.double(), "silu", padding=1, dilation=1)
    if win > 1:
        want = reference.pool2d(want, "max", win)
    bound = BOUND * (want.abs() + want.pow(2).mean().sqrt())
    geometry = dict(C=C, H=H, W=W, KH=3, KW=3, PH=1, PW=1, DH=1, DW=1, OH=H, OW=W)
    window = ("max", win, win) if win > 1 else ("none", 1, 1)
    pdl.set_enabled(use_pdl)
    fixed = gemm_flags(True, "silu", dtype, False, torch.device("cuda"))
    rows = []
    for config, guarded in candidates_and_controls(N * H * W, OC, C, H, W, win):
        wrong_runs, most, differ, where, first = 0, 0, 0, None, None
        for _ in range(reps):
            out = torch.full(want.shape, float("nan"), device="cuda", dtype=dtype)
            out = out.contiguous(memory_format=NHWC if y_last else torch.contiguous_format)
            conv_tma.launch(x, w, b, out, 0.01, geometry, window, fixed, config)
            bad = ~((out.double() - want).abs() <= bound)  # NaN (unwritten) counts as wrong
            n_bad = int(bad.sum())
            if n_bad:
                wrong_runs += 1
                most = max(most, n_bad)
                if where is None:
                    where = [int(i) for i in bad.nonzero()[0]]
            if first is None:
                first = out.clone()
            elif not torch.equal(out, first):
                differ += 1
        torch.cuda.synchronize()
        label = short(config) + (" (guarded out)" if guarded else "")
        rows.append({"config": config.meta(), "pdl": use_pdl, "wrong_runs": wrong_runs, "most_wrong": most,
                     "differ": differ, "first_wrong": where, "label": label})  # fmt: skip
    return rows


def candidates_and_controls(pixels: int, OC: int, C: int, H: int, W: int, win: int) -> list[tuple[LaunchConfig, bool]]:
    """(config, left out by the guard): the offered ones, then each 2-stage racy one at 3 and 4 stages too."""
    offered = conv_tma.cuda_configs(m_bucket(pixels), OC, C, H, W, (win, win), 2)
    out = [(c, False) for c in offered]
    for c in offered:
        bm = c["IMG"] * c["BH"] * c["BW"]
        if c.num_stages == 2 and conv_tma.racy_stages(bm, c["BLOCK_N"], c["BLOCK_K"], 2):
            for stages in (3, 4):
                control = LaunchConfig.of(c.num_warps, stages, **dict(c.kwargs))
                if conv_tma.shared_memory_bytes(control, 2) <= HOPPER_SHARED_MEMORY:
                    out.append((control, True))
    return out


def box_of(where: list[int], meta: dict, win: int) -> str:
    """The program that wrote y[n, c, h, w]: its output box (image block, row block) and channel block."""
    n, c, h, w = where
    return f"box n{n // meta['IMG']} h{h * win // meta['BH']} w{w * win // meta['BW']}, cols {c // meta['BLOCK_N']}"


def sweep(args: argparse.Namespace) -> dict:
    out: dict = {"reps": args.reps, "layers": []}
    started = time.monotonic()
    for layer in LAYERS:
        for use_pdl in (True, False) if args.pdl == "both" else (True,):
            rows = run_layer(layer, args.reps, use_pdl)
            out["layers"].append({"layer": list(layer), "rows": rows})
            N, C, H, W, OC, win, y_last = layer
            print(f"\n{N}x{C}x{H}x{W} -> {OC}, pool {win}, y {'NHWC' if y_last else 'NCHW'}, PDL {use_pdl}"
                  f" [{time.monotonic() - started:.0f} s]", flush=True)  # fmt: skip
            for r in rows:
                where = ""
                if r["first_wrong"]:
                    where = f"  first wrong y{r['first_wrong']} ({box_of(r['first_wrong'], r['config'], win)})"
                print(f"  {r['label']:44s} wrong {r['wrong_runs']:2d}/{args.reps} (most {r['most_wrong']:5d})"
                      f"  differ {r['differ']:2d}{where}", flush=True)  # fmt: skip
    pdl.set_enabled(None)
    return out


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reps", type=int, default=100, help="runs per config [100]")
    p.add_argument("--pdl", choices=("on", "both"), default="on", help="PDL on, or on and off [on]")


if __name__ == "__main__":
    main("conv_tma_race", sweep, options)
