"""The CPU-preprocessing peer of `bench serve` (bench/serve/apps/pil.py): Pillow prepares files as the model declares
them, close to fusedserve's own preparation of the same files, and the peer, started as `bench serve` starts it (its
own fusedserve upstream), answers a BYTES request of encoded digits with the digits' labels."""

from __future__ import annotations

import io
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
import torch

from bench.local_server import free_port
from bench.serve import images
from bench.serve.apps.pil import Prepare
from service.cli import main as cli_main
from service.images.decode import decode
from service.images.preprocess import Preprocess
from service.model.spec import read_spec

from .server import REPO

DIGITS = REPO / "model_weights" / "digits-resnet"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("m") / "digits-images"
    args = ["import", str(DIGITS / "digits-resnet.onnx"), str(out), "--resize", "8", "--mean", "0", "--std", "15.9375"]
    assert cli_main(args) == 0
    return out


def _rgb_model(tmp_path, resize: int, crop: int):
    """A model directory declaring RGB images resized to `resize` and cropped to crop x crop (its ops never run)."""
    from tests.modelgen import write_cnn_model

    d = write_cnn_model(tmp_path / "rgb", [3, crop, crop], [{"op": "conv2d", "out": 2, "kernel": 3}, {"op": "flatten"},
                        {"op": "linear", "out": 2}], seed=1)  # fmt: skip
    cfg = orjson.loads((d / "config.json").read_bytes())
    cfg["input"]["image"] = {"resize": resize}
    cfg["input"]["dtype"] = "uint8"
    (d / "config.json").write_bytes(orjson.dumps(cfg))
    return d


@pytest.mark.parametrize("channels", [1, 3])
def test_pillow_prepares_files_as_fusedserve_does(tmp_path, model, channels):
    """Pillow's resize filter against fusedserve's antialiased torch resize, on synthesized photos (500x375 and the
    other shapes bench serve sends): the same pixels to within a few levels."""
    d = model if channels == 1 else _rgb_model(tmp_path, 64, 56)
    spec = read_spec(d)[0]
    ours, pil = Preprocess.of(spec), Prepare(d)
    seed = int(np.random.default_rng().integers(1 << 16))
    for f in images.encoded("v2_png", 4, seed, channels):
        want = ours(torch.from_numpy(np.array(decode(f, ours.channels, 10**8)))).numpy().astype(int)
        got = pil(f).astype(int)
        assert got.shape == want.shape == (channels, ours.height, ours.width)
        diff = np.abs(got - want)
        assert diff.mean() <= 1.0 and diff.max() <= 8, (diff.mean(), diff.max())


@pytest.mark.timeout(240)
def test_the_peer_answers_binary_requests_of_files(model, tmp_path):
    port = free_port()
    argv = [sys.executable, "-m", "bench.serve.apps.pil", "--port", str(port), "--workers", "1", "--model",
            str(model), "--mode", "unfused", "--device", "cpu"]  # fmt: skip
    log = open(tmp_path / "pil.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 200
        with httpx.Client(timeout=30) as client:
            while True:
                assert proc.poll() is None, (tmp_path / "pil.log").read_text()
                try:
                    if client.get(url + "/health/ready").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "the peer did not become ready"
                time.sleep(0.3)
            files = [(DIGITS / "images" / f"{d}.{ext}").read_bytes() for d, ext in ((0, "png"), (1, "jpg"), (7, "png"))]
            data = b"".join(len(f).to_bytes(4, "little") + f for f in files)
            head = orjson.dumps({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [len(files)],
                                             "parameters": {"binary_data_size": len(data)}}],
                                 "outputs": [{"name": "label"}]})  # fmt: skip
            r = client.post(url + "/v2/models/digits-images/infer", content=head + data,
                            headers={"Inference-Header-Content-Length": str(len(head))})  # fmt: skip
            assert r.status_code == 200, r.text
            label = next(o for o in r.json()["outputs"] if o["name"] == "label")
            # the same files through fusedserve's own image path, via the peer's pass-through
            direct = client.post(url + "/predict", files=[("f", io.BytesIO(f)) for f in files])
            assert direct.status_code == 200, direct.text
            assert [str(x) for x in label["data"]] == [str(x) for x in direct.json()["predictions"]]
            bad = b"\x00\x00\x00\x00"  # one empty file
            head = orjson.dumps({"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1],
                                             "parameters": {"binary_data_size": 4}}]})  # fmt: skip
            r = client.post(url + "/v2/models/digits-images/infer", content=head + bad,
                            headers={"Inference-Header-Content-Length": str(len(head))})  # fmt: skip
            assert r.status_code == 422 and "cannot prepare" in r.text
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            import os
            import signal

            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    # Its upstream fusedserve stops with it: it once ran on, orphaned, after the peer's SIGTERM.
    deadline = time.monotonic() + 15
    while _processes_serving(model) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _processes_serving(model), "the peer's upstream fusedserve outlived it"


def _processes_serving(model: Path) -> list[int]:
    """pids of `service.cli serve` processes of this model."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"service.cli" in argv and str(model).encode() in argv:
                found.append(int(entry.name))
    return found


def test_bench_serve_runs_the_peer_on_the_file_phases_only(model):
    import argparse

    from bench.serve import cli as serve_cli
    from bench.serve.run import phase_list

    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    plan = serve_cli.resolve(p.parse_args(["--model", str(model), "--v2", "jpeg,binary", "--workers", "2"]))
    pil = next(s for s in plan.systems if s.name == "pil")
    assert pil.key == "pil@2" and pil.cannot_serve(plan.model) is None
    phases = phase_list(pil, plan, None)
    assert phases and {p["protocol"] for p in phases} == {"v2_jpeg"} and all(p["priority"] == 1 for p in phases)
