"""`fusedserve bench kernels`: the CPU smoke run writes the markdown, JSON and PNG with the expected rows
and columns and small errors; no CUDA means exit 2 unless --device cpu; a wrong result is flagged in the
table, not hidden; the time budget drops max-autotune before default compile. The GPU run is gpu-marked.
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

from bench.kernel_budget import Budget
from bench.kernel_report import markdown, ours_failed, slug_of, summary
from bench.kernels import SHAPES, resolve
from service.cli import main

HAS_CUDA = torch.cuda.is_available()
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
pytestmark = pytest.mark.timeout(120)


def _args(*argv: str):
    import argparse

    from bench.kernels import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One CPU smoke run for the module (~8 s: ours runs through Triton's interpreter)."""
    out = tmp_path_factory.mktemp("bench")
    rc = main(["bench", "kernels", "--device", "cpu", "--quick", "--out", str(out)])
    return rc, out


@pytest.mark.skipif(HAS_CUDA, reason="CPU smoke; ours needs the interpreter, chosen only without CUDA")
def test_cpu_quick_run_writes_tables_json_and_plot(cpu_run, capsys):
    rc, out = cpu_run
    assert rc == 0
    md = (out / "kernels_cpu.md").read_text()
    assert "Command: `fusedserve bench kernels --device cpu --quick --out" in md
    layer_head = next(line for line in md.splitlines() if line.startswith("| M×K×N"))
    for col in ("floor µs", "eager", "linear", "cublaslt", "ours", "eager wall / ours wall", "ours % floor", "max err"):
        assert f"| {col} |" in layer_head, col
    assert "compile-max" not in layer_head  # --quick drops it (and compile on the CPU)
    for act in ("relu", "gelu_tanh"):
        assert f"| 64×256×128 | float32 | {act} |" in md
    model_head = next(line for line in md.splitlines() if line.startswith("| model"))
    for col in ("ours-eager", "ours", "best anchor", "ours / best"):
        assert f"| {col} |" in model_head, col
    for batch in (1, 32):
        assert f"| digits-mlp | {batch} |" in md
    assert "cuBLASLt is CUDA-only" in md
    rows = [line for line in md.splitlines() if line.startswith(("| 64×256×128", "| digits-mlp"))]
    assert len(rows) == 4 and not any("**!**" in row for row in rows)  # no result over its bound

    data = json.loads((out / "kernels_cpu.json").read_text())
    assert data["meta"]["device"] == "cpu" and data["meta"]["interpreter"] is True
    assert data["meta"]["ceilings"]["bandwidth"] > 0
    assert [(c["M"], c["K"], c["N"], c["act"]) for c in data["layers"]] == [
        (64, 256, 128, "relu"),
        (64, 256, 128, "gelu_tanh"),
    ]
    for case in data["layers"]:
        assert set(case["providers"]) == {"eager", "linear", "cublaslt", "ours"}
        assert "na" in case["providers"]["cublaslt"]
        for name in ("eager", "linear", "ours"):
            cell = case["providers"][name]["plain"]
            assert cell["finite"] and cell["err"] < 1e-5 and cell["wall_us"] > 0, (name, cell)
            assert cell["device_us"] is None  # no device timer on the CPU
        assert case["floor_us"] > 0
    assert [c["batch"] for c in data["models"]] == [1, 32]
    for case in data["models"]:
        assert case["dims"] == [64, 256, 256, 10]
        cell = case["providers"]["ours-eager"]["plain"]
        assert cell["finite"] and cell["err"] < 1e-5
        assert "na" in case["providers"]["ours"]  # CUDA graphs need CUDA
    if HAS_MATPLOTLIB:
        assert (out / "kernels_cpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU refusal")
def test_without_cuda_it_refuses_unless_device_cpu(capsys, tmp_path):
    assert main(["bench", "kernels", "--out", str(tmp_path)]) == 2
    assert "--device cpu" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "argv",
    [["--providers", "eager,nope"], ["--shapes", "64x256"], ["--dtype", "float64"], ["--batches", "0"]],
)
def test_bad_flags_are_refused_by_name(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "kernels", *argv])
    assert e.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_quick_and_filters_resolve():
    full = resolve(_args())
    assert full.shapes == SHAPES and full.dtypes == ("float16", "bfloat16", "float32")
    assert "compile-max" in full.layer_providers and full.batches == (1, 8, 32, 256, 4096)
    assert full.tf32 and full.model_dtype == "float16"
    quick = resolve(_args("--quick"))
    assert quick.shapes == ((64, 256, 128),) and quick.dtypes == ("float16",)
    assert "compile-max" not in quick.layer_providers + quick.model_providers
    assert quick.models == ("digits",)
    cpu = resolve(_args("--device", "cpu", "--quick"))
    assert cpu.dtypes == ("float32",) and "compile" not in cpu.layer_providers
    picked = resolve(_args("--dtype", "bfloat16", "--dtype", "float32,bfloat16", "--shapes", "1x8x16", "--no-tf32"))
    assert picked.dtypes == ("bfloat16", "float32") and picked.shapes == ((1, 8, 16),) and not picked.tf32
    only = resolve(_args("--providers", "ours,cublaslt,ours-eager"))
    assert only.layer_providers == ("cublaslt", "ours") and only.model_providers == ("ours-eager", "ours")


