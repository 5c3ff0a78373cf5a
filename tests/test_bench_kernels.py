"""`fusedserve bench kernels`: the CPU smoke run writes the markdown, JSON and PNG with the expected rows
and columns and small errors; no CUDA means exit 2 unless --device cpu; a wrong result is flagged in the
table, not hidden; the time budget drops max-autotune before default compile; wall runs take turns across a
case's providers (best run each, GC off, a failing one recorded, torch.compile ones on the spot). The GPU run is
gpu-marked.
"""

from __future__ import annotations

import gc
import importlib.util
import itertools
import json
import math
import types
import weakref
from pathlib import Path

import pytest
import torch

from bench.gpu import results_dir, slug_of
from bench.kernels.budget import Budget
from bench.kernels.cli import SHAPES, resolve
from bench.kernels.report import markdown, ours_failed, summary
from fusedserve.cli import main

HAS_CUDA = torch.cuda.is_available()
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
pytestmark = pytest.mark.timeout(120)


def _args(*argv: str):
    import argparse

    from bench.kernels.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


# The docs' CPU smoke run of the benchmark, but for its --out folder: tests/test_docs.py holds the README's command to
# these words, and this module runs and checks it (once for the suite, in this process).
SMOKE_ARGV = ["bench", "kernels", "--device", "cpu", "--quick", "--out"]


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One CPU smoke run for the module (~8 s: ours runs through Triton's interpreter)."""
    out = tmp_path_factory.mktemp("bench")
    rc = main([*SMOKE_ARGV, str(out)])
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
    # --quick's convs section: the wider CNN's last conv (128 -> 128 at 8x8) at batch 1
    assert "## Conv layers of the wider CNN" in md and "| 128→128 8×8 | 1 |" in md
    [conv] = data["convs"]
    assert (conv["C"], conv["H"], conv["OC"], conv["batch"]) == (128, 8, 128, 1)
    assert conv["flops"] == 2 * 64 * 128 * 128 * 9
    assert set(conv["providers"]) == {"cudnn", "cudnn-fused", "ours"} and "na" in conv["providers"]["cudnn-fused"]
    for name in ("cudnn", "ours"):
        cell = conv["providers"][name]["plain"]
        assert cell["finite"] and cell["err"] < 1e-5 and cell["wall_us"] > 0, (name, cell)
    assert "hot_us" not in json.dumps(data)  # hot needs CUDA graphs
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
    # Issue 19: the digits MLP runs in fp16 and bf16, the other models in fp16; then the convs section.
    every = (1, 8, 32, 256, 4096)
    assert full.model_runs == (
        ("digits", "float16", every), ("digits", "bfloat16", every), ("wide", "float16", every),
        ("digits-cnn", "float16", every), ("wide-cnn", "float16", (1, 32, 256)),
    )  # fmt: skip
    assert full.sections == ("layers", "models", "convs") and full.conv_layers == (0, 1, 2, 3)
    assert full.conv_providers == ("cudnn", "cudnn-fused", "compile", "ours") and full.conv_batches == (1, 32, 256)
    both = resolve(_args("--model-dtype", "bfloat16,float16", "--models", "wide-cnn", "--batches", "2,4096"))
    assert both.model_runs == (("wide-cnn", "bfloat16", (2, 4096)), ("wide-cnn", "float16", (2, 4096)))
    assert both.model_dtype == "bfloat16"
    quick = resolve(_args("--quick"))
    assert quick.model_runs == (("digits", "float16", (1, 32)),)
    assert quick.conv_layers == (3,) and quick.conv_batches == (1,)
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
    # The results are named by GPU model alone: kernels_h100.md, as serve_h100.md and pool_h100.md, in a folder of
    # that name: bench/results/h100/.
    assert slug_of("NVIDIA H200") == "h200"
    assert slug_of("NVIDIA H100 80GB HBM3") == "h100"
    assert slug_of("NVIDIA H100 PCIe") == "h100"
    assert slug_of("NVIDIA H200 (x2)") == "h200"  # bench serve's name for a host of two
    assert slug_of("NVIDIA GeForce RTX 4090") == "geforce-rtx-4090"
    assert slug_of(None) == slug_of("") == "cpu"
    assert results_dir("h100") == Path("bench/results/h100")


@pytest.mark.gpu
@pytest.mark.gpu_timing
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
        # hot: every graph cell, back-to-back replays; never slower than a cold replay by much (L2 is warm)
        for name in ("eager", "linear", "compile", "ours", "ours-unfused-graph"):
            cell = case["providers"][name]["graph"]
            assert cell["hot_us"] > 0 and cell["hot_replays"] >= 10, (name, cell)
            assert cell["hot_us"] < 1.5 * cell["device_us"], (name, cell)
    for case in data["layers"]:
        assert all(case["providers"][p]["graph"]["hot_us"] > 0 for p in ("eager", "ours")), case
        assert "hot_us" not in case["providers"]["ours"]["plain"]  # hot is a graph replay's
    [conv] = data["convs"]  # --quick: the wider CNN's last conv at batch 1
    for name in ("cudnn", "compile", "ours"):
        cell = conv["providers"][name]["graph"]
        assert cell["device_us"] > 0 and cell["hot_us"] > 0 and not cell["bad"], (name, cell)
    assert (tmp_path / f"kernels_{slug}.md").exists()


def _cell(device_us: float, wall_us: float, hot_us: float | None = None) -> dict:
    graph = {"device_us": device_us, "wall_us": wall_us, "err": 1e-4, "finite": True, "bad": False}
    if hot_us is not None:
        graph["hot_us"] = hot_us
    return {"graph": graph, "plain": dict(graph, device_us=device_us + 1, hot_us=None)}


def test_targets_say_met_or_how_far():
    from bench.kernels.targets import checks

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
    issue3 = [c for c in checks(results) if not c.target.startswith(("hot", "cold"))]
    assert len(issue3) == 2 * 2 + 2 * 2 + 2
    assert len(checks(results)) == len(issue3)  # a run from before hot timing is judged by issue 3 alone
    wall = next(c for c in issue3 if c.target.endswith("ours wall") and c.case.startswith("64x"))
    # eager wall / ours wall = 30 / 20 = 1.5 < 2: needs 2 / 1.5 = 1.33x; device 5 <= cuBLASLt 6: met
    assert wall.met is False and wall.gap == "needs 1.33x"
    device = [c for c in issue3 if c.target.endswith("vs cuBLASLt") and c.case.startswith("64x")][0]
    assert device.met is True and device.gap == ""
    assert [c.met for c in issue3 if c.case.startswith("128x256x256")] == [None, None]  # ours missing
    digits = [c for c in issue3 if c.case.startswith("digits-mlp batch 1 ")]
    assert [c.met for c in digits] == [True, True]  # 5.5 <= 6 us; best anchor 12 / 5.5 = 2.2x
    digits256 = [c for c in issue3 if c.case.startswith("digits-mlp batch 256")]
    assert [(c.met, c.gap) for c in digits256] == [(False, "needs 1.33x"), (False, "needs 1.33x")]
    wide1 = next(c for c in issue3 if c.case.startswith("wide-mlp batch 1 "))
    assert wide1.met is True and wide1.measured == "79%"  # 11.8 / 15
    wide4096 = next(c for c in issue3 if c.case.startswith("wide-mlp batch 4096"))
    assert wide4096.met is False and wide4096.gap == "needs 1.21x"  # 400 / 330
    md = markdown(results)
    assert "## Targets (issue 3)" in md and "4 met, 4 not met, 2 not measured" in md
    assert "== targets: 4 of 10 met ==" in summary(results)
    results["meta"]["timing"] = _hot_results()["meta"]["timing"]  # a run with hot times: issue 19's rows too
    hot_rows = [c for c in checks(results) if c.target.startswith("hot")]  # one per MLP case
    assert len(hot_rows) == 5 and all(c.met is None for c in hot_rows)  # these fakes have no hot times
    md = markdown(results)
    assert "## Targets (issues 3, 19, 20)" in md and "4 met, 4 not met, 7 not measured" in md
    assert "== targets: 4 of 15 met ==" in summary(results)
    cpu = dict(results, meta=dict(results["meta"], device="cpu"))
    assert checks(cpu) == [] and "## Targets" not in markdown(cpu)


def test_report_rerenders_from_its_json(tmp_path):
    from bench.kernels.report import main as rerender

    results = _fake_results(1e-3)
    results["meta"]["slug"] = "h200"
    path = tmp_path / "kernels_h200.json"
    path.write_text(json.dumps(results))
    assert rerender([str(path)]) == 0
    assert (tmp_path / "kernels_h200.md").read_text() == markdown(results)


# Wall time, interleaved (bench/kernels/timing.py's docstring). The fake providers below run on a fake clock;
# with wall_target_s=0 every cell gets n=3 calls per run, so a provider's calls come in known blocks:
PREP_CALLS = 5  # before its runs: 1 call checked against ref, then calls_per_run's 3 warm-up calls and 1 timed
CALLS_PER_RUN = 4  # timed_run's untimed call, then n=3 timed


class _Clock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class _Provider:
    """Each call logs its name and costs run_costs[k] fake seconds during its k-th wall run (1 ms before);
    fail_at_run=k raises on the first call of run k."""

    def __init__(self, name, log, clock, run_costs, fail_at_run=None, probe=None):
        self.name, self.log, self.clock, self.run_costs = name, log, clock, run_costs
        self.fail_at_run, self.probe, self.calls = fail_at_run, probe, 0
        self.gc_in_runs: list[bool] = []

    def __call__(self):
        run = (self.calls - PREP_CALLS) // CALLS_PER_RUN if self.calls >= PREP_CALLS else None
        self.calls += 1
        self.log.append(self.name)
        if run is not None:
            self.gc_in_runs.append(gc.isenabled())
            if self.probe:
                self.probe()
            if run == self.fail_at_run:
                raise RuntimeError(f"{self.name} broke in run {run}")
        self.clock.now += 1e-3 if run is None else self.run_costs[run]
        return torch.ones(2, 2)


def _blocks(log: list[str]) -> list[tuple[str, int]]:
    """The log as (name, consecutive entries) blocks."""
    return [(name, len(list(group))) for name, group in itertools.groupby(log)]


def _run_fake_case(monkeypatch, names, make) -> tuple[dict, list[str]]:
    """bench.kernels.run._run_case on the CPU with fake providers (make(name, log, clock) -> Prepared)."""
    from bench.kernels import timing as kernel_timing
    from bench.kernels.run import _Ctx, _run_case
    from bench.kernels.timing import Timing

    log: list[str] = []
    clock = _Clock()
    monkeypatch.setattr(kernel_timing, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    monkeypatch.setattr(torch._dynamo, "reset", lambda: log.append("reset"))
    ctx = _Ctx(None, torch.device("cpu"), False, Timing(0, 0, 0.0), Budget(0), {}, lambda **_: [])
    case = {"error_bound": 1e-2, "providers": {}}
    ref = torch.ones(2, 2, dtype=torch.float64)
    _run_case(ctx, case, names, lambda name: make(name, log, clock), ref, cases_after=0)
    return case, log


def test_wall_runs_alternate_between_providers_and_keep_each_ones_best(monkeypatch):
    from bench.kernels.timing import Prepared

    costs = {"eager": [5e-6, 3e-6, 4e-6, 2e-6, 6e-6], "compile": [9e-6, 7e-6, 8e-6, 8e-6, 9e-6]}
    costs["ours"] = [2e-6, 1.5e-6, 3e-6, 1e-6, 2.5e-6]
    compiled: list[weakref.ref] = []
    compile_alive_in_rounds: list[bool] = []
    providers: dict[str, _Provider] = {}

    def make(name, log, clock):
        probe = (lambda: compile_alive_in_rounds.append(compiled[0]() is not None)) if name == "eager" else None
        p = _Provider(name, log, clock, costs[name], probe=probe)
        if name == "compile":
            compiled.append(weakref.ref(p))  # the test holds no strong reference to it
        else:
            providers[name] = p
        return Prepared(p)

    assert gc.isenabled()
    case, log = _run_fake_case(monkeypatch, ("eager", "compile", "ours"), make)
    # compile: measured on the spot (5 runs in a row), then dynamo reset; eager and ours take turns, round by round
    on_the_spot = PREP_CALLS + 5 * CALLS_PER_RUN
    expected = [("eager", PREP_CALLS), ("compile", on_the_spot), ("reset", 1), ("ours", PREP_CALLS)]
    assert _blocks(log) == expected + [("eager", CALLS_PER_RUN), ("ours", CALLS_PER_RUN)] * 5
    walls = {name: res["plain"]["wall_us"] for name, res in case["providers"].items()}
    assert walls == pytest.approx({"eager": 2.0, "compile": 7.0, "ours": 1.0})  # min of the rounds, not the mean
    assert compile_alive_in_rounds == [False] * 5 * CALLS_PER_RUN  # gone before the rounds started
    for p in providers.values():
        assert p.gc_in_runs == [False] * 5 * CALLS_PER_RUN  # GC off in every wall run
    assert gc.isenabled()
    cell = case["providers"]["ours"]["plain"]
    assert cell["err"] == 0.0 and cell["finite"] and not cell["bad"] and cell["device_us"] is None


def test_a_failing_wall_run_leaves_the_others_measured(monkeypatch):
    from bench.kernels.timing import Prepared

    costs = {"eager": [5e-6, 3e-6, 4e-6, 2e-6, 6e-6], "flaky": [1e-6] * 5, "ours": [2e-6, 1.5e-6, 3e-6, 1e-6, 2.5e-6]}

    def make(name, log, clock):
        return Prepared(_Provider(name, log, clock, costs[name], fail_at_run=1 if name == "flaky" else None))

    case, log = _run_fake_case(monkeypatch, ("eager", "flaky", "ours"), make)
    assert case["providers"]["flaky"]["plain"] == {"error": "RuntimeError: flaky broke in run 1"}
    assert case["providers"]["eager"]["plain"]["wall_us"] == pytest.approx(2.0)
    assert case["providers"]["ours"]["plain"]["wall_us"] == pytest.approx(1.0)
    rounds = _blocks(log)[3:]
    run = CALLS_PER_RUN
    assert rounds[:6] == [("eager", run), ("flaky", run), ("ours", run), ("eager", run), ("flaky", 1), ("ours", run)]
    assert rounds[6:] == [("eager", run), ("ours", run)] * 3  # flaky left the rounds, the others went on
    assert gc.isenabled()


def test_timed_run_turns_gc_off_and_restores_it():
    from bench.kernels.timing import timed_run

    cpu = torch.device("cpu")
    seen: list[bool] = []
    assert gc.isenabled()
    assert timed_run(lambda: seen.append(gc.isenabled()), 3, cpu) >= 0
    assert seen == [False] * 4 and gc.isenabled()

    def broken():
        raise RuntimeError("no")

    with pytest.raises(RuntimeError):
        timed_run(broken, 3, cpu)
    assert gc.isenabled()  # re-enabled on the way out of an exception
    gc.disable()
    try:
        timed_run(lambda: None, 3, cpu)
        assert not gc.isenabled()  # as timeit: a GC the caller had off stays off
    finally:
        gc.enable()


def test_method_line_says_how_the_wall_was_measured():
    results = _fake_results(1e-3)
    assert "best of 5 runs (the same rule for every provider)" in markdown(results)  # written before interleaving
    results["meta"]["timing"] = {"wall_interleaved": True}
    md = markdown(results)
    assert "GC off, best of 5 runs; a case's providers take turns run by run" in md
    assert "the same rule for every provider" not in md


def test_method_line_says_how_l2_was_cleared():
    results = _fake_results(1e-3)
    results["meta"]["device"] = "cuda"
    assert "zeroing 256 MB" in markdown(results)  # written before cold_timing
    results["meta"]["timing"] = {"l2_clear": "read"}
    md = markdown(results)
    assert "L2 cleared by reading 256 MB" in md and "zeroing" not in md


@pytest.mark.parametrize(
    ("floor_us", "ours_us", "want"), [(1.06, 10.6, "10%"), (0.99, 10.0, "10%"), (0.04, 9.47, "0.4%"), (3, 4, "75%")]
)
def test_percent_of_floor_reads_as_a_percent(floor_us, ours_us, want):
    # 9.96% once printed as "1e+01%" (H200 run, digits MLP batch 4096).
    from bench.kernels.report import _pct_floor

    assert _pct_floor({"floor_us": floor_us}, {"graph": {"device_us": ours_us}}) == want


def test_budget_estimates_each_section_from_its_own_costs():
    # Layer cases cost ~3 s, model cases ~12 (ours tunes a whole MLP per bucket). Carried over, the layers'
    # costs let compile-max take the time the last model cases needed (a 2026-11-23 H200 run skipped two).
    from bench.kernels.budget import MODEL_START_ESTIMATE_S

    b = Budget(limit_s=200)
    b.start_section(0.5)
    for _ in range(3):
        b.record("base", 2.0)
        b.record("compile-max", 20.0)
    assert b.estimate("base") == 2.0
    b.start_section(1.0, MODEL_START_ESTIMATE_S)
    assert b.estimate("base") == MODEL_START_ESTIMATE_S["base"] and b.estimate("compile-max") == 25.0
    # ~200 s left: 10 model cases after this one need 25 + 11 * 12 + 10 * 1 = 167 s with compile-max, 15
    # after need 25 + 16 * 12 + 15 = 232: skipped (with the layers' 2 s a case it would have run: 25 + 32 + 15).
    assert b.skip_reason("compile-max", 10) is None
    assert "--time-limit" in b.skip_reason("compile-max", 15)
    b.record("base", 20.0)
    assert b.estimate("base") == 20.0  # measured in this section, not averaged with the layers' 2 s


# Hot timing (kernels/hot_timing.py) on a simulated GPU: a stream that runs queued work in order, each
# item starting when it was launched or when the one before it ended, whichever is later.
class _FakeGPU:
    def __init__(self, host_us: float, device_us: float, ghz: float = 2.0):
        self.host_us, self.device_us, self.cycles_per_us = host_us, device_us, ghz * 1e3
        self.host = 0.0  # us: the host's clock
        self.done = 0.0  # us: when the last queued item ends on the device
        self.replays = 0
        gpu = self

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self):
                self.t = gpu._enqueue(0.0)

            def query(self):
                return self.t <= gpu.host

            def elapsed_time(self, end):
                return (end.t - self.t) / 1e3  # ms, as CUDA events

        self.Event = Event

    def _enqueue(self, us: float) -> float:
        self.done = max(self.done, self.host) + us
        return self.done

    def _sleep(self, cycles: int) -> None:
        self._enqueue(cycles / self.cycles_per_us)

    def synchronize(self) -> None:
        self.host = max(self.host, self.done)

    def clock(self) -> float:
        return self.host / 1e6

    def replay(self) -> None:
        self.host += self.host_us  # the launch costs the host this much, then the replay is queued
        self._enqueue(self.device_us)
        self.replays += 1


def test_hot_replays_fill_a_window_within_bounds():
    from kernels.hot_timing import HOT_MAX_REPLAYS, HOT_MIN_REPLAYS, hot_replays, spin_cycles

    assert hot_replays(2.0) == 500  # 1 ms / 2 us
    assert hot_replays(0.1) == HOT_MAX_REPLAYS == 1000 and hot_replays(0.0) == HOT_MAX_REPLAYS
    assert hot_replays(300.0) == HOT_MIN_REPLAYS == 10  # 1 ms / 300 us is 4: too few
    assert spin_cycles(1000.0, 2000.0) == int((1.5 * 1000 + 50) * 2000)


def test_hot_time_is_device_time_even_when_the_host_launches_slower():
    from kernels.hot_timing import HotTimer

    # The digits MLP's case: a replay costs the host 3 us and the device 2. Back to back without a spin
    # kernel the device would wait for the host (3 us a replay); with it, every replay is queued in time.
    gpu = _FakeGPU(host_us=3.0, device_us=2.0)
    timer = HotTimer(cuda=gpu, clock=gpu.clock)
    res = timer(gpu.replay)
    assert timer.cycles_per_us() == pytest.approx(2000.0)  # measured from the fake's 2 GHz spin
    assert res["hot_replays"] == 500  # 1 ms at the first estimate's 2 us
    assert res["hot_us"] == pytest.approx(2.0) and res["hot_host_bound"] is False
    assert gpu.replays == 3 + 10 + 5 * 500  # warm-up, estimate, 5 windows


def test_hot_time_says_when_the_host_set_the_pace(monkeypatch):
    from kernels import hot_timing
    from kernels.hot_timing import HotTimer

    monkeypatch.setattr(hot_timing, "HOT_SPIN_MARGIN", 0.0)  # no spin before the windows
    monkeypatch.setattr(hot_timing, "HOT_SPIN_EXTRA_US", 0.0)
    gpu = _FakeGPU(host_us=3.0, device_us=2.0)
    res = HotTimer(cuda=gpu, clock=gpu.clock)(gpu.replay)
    assert res["hot_us"] == pytest.approx(3.0, rel=0.01) and res["hot_host_bound"] is True
    # A device slower than the host needs no spin: the queue stays ahead by itself.
    gpu = _FakeGPU(host_us=3.0, device_us=20.0)
    res = HotTimer(cuda=gpu, clock=gpu.clock)(gpu.replay)
    assert res["hot_us"] == pytest.approx(20.0, rel=0.01) and res["hot_replays"] == 50
    assert res["hot_host_bound"] is False


def _hot_results() -> dict:
    """A CUDA run's results with hot times: ours 4 us cold / 2 hot, cuBLASLt 5 / 4, eager 9 / 7 (host-bound)."""
    results = _fake_results(1e-3)
    results["meta"]["timing"] = {
        "l2_clear": "read", "wall_interleaved": True,
        "hot": {"window_us": 1000.0, "windows": 5, "min_replays": 10, "max_replays": 1000, "spin_margin": 1.5},
    }  # fmt: skip

    def res(cold, hot, host_bound=False):
        graph = {"device_us": cold, "hot_us": hot, "hot_host_bound": host_bound, "wall_us": 30.0}
        graph.update(err=1e-4, finite=True, bad=False)
        return {"graph": graph, "plain": dict(graph, device_us=cold + 1, hot_us=None)}

    results["layers"][0]["providers"] = {"eager": res(9.0, 7.0, True), "cublaslt": res(5.0, 4.0), "ours": res(4.0, 2.0)}
    return results


def test_report_shows_hot_beside_cold():
    results = _hot_results()
    md = markdown(results)
    assert "Hot: the same graph replayed back to back" in md and "median of 5 windows" in md
    head = next(line for line in md.splitlines() if line.startswith("| M×K×N"))
    assert "| ours / cublaslt (device) | ours / cublaslt (hot) |" in head
    row = next(line for line in md.splitlines() if line.startswith("| 64×256×128"))
    assert "| 4.00 / 2.00 / 5.00 / 30.0 |" in row  # ours: graph cold / graph hot / plain cold / wall
    assert "| 9.00 / 7.00 **host** / 10.0 / 30.0 |" in row  # eager's hot window was paced by the host
    assert "| 0.80x | 0.50x |" in row  # 4 / 5 cold, 2 / 4 hot
    assert "hot o/lt" in summary(results) and " 0.50x " in summary(results)
    results["meta"]["timing"].pop("hot")  # written before hot timing: its tables as they were then
    md = markdown(results)
    assert "Hot:" not in md and "(hot)" not in md and "Device time: median" in md
    assert "graph device / plain device / wall" in md and "| 4.00 / 5.00 / 30.0 |" in md


def test_hot_and_cnn_targets():
    """Issue 19 (hot: digits MLP >= 1.3x the best anchor, wide MLP >= 1x and 1.5x at batch 1) and issue 20
    (digits CNN >= 2x eager and >= the best anchor, cold and hot; the wider CNN's convs <= 1.10x cuDNN)."""
    from bench.kernels.targets import checks

    results = _hot_results()
    results["layers"] = []
    skipped = {"skipped": "skipped: --time-limit"}
    models = {
        # hot: best anchor compile 13 / ours 10 = 1.3: met (exactly); compile-max was skipped: named
        ("digits-mlp", 1, "float16"): {"compile": _cell(15, 60, 13), "compile-max": skipped, "ours": _cell(8, 7, 10)},
        ("digits-mlp", 1, "bfloat16"): {"linear": _cell(16, 50, 12), "ours": _cell(8, 7, 10)},  # 1.2: not met
        ("wide-mlp", 1, "float16"): {"linear": _cell(33, 80, 30), "ours": _cell(21, 18, 21)},  # 1.43 < 1.5
        ("wide-mlp", 256, "float16"): {"linear": _cell(42, 60, 40), "ours": _cell(44, 43, 40)},  # 1.0: met
        # cold: eager 30 / ours 12 = 2.5, anchor linear 20 / 12; hot: eager 20 / 11 = 1.82 < 2, linear 9 / 11 < 1
        ("digits-cnn", 32, "float16"): {
            "eager": _cell(30, 90, 20), "linear": _cell(20, 80, 9), "ours": _cell(12, 10, 11),
        },
    }  # fmt: skip
    results["models"] = [
        {"model": m, "batch": b, "dtype": d, "floor_us": 1.0, "providers": ps} for (m, b, d), ps in models.items()
    ]
    results["convs"] = [
        {
            "layer": "64→64 32×32", "batch": 32, "dtype": "float16", "floor_us": 5.0,
            # cold: the faster cuDNN is cudnn-fused 20, ours 21.5 <= 22: met; hot: cudnn 10, ours 12 > 11: not met
            "providers": {"cudnn": _cell(25, 40, 10), "cudnn-fused": _cell(20, 40, 15), "ours": _cell(21.5, 40, 12)},
        }
    ]  # fmt: skip
    rows = {(c.target, c.case): c for c in checks(results)}
    d16 = rows[("hot, digits MLP: best anchor (compile) / ours", "digits-mlp batch 1 float16 (without compile-max: "
                "not measured)")]  # fmt: skip
    assert d16.met is True and d16.measured == "1.30x"
    d16b = rows[("hot, digits MLP: best anchor (linear) / ours", "digits-mlp batch 1 bfloat16")]
    assert d16b.met is False and d16b.gap == "needs 1.08x"  # 1.3 / 1.2
    w1 = rows[("hot, wide MLP: best anchor (linear) / ours", "wide-mlp batch 1 float16")]
    assert w1.met is False and w1.goal == ">= 1.50x"
    w256 = rows[("hot, wide MLP: best anchor (linear) / ours", "wide-mlp batch 256 float16")]
    assert w256.met is True and w256.goal == ">= 1.00x"
    cnn = "digits-cnn batch 32 float16"
    assert rows[("cold, digits CNN: eager / ours", cnn)].measured == "2.50x"
    assert rows[("cold, digits CNN: eager / ours", cnn)].met is True
    assert rows[("hot, digits CNN: eager / ours", cnn)].met is False
    assert rows[("cold, digits CNN: best anchor (linear) / ours", cnn)].met is True
    assert rows[("hot, digits CNN: best anchor (linear) / ours", cnn)].met is False
    conv = "wider CNN conv 64→64 32×32 batch 32 float16"
    cold_conv = rows[("cold, wider CNN conv vs cuDNN", conv)]
    assert cold_conv.met is True and cold_conv.goal == "<= 22.0 us (1.10x cudnn-fused)"
    hot_conv = rows[("hot, wider CNN conv vs cuDNN", conv)]
    assert hot_conv.met is False and hot_conv.gap == "needs 1.09x"  # 12 / 11
    assert len([t for t, _ in rows if t.startswith(("hot", "cold"))]) == 4 + 4 + 2  # issues 19 and 20


def test_cold_times_are_compared_with_an_earlier_run():
    from bench.kernels.targets import compare_cold

    old = _fake_results(1e-3)
    old["layers"][0]["providers"] = {"ours": _cell(10.0, 20.0)}
    old["models"] = [{"model": "digits-mlp", "batch": 1, "dtype": "float16", "providers": {"ours": _cell(8.0, 7.0)}}]
    new = _fake_results(1e-3)
    new["layers"][0]["providers"] = {"ours": _cell(10.3, 20.0)}  # +3%: still met
    new["models"] = [
        {"model": "digits-mlp", "batch": 1, "dtype": "float16", "providers": {"ours": _cell(8.4, 7.0)}},  # +5%
        {"model": "digits-mlp", "batch": 1, "dtype": "bfloat16", "providers": {"ours": _cell(9.0, 7.0)}},  # new
    ]
    rows = compare_cold(new, old)
    assert [(c.case, c.met) for c in rows] == [
        ("64 256 128 float16 relu", True),
        ("digits-mlp 1 float16", False),
    ]
    assert rows[1].gap == "needs 1.02x"  # 8.4 / (8 * 1.03)


def test_cold_times_relative_to_a_steady_anchor_of_each_run():
    """relative=True: ours / cuBLASLt (layers) or / linear (models) of the same run against the earlier run's ratio,
    so a machine 5% slower everywhere is not a regression, and ours slower against an unchanged cuBLASLt is."""
    from bench.kernels.targets import compare_cold

    old = _fake_results(1e-3)
    old["layers"][0]["providers"] = {"ours": _cell(10.0, 20.0), "cublaslt": _cell(12.0, 20.0)}
    old["models"] = [{"model": "digits-mlp", "batch": 8, "dtype": "float16",
                      "providers": {"ours": _cell(8.0, 7.0), "linear": _cell(30.0, 7.0)}}]  # fmt: skip
    new = _fake_results(1e-3)
    new["layers"][0]["providers"] = {"ours": _cell(10.5, 20.0), "cublaslt": _cell(12.6, 20.0)}  # both +5%
    new["models"] = [{"model": "digits-mlp", "batch": 8, "dtype": "float16",
                      "providers": {"ours": _cell(8.4, 7.0), "linear": _cell(30.0, 7.0)}}]  # fmt: skip  # ours +5%
    raw = compare_cold(new, old)
    assert [c.met for c in raw] == [False, False]
    rel = compare_cold(new, old, relative=True)
    assert [(c.target, c.met) for c in rel] == [
        ("cold / cublaslt vs the earlier run's (layers)", True),
        ("cold / linear vs the earlier run's (models)", False),
    ]
    assert rel[0].measured == "0.833" and rel[1].gap == "needs 1.02x"  # 0.28 / (0.2667 * 1.03)
    del new["layers"][0]["providers"]["cublaslt"]
    assert compare_cold(new, old, relative=True)[0].met is None  # no anchor: not measured


def test_cnn_models_are_built_measured_and_run_like_the_service(tmp_path):
    """The digits CNN (shipped) and the wider CNN (built here, fixed seed): dims, floor terms, and every CPU
    provider's forward against the float64 reference; ours-eager is the fused Executor (interpreted)."""
    from bench.kernels.models import (
        ModelProviders,
        bound_steps,
        bytes_and_flops,
        forward,
        load_named,
        model_dims,
        reference_forward,
    )
    from bench.kernels.timing import normwise_error
    from kernels.runtime import interpreting

    cpu = torch.device("cpu")
    digits = load_named("digits-cnn", tmp_path, 0)
    assert model_dims(digits) == [[1, 8, 8], [16, 8, 8], [16, 8, 8], [16, 4, 4], 64, 10]
    # conv 16x1x9 and 16x16x9 weights at 8x8 outputs, then 256 -> 64 -> 10: 173,696 multiply-adds an image
    assert bytes_and_flops(digits, 1, "float16")[1] == 2 * (144 * 64 + 2304 * 64 + 256 * 64 + 640)
    wide = load_named("wide-cnn", tmp_path, 0)
    assert model_dims(wide)[:4] == [[3, 32, 32], [64, 32, 32], [64, 32, 32], [64, 16, 16]]
    assert model_dims(wide)[-3:] == [[128, 4, 4], 256, 10]
    nbytes, flops = bytes_and_flops(wide, 64, "float16")
    assert 130e6 < flops / 64 < 140e6 and 1.5e6 < nbytes - 2 * 64 * (3 * 32 * 32 + 10) < 1.7e6
    again = load_named("wide-cnn", tmp_path / "again", 0)  # fixed seed: the same weights every run
    assert all(torch.equal(wide.tensors[k], again.tensors[k]) for k in wide.tensors)

    gen = torch.Generator().manual_seed(5)
    for model, batch in ((digits, 3), (wide, 1)):
        steps = bound_steps(model, cpu, torch.float32)
        x = torch.randn((batch, *model.input_shape), generator=gen)
        ref = reference_forward(steps, x)
        for how in ("eager", "linear"):
            err, finite = normwise_error(forward(steps, x, how), ref)
            assert finite and err < 1e-5, (model.name, how, err)
        if not interpreting():  # compiled kernels run on CUDA only: the GPU quick run checks ours there
            continue
        prep = ModelProviders(model, cpu, torch.float32, max_batch_size=4).prepare("ours-eager", x)
        err, finite = normwise_error(prep.fn(), ref)
        assert finite and err < 1e-5, (model.name, "ours-eager", err)
        assert prep.plain_only and prep.compile_s > 0


def test_sections_share_the_time_by_what_their_cases_cost():
    from bench.kernels.budget import SECTION_CASE_S, section_shares

    shares = section_shares({"layers": 36, "convs": 12, "models": 25})  # the run's order
    cost = {"layers": 36 * SECTION_CASE_S["layers"], "convs": 12 * SECTION_CASE_S["convs"]}
    cost["models"] = 25 * SECTION_CASE_S["models"]
    # Each share is of the time left when the section starts: the last section takes all of the rest.
    assert shares["layers"] == pytest.approx(cost["layers"] / sum(cost.values()))
    assert shares["convs"] == pytest.approx(cost["convs"] / (cost["models"] + cost["convs"]))
    assert shares["models"] == 1.0
    assert section_shares({"layers": 36, "models": 0, "convs": 0}) == {"layers": 1.0, "models": 0.0, "convs": 0.0}
    # The 2026-11-23 split, layers then 10 model cases, comes back: 252 / (252 + 270) = 48% (was 0.47).
    assert section_shares({"layers": 36, "models": 10, "convs": 0})["layers"] == pytest.approx(0.483, abs=1e-3)


def test_a_single_replay_is_timed_alone():
    from kernels.hot_timing import HotTimer

    gpu = _FakeGPU(host_us=30.0, device_us=2.0)  # a slow host: the spin still hides the launch
    timer = HotTimer(cuda=gpu, clock=gpu.clock)
    assert timer.single(gpu.replay, reps=5) == pytest.approx(2.0)
    assert gpu.replays == 3 + 1 + 5


def test_runs_that_split_the_sections_merge_into_one_report(tmp_path):
    from bench.kernels.report import main as rerender
    from bench.kernels.report import merge

    layers = _hot_results()
    layers["meta"].update(slug="h100", command="bench --sections layers", elapsed_s=300.0, started_utc="t0")
    models = _hot_results()
    models["layers"] = []
    models["meta"].update(slug="h100", command="bench --sections convs,models", elapsed_s=250.0, started_utc="t1")
    models["models"] = [
        {"model": "digits-mlp", "batch": 1, "dtype": "float16", "floor_us": 0.04, "error_bound": 1e-2,
         "providers": {"linear": _cell(16, 50, 12), "ours": _cell(8, 7, 6)}},
    ]  # fmt: skip
    models["convs"] = []
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "kernels_h100.json").write_text(json.dumps(layers))
    (tmp_path / "b" / "kernels_h100.json").write_text(json.dumps(models))
    out = tmp_path / "merged"
    assert rerender([str(tmp_path / d / "kernels_h100.json") for d in ("a", "b")] + ["--out", str(out)]) == 0
    merged = json.loads((out / "kernels_h100.json").read_text())
    assert len(merged["layers"]) == 1 and len(merged["models"]) == 1 and merged["meta"]["elapsed_s"] == 550.0
    assert [m["command"] for m in merged["meta"]["merged_from"]] == [
        "bench --sections layers",
        models["meta"]["command"],
    ]
    md = (out / "kernels_h100.md").read_text()
    assert "| 64×256×128 |" in md and "| digits-mlp | 1 |" in md
    models["meta"]["gpu"] = "NVIDIA H100 80GB HBM3"  # the fakes say H200
    with pytest.raises(ValueError, match="gpu differs"):
        merge([layers, models])


