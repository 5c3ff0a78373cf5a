"""`bench serve --model`: the model resolved as `fusedserve serve` resolves it, request bodies built from its input
shape and datatype, an image model's plan (fused and unfused at N, binary v2, the MLP-only phases skipped), the
client's CPU and the GPU's utilization per phase, and a quick run against the digits CNN on the CPU."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np
import pytest

from bench.serve import cli as serve_cli
from bench.serve import model as served
from bench.serve import report as serve_report
from bench.serve import v2
from bench.serve.gpu_busy import GpuSampler
from bench.serve.gpu_busy import text as gpu_text
from bench.serve.loadgen import client_cpu

from .server import REPO


def _plan(*argv: str):
    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    return serve_cli.resolve(p.parse_args(list(argv)))


# ------------------------------------------------------------------------------------------- the model


def test_models_resolve_by_name_and_path(tmp_path):
    mlp = served.resolve(None)
    assert (mlp.name, mlp.input_shape, mlp.image, mlp.shipped_mlp) == ("digits-mlp", (64,), False, True)
    cnn = served.resolve("digits-cnn")
    assert (cnn.name, cnn.input_shape, cnn.input_dtype, cnn.image) == ("digits-cnn", (1, 8, 8), "float32", True)
    assert cnn.path == str(REPO / "model_weights" / "digits-cnn")
    assert served.resolve(str(REPO / "model_weights" / "digits-cnn")).name == "digits-cnn"  # a path
    with pytest.raises(served.ModelError, match="no such path.*digits-cnn"):
        served.resolve("nope")


@pytest.mark.timeout(120)
def test_an_onnx_model_is_read_by_fusedserves_loader():
    """digits-resnet ships as an .onnx file alone: its name and shape come from the importer (a child process)."""
    m = served.resolve("digits-resnet")
    assert (m.name, m.input_shape, m.image) == ("digits-resnet", (1, 8, 8), True)


def test_uint8_only_where_the_model_declares_uint8_input(tmp_path):
    cnn = served.resolve("digits-cnn")
    cnn.check_datatype("FP16")
    with pytest.raises(served.ModelError, match="declares a float32 input.*uint8"):
        cnn.check_datatype("UINT8")
    with pytest.raises(SystemExit, match="UINT8"):
        _plan("--model", "digits-cnn", "--input-dtype", "uint8")
    # A model whose config declares uint8 pixels (the model format is gaining them): UINT8 is sent.
    config = {"name": "pixels", "input": {"shape": [3, 4, 5], "dtype": "uint8"}, "ops": []}
    (tmp_path / "config.json").write_text(json.dumps(config))
    pixels = served.resolve(str(tmp_path))
    pixels.check_datatype("UINT8")
    assert pixels.path == str(tmp_path.resolve()) and pixels.image


# ------------------------------------------------------------------------------------------- bodies


def test_bodies_carry_the_models_shape_in_the_datatype_asked():
    shape = (3, 4, 5)
    for datatype, dtype in (("FP32", "<f4"), ("FP16", "<f2"), ("UINT8", "u1")):
        bodies, header = v2.binary_bodies(2, 3, seed=1, shape=shape, datatype=datatype)
        n = int(header.split(b": ")[1])
        head = json.loads(bodies[0][:n])
        (inp,) = head["inputs"]
        assert (inp["datatype"], inp["shape"]) == (datatype, [2, 3, 4, 5])
        data = np.frombuffer(bodies[0][n:], dtype=dtype)
        assert data.size == 2 * 60 and inp["parameters"]["binary_data_size"] == data.nbytes
        assert np.isfinite(data.astype(np.float64)).all() and len({b[n:] for b in bodies}) == 3
        assert bodies == v2.binary_bodies(2, 3, seed=1, shape=shape, datatype=datatype)[0]  # seeded
    pixels = v2.binary_bodies(4, 1, shape=shape, datatype="UINT8")[0][0][-4 * 60 :]
    assert np.frombuffer(pixels, "u1").max() > 16  # 0..255, not the digits' 0..16
    # The digits MLP's bodies are what they were: integers 0..16 as FP32.
    rng = np.random.default_rng(0 * 1000 + 256 + 7)
    want = rng.integers(0, 17, size=(256, 64)).astype("<f4").tobytes()
    assert v2.binary_bodies(256, 1)[0][0].endswith(want)
    # In a process of its own: grpc_bodies builds with service.v2's messages, which cannot share a process with
    # tritonclient's (one protobuf pool, the same `inference` names), and other tests of this worker import those.
    script = (
        "from bench.serve import v2; from service.v2 import grpc_predict_v2_pb2 as pb; "
        "r = pb.ModelInferRequest.FromString(v2.grpc_bodies(2, 1, 0, (3, 4, 5), 'FP16', model='m')[0]); "
        "print(r.model_name, r.inputs[0].datatype, list(r.inputs[0].shape), len(r.raw_input_contents[0]))"
    )
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.stdout.strip() == "m FP16 [2, 3, 4, 5] 240", run.stderr  # 2 x 60 FP16 values: 240 bytes
    assert v2.body_count(32, (3, 224, 224), "FP16") == 8 and v2.body_count(256, (64,)) == 16


# ------------------------------------------------------------------------------------------- the plan


def test_an_image_models_plan():
    from bench.serve.run import phase_list, pick_perf_analyzer_system, pick_sigterm_system

    plan = _plan("--model", "digits-cnn", "--workers", "8", "--input-dtype", "fp16")
    assert [s.key for s in plan.systems] == ["empty@8", "fused@8", "unfused@8", "pil@8"]
    assert (plan.rows, plan.v2, plan.v2_rows, plan.connections) == ((), ("v2_binary",), 32, (16, 64, 256))
    assert plan.input_dtype == "FP16" and plan.open_systems == ()
    sig = pick_sigterm_system(plan)
    assert sig.key == "fused@8" and pick_perf_analyzer_system(plan) == sig
    assert plan.systems[-1].cannot_serve(plan.model) == "pil prepares encoded files: digits-cnn declares no input.image"
    assert phase_list(plan.systems[-1], plan, sig) == []  # the CPU-preprocessing peer: files only
    for system in plan.systems[:-1]:
        phases = phase_list(system, plan, sig)
        closed = [(p["protocol"], p["rows"], p["connections"], p["priority"]) for p in phases if p["kind"] == "closed"]
        assert closed == [("v2_binary", 32, c, 1) for c in (16, 64, 256)]  # the pair is the target: both essential
    assert phase_list(sig, plan, sig)[-1] == {
        "kind": "sigterm", "protocol": "v2_binary", "rows": 32, "connections": 256, "priority": 1
    }  # fmt: skip
    assert _plan("--model", "digits-cnn", "--images", "8", "--v2", "binary,grpc").v2_rows == 8
    # The eager app cannot serve it: no phase, and the reason. The empty route takes its binary requests in (the
    # images-in ceiling), binary REST only, even where the run has gRPC phases.
    mixed = _plan("--model", "digits-cnn", "--systems", "empty@1,eager@1,fused@1", "--workers", "1", "--v2",
                  "binary,grpc")  # fmt: skip
    empty, eager, fused = mixed.systems
    assert phase_list(eager, mixed, None) == [] and "digits MLP" in eager.cannot_serve(mixed.model)
    assert empty.cannot_serve(mixed.model) is None and fused.cannot_serve(mixed.model) is None
    assert [(p["protocol"], p["priority"]) for p in phase_list(empty, mixed, None)] == [("v2_binary", 1)] * 3
    assert {p["protocol"] for p in phase_list(fused, mixed, None)} == {"v2_binary", "v2_grpc"}
    with pytest.raises(SystemExit, match="not images"):
        _plan("--images", "32")  # the digits MLP
    with pytest.raises(SystemExit, match="differ"):
        _plan("--model", "digits-cnn", "--images", "32", "--v2-rows", "16")
    with pytest.raises(SystemExit, match="only the v2 phases"):
        _plan("--model", "digits-cnn", "--v2", "none")
    # The digits MLP's plan is as before.
    mlp = _plan("--workers", "8")
    assert (mlp.v2, mlp.v2_rows, mlp.rows, mlp.model.name) == (("v2_binary", "v2_grpc"), 256, (1, 64), "digits-mlp")


# ------------------------------------------------------------------------------------------- measurements


def test_client_cpu_flags_clients_above_85_percent_of_their_cores():
    assert client_cpu([0.5, 0.4], [1.0, 1.0]) == {"cores_used": 0.9, "cores_given": 2, "busiest": 0.5, "bound": False}
    bound = client_cpu([0.95, 0.9], [1.0, 1.0])
    assert bound["bound"] and bound["busiest"] == 0.95
    assert client_cpu([], [])["bound"] is None


def test_gpu_sampler_averages_nvidia_smis_samples_inside_the_window(tmp_path):
    """A stand-in nvidia-smi with two GPUs: 80% and 20% busy, one line each per 20 ms, with its timestamps."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import datetime, sys, time\n"
        "assert '--query-gpu=timestamp,index,utilization.gpu' in sys.argv\n"
        "while True:\n"
        "    ts = datetime.datetime.now().strftime('%Y/%m/%d %H:%M:%S.%f')[:-3]\n"
        "    print(f'{ts}, 0, 80'); print(f'{ts}, 1, 20'); print('[N/A], 2, [N/A]', flush=True)\n"
        "    time.sleep(0.02)\n"
    )
    fake.chmod(0o755)
    sampler = GpuSampler(str(fake)).start()
    try:
        time.sleep(0.5)
        t0 = time.monotonic()
        time.sleep(0.4)
        t1 = time.monotonic()
        time.sleep(0.2)
    finally:
        sampler.stop()
    busy = sampler.window(t0, t1)
    assert busy["per_gpu"] == {0: 80.0, 1: 20.0} and busy["mean"] == 50.0
    assert 10 <= busy["samples"] <= 2 * 0.4 / 0.02 + 4, busy
    assert gpu_text(busy) == "50 (80/20)" and gpu_text(None) == "n/a"
    assert sampler.window(t1 + 10, t1 + 20) is None  # nothing sampled then
    assert GpuSampler(str(tmp_path / "none")).start().window(0, 1) is None  # it does not run: n/a


