"""The model zoo (bench/zoo): torchvision's classification families, defined in bench/zoo/families.py, at their tiny
size, exported by torch's TorchScript and dynamo ONNX exporters and by export_module (torch.export), imported as the
service imports them, and checked in fp32 on the CPU against onnxruntime on the same file (the torch.export route:
against the module): the unfused mode for every (family, exporter), within 1e-4 of the largest logit and with every
top-1 the same over 8 random images; the fused mode (Triton's interpreter) once per family, through the first
exporter of SERVED, on 1 of them.

SERVED lists the (family, exporter) pairs that import and agree today; a pair in it that is refused fails (a
regression). Every other pair must be refused with a message that names the node and its op type (the importer's
worklist: `fusedserve bench zoo` groups them by op); one that imports instead must agree, and a warning says to
add it to SERVED. One test per family, so that its three exports (the dynamo one ~3-10 s on 2 cores) are made once
on whichever xdist worker runs it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import warnings

import pytest
import torch

from bench.zoo import check, cli, exporters, families, report
from tests.server import REPO

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")  # torch.onnx's dynamo exporter needs it

pytestmark = pytest.mark.timeout(900)

# What imports and agrees today (tiny size, at bbec8ad; `fusedserve bench zoo` measures it): every pair. A pair that
# stops importing is a regression; one that a change of the exporters makes the importer refuse goes here, with why.
REFUSED_TODAY: set[tuple[str, str]] = set()
SERVED = {(f, e) for f in families.FAMILIES for e in exporters.EXPORTERS} - REFUSED_TODAY
ROWS, FUSED_ROWS = 8, 1  # the fused mode's one image: Triton's interpreter takes ~2-20 s a family

# torchvision's parameter counts (its weights' `num_params`; Inception v3's without the auxiliary classifier, which
# an eval export never runs: 27,161,264 - 3,326,696). The full-size families must match them exactly.
TORCHVISION_PARAMS = {
    "alexnet": 61_100_840, "vgg11": 132_863_336, "vgg11_bn": 132_868_840, "resnet18": 11_689_512,
    "resnet50": 25_557_032, "resnext50_32x4d": 25_028_904, "wide_resnet50_2": 68_883_240, "squeezenet1_1": 1_235_496,
    "densenet121": 7_978_856, "googlenet": 6_624_904, "inception_v3": 23_834_568, "mobilenet_v2": 3_504_872,
    "mobilenet_v3_small": 2_542_856, "mobilenet_v3_large": 5_483_032, "mnasnet1_0": 4_383_312,
    "shufflenet_v2_x1_0": 2_278_604, "efficientnet_b0": 5_288_548, "efficientnet_v2_s": 21_458_488,
    "regnet_x_400mf": 5_495_976, "regnet_y_400mf": 4_344_144, "convnext_tiny": 28_589_128,
}  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _registry_once():
    with exporters.onnx_registry_once():  # the dynamo exporter's registry built once, not per export (exporters.py)
        yield


@pytest.mark.parametrize("family", list(families.FAMILIES))
def test_family_imports_and_agrees_or_names_the_refused_node(family, tmp_path):
    built = check.build(family, "tiny", tmp_path, exporters.EXPORTERS)
    fused_on = next((e for e in exporters.EXPORTERS if (family, e) in SERVED), None)
    problems = []
    for exporter in exporters.EXPORTERS:
        modes = ("unfused", "fused") if exporter == fused_on else ("unfused",)
        rec = check.check(built, exporter, modes, ROWS, FUSED_ROWS)
        where = f"{family} ({exporter})"
        if not rec["exported"]:
            problems.append(f"{where}: the export failed: {rec['export_error']}")
        elif not rec["imported"]:
            refused = rec["refusal"]
            if (family, exporter) in SERVED:
                problems.append(f"{where} is in SERVED but was refused: {refused['message']}")
            elif not (refused["node"] and refused["op"]):
                problems.append(f"{where}: the refusal names no node and op type: {refused['message']}")
        else:
            for mode, m in rec["modes"].items():
                if not m.get("ok"):
                    problems.append(f"{where}, {mode}: {json.dumps(m)}")
            if (family, exporter) not in SERVED and not problems:
                warnings.warn(f"{where} now imports and agrees: add it to SERVED in tests/test_zoo.py", stacklevel=1)
    assert not problems, "\n".join(problems)


def test_full_sizes_have_torchvisions_parameter_counts():
    """Every full-size family has torchvision's parameter count, to the parameter (built on the meta device)."""
    with torch.device("meta"):
        counts = {n: sum(p.numel() for p in f.full(1000).parameters()) for n, f in families.FAMILIES.items()}
    assert counts == TORCHVISION_PARAMS