def _fake_results(err: float, finite: bool = True) -> dict:
    good = {"plain": {"device_us": 5.0, "wall_us": 20.0, "err": 1e-4, "finite": True, "bad": False}}
    ours = {"err": err if finite else None, "finite": finite, "bad": (not finite) or err > 1e-2}
    case = {
        "M": 64, "K": 256, "N": 128, "dtype": "float16", "act": "relu", "floor_us": 1.0, "error_bound": 1e-2,
        "providers": {
            "eager": good,
            "cublaslt": {"na": "not here"},
            "compile": {"error": "OutOfMemoryError: CUDA out of memory | tried"},
            "ours": {"plain": {"device_us": 4.0, "wall_us": 10.0, **ours}, "graph": {"error": "RuntimeError: x"}},
        },
    }  # fmt: skip
    meta = {
        "device": "cuda", "gpu": "NVIDIA H200", "torch": "2.11", "triton": "3.6", "cuda": "13.0", "tf32": True,
        "command": "fusedserve bench kernels", "started_utc": "now", "elapsed_s": 1.0, "time_limit_s": 420.0,
        "model_dtype": "float16",
        "ceilings": {"bandwidth": 4.25e12, "matmul_side": 8192, "matmul_rate": {"float16": 7e14}},
    }  # fmt: skip
    return {"meta": meta, "layers": [case], "models": []}


@pytest.mark.parametrize(("err", "finite"), [(0.5, True), (math.nan, False)])
def test_a_wrong_result_is_flagged_in_the_table(err, finite):
    def row_of(md: str) -> str:
        return next(line for line in md.splitlines() if line.startswith("| 64×256×128"))

    results = _fake_results(err, finite)
    md = markdown(results)
    row = row_of(md)
    assert "**!**" in row and "over 1e-02 or not finite: ours" in row
    assert "n/a[" in row and "**ERR**[" in row  # reasons are numbered notes below the table
    assert "OutOfMemoryError: CUDA out of memory / tried" in md  # '|' cannot break the table
    assert ours_failed(results)
    assert "BAD: ours" in summary(results)
    assert "**!**" not in row_of(markdown(_fake_results(1e-3)))
    assert not ours_failed(_fake_results(1e-3))


def test_budget_drops_compile_max_before_compile():
    b = Budget(limit_s=100)
    b.start_section(1.0)
    for _ in range(3):
        b.record("base", 2.0)
        b.record("compile", 3.0)
        b.record("compile-max", 30.0)
    # ~100 s left. 10 cases after this one: compile needs 3 + 11 * 2 = 25 s, compile-max 30 + 22 + 10 * 3
    # = 82 s: both fit. 20 after: compile 3 + 21 * 2 = 45 s fits, compile-max 30 + 42 + 60 = 132 s does not.
    assert b.skip_reason("compile", 10) is None and b.skip_reason("compile-max", 10) is None
    assert b.skip_reason("compile", 20) is None
    assert "--time-limit" in b.skip_reason("compile-max", 20)
    assert b.skip_reason("eager", 10_000) is None  # non-compile providers are never skipped
    assert Budget(limit_s=0).skip_reason("compile-max", 10_000) is None  # 0 = no limit
    assert not b.expired()
    late = Budget(limit_s=100)
    late.start_section(0.0)  # a section whose share and grace (15 s) lie in the past
    late.section_hard_deadline -= 15.1
    assert late.expired() and not Budget(limit_s=0).expired()