def test_every_graph_cell_and_only_those_get_a_hot_time(monkeypatch):
    """measure() on "cuda" with the device parts faked: plain cells get cold and wall, graph cells (captured
    here, or the provider's own graph) also hot, timed on the replay; plain-only providers no graph at all."""
    from bench.kernels import timing as kernel_timing
    from bench.kernels.timing import Prepared, Timing, measure

    hot_calls: list = []

    class Graph:
        def __init__(self, out):
            self.out = out

        def replay(self):  # writes the output, as a real replay would after the NaN poisoning
            self.out.fill_(1.0)

    def fake_capture(fn):
        out = fn()
        return Graph(out), out

    monkeypatch.setattr(kernel_timing, "capture", fake_capture)
    monkeypatch.setattr(kernel_timing, "device_us", lambda fn, timing: 7.0)
    monkeypatch.setattr(kernel_timing, "synchronize", lambda device: None)
    monkeypatch.setattr(kernel_timing, "hot_us", lambda fn: hot_calls.append(fn) or {"hot_us": 3.0, "hot_replays": 10})
    cuda, ref = torch.device("cuda"), torch.ones(2, 2, dtype=torch.float64)

    def run(prep):
        return measure(prep, ref, cuda, Timing(0, 0, 0.0), 1e-2, defer=[])

    plain_and_graph = run(Prepared(lambda: torch.ones(2, 2)))
    assert plain_and_graph["plain"]["device_us"] == 7.0 and "hot_us" not in plain_and_graph["plain"]
    assert plain_and_graph["graph"]["hot_us"] == 3.0 and plain_and_graph["graph"]["hot_replays"] == 10
    assert not plain_and_graph["graph"]["bad"] and plain_and_graph["graph"]["err"] == 0.0
    assert len(hot_calls) == 1 and getattr(hot_calls[0], "__self__", None).__class__ is Graph  # graph.replay

    graphed = run(Prepared(lambda: torch.ones(2, 2), graphed=True))  # ours: the GraphedExecutor's replay
    assert set(graphed) == {"graph"} and graphed["graph"]["hot_us"] == 3.0
    plain_only = run(Prepared(lambda: torch.ones(2, 2), plain_only=True))  # ours-eager
    assert set(plain_only) == {"plain"} and "hot_us" not in plain_only["plain"]
    assert len(hot_calls) == 2


