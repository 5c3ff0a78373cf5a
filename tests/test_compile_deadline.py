"""The compile deadline (kernels/compile_deadline.py): a compile past it is dropped and counted, the tuner leaves
that candidate out, and a fused step whose kernel cannot compile in time runs its unfused op (Executor.warm_forward),
so a model that imports always becomes ready. On the CPU nothing compiles (Triton's interpreter), so the compiler
is a stand-in here; tests/test_compile_deadline_gpu.py makes real compiles miss the deadline on a GPU."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import kernels  # noqa: F401 - chooses the backend before any kernel is defined
from kernels import compile_deadline, tuning
from kernels.compile_deadline import CompileDeadlineExceeded
from service.model.executors import Executor
from service.model.loader import load_model
from tests.modelgen import write_cnn_model


class _Source:
    """What triton.compiler.compile takes, as far as the deadline reads it: a hash, and the name and module of the
    kernel's function (one of this package's, unless `module` says otherwise)."""

    def __init__(self, key: str, name: str = "toy_kernel", module: str = "kernels.toy"):
        self._key = key
        self.fn = type("Fn", (), {"__name__": name, "__module__": module})()

    def hash(self) -> str:
        return self._key


@pytest.fixture
def deadline():
    def set_to(seconds):
        compile_deadline.set_deadline(seconds)

    yield set_to
    compile_deadline._deadline.clear()


def _slow_compiler(release: threading.Event, calls: list):
    def compile(src, target=None, options=None):
        calls.append(src.hash())
        release.wait(10)  # "compiles" until the test lets it go
        return f"binary of {src.hash()}"

    return compile


def test_a_compile_past_the_deadline_raises_is_counted_and_is_not_waited_for_again(deadline):
    deadline(0.05)
    release, calls, told = threading.Event(), [], []
    compile_deadline.on_late(told.append)
    compile = compile_deadline.with_deadline(_slow_compiler(release, calls))
    before = compile_deadline.late_count()
    src = _Source("late-1", "huge_kernel")
    with pytest.raises(CompileDeadlineExceeded, match="huge_kernel.*more than 0.05 s"):
        compile(src, "cuda", {"num_warps": 4})
    assert compile_deadline.late_count() == before + 1
    assert "huge_kernel" in told
    # The same program again: refused at once, the compiler not called a second time.
    with pytest.raises(CompileDeadlineExceeded):
        compile(src, "cuda", {"num_warps": 4})
    assert calls == ["late-1"]
    # Other options are another program: compiled (and let through this time).
    release.set()
    assert compile(src, "cuda", {"num_warps": 8}) == "binary of late-1"
    compile_deadline.late.listeners.remove(told.append)


def test_a_compile_in_time_returns_its_result_and_its_errors(deadline):
    deadline(5.0)
    compile = compile_deadline.with_deadline(lambda src, target=None, options=None: f"ok {src.hash()}")
    assert compile(_Source("quick"), "cuda", {}) == "ok quick"

    def broken(src, target=None, options=None):
        raise ValueError("out of shared memory")

    with pytest.raises(ValueError, match="out of shared memory"):
        compile_deadline.with_deadline(broken)(_Source("broken"), "cuda", {})


def test_other_packages_kernels_compile_without_a_deadline(deadline):
    """torch.compile's inductor kernels (a benchmark's anchors) in the same process are not this package's to drop."""
    deadline(0.05)
    release, calls = threading.Event(), []
    compile = compile_deadline.with_deadline(_slow_compiler(release, calls))
    threading.Timer(0.2, release.set).start()
    assert compile(_Source("inductor-1", "triton_poi_fused_add_0", "torch._inductor.x"), "cuda", {}) == (
        "binary of inductor-1"
    )
    assert calls == ["inductor-1"]


def test_no_deadline_calls_the_compiler_on_the_callers_thread(deadline):
    deadline(0)
    assert compile_deadline.deadline_s() is None
    threads = []
    compile = compile_deadline.with_deadline(
        lambda src, target=None, options=None: threads.append(threading.current_thread()) or "done"
    )
    assert compile(_Source("k"), "cuda", {}) == "done"
    assert threads == [threading.current_thread()]


def test_the_setting_reads_the_environment(monkeypatch):
    compile_deadline._deadline.clear()
    monkeypatch.setenv(compile_deadline.ENV, "12.5")
    assert compile_deadline.deadline_s() == 12.5
    monkeypatch.setenv(compile_deadline.ENV, "0")
    assert compile_deadline.deadline_s() is None
    monkeypatch.setenv(compile_deadline.ENV, "soon")
    assert compile_deadline.deadline_s() == compile_deadline.DEFAULT_DEADLINE_S


