"""End to end for a model of uint8 pixels: a small CNN (3x16x16 input, ImageNet's mean and std, conv 7x7/2 padding
3 + relu, a global average pool, a linear head) served fused and unfused under real uvicorn, answering uint8 images
over /predict (integers 0-255 in JSON), the Open Inference Protocol's REST (binary and JSON UINT8) and gRPC (raw
UINT8), against a float64 torch reference of the normalized model; what it refuses, and how it describes itself.

The rows travel as uint8 from the front end through the shared-memory link to the engine (service/link/wire.py), and
the fused stem normalizes them as it loads them (kernels/conv.py, input_norm). Without a GPU the fused server runs
its kernels in Triton's interpreter, so its batches are kept small.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from .modelgen import IMAGENET_MEAN, IMAGENET_STD, write_pixel_model
from .server import free_port, running_servers

pytest.importorskip("tritonclient.grpc", reason="tritonclient[http,grpc] is not installed (pip install -e '.[test]')")
import tritonclient.grpc as tgrpc  # noqa: E402
import tritonclient.http as thttp  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODES = ("fused", "unfused")
NAME = "pixel-cnn"
SHAPE = (3, 16, 16)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MAX_BATCH = 4 if DEVICE == "cpu" else 64  # the fused CPU server runs its batches interpreted
TIMEOUT = httpx.Timeout(60.0, connect=5.0)
# float32 against float64, relative to |x| + rms(row): fp32 accumulation on the CPU; TF32 convs on a GPU (cuDNN's
# default, which fused_conv2d follows)
RTOL = {"cpu": 1e-4, "cuda": 5e-3}[DEVICE]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_pixel_model(tmp_path_factory.mktemp("uint8-model") / NAME, seed=11, name=NAME)


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory) -> dict[str, dict]:
    ports = {m: free_port() for m in MODES}
    env = {"model": str(model_dir), "dtype": "float32", "max_batch_size": MAX_BATCH, "max_delay_ms": 5}
    specs = {m: (m, {**env, "grpc_port": ports[m]}) for m in MODES}
    with running_servers(specs, tmp_path_factory.mktemp("e2e-uint8-logs")) as s:
        yield {m: {"url": srv.url, "grpc": f"127.0.0.1:{ports[m]}"} for m, srv in s.items()}


@pytest.fixture(scope="module")
def images() -> np.ndarray:
    return np.random.default_rng(5).integers(0, 256, (3, *SHAPE), dtype=np.uint8)


def reference(model_dir, images: np.ndarray) -> np.ndarray:
    """The model in float64: (x - mean) / std, conv 7x7/2 padding 3 + relu, global average pool, linear."""
    t = {k: v.double() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    x = torch.from_numpy(images).double()
    x = (x - torch.tensor(IMAGENET_MEAN).double().reshape(1, 3, 1, 1)) / torch.tensor(IMAGENET_STD).double().reshape(
        1, 3, 1, 1
    )
    h = torch.relu(F.conv2d(x, t["conv2d0.weight"], t["conv2d0.bias"], stride=2, padding=3))
    h = F.avg_pool2d(h, 8).flatten(1)
    return F.linear(h, t["linear4.weight"], t["linear4.bias"]).numpy()


def assert_rows_close(got, want, what: str) -> None:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{what}: {got.shape} != {want.shape}"
    bound = RTOL * (np.abs(want) + np.sqrt((want**2).mean(axis=-1, keepdims=True)))
    assert (np.abs(got - want) <= bound).all(), f"{what}: max error {np.abs(got - want).max():.3e}"


@pytest.mark.parametrize("mode", MODES)
def test_predict_takes_pixels(servers, model_dir, images, mode):
    want = reference(model_dir, images)
    r = httpx.post(f"{servers[mode]['url']}/predict", json={"inputs": images.tolist()}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text[:500]
    assert r.json()["mode"] == mode
    assert_rows_close(r.json()["outputs"], want, f"/predict {mode}")
    flat = [row.reshape(-1).tolist() for row in images[:2]]  # flat rows too
    r = httpx.post(f"{servers[mode]['url']}/predict", json={"inputs": flat}, timeout=TIMEOUT)
    assert_rows_close(r.json()["outputs"], want[:2], f"/predict flat {mode}")


@pytest.mark.parametrize("value,shown", [(256, "256"), (-3, "-3"), (12.5, "12.5")])
def test_predict_refuses_what_is_not_a_pixel(servers, images, value, shown):
    rows = images[:2].tolist()
    rows[1][2][5][7] = value
    r = httpx.post(f"{servers['unfused']['url']}/predict", json={"inputs": rows}, timeout=TIMEOUT)
    assert r.status_code == 422
    assert f"inputs[1][2][5][7] is {shown}; this model takes uint8 pixels: integers 0-255" in r.text


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["http-binary", "http-json", "grpc"])
def test_v2_uint8(servers, model_dir, images, mode, kind):
    want = reference(model_dir, images)
    shape = list(images.shape)
    if kind == "grpc":
        client = tgrpc.InferenceServerClient(servers[mode]["grpc"])
        inp = tgrpc.InferInput("input", shape, "UINT8")
        inp.set_data_from_numpy(images)  # raw_input_contents: the bytes as they are
        result = client.infer(NAME, [inp], client_timeout=60)
    else:
        client = thttp.InferenceServerClient(servers[mode]["url"].removeprefix("http://"), network_timeout=60)
        inp = thttp.InferInput("input", shape, "UINT8")
        inp.set_data_from_numpy(images, binary_data=kind == "http-binary")
        result = client.infer(NAME, [inp], outputs=[thttp.InferRequestedOutput("logits", binary_data=True)])
    client.close()
    assert_rows_close(result.as_numpy("logits"), want, f"{kind} {mode}")


def test_v2_describes_uint8_and_refuses_other_datatypes(servers, images):
    http = thttp.InferenceServerClient(servers["unfused"]["url"].removeprefix("http://"), network_timeout=60)
    try:
        assert http.get_model_metadata(NAME)["inputs"] == [{"name": "input", "datatype": "UINT8",
                                                             "shape": [-1, *SHAPE]}]  # fmt: skip
        assert http.get_model_config(NAME)["input"][0]["data_type"] == "TYPE_UINT8"
        inp = thttp.InferInput("input", list(images.shape), "FP32")
        inp.set_data_from_numpy(images.astype(np.float32), binary_data=True)
        with pytest.raises(InferenceServerException, match="has datatype 'FP32'; this model takes UINT8 pixels"):
            http.infer(NAME, [inp])
    finally:
        http.close()
    grpc_client = tgrpc.InferenceServerClient(servers["unfused"]["grpc"])
    try:
        config = grpc_client.get_model_config(NAME, as_json=True)["config"]
        assert config["input"][0]["data_type"] == "TYPE_UINT8"
    finally:
        grpc_client.close()


def test_model_describes_the_normalizing_stem(servers):
    for mode, s in servers.items():
        info = httpx.get(f"{s['url']}/model", timeout=TIMEOUT).json()
        assert info["input_dtype"] == "uint8" and info["input_shape"] == list(SHAPE), info
        stem = info["plan"][0]
        assert stem["kernel"] == "conv2d_0_relu", info["plan"]  # its 8x8 global pool is a step of its own
        assert stem["normalize"] == {"mean": IMAGENET_MEAN, "std": IMAGENET_STD}, (mode, stem)