def test_gpu_slug():
    assert slug_of("NVIDIA H200") == "h200"
    assert slug_of("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"


@pytest.mark.gpu
@pytest.mark.timeout(420)
def test_gpu_quick_run(tmp_path):
    """On CUDA: every provider plain and graphed, device and wall times, ours correct (~1-2 min: compiles)."""
    rc = main(["bench", "kernels", "--quick", "--out", str(tmp_path), "--time-limit", "0"])
    assert rc == 0
    slug = slug_of(torch.cuda.get_device_name())
    data = json.loads((tmp_path / f"kernels_{slug}.json").read_text())
    assert len(data["layers"]) == 2 and data["meta"]["ceilings"]["bandwidth"] > 1e11
    for case in data["layers"]:
        for name in ("eager", "linear", "cublaslt", "compile", "ours"):
            res = case["providers"][name]
            for variant in ("plain", "graph"):
                cell = res.get(variant, res)  # a provider that failed outright shows its error
                assert cell.get("device_us", 0) > 0 and cell.get("wall_us", 0) > 0, (name, variant, cell)
                assert cell.get("finite") and not cell.get("bad"), (name, variant, cell)
    assert [c["batch"] for c in data["models"]] == [1, 32]
    for case in data["models"]:
        for name in ("eager", "linear", "compile", "ours-eager", "ours", "ours-unfused-graph"):
            res = case["providers"][name]
            assert "plain" in res or "graph" in res, (name, res)
            for variant in ("plain", "graph"):
                if variant in res:
                    cell = res[variant]
                    assert cell.get("device_us", 0) > 0 and cell.get("finite") and not cell.get("bad"), (name, cell)
        assert "plain" not in case["providers"]["ours"] and "graph" not in case["providers"]["ours-eager"]
    assert (tmp_path / f"kernels_{slug}.md").exists()


def _cell(device_us: float, wall_us: float) -> dict:
    graph = {"device_us": device_us, "wall_us": wall_us, "err": 1e-4, "finite": True, "bad": False}
    return {"graph": graph, "plain": dict(graph, device_us=device_us + 1)}


def test_targets_say_met_or_how_far():
    from bench.kernel_targets import checks

    results = _fake_results(1e-3)
    results["layers"][0]["providers"] = {
        "eager": _cell(10.0, 30.0),
        "cublaslt": _cell(6.0, 12.0),
        "ours": _cell(5.0, 20.0),
    }
    unmeasured = dict(results["layers"][0], M=128, N=256, providers={"eager": _cell(10.0, 30.0)})
    results["layers"] += [unmeasured, dict(results["layers"][0], M=4096, K=4096, N=4096)]  # not a published shape
    models = {
        ("digits-mlp", 1): {"compile-max": _cell(12.0, 60.0), "linear": _cell(16.0, 50.0), "ours": _cell(5.5, 10.0)},
        ("digits-mlp", 256): {"compile-max": _cell(12.0, 60.0), "ours": _cell(8.0, 10.0)},
        ("digits-mlp", 4096): {"compile-max": _cell(19.0, 60.0), "ours": _cell(30.0, 10.0)},  # no target
        ("wide-mlp", 1): {"linear": _cell(37.0, 55.0), "ours": _cell(15.0, 20.0)},
        ("wide-mlp", 4096): {"linear": _cell(330.0, 340.0), "ours": _cell(400.0, 410.0)},
    }
    results["models"] = [
        {"model": m, "batch": b, "dtype": "float16", "floor_us": 11.8, "providers": ps} for (m, b), ps in models.items()
    ]
    assert len(checks(results)) == 2 * 2 + 2 * 2 + 2
    wall = next(c for c in checks(results) if c.target.endswith("ours wall") and c.case.startswith("64x"))
    # eager wall / ours wall = 30 / 20 = 1.5 < 2: needs 2 / 1.5 = 1.33x; device 5 <= cuBLASLt 6: met
    assert wall.met is False and wall.gap == "needs 1.33x"
    device = [c for c in checks(results) if c.target.endswith("vs cuBLASLt") and c.case.startswith("64x")][0]
    assert device.met is True and device.gap == ""
    assert [c.met for c in checks(results) if c.case.startswith("128x256x256")] == [None, None]  # ours missing
    digits = [c for c in checks(results) if c.case.startswith("digits-mlp batch 1 ")]
    assert [c.met for c in digits] == [True, True]  # 5.5 <= 6 us; best anchor 12 / 5.5 = 2.2x
    digits256 = [c for c in checks(results) if c.case.startswith("digits-mlp batch 256")]
    assert [(c.met, c.gap) for c in digits256] == [(False, "needs 1.33x"), (False, "needs 1.33x")]
    wide1 = next(c for c in checks(results) if c.case.startswith("wide-mlp batch 1 "))
    assert wide1.met is True and wide1.measured == "79%"  # 11.8 / 15
    wide4096 = next(c for c in checks(results) if c.case.startswith("wide-mlp batch 4096"))
    assert wide4096.met is False and wide4096.gap == "needs 1.21x"  # 400 / 330
    md = markdown(results)
    assert "## Targets (issue 3)" in md and "4 met, 4 not met, 2 not measured" in md
    assert "== targets: 4 of 10 met ==" in summary(results)
    cpu = dict(results, meta=dict(results["meta"], device="cpu"))
    assert checks(cpu) == [] and "## Targets" not in markdown(cpu)


def test_report_rerenders_from_its_json(tmp_path):
    from bench.kernel_report import main as rerender

    results = _fake_results(1e-3)
    results["meta"]["slug"] = "h200"
    path = tmp_path / "kernels_h200.json"
    path.write_text(json.dumps(results))
    assert rerender([str(path)]) == 0
    assert (tmp_path / "kernels_h200.md").read_text() == markdown(results)
