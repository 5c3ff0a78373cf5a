"""End to end for a model brought as an ONNX file: digits-resnet (model_weights/digits-resnet/digits-resnet.onnx, a
residual CNN with BatchNorm) served by the real service under real uvicorn on a loopback port, imported when the
server loads it: the fused server finds the .onnx in the folder by the model's name (`--model digits-resnet`), the
unfused server is given the file's path (`--model .../digits-resnet.onnx`). Both answer real held-out digits over
/predict, the unfused one all 360 of them, and UINT8 pixels over the Open Inference Protocol (binary REST and
gRPC). A file with an op fusedserve cannot run is refused at start, by node name.

Without a GPU the fused server runs its kernels in Triton's interpreter, so it gets a few rows.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from prometheus_client.parser import text_string_to_metric_families

from .digits import held_out_split
from .server import REPO, free_port, running_servers, service_env

tgrpc = pytest.importorskip("tritonclient.grpc")
thttp = pytest.importorskip("tritonclient.http")

pytestmark = pytest.mark.slow

MODEL_DIR = REPO / "model_weights" / "digits-resnet"
ONNX_FILE = MODEL_DIR / "digits-resnet.onnx"
KERNELS = [
    "conv2d_0_bn_relu", "conv2d_1_bn_relu", "conv2d_2_bn_add_relu", "conv2d_3_bn_relu", "conv2d_5_bn",
    "conv2d_4_bn_add_relu", "conv2d_6_bn_relu", "conv2d_7_bn_add_relu", "avgpool2d_0", "linear_0",
]  # fmt: skip
MAX_BATCH = 16  # the unfused server's: the held-out set in requests of 16 rows
FUSED_MAX_BATCH = 8  # the fused server takes FEW rows at most (interpreted on the CPU)
COMMON = {"dtype": "float32", "max_batch_size": MAX_BATCH, "max_delay_ms": 5, "kernel_timing_every": 1}
FEW = 6  # held-out rows the fused (interpreted) server answers
TIMEOUT = httpx.Timeout(120.0, connect=5.0)
RTOL_VS_UNFUSED = {"cpu": 1e-4, "cuda": 5e-3}  # float32; on a GPU both sides' convs run in TF32
GRPC_PORT = free_port()


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> dict[str, str]:
    specs = {
        # by name: the folder holding the .onnx
        "fused": ("fused", {**COMMON, "model": "digits-resnet", "max_batch_size": FUSED_MAX_BATCH}),
        "unfused": ("unfused", {**COMMON, "model": str(ONNX_FILE), "grpc_port": GRPC_PORT}),  # the file itself
    }
    with running_servers(specs, tmp_path_factory.mktemp("e2e-resnet-logs"), timeout_s=300) as s:
        yield {m: srv.url for m, srv in s.items()}


@pytest.fixture(scope="module")
def digits() -> tuple[np.ndarray, np.ndarray]:
    """The 360 held-out digits (the split of every digits model) as (360, 8, 8) raw pixels 0..16, and labels."""
    X_test, y_test = held_out_split()
    return X_test.reshape(-1, 8, 8), y_test


def predict(base: str, rows: list) -> dict:
    r = httpx.post(f"{base}/predict", json={"inputs": rows}, timeout=TIMEOUT)
    assert r.status_code == 200, f"{r.status_code} {r.text[:500]}"
    return r.json()


def assert_rows_close(got, want, rtol: float, what: str) -> None:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{what}: {got.shape} != {want.shape}"
    bound = rtol * (np.abs(want) + np.sqrt((want**2).mean(axis=-1, keepdims=True)))
    assert (np.abs(got - want) <= bound).all(), f"{what}: max error {np.abs(got - want).max():.3e}"


@pytest.mark.timeout(600)
def test_model_describes_the_imported_graphs_plan(servers):
    for mode, base in servers.items():
        info = httpx.get(f"{base}/model", timeout=TIMEOUT).json()
        assert info["name"] == "digits-resnet" and info["mode"] == mode and info["status"] == "ready", info
        assert info["input_shape"] == [1, 8, 8] and info["output_features"] == 10
        assert info["labels"] == [str(i) for i in range(10)]  # from the file's metadata
        assert [s["kernel"] for s in info["plan"] if s["kernel"]] == KERNELS, info["plan"]
        block1 = next(s for s in info["plan"] if s["kernel"] == "conv2d_2_bn_add_relu")
        assert block1["batchnorm"] is True and block1["activation"] == "relu" and block1["residual"]
        assert (block1["in_channels"], block1["out_channels"]) == (16, 16)


@pytest.mark.timeout(600)
def test_held_out_digits_both_modes(servers, digits):
    X, y = digits
    rows = X[:FEW].astype(int).tolist()  # [8][8] images of raw pixels
    docs = {mode: predict(base, rows) for mode, base in servers.items()}
    device = httpx.get(f"{servers['fused']}/model", timeout=TIMEOUT).json()["device"].split(":")[0]
    for mode, doc in docs.items():
        assert doc["model"] == "digits-resnet" and doc["mode"] == mode
        assert doc["predictions"] == [str(v) for v in y[:FEW]], f"{mode}: {doc['predictions']}"
    assert_rows_close(docs["fused"]["outputs"], docs["unfused"]["outputs"], RTOL_VS_UNFUSED[device], "fused/unfused")


@pytest.mark.timeout(600)
def test_unfused_answers_all_held_out_digits(servers, digits):
    X, y = digits
    predictions = []
    for start in range(0, len(X), MAX_BATCH):
        flat = X[start : start + MAX_BATCH].reshape(-1, 64).astype(int).tolist()  # flat rows, 64 values each
        predictions += predict(servers["unfused"], flat)["predictions"]
    accuracy = float(np.mean(np.asarray(predictions) == y.astype(str)))
    assert accuracy >= 0.985, f"held-out accuracy {accuracy:.4f} < 0.985 (README: 0.9972)"


@pytest.mark.timeout(600)
def test_readme_example_body_answers_with_true_labels(servers):
    body = (MODEL_DIR / "examples.json").read_bytes()
    truth = [str(t) for t in json.loads((MODEL_DIR / "examples_labels.json").read_text())]
    for mode, base in servers.items():
        r = httpx.post(f"{base}/predict", content=body, headers={"content-type": "application/json"}, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        assert r.json()["predictions"] == truth, mode


@pytest.mark.timeout(600)
def test_uint8_pixels_over_binary_rest_and_grpc(servers, digits):
    X, y = digits
    pixels = X[:MAX_BATCH].astype(np.uint8).reshape(-1, 1, 8, 8)
    want = predict(servers["unfused"], X[:MAX_BATCH].astype(int).tolist())["outputs"]
    http = thttp.InferenceServerClient(servers["unfused"].removeprefix("http://"), network_timeout=60)
    grpc = tgrpc.InferenceServerClient(f"127.0.0.1:{GRPC_PORT}")
    try:
        inp = thttp.InferInput("input", list(pixels.shape), "UINT8")
        inp.set_data_from_numpy(pixels, binary_data=True)
        outputs = [thttp.InferRequestedOutput(n, binary_data=True) for n in ("logits", "label")]
        rest = http.infer("digits-resnet", [inp], outputs=outputs)
        ginp = tgrpc.InferInput("input", list(pixels.shape), "UINT8")
        ginp.set_data_from_numpy(pixels)
        over_grpc = grpc.infer("digits-resnet", [ginp], client_timeout=60)
    finally:
        http.close()
        grpc.close()
    for what, result in (("binary REST", rest), ("gRPC", over_grpc)):
        labels = [v.decode() for v in result.as_numpy("label").tolist()]
        assert labels == [str(v) for v in y[:MAX_BATCH]], what
        assert_rows_close(result.as_numpy("logits"), want, 1e-6, f"{what} vs /predict")


@pytest.mark.timeout(600)
def test_per_kernel_metrics_line_up_in_both_modes(servers, digits):
    X, _ = digits
    seen = {}
    for mode, base in servers.items():
        predict(base, X[:2].astype(int).tolist())  # FUSEDSERVE_KERNEL_TIMING_EVERY=1: every batch times its steps
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{base}/metrics").text)}
        samples = families["fusedserve_kernel_seconds"].samples
        seen[mode] = {s.labels["kernel"] for s in samples if s.name.endswith("_count") and s.value > 0}
        assert all(s.labels["model"] == "digits-resnet" and s.labels["mode"] == mode for s in samples)
    assert seen["fused"] == seen["unfused"] == set(KERNELS), seen


@pytest.mark.timeout(120)
def test_serving_a_file_with_an_unsupported_op_is_refused_by_node_name(tmp_path):
    rng = np.random.default_rng(0)
    w = onnx.numpy_helper.from_array(rng.standard_normal((4, 1, 3, 3)).astype(np.float32), "w")
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="stem", pads=[1, 1, 1, 1]),
        helper.make_node("Sin", ["c"], ["s"], name="odd_activation"),
        helper.make_node("Flatten", ["s"], ["y"], name="flat"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 256])], initializer=[w],
    )  # fmt: skip
    path = tmp_path / "odd.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    argv = [sys.executable, "-m", "service.cli", "serve", "--model", str(path), "--port", str(free_port())]
    res = subprocess.run(argv, env=service_env(), cwd=tmp_path, capture_output=True, text=True, timeout=100)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "cannot serve: " in res.stderr and "node 'odd_activation' (Sin): this op is not supported" in res.stderr
