"""bench/probes/common.py's pure parts, on the CPU."""

from __future__ import annotations

import json

import pytest
import torch

from bench.probes import common


def test_write_named_by_gpu_names_the_files_as_results_keeps_them(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    rows = [{"layer": [64, 32, 32, 64, False], "batch": 1, "providers": {"cudnn": {"cold_us": 5.0}}}]
    common.write_named_by_gpu(tmp_path / "new", "probe_conv", "| table |\n", rows)
    assert (tmp_path / "new" / "probe_conv_h100.txt").read_text() == "| table |\n"
    assert json.loads((tmp_path / "new" / "probe_conv_h100.json").read_text()) == rows


def test_tuned_by_swaps_a_modules_tune_and_restores_it_even_on_error():
    import types

    module = types.SimpleNamespace(tune=lambda *a, **k: "tuner")
    original = module.tune
    with common.tuned_by(module, lambda scope, key, *a, **k: f"{scope}/{key}"):
        assert module.tune("linear", "N8|K8|") == "linear/N8|K8|"
    assert module.tune is original
    with pytest.raises(RuntimeError), common.forced(module, "cfg"):
        assert module.tune("s", "k", [], None) == "cfg"
        raise RuntimeError
    assert module.tune is original
