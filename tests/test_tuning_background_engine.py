"""Background tuning in the engine (service/engine/background_tuning.py): slices only while no request waits, the
graphs of the buckets whose picks changed captured again between batches, the metrics and GET /model's progress.
Graphs and runners are fakes (the capture itself: tests/test_tuning_background_gpu.py); timings are injected."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import numpy as np
import pytest

from kernels import tuning, tuning_background
from kernels.tuning import LaunchConfig, tune
from service.engine import background_tuning
from service.engine.background_tuning import BackgroundTuning
from service.link.tuning_progress import read_tuning, write_tuning
from service.metrics import EngineMetrics

from .test_link import OUT, SHAPE, EngineThread, StubRunner, ready_states, wait_until

A = LaunchConfig.of(4, 3, BLOCK_M=16)
B = LaunchConfig.of(8, 2, BLOCK_M=64)
SCOPE = "gpu | triton 3 | conv2d@abc"


@pytest.fixture(autouse=True)
def background(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning.switch, "_on", True)
    monkeypatch.setattr(tuning.background, "_on", True)
    monkeypatch.setattr(tuning.timing_policy, "_value", "both")
    monkeypatch.setattr(tuning, "_cache", [tuning.TuningCache(tmp_path / "tuning.json")])
    monkeypatch.setattr(tuning_background, "_queue", tuning_background.Queue())
    monkeypatch.setattr(tuning_background, "_clearers", [])


class FakeGraphs:
    """A GraphedExecutor's buckets and recapture, without CUDA."""

    def __init__(self, buckets=(1, 2, 4, 8)):
        self.buckets, self.max_batch_size = list(buckets), max(buckets)
        self.recaptured: list[int] = []

    def bucket_for(self, rows: int) -> int:
        return next(b for b in self.buckets if rows <= b)

    def recapture(self, rows: int) -> bool:
        self.recaptured.append(rows)
        return True


def tuning_with(graphs, metrics=None, published=None):
    runners = {"fused": SimpleNamespace(graphs=graphs), "unfused": SimpleNamespace(graphs=FakeGraphs())}
    publish = (lambda p, d: published.append((p, d))) if published is not None else None
    return BackgroundTuning(lambda: runners, metrics or EngineMetrics("m", "fused", "cpu", "float32"), publish)


@pytest.fixture
def measured(monkeypatch):
    """Each timed candidate's (cold, hot): B is faster than A, so every pick changes."""
    times = {A: 2.0, B: 1.0}

    def time_one(config, run, measure=None, label=""):
        run(config)
        return tuning.Times(times[config], times[config])

    monkeypatch.setattr(tuning, "time_one", time_one)
    return times


def sample(metrics: EngineMetrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, {"model": "m", "engine": "0", **labels}) or 0.0


def test_new_picks_swap_in_once_their_bucket_is_timed_and_the_metrics_say_so(measured):
    metrics = EngineMetrics("m", "fused", "cpu", "float32")
    graphs, published = FakeGraphs(), []
    for bucket, name in ((1, "a"), (1, "b"), (8, "a")):
        with tuning_background.queue().for_bucket(bucket):
            tune(SCOPE, f"{name}|m{bucket}", [A, B], lambda c: None)
    bt = tuning_with(graphs, metrics, published)
    assert bt.pending and published == [(3, 0)] and sample(metrics, "fusedserve_tuning_pending_keys") == 3
    t = 100.0
    bt.run_one(t)  # a|m1: A timed
    bt.run_one(t)  # a|m1: B timed, picked: bucket 1 stale, but b|m1 is still untimed
    assert bt.stale == {1: t} and graphs.recaptured == [] and published[-1] == (2, 1)
    bt.run_one(t)
    bt.run_one(t)  # b|m1 done: bucket 1 has no untimed key left
    bt.run_one(t)  # so this slice captures it again, and only that
    assert graphs.recaptured == [1] and bt.stale == {}
    assert sample(metrics, "fusedserve_graph_recaptures_total") == 1
    bt.run_one(t)
    bt.run_one(t)
    bt.run_one(t)
    assert graphs.recaptured == [1, 8] and not bt.pending
    assert sample(metrics, "fusedserve_tuning_pending_keys") == 0
    assert sample(metrics, "fusedserve_tuning_background_keys_total", changed="true") == 3
    assert published[-1] == (0, 3)
    # the launchers now get the timed pick from the cache
    assert tune(SCOPE, "a|m8", [A, B], lambda c: None) == B