def _image_phase(name: str, conns: int, images_s: float, bound: bool = False, ok: bool = True) -> dict:
    return {
        "system": f"{name}@8", "name": name, "workers": 8, "kind": "closed", "protocol": "v2_binary", "rows": 32,
        "connections": conns, "round": 0, "req_per_s": images_s / 32, "rows_per_s": images_s, "ok": ok, "lost": 0,
        "request_mb_per_s": images_s * 150528 * 2 / 1e6, "gpu_util": {"mean": 91.0, "per_gpu": {"0": 91.0}},
        "client_cpu": {"cores_used": 3.5 if bound else 1.2, "cores_given": 4, "busiest": 0.9, "bound": bound},
        "server": {"forward_us": 900.0, "batch_rows": 64.0}, "latency_ms": {"p50": 5.0, "p90": 6.0, "p99": 9.0},
        "accounting": {"problems": [], "notes": []},
    }  # fmt: skip


def test_image_targets_read_the_fused_and_unfused_pair_at_64_connections():
    meta = {"workers": 8, "v2_rows": 32, "input_dtype": "UINT8",
            "model": {"name": "resnet50", "input_shape": [3, 224, 224], "image": True}}  # fmt: skip
    phases = [_image_phase("fused", 64, 30_000), _image_phase("unfused", 64, 20_000, bound=True)]
    t = serve_report.targets({"meta": meta, "phases": phases})
    assert t[0]["met"] is True and t[0]["measured"].startswith("1.50x: 30,000 against 20,000 images/s (UINT8)")
    assert "CLIENT-BOUND" in t[0]["measured"]
    assert t[1]["met"] is True and "9,032 MB/s" in t[1]["measured"] and "1.20 of 4" in t[1]["measured"]
    phases[0]["client_cpu"]["bound"] = True  # the clients were the limit: not shown, so not met
    assert serve_report.targets({"meta": meta, "phases": phases})[1]["met"] is False
    meta["input_dtype"] = "FP16"
    assert serve_report.targets({"meta": meta, "phases": phases})[1]["met"] is None  # the target is UINT8's
    phases[1] = _image_phase("unfused", 64, 26_000)
    assert serve_report.targets({"meta": meta, "phases": phases})[0]["met"] is False  # 1.15x


