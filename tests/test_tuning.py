"""The tuner: which candidate each timing policy picks from cold and hot times, and the tuning cache (the pick
is kept with both times, survives a restart, is never reused under another policy, and a bad file costs a
re-tune only)."""

from __future__ import annotations

import json

import pytest

from kernels import precompile, tuning
from kernels.tuning import LaunchConfig, Times, TuningCache, pick, tune

A = LaunchConfig.of(4, 3, BLOCK_M=16, BLOCK_N=32)
B = LaunchConfig.of(8, 2, BLOCK_M=64, BLOCK_N=64)
C = LaunchConfig.of(4, 5, BLOCK_M=32, BLOCK_N=16)


@pytest.fixture(autouse=True)
def _tuning_on(monkeypatch):
    """These tests are about timing candidates: on even where the run switched tuning off (the GPU session
    runs the suite with FUSEDSERVE_TUNING=false), under the default policy unless a test sets one. No precompile
    (kernels/precompile.py): on a GPU host it would call the fake runs once more each, before their timing."""
    monkeypatch.setattr(tuning.switch, "_on", True)
    monkeypatch.setattr(precompile.threads, "_value", 0)
    monkeypatch.delenv("FUSEDSERVE_TUNING_TIMING", raising=False)
    monkeypatch.setattr(tuning.timing_policy, "_value", None)


