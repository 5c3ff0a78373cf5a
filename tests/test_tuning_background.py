"""Background tuning (kernels/tuning_background.py): a key missing from the cache gets an untimed pick at once (the
nearest bucket's cached pick, else the first candidate) and is queued; `step` times one candidate a call and stores
the same pick `tune` would; a changed pick clears the launchers' memos and names the graph buckets to capture again.
Timings are injected through `measure`, as in tests/test_tuning.py."""

from __future__ import annotations

import gc
import json
import logging

import pytest

from kernels import precompile, tuning, tuning_background
from kernels.tuning import LaunchConfig, tune
from kernels.tuning_background import nearest_pick, on_new_picks, split_bucket

A = LaunchConfig.of(4, 3, BLOCK_M=16, BLOCK_N=32)
B = LaunchConfig.of(8, 2, BLOCK_M=64, BLOCK_N=64)
C = LaunchConfig.of(4, 5, BLOCK_M=32, BLOCK_N=16)
SCOPE = "gpu | triton 3 | conv2d@abc"
SHAPE = "OC64|C64|H56|W56|k3x3|s(1, 1)|p(1, 1)|d(1, 1)|torch.float16|relu|bias=True|ieee|nhwc|y=nchw"


def key(bucket: int, flags: str = "") -> str:
    return f"{SHAPE}|m{bucket}{flags}"


@pytest.fixture
def cache_file(tmp_path, monkeypatch):
    """Tuning on with background on, the default policy, a fresh cache file, an empty queue and no memos; no
    precompile (kernels/precompile.py: on a GPU host it would call the fake runs once more each)."""
    monkeypatch.setattr(tuning.switch, "_on", True)
    monkeypatch.setattr(precompile.threads, "_value", 0)
    monkeypatch.setattr(tuning.background, "_on", True)
    monkeypatch.delenv("FUSEDSERVE_TUNING_TIMING", raising=False)
    monkeypatch.setattr(tuning.timing_policy, "_value", None)
    path = tmp_path / "tuning.json"
    monkeypatch.setattr(tuning, "_cache", [])
    monkeypatch.setenv("FUSEDSERVE_TUNING_CACHE", str(path))
    monkeypatch.setattr(tuning_background, "_queue", tuning_background.Queue())
    monkeypatch.setattr(tuning_background, "_clearers", [])
    return path


def timed_by(times: dict[LaunchConfig, float], calls: list):
    """A fake `measure`: runs the candidate (run appends it to `calls`), then returns its time, cold and hot alike."""

    def measure(fn):
        before = len(calls)
        fn()
        t = times[calls[before]]
        if isinstance(t, Exception):
            raise t
        return (t, t)

    return measure


def seed(bucket: int, config: LaunchConfig, flags: str = "", scope: str = SCOPE) -> None:
    """A pick timed earlier for `bucket`, as the cache holds it."""
    offered = [A, B, C, LaunchConfig.of(2, 1, BLOCK_M=bucket)]  # another bucket's list of candidates
    tuning.cache().put(scope, f"{key(bucket, flags)}|timing=both:cold1.02,hot1.10", config, tuning.Times(1, 1),
                       tuning.offered_hash(offered))  # fmt: skip


def test_the_bucket_is_read_from_every_launchers_key():
    assert split_bucket(key(4096)) == (f"{SHAPE}|m*", 4096)
    assert split_bucket(key(16, "|tma|residual|pool=max2x2s2x2")) == (f"{SHAPE}|m*|tma|residual|pool=max2x2s2x2", 16)
    assert split_bucket("rows|C64|H8|W8|torch.float16|avg|k(2, 2)|y=nchw|n32") == (
        "rows|C64|H8|W8|torch.float16|avg|k(2, 2)|y=nchw|n*", 32)  # fmt: skip
    assert split_bucket("N1000|K2048|torch.float16|none|bias=True|ieee|m8") == (
        "N1000|K2048|torch.float16|none|bias=True|ieee|m*", 8)  # fmt: skip
    assert split_bucket("no bucket|nhwc|nchw") is None


def test_a_missing_key_gets_the_first_candidate_untimed_and_is_queued(cache_file):
    calls: list[LaunchConfig] = []
    assert tune(SCOPE, key(8), [A, B, C], calls.append, timed_by({A: 3.0, B: 1.0, C: 2.0}, calls)) == A
    assert calls == []  # nothing timed, nothing run
    assert tuning_background.queue().pending() == 1
    assert not cache_file.exists()  # an untimed pick is never cached: the next start times it too
    # another layer of the same shape and dtype: the same pick, one key queued
    assert tune(SCOPE, key(8), [A, B, C], calls.append) == A
    assert tuning_background.queue().pending() == 1 and calls == []


