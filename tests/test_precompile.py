"""Compiling a key's candidates side by side before they are timed (kernels/precompile.py): launch.grid_launch
compiles instead of launching inside launch.precompiling(); precompile does nothing where it cannot help (the
interpreter, no CUDA, one candidate, one thread), runs every candidate's launch inside precompiling() where it can,
and never raises; the tuner precompiles a key before timing it, the background queue in chunks of precompile.threads()
candidates. On the GPU: a tuned key's candidates are all in Triton's kernel cache before the first is timed, and the
pick computes what the reference does."""

from __future__ import annotations

import threading

import pytest
import torch

from kernels import precompile, reference, tuning, tuning_background
from kernels.launch import grid_launch, precompiling, precompiling_now
from kernels.runtime import EnvCount
from kernels.tuning import LaunchConfig, tune
from tests.tolerances import RTOL, assert_close_to

A = LaunchConfig.of(4, 3, BLOCK_M=16, BLOCK_N=32)
B = LaunchConfig.of(8, 2, BLOCK_M=64, BLOCK_N=64)
C = LaunchConfig.of(4, 5, BLOCK_M=32, BLOCK_N=16)
D = LaunchConfig.of(4, 4, BLOCK_M=16, BLOCK_N=16)
E = LaunchConfig.of(8, 3, BLOCK_M=32, BLOCK_N=64)
SCOPE = "gpu | triton 3 | linear@abc"


class FakeKernel:
    """Records what a launch site asks of a Triton kernel: a launch (kernel[grid](...)) or a compile (warmup)."""

    def __init__(self):
        self.calls: list[tuple] = []

    def __getitem__(self, grid):
        def launched(*args, **kwargs):
            self.calls.append(("launch", grid, args, kwargs))
            return "compiled kernel"

        return launched

    def warmup(self, *args, grid, **kwargs):
        self.calls.append(("warmup", grid, args, kwargs))
        return "future kernel"


def test_grid_launch_launches_normally_and_only_compiles_inside_precompiling():
    kernel = FakeKernel()
    x = object()
    assert grid_launch(kernel, (3,))(x, 7, BLOCK=16, num_warps=4) == "compiled kernel"
    with precompiling():
        assert precompiling_now()
        assert grid_launch(kernel, (3,))(x, 7, BLOCK=16, num_warps=4) == "future kernel"
        with precompiling(False):  # the tuner's timing inside a precompile: launches again
            grid_launch(kernel, (5,))(x)
        assert precompiling_now()
    assert not precompiling_now()
    grid_launch(kernel, (1, 2))(x)
    assert kernel.calls == [
        ("launch", (3,), (x, 7), {"BLOCK": 16, "num_warps": 4}),
        ("warmup", (3,), (x, 7), {"BLOCK": 16, "num_warps": 4}),
        ("launch", (5,), (x,), {}),
        ("launch", (1, 2), (x,), {}),
    ]


def test_precompiling_is_this_threads_only():
    kernel = FakeKernel()
    with precompiling():
        other = threading.Thread(target=lambda: grid_launch(kernel, (1,))())
        other.start()
        other.join()
    assert kernel.calls == [("launch", (1,), (), {})]


@pytest.fixture
def threads(monkeypatch):
    """precompile.threads() at 4, whatever the host has or the environment says."""
    monkeypatch.setattr(precompile.threads, "_value", 4)


def test_precompile_does_nothing_where_it_cannot_help(threads, monkeypatch):
    ran: list[LaunchConfig] = []
    if not torch.cuda.is_available():
        precompile.precompile([A, B, C], ran.append)  # the interpreter, no CUDA
        monkeypatch.setattr(precompile, "interpreting", lambda: False)
        precompile.precompile([A, B, C], ran.append)  # no CUDA
        assert ran == []
    monkeypatch.setattr(precompile, "interpreting", lambda: False)
    monkeypatch.setattr(precompile.torch.cuda, "is_available", lambda: True)
    assert precompile.can_help(3)
    assert not precompile.can_help(1)  # one candidate: nothing to compile beside it
    with precompiling():
        assert not precompile.can_help(3)  # a tune inside a candidate's precompile
    monkeypatch.setattr(precompile.threads, "_value", 1)
    assert not precompile.can_help(3)
    monkeypatch.setattr(precompile.threads, "_value", 0)
    assert not precompile.can_help(3)
    monkeypatch.setattr(precompile.threads, "_value", 4)
    monkeypatch.setattr(precompile, "interpreting", lambda: True)
    assert not precompile.can_help(3)


