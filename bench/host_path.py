"""Python cost of one prepared-layer call with the GPU launch itself stubbed out: what a fused layer
spends on the host around Triton's C launcher (checks, lookups, the output tensor). Runs anywhere,
the CPU included, since nothing is launched; compare machines only by ratio.

    python -m bench.host_path

On the dev machine (2 cores, torch 2.13 CPU), before / after the per-batch-size fast path:
FusedLinear 14.3 / 4.4 us, FusedMLP 10.3 / 4.0 us per call (torch.empty alone: 2.4 us).
"""

from __future__ import annotations

import time

import torch

import kernels  # noqa: F401  (chooses interpreter vs compiled before the kernel modules load)
from kernels.linear import FusedLinear, m_bucket
from kernels.mlp import FusedMLP, MLPLayer
from kernels.tuning import LaunchConfig


def per_call_us(fn, n: int = 20_000, repeats: int = 5) -> float:
    for _ in range(1000):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e6


def _noop(*args) -> None:
    return None


def main() -> None:
    x = torch.randn(64, 256)
    layer = FusedLinear(torch.randn(128, 256), torch.randn(128), "relu", allow_tf32=False)
    key = (m_bucket(64), "ieee")
    layer.configs[key] = LaunchConfig.of(4, 4, BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, SPLIT_K=1)
    layer.direct[key] = _noop
    mlp = FusedMLP([MLPLayer(torch.randn(256, 64), torch.randn(256), "relu"), MLPLayer(torch.randn(10, 256), None)])
    xm = torch.randn(32, 64)
    mlp._configs[(32, "ieee")] = LaunchConfig.of(4, 1, BLOCK_M=16, BLOCK_N=64, STAGES=2, SPLIT=1, LEAD=0)
    mlp._direct[(32, "ieee")] = _noop
    mlp.allow_tf32 = False
    rows = [
        ("FusedLinear 64x256 -> 128, launch stubbed", per_call_us(lambda: layer(x))),
        ("FusedMLP 32x64 -> 256 -> 10, launch stubbed", per_call_us(lambda: mlp(xm))),
        ("torch.empty((64, 128)) alone", per_call_us(lambda: torch.empty((64, 128), device=x.device, dtype=x.dtype))),
    ]
    for name, us in rows:
        print(f"{name:45s} {us:6.2f} us")


if __name__ == "__main__":
    main()