@pytest.fixture
def cache_file(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "tuning.json"
    monkeypatch.setattr(tuning, "_cache", [])
    monkeypatch.setenv("FUSEDSERVE_TUNING_CACHE", str(path))
    return path


def _bench_by(times: dict[LaunchConfig, float | tuple[float, float]], calls: list):
    """A fake `measure`: runs the candidate, then returns its (cold, hot) from `times` (a float: both alike)."""

    def measure(fn):
        before = len(calls)
        fn()
        t = times[calls[before]]
        return (t, t) if isinstance(t, float) else t

    return measure


def test_fastest_candidate_is_chosen_and_written(cache_file):
    calls: list[LaunchConfig] = []
    best = tune("gpu | t | k@1", "m1", [A, B, C], calls.append, _bench_by({A: 5.0, B: 2.5, C: 9.0}, calls))
    assert best == B
    assert calls == [A, B, C]
    saved = json.loads(cache_file.read_text())
    assert saved["gpu | t | k@1"]["m1|timing=both:cold1.02,hot1.10"] == {
        **B.to_json(),
        "cold_us": 2.5,
        "hot_us": 2.5,
        "offered": tuning.offered_hash([A, B, C]),
    }


def test_a_restart_reads_the_file_and_times_nothing(cache_file):
    calls: list[LaunchConfig] = []
    tune("s", "k", [A, B], calls.append, _bench_by({A: 1.0, B: 2.0}, calls))
    tuning._cache.clear()  # a new process
    again: list[LaunchConfig] = []
    assert tune("s", "k", [A, B], again.append, _bench_by({A: 1.0, B: 2.0}, again)) == A
    assert again == []
    # another key still tunes
    assert tune("s", "k2", [A, B], again.append, _bench_by({A: 3.0, B: 2.0}, again)) == B
    assert again == [A, B]


def test_a_new_list_of_candidates_is_tuned_again_and_an_old_entry_without_one_too(cache_file):
    """A release that offers another candidate has it timed rather than keep the pick made without it."""
    calls: list[LaunchConfig] = []
    assert tune("s", "k", [A, B], calls.append, _bench_by({A: 2.0, B: 3.0}, calls)) == A
    tuning._cache.clear()  # a new process, a new release: C offered too
    again: list[LaunchConfig] = []
    assert tune("s", "k", [A, B, C], again.append, _bench_by({A: 2.0, B: 3.0, C: 1.0}, again)) == C
    assert again == [A, B, C]
    tuning._cache.clear()  # the same list once more: read back, nothing timed
    third: list[LaunchConfig] = []
    assert tune("s", "k", [A, B, C], third.append, _bench_by({A: 2.0, B: 3.0, C: 1.0}, third)) == C
    assert third == []
    # an entry written before candidates were recorded counts as picked from another list
    saved = json.loads(cache_file.read_text())
    del saved["s"]["k|timing=both:cold1.02,hot1.10"]["offered"]
    cache_file.write_text(json.dumps(saved))
    tuning._cache.clear()
    fourth: list[LaunchConfig] = []
    assert tune("s", "k", [A, B, C], fourth.append, _bench_by({A: 2.0, B: 3.0, C: 1.0}, fourth)) == C
    assert fourth == [A, B, C]


def test_a_failing_candidate_is_skipped_and_all_failing_is_an_error(cache_file):
    def run(config):
        if config is A:
            raise RuntimeError("out of shared memory")

    assert tune("s", "k", [A, C], run, lambda fn: (fn(), (1.0, 1.0))[1]) == C

    def broken(config):
        raise RuntimeError("nope")

    with pytest.raises(RuntimeError, match="no launch config runs s k3"):
        tune("s", "k3", [A, B], broken, lambda fn: (fn(), (1.0, 1.0))[1])


def test_corrupt_file_is_replaced_not_fatal(cache_file, caplog):
    cache_file.parent.mkdir(parents=True)
    cache_file.write_text("{not json")
    calls: list[LaunchConfig] = []
    assert tune("s", "k", [A, B], calls.append, _bench_by({A: 2.0, B: 1.0}, calls)) == B
    assert "unreadable" in caplog.text
    assert json.loads(cache_file.read_text())["s"]["k|timing=both:cold1.02,hot1.10"]["num_warps"] == 8


def test_unwritable_location_keeps_results_in_memory(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setattr(tuning, "_cache", [])
    monkeypatch.setenv("FUSEDSERVE_TUNING_CACHE", str(blocker / "tuning.json"))  # parent is a file
    calls: list[LaunchConfig] = []
    assert tune("s", "k", [A, B], calls.append, _bench_by({A: 2.0, B: 1.0}, calls)) == B
    assert "cannot write tuning cache" in caplog.text
    assert tune("s", "k", [A, B], calls.append, _bench_by({A: 2.0, B: 1.0}, calls)) == B
    assert len(calls) == 2  # the second call was a memory hit


def test_default_path_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("FUSEDSERVE_TUNING_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tuning.default_cache_path() == tmp_path / "fusedserve" / "tuning.json"


def test_memory_only_cache(monkeypatch):
    monkeypatch.setattr(tuning, "_cache", [])
    store = tuning.use_cache(None)
    assert isinstance(store, TuningCache) and store.path is None
    calls: list[LaunchConfig] = []
    assert tune("s", "k", [A], calls.append, _bench_by({A: 1.0}, calls)) == A


def test_tuning_off_takes_the_first_candidate_untimed(cache_file, monkeypatch):
    monkeypatch.setattr(tuning.switch, "_on", False)
    calls: list[LaunchConfig] = []
    assert tune("s", "k", [C, A, B], calls.append, _bench_by({A: 1.0, B: 2.0, C: 3.0}, calls)) == C
    assert calls == []
    assert not cache_file.exists()  # an untimed pick is never recorded as tuned


def test_tuning_switch_reads_the_environment(monkeypatch):
    monkeypatch.setattr(tuning.switch, "_on", None)
    monkeypatch.setenv("FUSEDSERVE_TUNING", "false")
    assert tuning.enabled() is False
    monkeypatch.setattr(tuning.switch, "_on", None)
    monkeypatch.setenv("FUSEDSERVE_TUNING", "true")
    assert tuning.enabled() is True


# pick: fake (cold, hot) times per candidate.


def test_under_both_a_candidate_best_cold_but_twice_as_slow_hot_loses():
    times = {A: (4.0, 8.0), B: (4.4, 4.0), C: (6.0, 4.2)}  # A: best cold, 2x hot; B: 1.1x cold, best hot
    assert pick(times, "both") == B
    assert pick(times, "cold") == A
    assert pick(times, "hot") == B


def test_both_takes_the_least_worse_ratio_not_the_least_sum():
    # A: 1.0 cold, 1.5 hot (sum 2.5, worse 1.5); B: 1.3 cold, 1.3 hot (sum 2.6, worse 1.3)
    times = {A: (10.0, 6.0), B: (13.0, 5.2), C: (20.0, 4.0)}
    assert pick(times, "both") == B


def test_both_takes_the_fastest_hot_of_those_near_the_best_on_each_count():
    # The H200's wide MLP middle layer at batch 16 (probe_tuner_picks_h200.txt): A 1.00x cold and 1.07x hot,
    # B 1.06x cold and 1.00x hot. Only A is within 2% cold and 10% hot; minimax alone would take B.
    times = {A: (14.85, 10.58), B: (15.81, 9.87), C: (15.62, 10.62)}
    assert pick(times, "both") == A
    assert pick(times, "hot") == B
    # Within both slacks, hot decides: 1.015x cold buys 1.00x hot over 1.00x cold at 1.09x hot.
    assert pick({A: (10.0, 10.9), B: (10.15, 10.0)}, "both") == B
    # B just past the cold slack (1.021x) is out, though its worse count is better than A's.
    assert pick({A: (10.0, 10.9), B: (10.21, 10.0)}, "both") == A
    # None within both (A 1.11x hot, B 1.05x cold): the least worse count.
    assert pick({A: (10.0, 11.1), B: (10.5, 10.0)}, "both") == B
    assert pick({A: (10.0, 10.5), B: (10.5, 10.0), C: (10.1, 10.4)}, "both") == C  # in both slacks: hot 1.04


def test_a_pick_made_under_other_bounds_of_both_is_timed_again(cache_file, monkeypatch):
    times = {A: (4.0, 8.0), B: (4.4, 4.0)}
    calls: list[LaunchConfig] = []
    assert tune("s", "k", [A, B], calls.append, _bench_by(times, calls)) == B
    monkeypatch.setattr(tuning, "COLD_SLACK", 1.10)  # B is now within both bounds: still B, but timed again
    tuning._cache.clear()
    assert tune("s", "k", [A, B], calls.append, _bench_by(times, calls)) == B
    assert calls == [A, B, A, B]
    assert set(json.loads(cache_file.read_text())["s"]) == {
        "k|timing=both:cold1.02,hot1.10",
        "k|timing=both:cold1.10,hot1.10",
    }


def test_ties_go_to_the_other_timing_then_to_the_earlier_candidate():
    assert pick({A: (5.0, 3.0), B: (5.0, 2.0)}, "cold") == B  # equal cold: the faster hot
    assert pick({A: (4.0, 3.0), B: (3.0, 3.0)}, "hot") == B  # equal hot: the faster cold
    assert pick({A: (2.0, 2.0), B: (2.0, 2.0)}, "both") == A  # equal in all: candidate order
    assert pick({B: (2.0, 2.0), A: (2.0, 2.0)}, "both") == B
    # A and B: the same worse ratio (1.2); B has the lower sum (1.2 + 1.0 against 1.2 + 1.1); C's worse is 1.25
    assert pick({A: (12.0, 11.0), B: (12.0, 10.0), C: (10.0, 12.5)}, "both") == B


@pytest.mark.parametrize("policy", tuning.POLICIES)
def test_a_single_candidate_is_picked_under_every_policy(policy):
    assert pick({C: (7.0, 30.0)}, policy) == C


def test_pick_refuses_an_unknown_policy_and_no_candidates():
    with pytest.raises(ValueError, match="timing policy must be one of both, cold, hot"):
        pick({A: (1.0, 1.0)}, "warm")
    with pytest.raises(ValueError, match="no timed candidate"):
        pick({}, "both")


def test_regret_is_each_time_over_its_best():
    assert tuning.regret(Times(6.0, 9.0), Times(4.0, 3.0)) == Times(1.5, 3.0)
    assert tuning.best_times({A: (4.0, 8.0), B: (5.0, 3.0)}) == Times(4.0, 3.0)


# The policy in tune() and its switch.


def test_tune_picks_by_both_and_stores_both_times(cache_file, caplog):
    calls: list[LaunchConfig] = []
    caplog.set_level("INFO", logger="kernels.tuning")
    times = {A: (4.0, 8.0), B: (4.4, 4.0), C: (6.0, 4.2)}
    assert tune("s", "k", [A, B, C], calls.append, _bench_by(times, calls)) == B
    saved = json.loads(cache_file.read_text())["s"]["k|timing=both:cold1.02,hot1.10"]
    assert (saved["cold_us"], saved["hot_us"]) == (4.4, 4.0)
    assert "cold 4.4 us, hot 4.0 us: 1.10x and 1.00x the best of 3 candidates; timing both" in caplog.text


def test_a_pick_made_under_another_policy_is_not_reused(cache_file):
    times = {A: (4.0, 8.0), B: (4.4, 4.0)}
    calls: list[LaunchConfig] = []
    tuning.set_timing_policy("cold")
    assert tune("s", "k", [A, B], calls.append, _bench_by(times, calls)) == A
    tuning.set_timing_policy("both")
    assert tune("s", "k", [A, B], calls.append, _bench_by(times, calls)) == B
    assert calls == [A, B, A, B]  # timed again: the cold pick was not taken for this policy
    tuning._cache.clear()  # a new process: each policy reads its own entry, timing nothing
    assert tune("s", "k", [A, B], calls.append, _bench_by(times, calls)) == B
    tuning.set_timing_policy("cold")
    assert tune("s", "k", [A, B], calls.append, _bench_by(times, calls)) == A
    assert len(calls) == 4
    assert set(json.loads(cache_file.read_text())["s"]) == {"k|timing=cold", "k|timing=both:cold1.02,hot1.10"}


def test_an_entry_of_the_cold_only_tuner_is_re_tuned(cache_file):
    # Files written before hot timing existed keyed the entry by the bare key (and stored one "us").
    cache_file.parent.mkdir(parents=True)
    cache_file.write_text(json.dumps({"s": {"k": {**A.to_json(), "us": 4.0}}}))
    calls: list[LaunchConfig] = []
    assert tune("s", "k", [A, B], calls.append, _bench_by({A: (4.0, 8.0), B: (4.4, 4.0)}, calls)) == B
    assert calls == [A, B]


def test_a_candidate_whose_timing_is_not_a_number_is_skipped(cache_file):
    calls: list[LaunchConfig] = []
    times = {A: (1.0, float("nan")), B: (2.0, 2.0)}
    assert tune("s", "k", [A, B], calls.append, _bench_by(times, calls)) == B


def test_timing_policy_reads_the_environment(monkeypatch):
    assert tuning.timing_policy() == "both"  # the default
    monkeypatch.setattr(tuning.timing_policy, "_value", None)
    monkeypatch.setenv("FUSEDSERVE_TUNING_TIMING", "Cold")
    assert tuning.timing_policy() == "cold"
    tuning.set_timing_policy("hot")  # the service's setting beats the environment
    assert tuning.timing_policy() == "hot"
    tuning.set_timing_policy(None)
    assert tuning.timing_policy() == "cold"
    monkeypatch.setattr(tuning.timing_policy, "_value", None)
    monkeypatch.setenv("FUSEDSERVE_TUNING_TIMING", "warm")
    with pytest.raises(ValueError, match="FUSEDSERVE_TUNING_TIMING must be one of both, cold, hot; got 'warm'"):
        tuning.timing_policy()
    with pytest.raises(ValueError, match="got 'fast'"):
        tuning.set_timing_policy("fast")


@pytest.mark.gpu
def test_candidates_are_timed_with_l2_flushed():
    # Reading 24 MB (inside the 50-60 MB L2 of an H100/H200) from HBM cannot beat its peak bandwidth
    # (H100 3.35 TB/s, H200 4.8 TB/s; 6 TB/s bounds both): timed back to back, from L2, it could.
    import torch

    src = torch.randn(6 * 2**20, device="cuda")  # 24 MB of fp32
    out = torch.empty((), device="cuda")
    calls = []

    def read_all():
        calls.append(1)
        torch.sum(src, dim=0, out=out)  # torch 2.11 has no out= form without dim

    times = tuning._graph_times(read_all)
    us = times.cold_us
    assert us >= src.numel() * 4 / 6e12 * 1e6, f"{us:.2f} us: faster than HBM, so not timed cold"
    assert times.hot_us > 0
    assert len(calls) == 3  # the first call, a warm-up on a side stream, the capture; replays call nothing


def test_the_l2_flush_reads_every_byte_and_writes_none():
    # Clearing L2 by writes leaves dirty lines for the timed call to write back (kernels/cold_timing.py):
    # the flush must read its whole buffer (the sum sees every element) and leave it unchanged.
    import torch

    from kernels.cold_timing import L2Flush

    flush = L2Flush(torch.device("cpu"), nbytes=4 * 1001)
    flush.buffer.copy_(torch.randint(-1000, 1000, (1001,), dtype=torch.int32))
    before = flush.buffer.clone()
    flush.sink.fill_(-1)
    flush()
    assert torch.equal(flush.buffer, before)
    assert int(flush.sink) == int(before.long().sum())


@pytest.mark.gpu
@pytest.mark.gpu_timing  # a cold-against-warm ratio: other workers' kernels on the same GPU land inside its windows
def test_cold_timing_reads_from_memory_where_a_busy_wait_instead_of_the_flush_reads_from_l2():
    # The same 24 MB sum (half an H200's L2), timed after the flush and after a busy wait of about the same
    # length that touches no memory: the first reads HBM (at most 4.8 TB/s on an H200, 6e12 bounds it), the
    # second finds the tensor in L2, so the flush must cost it time: at least a quarter of the tensor's read at
    # 4.8 TB/s (1.3 us). A ratio missed on the H200, whose fast HBM leaves the sum's fixed ~10 us to dominate: cold
    # 14.9-15.2 against warm 12.8-13.0 us, 1.16-1.19x, and 2.1-2.3 us apart; a flush that evicts nothing: ~0 apart.
    import torch

    from kernels.cold_timing import cold_us

    src = torch.randn(6 * 2**20, device="cuda")
    out = torch.empty((), device="cuda")

    def read_all():
        torch.sum(src, dim=0, out=out)

    cold = cold_us(read_all, warmup_ms=2, rep_ms=10)
    warm = cold_us(read_all, warmup_ms=2, rep_ms=10, flush=lambda: torch.cuda._sleep(100_000))
    assert cold >= src.numel() * 4 / 6e12 * 1e6, f"{cold:.2f} us: faster than HBM, so not timed cold"
    read_us = src.numel() * 4 / 4.8e12 * 1e6
    evicted = cold - warm > 0.25 * read_us
    assert evicted, f"cold {cold:.2f} us, L2-warm {warm:.2f} us: the flush did not evict the tensor"


_HASH_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])  # the test's modules
from kernels.tuning import source_hash
import k_plus_one, k_plus_two, k_plus_one_again
import kernels.conv as conv, kernels.linear as linear, kernels.mlp as mlp, kernels.pool as pool
hashes = {name: source_hash(module.kernel) for name, module in
          [("one", k_plus_one), ("two", k_plus_two), ("one_again", k_plus_one_again)]}
# every kernel the tuner scopes (Triton walks each one's calls: a construct it cannot walk would raise here)
kernels = [linear._linear_kernel, linear.gemv._gemv_kernel, linear.persistent._linear_persistent_kernel,
           mlp._mlp_kernel, conv._conv2d_kernel, conv.conv_tma._conv2d_tma_kernel,
           pool._pool_rows_kernel, pool._pool_channels_kernel]
hashes["service"] = [source_hash(k) for k in kernels]
print(json.dumps(hashes))
"""


def test_source_hash_covers_the_helpers_a_kernel_calls(tmp_path):
    """Two kernels of the same source that call helpers of different source hash apart (a helper edited, as
    activations.py's are, must not reuse the picks timed with the old one); the same kernel and helper in other
    files hash alike. Compiled mode in a subprocess: under the interpreter Triton's functions have no cache_key."""
    from tests.test_kernels_compile import _compiled

    header = "import triton\nimport triton.language as tl\n"
    for name, step in (("plus_one", 1), ("plus_two", 2), ("plus_one_again", 1)):
        (tmp_path / f"h_{name}.py").write_text(f"{header}\n\n@triton.jit\ndef helper(x):\n    return x + {step}\n")
        kernel = "@triton.jit\ndef kernel(p):\n    tl.store(p, helper(tl.load(p)))\n"
        (tmp_path / f"k_{name}.py").write_text(f"{header}from h_{name} import helper\n\n\n{kernel}")
    (hashes,) = _compiled(_HASH_SCRIPT, str(tmp_path))
    assert hashes["one"] != hashes["two"], hashes
    assert hashes["one"] == hashes["one_again"], hashes
    assert len(set(hashes["service"])) == len(hashes["service"]), hashes