def test_install_wraps_tritons_compiler_once():
    import triton.compiler

    compile_deadline.install()
    first = triton.compiler.compile
    compile_deadline.install()
    assert triton.compiler.compile is first
    assert getattr(first, "__wrapped_by_deadline__", False)


def test_the_tuner_drops_late_candidates_and_reports_a_deadline_when_none_is_left():
    def measure(fn):
        fn()
        return 1.0, 1.0

    def run(config):
        if config in ("late-a", "late-b"):
            raise CompileDeadlineExceeded(f"kernel {config}", 0.05)

    timings = tuning.time_candidates(["late-a", "fine", "late-b"], run, measure, "toy")
    assert list(timings) == ["fine"]
    with pytest.raises(RuntimeError, match="no launch config runs toy") as err:
        tuning.time_candidates(["late-a", "late-b"], run, measure, "toy")
    assert isinstance(err.value.__cause__, CompileDeadlineExceeded)


# ------------------------------------------------------------------------------------- the executor's fallback


def _cnn(tmp_path, seed: int):
    layers = [
        {"op": "conv2d", "out": 6, "kernel": 3, "padding": 1}, {"op": "relu"},
        {"op": "conv2d", "out": 5, "kernel": 3, "stride": 2, "padding": 1}, {"op": "relu"},
        {"op": "maxpool2d", "kernel_size": 2, "stride": 2}, {"op": "flatten"}, {"op": "linear", "out": 7},
    ]  # fmt: skip
    return load_model(write_cnn_model(tmp_path / f"cnn{seed}", [3, 11, 13], layers, seed=seed))


def _late_for(strides: set, monkeypatch):
    """fused_conv2d that misses the compile deadline for convs of these strides (its program for that shape)."""
    import kernels.conv

    real = kernels.conv.fused_conv2d

    def fused_conv2d(*args, **kwargs):
        if tuple(kwargs["stride"]) in strides:
            raise RuntimeError("no launch config runs conv") from CompileDeadlineExceeded("_conv_kernel", 0.05)
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels.conv, "fused_conv2d", fused_conv2d)


@pytest.mark.parametrize("in_time", [0, 1], ids=["every-conv-late", "second-conv-late"])
def test_a_step_whose_kernel_is_late_runs_its_unfused_op_and_the_model_still_answers(tmp_path, monkeypatch, in_time):
    model = _cnn(tmp_path, seed=3 + in_time)
    x = torch.randn(5, *model.input_shape, generator=torch.Generator().manual_seed(11))
    expected = Executor(model, "unfused", torch.device("cpu"), torch.float32).forward(x)
    _late_for({(2, 2)} if in_time else {(1, 1), (2, 2)}, monkeypatch)
    fused = Executor(model, "fused", torch.device("cpu"), torch.float32)
    convs = [s.name for s in fused.steps if type(s).__name__ == "Conv2dStep"]
    assert len(convs) == 2
    warm = fused.warm_forward(x)
    late = convs[in_time:]
    assert sorted(fused.fallbacks) == sorted(late)
    assert all("unfused op" in why and "_conv_kernel" in why for why in fused.fallbacks.values())
    # Later forwards run the rebound steps (no deadline error), and agree with the unfused executor.
    again = fused.forward(x)
    assert torch.isfinite(warm).all() and warm.shape == expected.shape == (5, 7)
    np.testing.assert_allclose(warm.numpy(), expected.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(again.numpy(), expected.numpy(), rtol=1e-4, atol=1e-5)


def test_other_errors_are_not_taken_for_a_deadline(tmp_path, monkeypatch):
    import kernels.conv

    def broken(*args, **kwargs):
        raise RuntimeError("an illegal memory access")

    monkeypatch.setattr(kernels.conv, "fused_conv2d", broken)
    model = _cnn(tmp_path, seed=5)
    fused = Executor(model, "fused", torch.device("cpu"), torch.float32)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        fused.warm_forward(torch.randn(2, *model.input_shape))
    assert fused.fallbacks == {}


def test_the_plan_file_names_the_steps_that_fell_back(tmp_path, monkeypatch):
    from service.link.plan import read_plan, write_plan

    model = _cnn(tmp_path, seed=7)
    _late_for({(2, 2)}, monkeypatch)
    fused = Executor(model, "fused", torch.device("cpu"), torch.float32)
    fused.warm_forward(torch.randn(2, *model.input_shape))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_plan(run_dir, fused, "cpu")
    plan = read_plan(run_dir)["plan"]
    marked = {e["kernel"]: e["unfused_fallback"] for e in plan if "unfused_fallback" in e}
    assert list(marked) == list(fused.fallbacks) and len(marked) == 1
    assert "more than 0.05 s" in next(iter(marked.values()))