def test_resnets_are_imported_from_onnx_and_their_anchors_run_the_torch_module(tmp_path, monkeypatch):
    """ResNet-18 on 3x32x32 images (the same layers as at 224x224, smaller maps; bench/resnets.py): the ONNX
    file imported as a user's, its dims and flops, and every anchor (the module NCHW, channels_last, with BN
    folded) and ours-eager (the fused Executor, interpreted) against the module in float64."""
    from bench import resnets
    from bench.kernels.models import ModelProviders, NotAvailable, bytes_and_flops, load_with_module, model_dims
    from bench.kernels.timing import normwise_error
    from kernels.runtime import interpreting

    monkeypatch.setattr(resnets, "IMAGE", (3, 32, 32))
    model, module = load_with_module("resnet18", tmp_path, 0)
    dims = model_dims(model)
    # the stem conv halves 32 to 16, its max pool to 8; stages of 64, 128, 256, 512 channels at 8, 4, 2, 1
    assert dims[:3] == [[3, 32, 32], [64, 16, 16], [64, 8, 8]] and dims[-3:] == [[512, 1, 1], [512, 1, 1], 1000]
    assert len(dims) == 1 + 20 + 2 + 1  # input, 20 convs (17 + 3 shortcuts), 2 pools, the linear head
    convs = [t for k, t in model.tensors.items() if t.dim() == 4]
    macs = sum(t.numel() * s * s for t, s in zip(convs, [16] + [8] * 4 + [4] * 5 + [2] * 5 + [1] * 5, strict=True))
    assert bytes_and_flops(model, 2, "float16")[1] == 2 * 2 * (macs + 512 * 1000)
    cpu = torch.device("cpu")
    providers = ModelProviders(model, cpu, torch.float32, max_batch_size=2, module=module)
    x = torch.randn((2, *model.input_shape), generator=torch.Generator().manual_seed(3))
    ref = providers.reference(x)
    assert ref.dtype == torch.float64 and ref.shape == (2, 1000) and ref.std() > 0.05
    names = ("eager", "eager-cl", "eager-folded") + (("ours-eager",) if interpreting() else ())
    for name in names:
        err, finite = normwise_error(providers.prepare(name, x).fn(), ref)
        assert finite and err < 1e-5, (name, err)
    with pytest.raises(NotAvailable):
        providers.prepare("linear", x)
    plain = ModelProviders(load_with_module("digits", tmp_path, 0)[0], cpu, torch.float32, max_batch_size=2)
    with pytest.raises(NotAvailable):
        plain.prepare("eager-folded", torch.randn(2, 64))


