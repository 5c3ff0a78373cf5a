"""bench/probes/tuner_picks.py's pure parts on fake timings: the tables of (a) and (b), the spread of (c), and
how (c) shares the time limit among its processes. The probe itself runs on a GPU only."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from bench.probes import tuner_picks as probe
from kernels import precompile
from kernels.launch import precompiling_now
from kernels.tuning import LaunchConfig, Times

A = LaunchConfig.of(4, 1, BLOCK_M=16, BLOCK_N=32, STAGES=2, SPLIT=8, LEAD=1)
B = LaunchConfig.of(8, 1, BLOCK_M=32, BLOCK_N=64, STAGES=2, SPLIT=1, LEAD=0)
C = LaunchConfig.of(4, 3, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, SPLIT_K=2)
# A: best cold, 2x hot (flagged: 8 > 1.5 x 4); B: 1.1x cold, best hot; C: slow cold, 1.05x hot
TIMINGS = {A: Times(4.0, 8.0), B: Times(4.4, 4.0), C: Times(6.0, 4.2)}
REPO = Path(__file__).resolve().parents[1]


def test_short_names_every_meta_parameter():
    assert probe.short(A) == "BM16 BN32 SP8 ST2 L1 w4 s1"
    assert probe.short(C) == "BM64 BN128 BK64 GM8 SK2 w4 s3"


def test_analyze_flags_hot_over_1_5x_cold_and_gives_each_policy_its_pick_and_regret():
    res = probe.analyze(TIMINGS)
    assert (res["best_cold_us"], res["best_hot_us"]) == (4.0, 4.0)
    rows = res["candidates"]
    assert [r["config"] for r in rows] == [probe.short(c) for c in (A, B, C)]  # fastest cold first
    assert [r["hot_flag"] for r in rows] == [True, False, False]
    assert rows[0]["hot_over_cold"] == 2.0
    picks = res["picks"]
    assert picks["cold"]["config"] == probe.short(A) and picks["cold"]["hot_regret"] == 2.0
    assert picks["hot"]["config"] == probe.short(B) and picks["both"]["config"] == probe.short(B)
    assert picks["both"]["cold_regret"] == pytest.approx(1.1) and picks["both"]["hot_regret"] == 1.0
    lines = probe.format_case("digits float16 bucket 32", res)
    assert "HOT>1.5x pick:cold" in lines[2] and "pick:both pick:hot" in lines[3]


def _worker(process: int, policy: str, picks: dict[int, LaunchConfig]) -> dict:
    return {
        "process": process,
        "policy": policy,
        "buckets": {str(b): {"config": c.to_json()} for b, c in picks.items()},
    }


def test_spread_judges_every_process_pick_on_the_parent_timings():
    sweep = {32: TIMINGS, 64: {A: Times(5.0, 5.0), B: Times(5.0, 5.4)}}
    workers = [
        _worker(1, "cold", {32: A, 64: A}),
        _worker(1, "both", {32: B, 64: A}),
        _worker(2, "cold", {32: B}),  # cut short by its share: no bucket 64
        _worker(2, "both", {32: C, 64: A}),
    ]
    res = probe.spread(sweep, workers)
    cold, both = res["cold"], res["both"]
    assert cold["buckets"]["32"]["worst_hot_ratio"] == 2.0 and not cold["buckets"]["32"]["pass"]
    assert cold["buckets"]["32"]["distinct_picks"] == 2
    assert [p["process"] for p in cold["buckets"]["64"]["processes"]] == [1]
    assert cold["pass"] is False and cold["worst_hot_ratio"] == 2.0
    assert both["buckets"]["32"]["worst_hot_ratio"] == pytest.approx(1.05) and both["buckets"]["32"]["pass"]
    assert both["pass"] is True and both["worst_hot_ratio"] == pytest.approx(1.05)
    lines = probe.format_spread(res)
    assert any(line.startswith("  bucket   32: worst 2.00x FAIL") for line in lines)
    assert lines[-1] == "  policy both: worst 1.05x over 2 buckets: PASS"


def test_a_pick_the_parent_did_not_time_fails_the_spread():
    res = probe.spread({32: {A: Times(4.0, 4.0)}}, [_worker(1, "both", {32: B})])
    bucket = res["both"]["buckets"]["32"]
    assert bucket["processes"][0]["hot_ratio"] is None and not bucket["pass"] and not res["both"]["pass"]
    assert "not timed" in "\n".join(probe.format_spread(res))
    assert res["cold"] == {"buckets": {}, "limit": 1.10, "worst_hot_ratio": None, "pass": False}


def test_worker_result_is_its_last_marker_line():
    out = f"noise\n{probe.MARKER}{json.dumps({'n': 1})}\nmore\n{probe.MARKER}{json.dumps({'n': 2})}\n"
    assert probe.worker_result(out) == {"n": 2}
    assert probe.worker_result("Traceback ...") is None


def test_layer_name_reads_the_linear_tuning_key():
    assert probe.layer_name("N4096|K1024|torch.float16|relu|bias=True|ieee|m32") == "1024->4096"
    assert probe.layer_name("something else") == "something else"
    assert probe.key_shape("N1024|K4096|torch.float16|relu|bias") == (4096, 1024)
    assert probe.key_shape("something else") is None


def test_recording_times_every_candidate_takes_the_both_pick_and_restores_tune(monkeypatch):
    monkeypatch.setattr(precompile, "can_help", lambda count: True)  # as on a GPU host, here too
    module = types.SimpleNamespace(tune="the real tune")
    record: list = []
    ran: list = []

    def run(config):  # on a GPU host the tuner first compiles each candidate through run (kernels/precompile.py)
        if not precompiling_now():
            ran.append(config)

    with probe.recording(module, record):
        got = module.tune("scope", "m32", [A, B, C], run, lambda fn: (fn(), TIMINGS[ran[-1]])[1])
    assert got == B and ran == [A, B, C]
    assert record == [("m32", TIMINGS)]
    assert module.tune == "the real tune"


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_spread_shares_the_time_left_and_skips_processes_that_would_not_fit(monkeypatch):
    clock = _Clock()
    runs = []

    def fake_run(argv, cwd, env, capture_output, text, timeout):
        runs.append((env["FUSEDSERVE_TUNING_TIMING"], env["FUSEDSERVE_TUNING_CACHE"], timeout))
        clock.now += 30.0  # each process takes 30 s
        process = int(argv[argv.index("--process") + 1])
        result = _worker(process, env["FUSEDSERVE_TUNING_TIMING"], {1: A})
        return subprocess.CompletedProcess(argv, 0, stdout=probe.MARKER + json.dumps(result) + "\n", stderr="")

    monkeypatch.setattr(probe.subprocess, "run", fake_run)
    monkeypatch.setattr(probe.time, "monotonic", clock)
    skipped: list[str] = []
    results = probe.run_spread(2, probe.Deadline(100.0, clock=clock), skipped)
    # 100 s for 4 processes: 25 s, then 70 / 3, then max(20, 40 / 2); 10 s left is less than MIN_WORKER_S
    assert [r[0] for r in runs] == ["cold", "both", "cold"]
    assert [r[2] - 60 for r in runs] == pytest.approx([25.0, 70.0 / 3, 20.0])
    assert len({r[1] for r in runs}) == 3  # a fresh tuning cache each
    assert [(r["process"], r["policy"]) for r in results] == [(1, "cold"), (1, "both"), (2, "cold")]
    assert skipped == ["spread process 2 (both)"]


def test_a_process_without_a_result_is_reported_not_fatal(monkeypatch):
    def fake_run(argv, cwd, env, capture_output, text, timeout):
        return subprocess.CompletedProcess(argv, 1, stdout="", stderr="RuntimeError: CUDA error")

    monkeypatch.setattr(probe.subprocess, "run", fake_run)
    results = probe.run_spread(1, probe.Deadline(100.0), [])
    assert [r["buckets"] for r in results] == [{}, {}]
    assert results[0]["error"] == "exit 1: RuntimeError: CUDA error"


class _FakeMLP:
    """Tunes as FusedMLP does (kernels.mlp's tune: the real one, unless a test replaced it), on TIMINGS."""

    def __init__(self, layers):
        self._configs = {}

    def __call__(self, x):
        import kernels.mlp as mlp_mod

        bucket, ran = x.shape[0], []
        config = mlp_mod.tune("gpu | t | mlp@1", f"m{bucket}", list(TIMINGS), ran.append,
                              lambda fn: (fn(), TIMINGS[ran[-1]])[1])  # fmt: skip
        self._configs[(bucket, "ieee")] = config


@pytest.fixture
def fake_worker(monkeypatch, tmp_path):
    from kernels import tuning

    monkeypatch.setattr(probe, "FusedMLP", _FakeMLP)
    monkeypatch.setattr(probe, "digits_layers", lambda dtype: [types.SimpleNamespace(weight=torch.empty(256, 64))])
    monkeypatch.setattr(probe, "DEVICE", torch.device("cpu"))
    monkeypatch.setattr(probe, "BUCKETS", (1, 2, 4))
    monkeypatch.setattr(tuning, "_cache", [])
    monkeypatch.setattr(tuning, "time_candidates", tuning.time_candidates)  # the worker wraps it
    monkeypatch.setattr(tuning.switch, "_on", None)
    monkeypatch.setattr(tuning.timing_policy, "_value", None)
    monkeypatch.setenv("FUSEDSERVE_TUNING", "true")
    monkeypatch.setenv("FUSEDSERVE_TUNING_TIMING", "cold")  # as run_spread sets them
    monkeypatch.setenv("FUSEDSERVE_TUNING_CACHE", str(tmp_path / "tuning.json"))
    return tmp_path / "tuning.json"


def test_the_worker_runs_the_real_tuner_under_its_environment_policy(fake_worker, capsys):
    probe.worker(["--until", str(time.time() + 60), "--process", "3"])
    result = probe.worker_result(capsys.readouterr().out)
    assert (result["policy"], result["process"], result["skipped"]) == ("cold", 3, [])
    assert set(result["buckets"]) == {"1", "2", "4"}
    got = result["buckets"]["2"]
    assert LaunchConfig.from_json(got["config"]) == A and got["short"] == probe.short(A)
    assert (got["cold_us"], got["hot_us"], got["own_cold_regret"], got["own_hot_regret"]) == (4.0, 8.0, 1.0, 2.0)
    assert got["same_timings"] == {"both": probe.short(B), "cold": probe.short(A), "hot": probe.short(B)}
    cached = json.loads(fake_worker.read_text())["gpu | t | mlp@1"]  # the tuner's own cache, under its policy
    assert set(cached) == {"m1|timing=cold", "m2|timing=cold", "m4|timing=cold"}


def test_a_worker_past_its_time_tunes_nothing_and_says_so(fake_worker, capsys):
    probe.worker(["--until", str(time.time() - 1), "--process", "1"])
    result = probe.worker_result(capsys.readouterr().out)
    assert result["buckets"] == {} and result["skipped"] == [1, 2, 4]


def test_the_sweep_judges_the_spread_on_the_float16_timings_and_lists_what_it_skipped(monkeypatch):

    calls = []

    def sweep_digits(dtype, deadline, skipped):
        calls.append(str(dtype))
        if dtype == torch.bfloat16:
            skipped.append("digits bfloat16 bucket 1")
            return {}
        return {32: TIMINGS}

    def run_spread(processes, deadline, skipped):
        calls.append(f"spread x{processes}")
        return [_worker(1, "cold", {32: A}), _worker(1, "both", {32: B})]

    monkeypatch.setattr(probe, "sweep_digits", sweep_digits)
    monkeypatch.setattr(probe, "run_spread", run_spread)

    def sweep_wide(deadline, skipped, batches):
        calls.append(f"wide {batches}")
        return {"wide float16 batch 1 layer 0": TIMINGS}

    monkeypatch.setattr(probe, "sweep_wide", sweep_wide)
    args = argparse.Namespace(time_limit=100.0, processes=2, cases="digits-float16,digits-bfloat16,wide-float16",
                              wide_batches=(1, 16))  # fmt: skip
    out = probe.sweep(args)
    assert calls == ["torch.float16", "spread x2", "torch.bfloat16", "wide (1, 16)"]  # spread right after its input
    assert set(out["cases"]) == {"digits float16 bucket 32", "wide float16 batch 1 layer 0"}
    assert out["spread"]["cold"]["pass"] is False and out["spread"]["both"]["pass"] is True
    assert out["skipped"] == ["digits bfloat16 bucket 1"]
    json.dumps(out, default=str)  # what common.main writes
    args = argparse.Namespace(time_limit=100.0, processes=2, cases="digits-bfloat16", wide_batches=(1,))
    assert probe.sweep(args)["skipped"] == ["spread (needs the digits-float16 sweep)", "digits bfloat16 bucket 1"]
    with pytest.raises(SystemExit, match="unknown case"):
        probe.sweep(argparse.Namespace(time_limit=1.0, processes=0, cases="digits-fp8", wide_batches=(1,)))


def test_wide_batches_option():
    parser = argparse.ArgumentParser()
    probe.options(parser)
    assert parser.parse_args([]).wide_batches == probe.WIDE_BATCHES
    assert parser.parse_args(["--wide-batches", "1,16,256"]).wide_batches == (1, 16, 256)
    for bad in ("0", "x", ","):
        with pytest.raises(SystemExit):
            parser.parse_args(["--wide-batches", bad])


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the probe would run")
def test_the_probe_says_it_needs_a_gpu(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "bench.probes.tuner_picks", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "no CUDA GPU here" in proc.stderr, proc.stderr
    assert not (tmp_path / "probe_tuner_picks.json").exists()
