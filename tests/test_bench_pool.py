"""`python -m bench.pool`: the CPU smoke run writes markdown, JSON and PNG with every case and small errors; the
flags resolve as documented; the argument module imports no torch. The GPU run is gpu-marked."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from bench.pool import cli as bench_pool

HAS_CUDA = torch.cuda.is_available()
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
pytestmark = pytest.mark.timeout(300)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench_pool.add_arguments(p)
    return p.parse_args(list(argv))


def test_argument_module_imports_no_torch():
    code = "import sys, bench.pool.cli; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_plan_defaults_and_quick():
    full = bench_pool.plan_of(_args())
    assert full["sizes"] == bench_pool.SIZES and full["dtypes"] == ("float32", "float16")
    assert full["providers"] == ("cpu", "torch", "compile", "ours") and full["windows"] == (8, 2)
    quick = bench_pool.plan_of(_args("--quick", "--dtypes", "float16"))
    assert quick["sizes"] == bench_pool.QUICK_SIZES and quick["dtypes"] == ("float16",)
    cpu = bench_pool.plan_of(_args("--device", "cpu"))
    assert cpu["providers"] == ("cpu", "torch", "ours") and cpu["batch_channels"] == ((1, 1),)
    with pytest.raises(SystemExit):
        _args("--providers", "cudnn")


def test_cases_leave_out_the_huge_ones():
    from bench.pool.run import MAX_ELEMENTS, _cases

    plan = bench_pool.plan_of(_args())
    cases = list(_cases(plan))
    assert all(c["n"] * c["c"] * c["size"] ** 2 <= MAX_ELEMENTS for c in cases)
    assert {"dtype": "float32", "k": 2, "n": 1, "c": 1, "size": 8192} in cases
    assert not any(c["n"] == 32 and c["size"] > 512 for c in cases)


@pytest.mark.skipif(HAS_CUDA, reason="CPU smoke; ours needs the interpreter, chosen only without CUDA")
def test_cpu_quick_run_writes_tables_json_and_plot(tmp_path):
    rc = bench_pool.main(["--device", "cpu", "--quick", "--out", str(tmp_path)])
    assert rc == 0
    md = (tmp_path / "pool_cpu.md").read_text()
    assert "Command: `python -m bench.pool --device cpu --quick --out" in md
    for k in (8, 2):
        for s in bench_pool.CPU_QUICK_SIZES:
            assert f"| 1×1×{s}² | float32 | {k} |" in md
    result = json.loads((tmp_path / "pool_cpu.json").read_text())
    assert len(result["rows"]) == 4
    for row in result["rows"]:
        ours = row["providers"]["ours"]
        assert ours["err"] < 1e-6 and not ours["bad"] and ours["wall_us"] > 0
        assert row["providers"]["cpu"]["wall_us"] > 0
    if HAS_MATPLOTLIB:
        assert (tmp_path / "pool_cpu.png").stat().st_size > 1000


@pytest.mark.gpu
def test_gpu_quick_run(tmp_path):
    rc = bench_pool.main(["--quick", "--providers", "cpu,torch,ours", "--out", str(tmp_path)])
    assert rc == 0
    (md,) = tmp_path.glob("pool_*.md")
    text = md.read_text()
    assert "ours % floor" in text and "Where the GPU starts beating the CPU" in text
    result = json.loads(md.with_suffix(".json").read_text())
    for row in result["rows"]:
        ours = row["providers"]["ours"]
        assert ours["cold_us"] > 0 and ours["hot_us"] > 0 and ours["e2e_pinned_us"] > 0 and not ours["bad"]
