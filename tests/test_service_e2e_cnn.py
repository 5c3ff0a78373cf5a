"""End to end for a CNN: digits-cnn served by the real service under real uvicorn on a loopback port, in both
modes, answering real held-out digits sent as [8][8], [1][8][8] and flat rows over HTTP.

Without a GPU the fused server runs its conv, pool and MLP kernels in Triton's interpreter, so it gets a few
rows; the unfused server gets all 360 held-out digits.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .digits import held_out_split
from .server import REPO, running_servers

pytestmark = pytest.mark.slow

MODES = ("fused", "unfused")
MODEL_DIR = REPO / "model_weights" / "digits-cnn"
KERNELS = ["conv2d_0_relu", "conv2d_1_relu_maxpool2d_0", "mlp_0_1"]  # the pool rides in the second conv's kernel
MAX_BATCH = 16  # the unfused server's: the held-out set in requests of 16 rows
FUSED_MAX_BATCH = 8  # the fused server takes FEW rows and the README's 8 at most (interpreted on the CPU)
ENV = {
    "model": str(MODEL_DIR), "dtype": "float32", "max_batch_size": MAX_BATCH, "max_delay_ms": 5,
    "kernel_timing_every": 1,
}  # fmt: skip
FEW = 6  # held-out rows the fused (interpreted) server answers per layout
TIMEOUT = httpx.Timeout(60.0, connect=5.0)
# float32, relative to |x| + rms(row). On a GPU both servers' float32 convs run in TF32 (torch's default for
# cuDNN, which fused_conv2d follows), in different algorithms.
RTOL_VS_UNFUSED = {"cpu": 1e-4, "cuda": 5e-3}


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> dict[str, str]:
    specs = {m: (m, ENV if m == "unfused" else {**ENV, "max_batch_size": FUSED_MAX_BATCH}) for m in MODES}
    with running_servers(specs, tmp_path_factory.mktemp("e2e-cnn-logs")) as s:
        yield {m: srv.url for m, srv in s.items()}


@pytest.fixture(scope="module")
def digits() -> tuple[np.ndarray, np.ndarray]:
    """The 360 held-out digits (the MLP's split) as (360, 8, 8) raw pixels 0..16, and their labels."""
    X_test, y_test = held_out_split()
    return X_test.reshape(-1, 8, 8), y_test


def predict(base: str, rows: list) -> dict:
    r = httpx.post(f"{base}/predict", json={"inputs": rows}, timeout=TIMEOUT)
    assert r.status_code == 200, f"{r.status_code} {r.text[:500]}"
    return r.json()


def layout(images: np.ndarray, kind: str) -> list:
    """(n, 8, 8) -> rows as [8][8], [1][8][8] or 64 flat values (ints, as load_digits gives them)."""
    images = images.astype(int)
    return {"8x8": images, "1x8x8": images[:, None], "flat": images.reshape(len(images), 64)}[kind].tolist()


def assert_rows_close(got, want, rtol: float, what: str) -> None:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{what}: {got.shape} != {want.shape}"
    bound = rtol * (np.abs(want) + np.sqrt((want**2).mean(axis=-1, keepdims=True)))
    assert (np.abs(got - want) <= bound).all(), f"{what}: max error {np.abs(got - want).max():.3e}"


@pytest.mark.timeout(300)
def test_model_describes_the_cnn_plan(servers):
    for mode, base in servers.items():
        info = httpx.get(f"{base}/model", timeout=TIMEOUT).json()
        assert info["name"] == "digits-cnn" and info["mode"] == mode and info["status"] == "ready", info
        assert info["input_shape"] == [1, 8, 8] and info["output_features"] == 10 and info["dtype"] == "float32"
        assert [s["kernel"] for s in info["plan"] if s["kernel"]] == KERNELS, info["plan"]
        conv0, conv1, flatten, mlp = info["plan"]
        assert conv0 == {
            "kernel": "conv2d_0_relu", "op": "conv2d", "in_channels": 1, "out_channels": 16, "kernel_size": [3, 3],
            "stride": [1, 1], "padding": [1, 1], "dilation": [1, 1], "bias": True, "activation": "relu",
            "precision": "float32",
        }  # fmt: skip
        assert (conv1["kernel"], conv1["in_channels"], conv1["out_channels"]) == ("conv2d_1_relu_maxpool2d_0", 16, 16)
        assert conv1["pool"] == {
            "op": "maxpool2d", "kernel_size": [2, 2], "stride": [2, 2], "padding": [0, 0], "ceil_mode": False,
            "activation": "none",
        }  # fmt: skip
        assert flatten == {"kernel": None, "op": "flatten"}
        assert [(s["in"], s["out"], s["activation"]) for s in mlp["layers"]] == [(256, 64, "relu"), (64, 10, "none")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["8x8", "1x8x8", "flat"])
def test_held_out_digits_in_every_layout_both_modes(servers, digits, kind):
    """The first held-out digits, each layout, each mode: the true labels, and the same logits in both modes."""
    X, y = digits
    rows = layout(X[:FEW], kind)
    docs = {mode: predict(base, rows) for mode, base in servers.items()}
    device = httpx.get(f"{servers['fused']}/model", timeout=TIMEOUT).json()["device"].split(":")[0]
    for mode, doc in docs.items():
        assert doc["model"] == "digits-cnn" and doc["mode"] == mode
        assert doc["predictions"] == [str(v) for v in y[:FEW]], f"{mode} {kind}: {doc['predictions']}"
        assert doc["predictions"] == [str(i) for i in np.argmax(doc["outputs"], axis=1)]
    rtol = RTOL_VS_UNFUSED[device]
    assert_rows_close(docs["fused"]["outputs"], docs["unfused"]["outputs"], rtol, f"{kind}: fused vs unfused")


@pytest.mark.timeout(300)
def test_layouts_mixed_in_one_request_give_the_same_outputs(servers, digits):
    X, _ = digits
    base = servers["fused"]
    mixed = [layout(X[:1], "8x8")[0], layout(X[:1], "1x8x8")[0], layout(X[:1], "flat")[0]]
    out = np.asarray(predict(base, mixed)["outputs"])
    alone = np.asarray(predict(base, layout(X[:1], "flat"))["outputs"])
    assert_rows_close(out, np.repeat(alone, 3, axis=0), 1e-5, "one digit in three layouts")


@pytest.mark.timeout(300)
def test_unfused_answers_all_held_out_digits(servers, digits):
    X, y = digits
    predictions = []
    for start in range(0, len(X), MAX_BATCH):
        predictions += predict(servers["unfused"], layout(X[start : start + MAX_BATCH], "8x8"))["predictions"]
    accuracy = float(np.mean(np.asarray(predictions) == y.astype(str)))
    assert accuracy >= 0.98, f"unfused: held-out accuracy {accuracy:.4f} < 0.98 (README: 0.9833)"


@pytest.mark.timeout(300)
def test_readme_example_body_answers_with_true_labels(servers):
    body = (MODEL_DIR / "examples.json").read_bytes()
    truth = [str(t) for t in json.loads((MODEL_DIR / "examples_labels.json").read_text())]
    for mode, base in servers.items():
        r = httpx.post(f"{base}/predict", content=body, headers={"content-type": "application/json"}, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        assert r.json()["predictions"] == truth, mode


GOOD = (np.arange(64).reshape(8, 8) % 17).tolist()


def _with(value, at=(2, 5)) -> list:
    img = [list(r) for r in GOOD]
    img[at[0]][at[1]] = value
    return img


BAD_BODIES = [
    ("string-pixel", [GOOD, _with("7")], ["inputs[1][2][5]", "string"]),
    ("null-pixel-with-channel", [[_with(None, (7, 7))]], ["inputs[0][0][7][7]", "null"]),
    ("short-image-row", [[*GOOD[:7], GOOD[7][:7]]], ["inputs[0][7] has 7 values; expected 8"]),
    ("seven-image-rows", [GOOD[:7]], ["inputs[0] has 7 items; expected 8", "[8][8]", "64 numbers"]),
    ("flat-63", [sum(GOOD, [])[:63]], ["inputs[0] has 63 values; expected 64"]),
    ("out-of-range", [_with(1e39, (4, 1))], ["inputs[0][4][1] is out of float32 range"]),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("inputs,needles", [c[1:] for c in BAD_BODIES], ids=[c[0] for c in BAD_BODIES])
def test_bad_image_rows_are_refused_with_the_place(servers, inputs, needles):
    for base in servers.values():
        r = httpx.post(f"{base}/predict", content=orjson.dumps({"inputs": inputs}), timeout=TIMEOUT,
                       headers={"content-type": "application/json"})  # fmt: skip
        assert r.status_code == 422, f"{r.status_code} {r.text[:300]}"
        detail = r.json()["detail"]
        assert all(n in detail for n in needles), detail


@pytest.mark.timeout(300)
def test_per_kernel_metrics_line_up_in_both_modes(servers, digits):
    X, _ = digits
    seen = {}
    for mode, base in servers.items():
        predict(base, layout(X[:2], "8x8"))  # FUSEDSERVE_KERNEL_TIMING_EVERY=1: every batch times its steps
        text = httpx.get(f"{base}/metrics", timeout=TIMEOUT).text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        samples = families["fusedserve_kernel_seconds"].samples
        seen[mode] = {s.labels["kernel"] for s in samples if s.name.endswith("_count") and s.value > 0}
        assert all(s.labels["model"] == "digits-cnn" and s.labels["mode"] == mode for s in samples)
    assert seen["fused"] == seen["unfused"] == set(KERNELS), seen