def test_threads_come_from_the_environment_else_the_cpus(monkeypatch, caplog):
    setting = EnvCount("FUSEDSERVE_COMPILE_THREADS", precompile.default_threads)  # as precompile.threads is made
    monkeypatch.delenv("FUSEDSERVE_COMPILE_THREADS", raising=False)
    assert setting() == precompile.default_threads()
    assert 1 <= precompile.default_threads() <= precompile.MAX_DEFAULT_THREADS
    monkeypatch.setenv("FUSEDSERVE_COMPILE_THREADS", "0")
    setting.set(None)
    assert setting() == 0
    monkeypatch.setenv("FUSEDSERVE_COMPILE_THREADS", "6")
    setting.set(None)
    assert setting() == 6
    setting.set(3)  # the service's setting beats the environment
    assert setting() == 3
    monkeypatch.setenv("FUSEDSERVE_COMPILE_THREADS", "many")
    setting.set(None)
    assert setting() == precompile.default_threads()
    assert "FUSEDSERVE_COMPILE_THREADS" in caplog.text


def test_the_service_reads_the_setting(monkeypatch):
    from service.config import Settings

    monkeypatch.setenv("FUSEDSERVE_COMPILE_THREADS", "5")
    assert Settings().compile_threads == 5
    monkeypatch.delenv("FUSEDSERVE_COMPILE_THREADS")
    assert Settings().compile_threads is None


@pytest.fixture
def forced(threads, monkeypatch):
    """precompile as on a GPU host with AsyncCompileMode (the installed Triton's, with nothing to compile)."""
    monkeypatch.setattr(precompile, "can_help", lambda count: count > 1)


def test_precompile_runs_every_candidate_inside_precompiling_and_swallows_failures(forced):
    kernel = FakeKernel()
    ran = []

    def run(config: LaunchConfig):
        ran.append((config, precompiling_now()))
        if config == B:
            raise RuntimeError("out of resources")
        return grid_launch(kernel, (config.num_warps,))(config["BLOCK_M"], BLOCK_N=config["BLOCK_N"])

    assert precompile.precompile([A, B, C], run, "a key") is None
    assert ran == [(A, True), (B, True), (C, True)]
    assert kernel.calls == [("warmup", (4,), (16,), {"BLOCK_N": 32}), ("warmup", (4,), (32,), {"BLOCK_N": 16})]
    assert not precompiling_now()


def test_precompile_never_raises(forced, monkeypatch):
    class Broken:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("Another AsyncCompileMode is already active")

    monkeypatch.setattr(precompile.triton, "AsyncCompileMode", Broken)
    ran: list[LaunchConfig] = []
    precompile.precompile([A, B], ran.append)
    assert ran == [] and not precompiling_now()


@pytest.fixture
def tuning_on(tmp_path, monkeypatch):
    """Tuning on, timed at once, the default policy, a fresh cache file, an empty background queue."""
    monkeypatch.setattr(tuning.switch, "_on", True)
    monkeypatch.setattr(tuning.background, "_on", False)
    monkeypatch.setattr(tuning, "timing_budget", tuning.TimingBudget())
    monkeypatch.setattr(tuning.timing_policy, "_value", "both")
    monkeypatch.setattr(tuning, "_cache", [tuning.TuningCache(tmp_path / "tuning.json")])
    monkeypatch.setattr(tuning_background, "_queue", tuning_background.Queue())
    monkeypatch.setattr(tuning_background, "_clearers", [])
    return tmp_path / "tuning.json"


def recorded(monkeypatch) -> list[tuple[list[LaunchConfig], str]]:
    """Each precompile call's candidates and label, in place of compiling them."""
    got: list[tuple[list[LaunchConfig], str]] = []
    monkeypatch.setattr(
        precompile, "precompile", lambda candidates, run, label="": got.append((list(candidates), label))
    )
    return got


def timed(times: dict[LaunchConfig, float], calls: list):
    """A fake `measure`: runs the candidate (run appends it to `calls`), then returns its time; and checks that the
    candidate is timed with launches on."""

    def measure(fn):
        assert not precompiling_now()
        before = len(calls)
        fn()
        return (times[calls[before]], times[calls[before]])

    return measure


def test_tune_precompiles_the_key_then_times_each_candidate(tuning_on, monkeypatch):
    got = recorded(monkeypatch)
    calls: list[LaunchConfig] = []
    assert tune(SCOPE, "N64|m8", iter([A, B, C]), calls.append, timed({A: 3.0, B: 1.0, C: 2.0}, calls)) == B
    assert got == [([A, B, C], f"{SCOPE} N64|m8")]
    assert calls == [A, B, C]
    calls.clear()
    assert tune(SCOPE, "N64|m8", [A, B, C], calls.append) == B  # cached: nothing compiled, nothing timed
    assert len(got) == 1 and calls == []


def test_a_tune_inside_a_precompile_times_with_launches(tuning_on, monkeypatch):
    """A candidate's launch that tunes another key (conv's pool apart, its memo cleared) times that key's candidates
    with real launches, not compiles."""
    monkeypatch.setattr(precompile, "can_help", lambda count: False)
    calls: list[LaunchConfig] = []
    with precompiling():
        assert tune(SCOPE, "N64|m16", [A, B], calls.append, timed({A: 1.0, B: 2.0}, calls)) == A
        assert precompiling_now()
    assert calls == [A, B]


