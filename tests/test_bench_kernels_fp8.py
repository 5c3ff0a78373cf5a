"""`fusedserve bench kernels`' ours-float8 (issue 52): the fused executor in float8 beside float16, models section.
It is asked for by name, calibrates on random rows of its own seed, runs on the CPU through Triton's interpreter (the
executor's forward: no CUDA graphs), is n/a with the reason where it cannot run, and its error is held to its own bound
(models.FLOAT8_ERROR_BOUND), so a float8 result is not reported as a wrong one.
"""

from __future__ import annotations

import json

import pytest
import torch

from bench.kernels.cli import resolve
from bench.kernels.models import FLOAT8_ERROR_BOUND, ModelProviders, NotAvailable, load_named
from bench.kernels.report import markdown, ours_failed, summary
from fusedserve.cli import main

HAS_CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.timeout(120)


def _args(*argv: str):
    import argparse

    from bench.kernels.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_float8_is_run_by_name_only():
    for argv in ((), ("--quick",), ("--device", "cpu")):
        assert "ours-float8" not in resolve(_args(*argv)).model_providers, argv
    plan = resolve(_args("--providers", "compile,ours,ours-float8", "--models", "resnet50", "--batches", "1,256"))
    assert plan.model_providers == ("compile", "ours", "ours-float8")
    assert "ours-float8" not in plan.layer_providers + plan.conv_providers


@pytest.mark.skipif(HAS_CUDA, reason="CPU smoke; ours needs the interpreter, chosen only without CUDA")
def test_cpu_quick_run_times_float8_beside_float16(tmp_path, monkeypatch, capsys):
    import bench.kernels.run as run

    # The ceilings' fp16 GEMM takes seconds on the CPU and this test reads none of them.
    ceilings = {"bandwidth": 8e9, "matmul_side": 1024, "matmul_rate": {"float16": 1e10}}
    monkeypatch.setattr(run, "measure_ceilings", lambda *a: ceilings)
    argv = ["bench", "kernels", "--device", "cpu", "--quick", "--sections", "models", "--model-dtype", "float16"]
    rc = main([*argv, "--batches", "4", "--providers", "ours,ours-float8", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "kernels_cpu.json").read_text())
    [case] = data["models"]
    assert (case["model"], case["batch"], case["dtype"]) == ("digits-mlp", 4, "float16")
    assert case["error_bounds"] == {"ours-float8": FLOAT8_ERROR_BOUND}
    assert case["providers"]["ours"] == {"na": "CUDA graphs need CUDA", "seconds": 0.0}
    cell = case["providers"]["ours-float8"]["plain"]  # the interpreter: the executor's forward, no graph
    assert cell["finite"] and 0 < cell["err"] < FLOAT8_ERROR_BOUND and not cell["bad"] and cell["wall_us"] > 0
    md = (tmp_path / "kernels_cpu.md").read_text()
    head = next(line for line in md.splitlines() if line.startswith("| model"))
    assert "| ours | ours-float8 |" in head
    row = next(line for line in md.splitlines() if line.startswith("| digits-mlp | 4 |"))
    assert "n/a[" in row and "ours-float8 " in row and "(bound 0.14)" in row and "**!**" not in row
    assert "against its own bound 0.14 (e4m3 is not fp16)" in md
    assert "| float8 " in capsys.readouterr().out  # the summary's float8 cell