def test_a_resnets_steps_are_timed_fused_against_unfused_under_the_same_names(tmp_path, monkeypatch):
    """ModelProviders.step_times on ResNet-18 at 3x32x32 (the CPU: wall time around each step of an eager forward):
    one row per step of the plan, named as the service's `kernel` label, both modes timed; and the report's table."""
    from bench import resnets
    from bench.kernels.models import ModelProviders, load_with_module
    from bench.kernels.report import _step_tables
    from kernels.runtime import interpreting

    if not interpreting():
        pytest.skip("the CPU path of step_times; the GPU's runs in bench kernels")
    monkeypatch.setattr(resnets, "IMAGE", (3, 32, 32))
    model, module = load_with_module("resnet18", tmp_path, 0)
    providers = ModelProviders(model, torch.device("cpu"), torch.float32, max_batch_size=1, module=module)
    rows = providers.step_times(torch.randn(1, *model.input_shape), reps=1)
    names = [r["step"] for r in rows]
    assert names[0] == "conv2d_0_bn_relu" and "conv2d_2_bn_add_relu" in names and names[-1] == "linear_0"
    # every step that launches work: 20 convs, 2 pools, the linear head (the flatten is a view, not timed)
    assert len(names) == 23 and "flatten_0" not in names
    assert all(r["fused_us"] > 0 and r["unfused_us"] > 0 for r in rows)
    case = {"model": "resnet18", "dtype": "float32", "batch": 1, "steps": rows}
    lines = _step_tables([case, {**case, "batch": 4}], cuda=False)
    assert lines[0] == "## Models: each fused step"
    assert sum(line.startswith("resnet18, float32, batch") for line in lines) == 2
    assert sum(line.startswith("| conv2d_2_bn_add_relu |") for line in lines) == 2