def test_the_background_step_precompiles_in_chunks_and_times_as_before(tuning_on, monkeypatch):
    monkeypatch.setattr(tuning.background, "_on", True)
    monkeypatch.setattr(precompile.threads, "_value", 2)
    got = recorded(monkeypatch)
    times = {A: 3.0, B: 1.0, C: 2.0, D: 4.0, E: 5.0}
    calls: list[LaunchConfig] = []
    assert tune(SCOPE, "N64|m8", [A, B, C, D, E], calls.append, timed(times, calls)) == A  # untimed, queued
    assert got == [] and calls == []
    q = tuning_background.queue()
    chunks = []
    for _ in range(4):
        assert q.step() is None
        chunks.append([c for c, _ in got])
    finished = q.step()
    assert calls == [A, B, C, D, E]  # one candidate a step, in order
    label = f"{SCOPE} N64|m8"
    assert got == [([A, B], label), ([C, D], label), ([E], label)]
    # a chunk is compiled by the step that first needs it: steps 1, 3 and 5
    assert [len(c) for c in chunks] == [1, 1, 2, 2]
    assert finished.pick == B and finished.changed and q.pending() == 0
    assert tune(SCOPE, "N64|m8", [A, B, C, D, E], calls.append) == B


def test_with_threads_off_the_background_step_still_times_one_candidate_a_step(tuning_on, monkeypatch):
    monkeypatch.setattr(tuning.background, "_on", True)
    monkeypatch.setattr(precompile.threads, "_value", 0)
    got = recorded(monkeypatch)
    calls: list[LaunchConfig] = []
    tune(SCOPE, "N64|m8", [A, B], calls.append, timed({A: 2.0, B: 1.0}, calls))
    q = tuning_background.queue()
    assert q.step() is None and calls == [A]
    assert q.step().pick == B and calls == [A, B]
    assert [c for c, _ in got] == [[A], [B]]  # one candidate each: precompile does nothing with it


# ---- on the GPU: the real thing ----


def _compiled(kernels, device: int) -> int:
    """Kernels in the JIT caches of `kernels` on `device`, after checking none is a pending compile."""
    from triton.runtime._async_compile import FutureKernel

    count = 0
    for kernel in kernels:
        cache = kernel.device_caches[device][0]
        assert not any(isinstance(k, FutureKernel) for k in cache.values()), "a compile left pending"
        count += len(cache)
    return count


def _linear_case():
    from kernels import fused_linear
    from kernels import linear as linear_mod

    # 2048 rows x 1280 outputs: 160 tiles of 128x128, enough for the persistent (TMA) kernel's candidates too.
    x = torch.randn(2048, 328, device="cuda", dtype=torch.float16)
    w = torch.randn(1280, 328, device="cuda", dtype=torch.float16) / 18
    b = torch.randn(1280, device="cuda", dtype=torch.float16)
    kernels = (linear_mod._linear_kernel, linear_mod.gemv._gemv_kernel, linear_mod.persistent._linear_persistent_kernel)
    return (
        kernels,
        lambda: fused_linear(x, w, b, "relu"),
        lambda: reference.linear(x.double(), w.double(), b.double(), "relu"),
    )


def _conv_case():
    from kernels import conv as conv_mod
    from kernels import conv_tma, fused_conv2d

    x = torch.randn(4, 48, 20, 20, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    w = conv_tma.weight_for(torch.randn(96, 48, 3, 3, device="cuda", dtype=torch.float16) / 20, (1, 1))
    b = torch.randn(96, device="cuda", dtype=torch.float16)
    kernels = (conv_mod._conv2d_kernel, conv_tma._conv2d_tma_kernel)
    run = lambda: fused_conv2d(x, w, b, activation="relu", padding=1)  # noqa: E731
    return kernels, run, lambda: reference.conv2d(x.double(), w.double(), b.double(), "relu", padding=(1, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("case", [_linear_case, _conv_case], ids=["linear", "conv"])
def test_gpu_a_tuned_key_is_compiled_before_it_is_timed_and_its_pick_is_right(case, tuning_on, monkeypatch):
    kernels, run, want = case()
    device = torch.cuda.current_device()
    monkeypatch.setattr(precompile.threads, "_value", 8)
    assert precompile.can_help(2), "triton.AsyncCompileMode missing?"
    counts = []
    real = precompile.precompile

    def counted(candidates, run, label=""):
        before = _compiled(kernels, device)
        real(candidates, run, label)
        counts.append((len(candidates), before, _compiled(kernels, device)))

    monkeypatch.setattr(precompile, "precompile", counted)
    got = run()
    torch.cuda.synchronize()
    assert len(counts) == 1, "one key tuned, precompiled once"
    candidates, before, after = counts[0]
    assert after - before >= 2, f"precompile compiled {after - before} of {candidates} candidates"
    assert _compiled(kernels, device) == after, "the timing compiled what precompile had not"
    assert tuning_on.exists()  # the pick, cached
    assert_close_to(got, want(), RTOL[torch.float16], "the tuned pick")
    print(f"{candidates} candidates, {after - before} kernels compiled by precompile")