def test_the_untimed_pick_is_the_nearest_buckets_where_it_is_offered(cache_file):
    seed(2, C)  # 2 factors of two below 8
    seed(64, B)  # 3 above
    seed(16, LaunchConfig.of(1, 1, BLOCK_M=999))  # 1 above, but not among this key's candidates
    seed(4, A, "|residual")  # another key (a residual epilogue)
    seed(8, A, scope="gpu | triton 3 | linear@abc")  # another kernel
    assert nearest_pick(SCOPE, key(8), [A, B, C]) == C
    assert tune(SCOPE, key(8), [A, B, C], lambda c: None) == C
    assert nearest_pick(SCOPE, key(8), [A, B]) == B  # C not offered here: the next nearest
    seed(32, A)  # 2 above, as near as 2 below: the smaller bucket wins
    assert nearest_pick(SCOPE, key(8), [A, B, C]) == C
    assert nearest_pick(SCOPE, key(8, "|tma"), [A, B, C]) is None  # no tma pick cached


def test_a_pick_under_another_timing_policy_is_no_hint(cache_file):
    seed(4, B)
    tuning.set_timing_policy("hot")
    try:
        assert nearest_pick(SCOPE, key(8), [A, B, C]) is None
    finally:
        tuning.set_timing_policy(None)


def test_step_times_one_candidate_a_call_and_stores_what_tune_would(cache_file, tmp_path):
    times = {A: 3.0, B: 1.0, C: 2.0}
    calls: list[LaunchConfig] = []
    with tuning_background.queue().for_bucket(8):
        assert tune(SCOPE, key(8), [A, B, C], calls.append, timed_by(times, calls)) == A
    q = tuning_background.queue()
    assert q.step() is None and calls == [A]
    assert q.step() is None and calls == [A, B]
    finished = q.step()
    assert calls == [A, B, C]
    assert finished == tuning_background.Finished(SCOPE, key(8), B, True, frozenset({8}))
    assert q.pending() == 0 and q.done == 1 and q.step() is None
    background = json.loads(cache_file.read_text())
    # the same entry as tuning at once, in another process
    tuning.set_background(False)
    try:
        tuning.use_cache(tmp_path / "at_once.json")
        at_once: list[LaunchConfig] = []
        assert tune(SCOPE, key(8), [A, B, C], at_once.append, timed_by(times, at_once)) == B
        assert json.loads((tmp_path / "at_once.json").read_text()) == background
    finally:
        tuning.set_background(True)
    # a restart finds the pick: nothing queued, nothing timed
    tuning.use_cache(cache_file)
    assert tune(SCOPE, key(8), [A, B, C], calls.append) == B
    assert q.pending() == 0 and calls == [A, B, C]


def test_a_changed_pick_clears_the_memos_an_unchanged_one_does_not(cache_file):
    memo = {"layer": A}
    on_new_picks(memo.clear)
    calls: list[LaunchConfig] = []
    tune(SCOPE, key(8), [A, B], calls.append, timed_by({A: 1.0, B: 2.0}, calls))  # A untimed, and A wins
    q = tuning_background.queue()
    q.step()
    assert q.step().changed is False and memo == {"layer": A}
    tune(SCOPE, key(16), [A, B], calls.append, timed_by({A: 2.0, B: 1.0}, calls))  # A untimed (A cached at 8)
    q.step()
    assert q.step().changed is True and memo == {}
    # the launchers then ask tune() again and get the timed pick
    assert tune(SCOPE, key(16), [A, B], calls.append) == B


def test_a_layers_memo_is_held_weakly(cache_file):
    class Layer:
        def __init__(self):
            self.memo = {1: A}
            on_new_picks(self.forget_picks)

        def forget_picks(self):
            self.memo.clear()

    kept, dropped = Layer(), Layer()
    del dropped
    gc.collect()
    assert [ref() for ref in tuning_background._clearers][1] is None
    tuning_background.forget_picks()
    assert kept.memo == {}


