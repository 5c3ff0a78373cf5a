"""How should the whole-MLP kernel split the digits MLP (64-256-256-10, fp16) over programs?

Times the digits MLP under every config the tuner may pick for batches 1-256 (kernels/mlp.py's
cuda_configs: SPLIT programs per row block, LEAD on or off, 4 or 8 warps), cold (L2 cleared by reading,
as the benchmark and the tuner time) and hot (back to back), and prints what the tuner picks (cold only
when the committed log was taken; now by FUSEDSERVE_TUNING_TIMING, kernels/tuning.py).

    python -m bench.probes.mlp_split --out DIR

What it finds (H200; bench/results/h200/probe_mlp_split_h200.txt): LEAD with 16 programs of one 16-wide
chunk each is fastest at batches 1-32 (8.32 us cold at batch 1 against 8.42 for 8 programs, 9.47 for one
program); at 256, 8 programs of 32-wide chunks (9.06 us); 8 warps lose everywhere.
"""

from __future__ import annotations

import torch

import kernels.linear as linear_mod
import kernels.mlp as mlp_mod
from kernels.mlp import FusedMLP

from .common import digits_layers, forced, graph_us, hot_graph_us, main, one_store_floor


def sweep() -> dict:
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
        print(f"digits MLP M={M}: tuner picks {pick}; fastest cold of {len(rows)}:", flush=True)
        for cold, hot, meta in rows[:5]:
            print(f"   cold {cold:6.2f} us  hot {hot:6.2f} us  {meta}")
        best_unsplit = min((r for r in rows if r[2]["SPLIT"] == 1), key=lambda r: r[0])
        print(f"   best SPLIT=1: cold {best_unsplit[0]:6.2f} us  hot {best_unsplit[1]:6.2f} us  {best_unsplit[2]}")
        best_plain = min((r for r in rows if not r[2]["LEAD"]), key=lambda r: r[0])
        print(f"   best LEAD=0:  cold {best_plain[0]:6.2f} us  hot {best_plain[1]:6.2f} us  {best_plain[2]}")
        out["rows"].append({"M": M, "pick": pick, "configs": rows})
    return out


if __name__ == "__main__":
    main("mlp_split", sweep)