def test_a_bucket_with_keys_left_is_captured_again_after_a_while(measured):
    graphs = FakeGraphs()
    for name in "abc":
        with tuning_background.queue().for_bucket(2):
            tune(SCOPE, f"{name}|m2", [A, B], lambda c: None)
    bt = tuning_with(graphs)
    bt.run_one(0.0)
    bt.run_one(0.0)
    assert bt.stale == {2: 0.0}
    bt.run_one(background_tuning.RECAPTURE_AFTER_S - 1)  # b's first candidate: not due yet
    assert graphs.recaptured == []
    bt.run_one(background_tuning.RECAPTURE_AFTER_S)
    assert graphs.recaptured == [2]


def test_an_unchanged_pick_captures_nothing(measured):
    measured[A] = 0.5  # the untimed pick wins
    metrics, graphs = EngineMetrics("m", "fused", "cpu", "float32"), FakeGraphs()
    with tuning_background.queue().for_bucket(4):
        tune(SCOPE, "a|m4", [A, B], lambda c: None)
    bt = tuning_with(graphs, metrics)
    while bt.pending:
        bt.run_one(0.0)
    assert graphs.recaptured == []
    assert sample(metrics, "fusedserve_tuning_background_keys_total", changed="false") == 1


def test_the_bucket_of_each_batch_goes_first(measured):
    graphs = FakeGraphs()
    for bucket in (1, 8):
        with tuning_background.queue().for_bucket(bucket):
            tune(SCOPE, f"a|m{bucket}", [A, B], lambda c: None)
    bt = tuning_with(graphs)
    bt.used(5)  # a batch of 5 rows runs bucket 8's graph
    bt.used(100)  # beyond the graphs: no bucket
    bt.run_one(0.0)
    bt.run_one(0.0)
    assert bt.stale == {8: 0.0}


def test_the_progress_files_sum_over_engines(tmp_path):
    assert read_tuning(tmp_path) == {"pending": 0, "done": 0}
    write_tuning(tmp_path, 0, 5, 2)
    write_tuning(tmp_path, 1, 1, 7)
    (tmp_path / "tuning-2.json").write_text("{half")  # being replaced: skipped
    assert read_tuning(tmp_path) == {"pending": 6, "done": 9}


class SlicedTuning:
    """An engine's BackgroundTuning stand-in: records each slice and each batch's rows."""

    def __init__(self, slices: int, engine=None):
        self.left, self.engine = slices, engine
        self.slices: list[int] = []  # the queue's length at each slice
        self.used_rows: list[int] = []

    @property
    def pending(self) -> bool:
        return self.left > 0

    def run_one(self) -> None:
        self.slices.append(len(self.engine.queue))
        self.left -= 1
        time.sleep(0.002)

    def used(self, rows: int) -> None:
        self.used_rows.append(rows)


def test_the_engine_tunes_only_while_no_request_waits(tmp_path):
    from service.frontend.engine_client import EngineClient

    path = str(tmp_path / "engine.sock")
    x = np.ones((3, *SHAPE), np.float32)

    async def scenario(sliced):
        client = EngineClient([path], ready_states(), OUT)
        client.start()
        await wait_until(lambda: len(sliced.slices) >= 5)
        out, _ = await asyncio.wait_for(client.submit(x, time.monotonic() + 5, time.monotonic())[1], 5)
        client.close()
        return out

    thread = EngineThread(path, StubRunner("float32"))
    sliced = thread.engine.tuning = SlicedTuning(10_000, thread.engine)
    with thread:
        out = asyncio.run(scenario(sliced))
    np.testing.assert_array_equal(out, np.full((3, OUT), 2.0, np.float32))
    assert sliced.used_rows == [3] and set(sliced.slices) == {0}  # never a slice with a request queued


@pytest.mark.parametrize("background", [False, True])
def test_get_model_shows_the_progress(tmp_path, background):
    from service.config import Settings
    from service.frontend.state import FrontendState, ModelInfo
    from service.link import wire

    engines = SimpleNamespace(states=lambda: [wire.READY, wire.READY])
    model = ModelInfo("m", None, (4,), 2, None)
    # tuning on explicitly: the GPU suite runs with FUSEDSERVE_TUNING=false, which turns background tuning off
    state = FrontendState(Settings(tuning=True, tuning_background=background), model, engines, None, tmp_path)
    if background:
        write_tuning(tmp_path, 0, 3, 4)
        write_tuning(tmp_path, 1, 0, 7)
    want = {"background": background, "pending": 3 if background else 0, "done": 11 if background else 0}
    assert state.describe()["tuning"] == want
