"""bench/probes/wide_layers.py's grid: what it sweeps for the wide MLP's layers. The probe itself runs on a GPU only."""

from __future__ import annotations

import pytest

import kernels.linear as linear_mod
from bench.probes import wide_layers as probe
from kernels.tiles import HOPPER_SHARED_MEMORY


def test_the_grid_fits_hoppers_shared_memory_and_covers_the_tuners_big_batch_tiles():
    grid = probe.grid(HOPPER_SHARED_MEMORY)
    assert len(grid) == len(set(grid)) > 100
    assert all(linear_mod.pipeline_shared_memory(c, 2) <= HOPPER_SHARED_MEMORY for c in grid)
    for K, N, _ in probe.layers_of("wide"):
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


def test_the_layers_of_each_model():
    assert probe.layers_of("wide") == [(1024, 4096, "relu"), (4096, 4096, "relu"), (4096, 1024, "none")]
    assert probe.layers_of("mlp-768") == [(768, 3072, "gelu"), (3072, 768, "none")]
    assert probe.layers_of("mlp-1000") == [(1000, 2000, "relu"), (2000, 500, "relu"), (500, 10, "none")]