# ------------------------------------------------------------------------------------ a real run


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_quick_image_run_on_the_cpu(tmp_path):
    """The digits CNN, unfused at 1 worker (fused runs Triton's interpreter on the CPU: a minute to start), 32-image
    FP16 binary requests at 1 and 4 connections and the SIGTERM phase with them: images/s, MB/s, the client's cores,
    the GPU n/a, and the skipped phases listed."""
    argv = [sys.executable, "-m", "bench.serve", "--quick", "--device", "cpu", "--out", str(tmp_path), "--model",
            "digits-cnn", "--systems", "empty@1,unfused@1", "--input-dtype", "FP16", "--duration", "0.4", "--warmup",
            "0.1", "--time-budget", "100", "--perf-analyzer", "none"]  # fmt: skip
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=140)
    out = proc.stdout + proc.stderr
    assert (tmp_path / "serve_cpu.md").is_file(), out
    results = json.loads((tmp_path / "serve_cpu.json").read_text())
    assert results["meta"]["model"]["name"] == "digits-cnn" and results["meta"]["input_dtype"] == "FP16"
    phases = results["phases"]
    closed = [r for r in phases if r["kind"] == "closed"]
    assert sorted((r["system"], r["protocol"], r["rows"], r["connections"]) for r in closed) == [
        ("empty@1", "v2_binary", 32, 1), ("empty@1", "v2_binary", 32, 4),
        ("unfused@1", "v2_binary", 32, 1), ("unfused@1", "v2_binary", 32, 4),
    ], out  # fmt: skip
    for r in closed:
        assert r["ok"] and r["sent"] == r["status"]["200"] > 0, r
        if r["system"] == "unfused@1":  # the empty route keeps no counters
            assert r["server"]["outcomes"]["ok"] == r["sent"], r
        assert r["request_bytes"] > 32 * 64 * 2 and r["request_mb_per_s"] == pytest.approx(
            r["req_per_s"] * r["request_bytes"] / 1e6, rel=0.01
        )
        # one core a client process, as many processes as the host gives the clients (2 on CI's 2 cores, 4 on 16)
        given = min(results["meta"]["clients"], r["connections"])
        assert r["gpu_util"] is None and r["client_cpu"]["cores_given"] == given
        assert 0 < r["client_cpu"]["cores_used"] <= r["client_cpu"]["cores_given"] * 1.05
    (sig,) = [r for r in phases if r["kind"] == "sigterm"]
    assert (sig["protocol"], sig["rows"]) == ("v2_binary", 32) and sig["exit"]["graceful"], sig
    skipped = {(s["system"], s["what"]) for s in results["skipped"]}
    assert ("every system", "JSON /predict and open-loop phases") in skipped
    assert not any(s["system"] == "empty@1" for s in results["skipped"]), results["skipped"]
    md = (tmp_path / "serve_cpu.md").read_text()
    assert "## Targets (issue 34)" in md and "No JSON /predict phase: digits-cnn is an image model" in md
    assert "| unfused (v2_binary) | 1 | 32 | 4 |" in md and "| images/s | MB/s |" in md and "| n/a |" in md
    assert "| empty (v2_binary) | 1 | 32 | 4 |" in md
    assert "Not run: every run: --perf-analyzer none." in md