def _fake(err: float) -> dict:
    """A models-section result with ours at an fp16 error and ours-float8 at `err`."""
    meta = {
        "gpu": "NVIDIA H200", "device": "cuda", "torch": "x", "triton": "x", "cuda": "12", "tf32": True,
        "started_utc": "now", "command": "fusedserve bench kernels", "model_dtype": "float16",
        "ceilings": {"bandwidth": 4.25e12, "matmul_side": 8192, "matmul_rate": {"float16": 7e14}},
    }  # fmt: skip

    def cell(e: float, us: float) -> dict:
        return {"err": e, "finite": True, "bad": e > (FLOAT8_ERROR_BOUND if e == err else 1e-2), "device_us": us,
                "wall_us": us + 5, "hot_us": us - 1}  # fmt: skip

    case = {
        "model": "resnet50", "batch": 256, "dtype": "float16", "floor_us": 1000.0, "error_bound": 1e-2,
        "error_bounds": {"ours-float8": FLOAT8_ERROR_BOUND},
        "providers": {
            "compile": {"graph": cell(2e-3, 9000.0)}, "ours": {"graph": cell(1e-3, 8400.0)},
            "ours-float8": {"graph": cell(err, 5600.0)},
        },
    }  # fmt: skip
    return {"meta": meta, "layers": [], "models": [case], "convs": []}


def test_a_float8_error_is_held_to_its_own_bound():
    assert abs(FLOAT8_ERROR_BOUND - 0.1414) < 1e-4  # the error at the contract's cosine, 0.99
    ok = _fake(0.04)  # over fp16's 1e-2, inside float8's 0.14: not a wrong result
    row = next(line for line in markdown(ok).splitlines() if line.startswith("| resnet50 | 256 |"))
    assert row.endswith("| 2.0e-03; ours-float8 4.0e-02 (bound 0.14) |")  # max err: the fp16 providers' alone
    assert not ours_failed(ok)
    line = next(line for line in summary(ok).splitlines() if line.startswith("resnet50"))
    assert "BAD" not in line and "| float8 5600/5599 us, 0.67x/0.67x ours, err 4e-02" in line
    wrong = _fake(0.5)
    row = next(line for line in markdown(wrong).splitlines() if line.startswith("| resnet50 | 256 |"))
    assert "**!**" in row and "not finite: ours-float8 (over 0.14)**" in row
    assert ours_failed(wrong) and "BAD: ours-float8" in summary(wrong)


def test_float8_says_why_it_cannot_run(tmp_path, monkeypatch):
    import kernels.fp8
    import kernels.runtime

    cpu = torch.device("cpu")
    model = load_named("digits", tmp_path, 0)
    x = torch.randn(2, 64)
    with pytest.raises(NotAvailable, match="float8 runs beside float16.*--model-dtype float16"):
        ModelProviders(model, cpu, torch.float32, max_batch_size=2).prepare("ours-float8", x)
    providers = ModelProviders(model, cpu, torch.float16, max_batch_size=2)
    monkeypatch.setattr(kernels.runtime, "interpreting", lambda: False)
    assert "only through Triton's interpreter" in providers.float8_unavailable()
    # A GPU without fp8 tensor cores (an A100): the device's name and compute capability
    providers.device = torch.device("cuda")
    monkeypatch.setattr(kernels.fp8, "fp8_capable", lambda device=None: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    reason = r"^NVIDIA A100-SXM4-80GB: no fp8 tensor cores \(compute capability 8.0 < 8.9\)"
    with pytest.raises(NotAvailable, match=reason):
        providers.prepare("ours-float8", x)


def test_float8_calibrates_on_rows_of_its_own_seed(tmp_path):
    """The calibration covers every tensor the executor reads (calibrate.measure, unfused float32), from rows of
    calibration_seed: another seed, other ranges; the run gives each model its seed apart from the timed inputs'."""
    from bench.kernels.run import CALIBRATION_SEED_OFFSET

    model = load_named("digits-cnn", tmp_path, 0)
    cpu = torch.device("cpu")
    a = ModelProviders(model, cpu, torch.float16, 2, calibration_seed=1).calibration(rows=8)
    b = ModelProviders(model, cpu, torch.float16, 2, calibration_seed=2).calibration(rows=8)
    assert a.samples == 8 and model.input_name in a.ranges and set(a.ranges) == set(b.ranges)
    assert a.ranges != b.ranges and all(v > 0 for v in a.ranges.values())
    assert CALIBRATION_SEED_OFFSET > 50_000 + 1000  # the model cases' seeds: + 50_000 + case number