def test_the_buckets_traffic_uses_are_timed_first(cache_file):
    q = tuning_background.queue()
    calls: list[LaunchConfig] = []
    measure = timed_by({A: 1.0, B: 2.0}, calls)
    for bucket in (1, 8, 64):  # warm-up order: the smallest bucket first
        with q.for_bucket(bucket):
            tune(SCOPE, key(bucket), [A, B], calls.append, measure)
    q.used(64)
    q.used(64)
    q.used(8)
    done = []
    while q.pending():
        finished = q.step()
        if finished:
            done.append(min(finished.buckets))
    assert done == [64, 8, 1]


def test_a_key_that_no_candidate_runs_keeps_its_untimed_pick(cache_file, caplog):
    calls: list[LaunchConfig] = []
    measure = timed_by({A: RuntimeError("out of resources"), B: float("nan")}, calls)
    assert tune(SCOPE, key(8), [A, B], calls.append, measure) == A
    q = tuning_background.queue()
    with caplog.at_level(logging.WARNING, logger="kernels.tuning_background"):
        assert q.step() is None and q.step() is None
    assert "no candidate could be timed" in caplog.text
    assert q.pending() == 0 and q.done == 0
    assert tune(SCOPE, key(8), [A, B], calls.append, measure) == A  # not queued again
    assert q.pending() == 0


def test_tuning_on_without_background_times_at_once(cache_file):
    """FUSEDSERVE_TUNING=true alone, as before: every candidate timed in tune(), nothing queued."""
    tuning.set_background(None)
    try:
        calls: list[LaunchConfig] = []
        assert tune(SCOPE, key(8), [A, B, C], calls.append, timed_by({A: 3.0, B: 1.0, C: 2.0}, calls)) == B
        assert calls == [A, B, C] and tuning_background.queue().pending() == 0
    finally:
        tuning.set_background(True)


def test_background_is_off_unless_set(monkeypatch):
    switch = tuning.EnvSwitch("FUSEDSERVE_TUNING_BACKGROUND", default=False)
    monkeypatch.delenv("FUSEDSERVE_TUNING_BACKGROUND", raising=False)
    assert switch() is False
    monkeypatch.setenv("FUSEDSERVE_TUNING_BACKGROUND", "true")
    switch.set(None)
    assert switch() is True


def test_tuning_off_takes_the_first_candidate_even_with_background_on(cache_file):
    tuning.set_enabled(False)
    try:
        assert tune(SCOPE, key(8), [A, B], lambda c: None) == A
        assert tuning_background.queue().pending() == 0
    finally:
        tuning.set_enabled(None)


@pytest.fixture
def budget(cache_file, monkeypatch):
    """Background tuning off, and a fresh timing budget that the test sets."""
    monkeypatch.setattr(tuning.background, "_on", False)
    monkeypatch.setattr(tuning, "timing_budget", tuning.TimingBudget())
    return tuning.timing_budget


def test_keys_are_timed_at_once_until_the_timing_budget_is_spent_then_deferred(budget):
    """FUSEDSERVE_TUNING_STARTUP_S: a start times keys until it has spent the budget; the next missing key gets an
    untimed pick (the nearest bucket's, just timed) and is queued for the idle engine, as with background on."""
    budget.set(10.0)
    calls: list[LaunchConfig] = []
    times = {A: 3.0, B: 1.0, C: 2.0}
    assert tune(SCOPE, key(8), [A, B, C], calls.append, timed_by(times, calls)) == B
    assert calls == [A, B, C] and tuning_background.queue().pending() == 0
    assert 0 < budget.used < 10.0 and not budget.spent()  # the timing's own seconds were charged
    budget.charge(10.0)
    calls.clear()
    assert tune(SCOPE, key(16), [A, B, C], calls.append, timed_by(times, calls)) == B
    assert calls == [] and tuning_background.queue().pending() == 1
    assert tune(SCOPE, key(8), [A, B, C], calls.append, timed_by(times, calls)) == B  # a cached key: still a hit


def test_a_zero_budget_defers_every_key_and_none_times_every_key(budget):
    calls: list[LaunchConfig] = []
    budget.set(0.0)
    assert tune(SCOPE, key(8), [A, B, C], calls.append, timed_by({A: 3.0, B: 1.0, C: 2.0}, calls)) == A
    assert calls == [] and tuning_background.queue().pending() == 1
    budget.set(None)
    budget.charge(1e9)
    assert tune(SCOPE, key(32), [A, B, C], calls.append, timed_by({A: 3.0, B: 1.0, C: 2.0}, calls)) == B
    assert calls == [A, B, C]
