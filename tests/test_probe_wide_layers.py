"""bench/probes/wide_layers.py's grid: what it sweeps for the wide MLP's layers. The probe itself runs on a GPU only."""

from __future__ import annotations

import pytest
import torch

import kernels.linear as linear_mod
from bench.probes import wide_layers as probe
from kernels import FusedLinear, reference
from kernels.tiles import HOPPER_SHARED_MEMORY
from tests.tolerances import RTOL, assert_close_to


def test_the_grid_fits_hoppers_shared_memory_and_covers_the_tuners_big_batch_tiles():
    grid = probe.grid(HOPPER_SHARED_MEMORY)
    assert len(grid) == len(set(grid)) > 100
    assert all(linear_mod.pipeline_shared_memory(c, 2) <= HOPPER_SHARED_MEMORY for c in grid)
    for K, N, _ in probe.LAYERS:
        tuner = linear_mod.cuda_configs(256, N, K, sms=132)
        # the 16-row tiles the tuner adds for GEMMs of few tiles are timed from its own list, not the grid's
        missing = [c for c in tuner if c["BLOCK_M"] >= 64 and c not in grid]
        assert not missing, (K, N, missing)
    assert {c["SPLIT_K"] for c in grid} == set(probe.SPLITS)


@pytest.mark.parametrize(
    ("bk", "split", "K", "fits"), [(128, 8, 1024, False), (128, 4, 1024, True), (64, 8, 1024, True)]
)
def test_every_split_keeps_two_k_steps(bk, split, K, fits):
    config = next(c for c in probe.grid(HOPPER_SHARED_MEMORY) if c["BLOCK_K"] == bk and c["SPLIT_K"] == split)
    assert probe.fits(config, K) is fits


@pytest.mark.skipif(torch.cuda.is_available(), reason="a compiled kernel keeps the sum of its first compile")
@pytest.mark.parametrize("split", [2, 3, 4])
def test_the_paired_split_k_sum_gives_the_same_bits_as_the_loop(monkeypatch, split):
    """--reduce pairs: the same sum in the same order, so the same result to the bit, counters left at 0.
    (On the CPU the kernel runs interpreted; the probe's point, its speed, is the GPU's to say.)"""
    monkeypatch.setattr(linear_mod, "interpreter_tile", linear_mod.SMALL_INTERPRETER_TILE)
    monkeypatch.setattr(linear_mod, "interpreter_split_k", split)
    x, w, b = torch.randn(17, 129), torch.randn(70, 129) / 129**0.5, torch.randn(70)
    loop = FusedLinear(w, b, "relu")
    want = loop(x)
    monkeypatch.setattr(linear_mod, "split_k_sum", probe.split_k_sum_pairs)
    pairs = FusedLinear(w, b, "relu")
    for _ in range(2):  # the second call finds the counters reset
        assert torch.equal(pairs(x), want)
        assert int(pairs.workspace.counters.abs().sum()) == 0
    assert_close_to(want, reference.linear(x.double(), w.double(), b.double(), "relu"), RTOL[torch.float32])