def test_regnet_stages_follow_the_design_space():
    """RegNet's quantised widths: torchvision's 400MF models' stage widths, depths and group widths."""
    assert families.regnet_stages(**families.REGNET_X_400MF) == [(32, 1, 16), (64, 2, 16), (160, 7, 16), (400, 12, 16)]
    assert families.regnet_stages(**families.REGNET_Y_400MF) == [(48, 1, 8), (104, 3, 8), (208, 6, 8), (440, 6, 8)]


def test_tiny_models_are_calibrated_and_deterministic():
    """BatchNorm's running statistics are measured (not 0 and 1), and a family, size and seed give one model."""
    a, b = families.build("resnet18", "tiny", seed=3), families.build("resnet18", "tiny", seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    bn = a.bn1
    assert not torch.allclose(bn.running_var, torch.ones_like(bn.running_var))
    assert not torch.allclose(bn.running_mean, torch.zeros_like(bn.running_mean))


def test_the_cli_mirrors_the_families_and_exporters_and_is_registered():
    from fusedserve.cli import BENCHMARKS

    assert tuple(families.FAMILIES) == cli.FAMILIES
    assert exporters.EXPORTERS == cli.EXPORTERS
    from bench.zoo import gpu

    assert gpu.PROVIDERS == cli.PROVIDERS
    assert BENCHMARKS["zoo"] == "bench.zoo.cli"
    parser = argparse.ArgumentParser()
    importlib.import_module(BENCHMARKS["zoo"]).add_arguments(parser)
    args = parser.parse_args(["--families", "resnet18,convnext_tiny", "--modes", "unfused"])
    assert args.families == ("resnet18", "convnext_tiny") and args.modes == ("unfused",)
    with pytest.raises(SystemExit):
        parser.parse_args(["--families", "resnet19"])


@pytest.mark.parametrize(
    ("message", "node", "op"),
    [
        ("/tmp/x/m.onnx: node '/features/gate/HardSigmoid' (HardSigmoid): HardSigmoid is supported only as part of",
         "'/features/gate/HardSigmoid'", "HardSigmoid"),
        ("/tmp/x/m.onnx: node 'node_transpose' (Transpose); node 'node_Split_394' (Split) and 1 more: these ops are "
         "not supported", "'node_transpose'", "Transpose"),
        ("node 'relu_' (aten.relu_.default): not supported", "'relu_'", "aten.relu_.default"),
        ("/tmp/x/m.onnx: ops[3] (concat '/features/Concat'): reads 1 tensor(s) ['a']; concat reads at least 2",
         "'/features/Concat'", "concat"),
        ("/tmp/x/m.onnx: node #4 (output 'y') (Foo, domain com.x): these ops are not supported", "#4 (output 'y')",
         "Foo"),
        ("the module returns 2 values", None, None),
    ],
)  # fmt: skip
def test_refusals_are_parsed_for_their_node_and_op(message, node, op):
    got = check.refusal(message, "/tmp/x/m.onnx" if message.startswith("/tmp") else None)
    assert (got["node"], got["op"]) == (node, op)
    assert "/tmp/x/" not in got["message"]
    assert got["ops"] == (["Transpose", "Split"] if op == "Transpose" else [op] if op else [])


def _record(family, exporter, **kw):
    base = {"family": family, "title": family.upper(), "size": "tiny", "image": [3, 32, 32], "exporter": exporter,
            "export_s": 0.5, "exported": True}  # fmt: skip
    return {**base, **kw}


def _records():
    plan = {"ops": 9, "steps": 5, "fused": 4, "torch": 1, "views": 0, "torch_parts": {"concat": 1}}
    good = {"rel_err": 1e-6, "top1": 1.0, "rows": 8, "ok": True, "seconds": 0.1}
    mul = {"message": "node 'm' (Mul): x", "node": "'m'", "op": "Mul"}
    return [
        _record("a", "torchscript", imported=True, load_s=0.1, plan=plan, modes={"unfused": good, "fused": good}),
        _record("a", "dynamo", imported=False, refusal=mul),
        _record("b", "torchscript", imported=False, refusal=mul),
        _record("b", "dynamo", imported=True, load_s=0.1, plan=plan, modes={"unfused": {**good, "ok": False}}),
        _record("b", "torch.export", exported=False, imported=False, export_error="RuntimeError: no"),
    ]


def test_the_report_groups_refusals_by_op_and_flags_disagreement():
    records = _records()
    assert [report.verdict(r) for r in records] == ["ok", "refused (Mul)", "refused (Mul)", "BAD", "export failed"]
    groups = report.worklist(records)
    assert list(groups) == ["Mul", "(export failed)"] and len(groups["Mul"]) == 2
    md = report.check_md({"meta": {"size": "tiny", "device": "cpu", "dtype": "float32"}, "records": records})
    assert "**Mul** (2): a (dynamo), b (torchscript)" in md and "**BAD**" in md
    assert "1 of 5 (family, exporter) pairs imported and agree; 1 imported but DISAGREE" in report.summary(records)


def test_the_gpu_table_compares_ours_with_the_best_anchor():
    cases = [{"family": "a", "title": "A", "batch": 256, "ready_s": 12.5, "providers": {
        "ours": {"graph": {"hot_us": 100.0, "bad": False}}, "eager-cl": {"graph": {"hot_us": 150.0}},
        "compile": {"graph": {"hot_us": 120.0}}, "ort": {"na": "absent"}}}]  # fmt: skip
    table = report.gpu_table(cases)
    assert "| A | 256 | 100 | 150 | 120 | n/a | 1.20x vs compile | 12.5 |" in table
    # onnxruntime run by run (no graph of its own): its device time, marked, and never "best" against hot replays;
    # a family ours did not time: "not timed"; past the bound flagged only where eager's error set it
    cases = [
        {"family": "b", "title": "B", "batch": 1, "providers": {
            "ours": {"graph": {"hot_us": 90.0, "bad": False}}, "eager-cl": {"graph": {"hot_us": 150.0, "err": 1e-3}},
            "ort": {"plain": {"device_us": 80.0, "bad": True}}}},
        {"family": "c", "title": "C", "batch": 1, "providers": {"ort": {"graph": {"hot_us": 70.0, "bad": True}}}},
    ]  # fmt: skip
    table = report.gpu_table(cases)
    assert "| B | 1 | 90.0 | 150 | 80.0 launched **BAD** | 1.67x vs eager-cl |" in table
    assert "| C | 1 | not timed | not timed | 70.0 | — | — | — |" in table


def test_the_docs_section_replaces_itself_and_keeps_the_rest(tmp_path):
    doc = tmp_path / "models.md"
    doc.write_text("# Models\n\nHand-written text.\n")
    check_results = {"meta": {"size": "tiny", "torch": "2", "onnxruntime": "1"}, "records": _records()}
    timing = {"meta": {"gpu": "NVIDIA H100", "dtype": "float16"}, "cases": [
        {"family": "a", "title": "A", "batch": 1, "ready_s": 12.5, "providers": {
            "ours": {"graph": {"hot_us": 100.0}}, "eager-cl": {"graph": {"hot_us": 150.0}}, "ort": {"na": "absent"}}},
    ]}  # fmt: skip
    report.update_docs(doc, report.render_docs(check_results, timing))
    once = doc.read_text()
    report.update_docs(doc, report.render_docs(check_results, timing))
    assert doc.read_text() == once
    assert once.startswith("# Models\n\nHand-written text.\n\n" + report.DOCS_BEGIN)
    assert "| A | 1 | 100 | 150 | n/a | 1.50x vs eager-cl | 12.5 |" in once
    assert "ok, 4 fused / 1 torch" in once


def test_the_command_writes_json_and_markdown(tmp_path, capsys):
    from bench.zoo.cli import main

    out = tmp_path / "out"
    assert main(["--families", "alexnet", "--exporters", "torchscript", "--modes", "unfused", "--out", str(out)]) == 0
    results = json.loads((out / "zoo_cpu.json").read_text())
    (rec,) = results["records"]
    assert rec["imported"] and rec["modes"]["unfused"]["ok"] and rec["plan"]["fused"] > 0
    assert "AlexNet" in (out / "zoo_cpu.md").read_text()
    assert "1 of 1 (family, exporter) pairs imported and agree" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.gpu_timing
def test_the_gpu_mode_times_a_tiny_family(tmp_path):
    from bench.zoo.cli import main

    argv = ["--gpu", "--size", "tiny", "--families", "resnet18", "--batches", "1,4", "--out", str(tmp_path)]
    assert main(argv) == 0
    (path,) = tmp_path.glob("zoo_*.json")
    cases = json.loads(path.read_text())["cases"]
    assert [c["batch"] for c in cases] == [1, 4]
    for c in cases:
        assert c["providers"]["ours"]["graph"]["hot_us"] > 0 and not c["providers"]["ours"]["graph"]["bad"]
        assert c["ready_s"] > 0


def test_export_writes_files_the_service_imports(tmp_path, capsys):
    """`--export DIR`: each family as DIR/<family>.onnx (TorchScript exporter, dynamic batch), which the importer takes
    as a user's file; nothing checked or timed."""
    from service.model.loader import load_model

    assert cli.main(["--export", str(tmp_path), "--families", "squeezenet1_1", "--size", "tiny"]) == 0
    path = tmp_path / "squeezenet1_1.onnx"
    assert f"wrote {path}" in capsys.readouterr().out and sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    model = load_model(path)
    assert model.input_shape == families.image_shape("squeezenet1_1", "tiny")


def test_a_gpu_run_replaces_only_what_it_timed(tmp_path, monkeypatch):
    """The timing run's merge into the results file (bench/zoo/gpu.execute), with the timing itself replaced: a batch
    this run times replaces its case, a batch it does not time (--batches) keeps its own; a family that fails loses
    its cases and says why; and until a family is timed its earlier cases stay in the file (a run cut off mid-way
    loses none)."""
    import copy

    from bench.zoo import gpu

    committed = json.loads((REPO / "bench/results/h200/zoo_h200.json").read_text())
    mine = {"meta": committed["meta"], "not_run": {}, "cases": [
        copy.deepcopy(c) for c in committed["cases"] if c["family"] in ("resnet18", "alexnet")]}  # fmt: skip
    assert sorted((c["family"], c["batch"]) for c in mine["cases"]) == [
        ("alexnet", 1), ("alexnet", 256), ("resnet18", 1), ("resnet18", 256)]  # fmt: skip
    (tmp_path / "zoo_h200.json").write_text(json.dumps(mine))
    on_disk = []

    def timed(args, family, workdir):
        on_disk.append({c["family"] for c in json.loads((tmp_path / "zoo_h200.json").read_text())["cases"]})
        if family == "alexnet":
            raise RuntimeError("out of memory")
        case = copy.deepcopy(next(c for c in mine["cases"] if (c["family"], c["batch"]) == (family, 256)))
        case["ready_s"] = 1234.5
        return [case]

    monkeypatch.setattr(gpu, "_family", timed)
    monkeypatch.setattr("bench.gpu.gpu_name", lambda: "NVIDIA H200")
    args = argparse.Namespace(out=tmp_path, fresh=False, families=["resnet18", "alexnet"], providers=("ours",),
                              batches=[256], max_autotune=(), size="full")  # fmt: skip
    gpu.execute(args, "test")
    assert on_disk == [{"resnet18", "alexnet"}] * 2  # alexnet's cases still there while resnet18 was timed
    after = json.loads((tmp_path / "zoo_h200.json").read_text())
    got = {(c["family"], c["batch"]): c for c in after["cases"]}
    assert sorted(got) == [("resnet18", 1), ("resnet18", 256)]
    assert got["resnet18", 256]["ready_s"] == 1234.5  # replaced
    assert got["resnet18", 1]["ready_s"] != 1234.5  # not timed this run: kept
    assert "out of memory" in after["not_run"]["alexnet"]
    assert after["meta"]["onnxruntime"] == committed["meta"]["onnxruntime"]  # none here: the file's is kept
