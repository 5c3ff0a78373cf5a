"""`bench serve --v2 jpeg,png`: encoded files as one BYTES tensor per request (bench/serve/images.py), only for a model
that declares its image preprocessing, and a quick CPU run of them against digits-resnet imported as an image model."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import numpy as np
import pytest

from bench.serve import cli as serve_cli
from bench.serve import images
from service.cli import main as cli_main
from service.images.decode import decode

from .server import REPO

ONNX_FILE = REPO / "model_weights" / "digits-resnet" / "digits-resnet.onnx"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("m") / "digits-images"
    assert cli_main(["import", str(ONNX_FILE), str(out), "--resize", "8", "--mean", "0", "--std", "15.9375"]) == 0
    return out


def _plan(*argv: str):
    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    return serve_cli.resolve(p.parse_args(list(argv)))


def test_bodies_are_binary_requests_of_encoded_files():
    seed = int(np.random.default_rng().integers(1 << 16))
    for protocol, kind in (("v2_jpeg", "jpeg"), ("v2_png", "png")):
        (body,) = images.bodies(protocol, 3, 1, seed, 1)
        head = json.loads(body[: images.HEAD_BYTES])
        assert head["inputs"][0]["datatype"] == "BYTES" and head["inputs"][0]["shape"] == [3]
        data, files, at = body[images.HEAD_BYTES :], [], 0
        assert len(data) == head["inputs"][0]["parameters"]["binary_data_size"]
        while at < len(data):
            n = int.from_bytes(data[at : at + 4], "little")
            files.append(data[at + 4 : at + 4 + n])
            at += 4 + n
        assert len(files) == 3
        for f in files:
            pixels = decode(f, "L", 10**8)
            assert pixels.shape[:2] in images.SIZES, (kind, pixels.shape)


def test_files_need_a_model_that_declares_images(model):
    plan = _plan("--model", str(model), "--v2", "jpeg,binary")
    assert plan.v2 == ("v2_jpeg", "v2_binary")
    with pytest.raises(SystemExit, match="digits-cnn declares no image preprocessing"):
        _plan("--model", "digits-cnn", "--v2", "jpeg")


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_quick_run_of_files_on_the_cpu(model, tmp_path):
    argv = [sys.executable, "-m", "bench.serve", "--quick", "--device", "cpu", "--out", str(tmp_path), "--model",
            str(model), "--systems", "unfused@1", "--v2", "jpeg,png", "--images", "4", "--duration", "0.4",
            "--warmup", "0.1", "--time-budget", "150", "--perf-analyzer", "none", "--no-sigterm"]  # fmt: skip
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=190)
    out = proc.stdout + proc.stderr
    results = json.loads((tmp_path / "serve_cpu.json").read_text())
    closed = [r for r in results["phases"] if r["kind"] == "closed"]
    assert sorted({r["protocol"] for r in closed}) == ["v2_jpeg", "v2_png"], out
    for r in closed:
        assert r["ok"] and r["sent"] == r["status"]["200"] > 0 and r["rows"] == 4, r
        assert r["server"]["outcomes"]["ok"] == r["sent"], r
