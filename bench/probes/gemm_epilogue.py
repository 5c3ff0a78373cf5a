"""What does an activation cost in a GEMM's epilogue, and which kernels hide it? mlp-768's two layers (768 -> 3072 and
3072 -> 768) at 4096 and 1024 rows, fp16, with no activation, the erf GELU, the tanh GELU and SiLU, each through:
cuBLASLt (`addmm`, and `_addmm_activation` for ReLU and its tanh-GELU epilogue) as the yardstick; the persistent TMA
kernel (linear_persistent.py) at 128x128 and 128x256 tiles, one program per SM, and at 128x128 over 2 stages with
two programs per SM; linear.py's pointer kernel at 128x128 (8 warps, 4 stages; 4 warps, 3 stages) and 64x128 (4
warps, 3 stages). Hot times (graph replays back to back, kernels/tuning._graph_times), us.

    python -m bench.probes.gemm_epilogue --out DIR

What it found (H100, bench/results/h100/probe_gemm_epilogue_h100.txt): with the erf GELU computed through Triton's
tl.exp and `/`, 4096x768 -> 3072 took 59.3 us on the 128x128 persistent kernel against 39.0 without an activation
(cuBLASLt's tanh-GELU epilogue 38.6): 32 instructions an element in an epilogue that no MMA overlaps. With bare
ex2/rcp instructions (activations.py) it takes 48.6, 45.2 on 128x256 tiles. Kernels of which several programs share
an SM hide more of it: at 1024 rows 64x128 tiles over 3 stages take 13.8 us with the GELU against 11.9 without.
"""

from __future__ import annotations

import torch

import kernels.linear as linear_mod
from kernels import FusedLinear, tuning
from kernels.linear_persistent import linear_persistent
from kernels.tiles import device_limits
from kernels.tuning import LaunchConfig

from .common import forced, main

SHAPES = ((4096, 768, 3072), (4096, 3072, 768), (1024, 768, 3072), (1024, 3072, 768))  # (M, K, N)
ACTIVATIONS = ("none", "gelu", "gelu_tanh", "silu")
# (BLOCK_N, warps, stages, programs per SM) of the persistent kernel; (BLOCK_M, BLOCK_N, warps, stages) of linear.py's
PERSISTENT = ((128, 8, 4, 1), (256, 8, 3, 1), (128, 8, 2, 2))
POINTER = ((128, 128, 8, 4), (128, 128, 4, 3), (64, 128, 4, 3))


def persistent(bn: int, warps: int, stages: int) -> LaunchConfig:
    return LaunchConfig.of(warps, stages, BLOCK_M=128, BLOCK_N=bn, BLOCK_K=64, GROUP_M=8, PERSISTENT=1)


def pointer(bm: int, bn: int, warps: int, stages: int) -> LaunchConfig:
    return LaunchConfig.of(warps, stages, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=64, GROUP_M=8, SPLIT_K=1)


def activation_times(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, act: str, sms: int) -> dict[str, float]:
    """Hot us of one layer with `act` through each persistent and pointer config."""
    times = {}
    for bn, warps, stages, per_sm in PERSISTENT:
        cfg, programs = persistent(bn, warps, stages), per_sm * sms
        name = f"P128x{bn} w{warps} s{stages} x{per_sm}"
        times[name] = tuning._graph_times(lambda cfg=cfg, p=programs: linear_persistent(x, w, b, act, cfg, programs=p))
    for bm, bn, warps, stages in POINTER:
        layer = FusedLinear(w, b, act)
        with forced(linear_mod, pointer(bm, bn, warps, stages)):
            layer(x)  # compiles and keeps this config for the bucket
        times[f"Q{bm}x{bn} w{warps} s{stages}"] = tuning._graph_times(lambda layer=layer: layer(x))
    return {name: t.hot_us for name, t in times.items()}


def shape_times(M: int, K: int, N: int, sms: int) -> dict:
    x = torch.randn(M, K, device="cuda").half()
    w = (torch.randn(N, K, device="cuda") / K**0.5).half()
    b = torch.randn(N, device="cuda").half()
    yardstick = {
        "none": tuning._graph_times(lambda: torch.addmm(b, x, w.t())).hot_us,
        "relu": tuning._graph_times(lambda: torch._addmm_activation(b, x, w.t())).hot_us,
        "gelu_tanh": tuning._graph_times(lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True)).hot_us,
    }
    print(f"\n{M}x{K}->{N}  cuBLASLt hot: " + "  ".join(f"{a} {t:.1f}" for a, t in yardstick.items()), flush=True)
    rows = {}
    for act in ACTIVATIONS:
        rows[act] = activation_times(x, w, b, act, sms)
        print(f"  {act:9s} " + " | ".join(f"{name} {t:6.1f}" for name, t in rows[act].items()), flush=True)
    return {"M": M, "K": K, "N": N, "cublaslt_hot_us": yardstick, "hot_us": rows}


def sweep() -> dict:
    sms, _ = device_limits(torch.device("cuda"))
    return {"shapes": [shape_times(M, K, N, sms) for M, K, N in SHAPES]}


if __name__ == "__main__":
    main("gemm_epilogue", sweep)
