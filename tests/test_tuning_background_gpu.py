"""Background tuning on the GPU, end to end through a ModelRunner: warm-up times nothing and leaves keys untimed, the
idle slices time them one candidate each, the graphs of the buckets whose picks changed are captured again and
still give the same outputs, and the next start finds every pick in the cache."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kernels import tuning, tuning_background
from service.engine.background_tuning import BackgroundTuning
from service.metrics import EngineMetrics
from service.model.loader import load_model
from service.model.runner import ModelRunner

SHIPPED_CNN = Path(__file__).resolve().parents[1] / "model_weights" / "digits-cnn"
MAX_BATCH = 8


@pytest.fixture
def background(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning.switch, "_on", True)
    monkeypatch.setattr(tuning.background, "_on", True)
    monkeypatch.setattr(tuning.timing_policy, "_value", "both")
    monkeypatch.setattr(tuning, "_cache", [tuning.TuningCache(tmp_path / "tuning.json")])
    monkeypatch.setattr(tuning_background, "_queue", tuning_background.Queue())
    tuning_background.forget_picks()  # picks other tests left in the launchers' memos
    yield tmp_path / "tuning.json"
    tuning_background.forget_picks()  # ours, made from this test's cache


def start(model) -> ModelRunner:
    runner = ModelRunner(model, "fused", torch.device("cuda"), "float16", max_batch_size=MAX_BATCH)
    runner.warmup(MAX_BATCH)
    return runner


@pytest.mark.gpu
def test_gpu_ready_untimed_then_tuned_while_idle_with_the_same_outputs(background):
    model = load_model(SHIPPED_CNN)
    x = np.random.default_rng(0).uniform(0, 16, (5, *model.input_shape)).astype(np.float32)
    runner = start(model)
    queue = tuning_background.queue()
    keys = queue.pending()
    assert keys > 0 and not background.exists()  # nothing timed before ready
    before = runner.run(x)

    metrics = EngineMetrics(model.name, "fused", "cuda:0", "float16")
    published = []
    bt = BackgroundTuning(lambda: {"fused": runner}, metrics, lambda p, d: published.append((p, d)))
    bt.used(5)  # bucket 8 first
    slices = []
    while bt.pending:
        t = time.perf_counter()
        bt.run_one()
        slices.append(time.perf_counter() - t)
    # Keys first met while timing or capturing again join the queue and are timed too (a conv's APART candidate runs
    # the pool kernel apart, under a key of its own): on an H100 16 keys at ready, 20 timed in all.
    assert queue.pending() == 0 and queue.done >= keys and published[-1] == (0, queue.done)
    recaptured = metrics.registry.get_sample_value("fusedserve_graph_recaptures_total",
                                                   {"model": model.name, "engine": "0"})  # fmt: skip
    changed = metrics.registry.get_sample_value("fusedserve_tuning_background_keys_total",
                                                {"model": model.name, "engine": "0", "changed": "true"})  # fmt: skip
    assert (recaptured > 0) == (changed > 0)
    print(f"{keys} keys at ready, {queue.done} timed, {len(slices)} slices, longest {max(slices) * 1e3:.0f} ms, median "
          f"{sorted(slices)[len(slices) // 2] * 1e3:.0f} ms, {recaptured:.0f} graphs captured again")  # fmt: skip
    after = runner.run(x)
    np.testing.assert_allclose(after, before, rtol=1e-2, atol=1e-2 * float(np.abs(before).max()))

    # The next start: every pick cached, nothing left untimed.
    tuning_background.reset()
    tuning_background.forget_picks()
    tuning.use_cache(background)
    start(model)
    assert tuning_background.queue().pending() == 0
