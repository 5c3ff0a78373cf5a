"""Triton's model-configuration and statistics extensions (service/v2/extensions.py).

Unit: an engine's answered-request counts are kept and written together, and read back with the front end's;
instance groups say what Triton's would. End to end (slow): tritonclient's get_model_config and
get_inference_statistics over HTTP and gRPC against the real service under real uvicorn on loopback, with two front
ends and two engines, so that the statistics are sums over processes: the configuration as Triton's, the counts exact
after known numbers of requests by /predict, REST and gRPC, the times consistent, unknown models 404 / NOT_FOUND.
"""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest

from service.metrics import ANSWERED_WRITE_EVERY_S, PHASES, EngineMetrics, RequestMetrics, inference_totals
from service.v2.extensions import EXTENSIONS, instance_groups

from . import digits as digits_data
from .server import free_port, running_servers

MODEL = "digits-mlp"
MAX_ROWS = 32  # MAX_ROWS_PER_REQUEST, below MAX_BATCH_SIZE: the config's max_batch_size must be this one
MAX_BATCH = 64
DELAY_US = 1500  # MAX_DELAY_MS 1.5: the config's max_queue_delay_microseconds
TIMEOUT = httpx.Timeout(30.0, connect=5.0)
STATS = ("success", "fail", *PHASES, "cache_hit", "cache_miss")


# ------------------------------------------------------------------------------------ unit


def test_answered_counts_are_kept_then_written_together():
    m = EngineMetrics("m", "fused", "cuda:0", "float16", engine="0")
    m.batch(12)
    m.answered(3, (0.3, 0.03, 0.6, 0.003), time.monotonic())  # the last write was at construction, just now
    m.batch(4)
    m.answered(1, (0.1, 0.01, 0.2, 0.001), time.monotonic())
    t = inference_totals(m.registry, "m")
    assert (t.requests, t.rows, t.batches) == (0, 16, 2), "written before ANSWERED_WRITE_EVERY_S passed"
    m.write_answered()
    t = inference_totals(m.registry, "m")
    assert (t.requests, t.rows, t.batches) == (4, 16, 2)
    assert t.phase_s == pytest.approx({"queue": 0.4, "compute_input": 0.04, "compute_infer": 0.8,
                                       "compute_output": 0.004})  # fmt: skip
    assert time.time() - 5 < t.last_inference_s <= time.time()
    assert t.devices == {"0": "cuda:0"}
    assert inference_totals(m.registry, "other").requests == 0
    m.write_answered()  # nothing new: nothing written twice
    assert inference_totals(m.registry, "m").requests == 4
    m.answered(2, (0.0, 0.0, 0.0, 0.0), time.monotonic() + ANSWERED_WRITE_EVERY_S)  # the interval passed: written
    assert inference_totals(m.registry, "m").requests == 6


def test_front_end_totals_split_ok_from_failed():
    m = RequestMetrics("m", "unfused")
    m.observe_request("ok", 0.25, protocol="v2_rest")
    m.observe_request("ok", 0.5, protocol="v2_grpc")
    m.observe_request("invalid", 0.125)
    m.observe_request("overloaded")  # refused before any handler: counted, not timed
    t = inference_totals(m.registry, "m")
    assert (t.ok, t.ok_s, t.failed, t.failed_s) == (2, 0.75, 2, 0.125)


@pytest.mark.parametrize(
    "devices, groups",
    [
        (["cuda:0"], [{"name": "m", "kind": "KIND_GPU", "count": 1, "gpus": [0]}]),
        (["cuda:1", "cuda:0"], [{"name": "m", "kind": "KIND_GPU", "count": 1, "gpus": [0, 1]}]),
        (["cuda:0", "cuda:0", "cuda:1"], [{"name": "m_0", "kind": "KIND_GPU", "count": 1, "gpus": [1]},
                                          {"name": "m_1", "kind": "KIND_GPU", "count": 2, "gpus": [0]}]),
        (["cpu", "cpu"], [{"name": "m", "kind": "KIND_CPU", "count": 2, "gpus": []}]),
    ],
)  # fmt: skip
def test_instance_groups_count_per_gpu_as_triton_does(devices, groups):
    assert instance_groups("m", devices) == groups


# ------------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def triton():
    """tritonclient's HTTP and gRPC modules and its exception (in the test extra; a host without it skips)."""
    tgrpc = pytest.importorskip("tritonclient.grpc", reason="tritonclient[http,grpc] is not installed")
    thttp = pytest.importorskip("tritonclient.http")
    from tritonclient.utils import InferenceServerException

    return tgrpc, thttp, InferenceServerException


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> dict:
    grpc_port = free_port()
    env = {
        "dtype": "float32", "max_batch_size": MAX_BATCH, "max_rows_per_request": MAX_ROWS,
        "max_delay_ms": DELAY_US / 1000, "grpc_port": grpc_port, "workers": 2, "engines": 2,
    }  # fmt: skip
    with running_servers({"s": ("unfused", env)}, tmp_path_factory.mktemp("v2-ext-logs")) as s:
        url = s["s"].url
        yield {"url": url, "grpc": f"127.0.0.1:{grpc_port}", "host": url.removeprefix("http://")}


@pytest.fixture(scope="module")
def http(server, triton):
    client = triton[1].InferenceServerClient(server["host"], network_timeout=30)
    yield client
    client.close()


@pytest.fixture(scope="module")
def grpc_client(server, triton):
    client = triton[0].InferenceServerClient(server["grpc"])
    yield client
    client.close()


@pytest.fixture(scope="module")
def digits() -> np.ndarray:
    return digits_data.load()[0][:40].astype(np.float32)


@pytest.mark.slow
def test_config_is_tritons_over_http_and_grpc(server, http, grpc_client):
    assert http.get_server_metadata()["extensions"] == list(EXTENSIONS)
    assert list(grpc_client.get_server_metadata().extensions) == list(EXTENSIONS)

    config = http.get_model_config(MODEL)
    assert {k: config[k] for k in ("name", "platform", "backend", "max_batch_size")} == {
        "name": MODEL, "platform": "fusedserve", "backend": "fusedserve", "max_batch_size": MAX_ROWS,
    }  # fmt: skip
    (inp,) = config["input"]
    assert (inp["name"], inp["data_type"], inp["dims"]) == ("input", "TYPE_FP32", [64])
    logits, label = config["output"]
    assert (logits["name"], logits["data_type"], logits["dims"]) == ("logits", "TYPE_FP32", [10])
    assert (label["name"], label["data_type"], label["dims"], label["reshape"]) == (
        "label", "TYPE_STRING", [1], {"shape": []},
    )  # fmt: skip
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == DELAY_US
    # Two engines: on the CPU, or on a GPU host both on the first visible GPU (one GPU) or one on each (two or more).
    import torch

    gpus = torch.cuda.device_count()
    expected = (
        {"name": MODEL, "kind": "KIND_CPU", "count": 2, "gpus": []} if not gpus
        else {"name": MODEL, "kind": "KIND_GPU", "count": 2, "gpus": [0]} if gpus == 1
        else {"name": MODEL, "kind": "KIND_GPU", "count": 1, "gpus": [0, 1]}
    )  # fmt: skip
    assert config["instance_group"] == [expected]
    assert config["parameters"]["mode"] == {"string_value": "unfused"}
    assert config["parameters"]["engine_max_batch_size"] == {"string_value": str(MAX_BATCH)}
    assert http.get_model_config(MODEL, "1") == config

    # gRPC's message holds the same configuration: REST's JSON parsed into tritonclient's own ModelConfig is equal.
    from google.protobuf import json_format
    from tritonclient.grpc import model_config_pb2

    message = grpc_client.get_model_config(MODEL).config
    assert json_format.ParseDict(config, model_config_pb2.ModelConfig()) == message
    assert message.max_batch_size == MAX_ROWS and list(message.input[0].dims) == [64]
    assert grpc_client.get_model_config(MODEL, "1").config == message


@pytest.mark.slow
@pytest.mark.parametrize(
    "path",
    ["/v2/models/nope/config", "/v2/models/nope/stats", f"/v2/models/{MODEL}/versions/2/config",
     f"/v2/models/{MODEL}/versions/2/stats"],
)  # fmt: skip
def test_unknown_model_or_version_is_404(server, path):
    r = httpx.get(server["url"] + path, timeout=TIMEOUT)
    assert r.status_code == 404, r.text
    assert ("unknown model 'nope'" if "nope" in path else "unknown version '2'") in r.json()["error"]


@pytest.mark.slow
def test_unknown_model_is_not_found_over_grpc(triton, grpc_client, http):
    InferenceServerException = triton[2]
    for call in (grpc_client.get_model_config, grpc_client.get_inference_statistics):
        with pytest.raises(InferenceServerException, match="unknown model 'nope'") as e:
            call("nope")
        assert e.value.status() == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException, match="unknown model 'nope'"):
        http.get_model_config("nope")


@pytest.mark.slow
def test_routes_are_listed_and_take_get_only(server):
    with httpx.Client(base_url=server["url"], timeout=TIMEOUT) as c:
        paths = c.get("/openapi.json").json()["paths"]
        for path in (
            "/v2/models/stats",
            "/v2/models/{name}/config",
            "/v2/models/{name}/stats",
            "/v2/models/{name}/versions/{version}/config",
            "/v2/models/{name}/versions/{version}/stats",
        ):
            assert "get" in paths[path], path
        for path in ("/v2/models/stats", f"/v2/models/{MODEL}/config", f"/v2/models/{MODEL}/versions/1/stats"):
            r = c.post(path, content=b"{}")
            assert r.status_code == 405 and r.headers["allow"] == "GET", (path, r.status_code, r.text)


def _stats(url: str) -> dict:
    doc = httpx.get(f"{url}/v2/models/{MODEL}/stats", timeout=TIMEOUT).json()
    (stat,) = doc["model_stats"]
    return stat


def _delta(after: dict, before: dict) -> dict:
    out = {k: after[k] - before[k] for k in ("inference_count", "execution_count")}
    for k in STATS:
        out[k] = {f: after["inference_stats"][k][f] - before["inference_stats"][k][f] for f in ("count", "ns")}
    return out


def _settled(url: str, before: dict, requests: int, timeout_s: float = 15.0) -> dict:
    """The statistics once the engines have written `requests` more answered requests (they write when idle)."""
    end = time.monotonic() + timeout_s
    while True:
        after = _stats(url)
        d = _delta(after, before)
        if d["queue"]["count"] >= requests and d["success"]["count"] >= requests or time.monotonic() > end:
            return after
        time.sleep(0.05)


@pytest.mark.slow
def test_statistics_count_what_was_sent(triton, server, http, grpc_client, digits):
    tgrpc, thttp, InferenceServerException = triton
    url = server["url"]
    before = _stats(url)
    t0_ms = time.time() * 1000
    sent_rows = 0
    # One request at a time, each answered before the next: each is a batch of its own. /predict on fresh
    # connections, spread over the two front ends by the kernel; REST and gRPC each on its client's connection.
    for i in range(4):
        r = httpx.post(f"{url}/predict", json={"inputs": digits[i : i + 3].tolist()}, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        sent_rows += 3
    for i in range(5):
        inp = thttp.InferInput("input", [2, 64], "FP32")
        inp.set_data_from_numpy(digits[i : i + 2], binary_data=True)
        http.infer(MODEL, [inp])
        sent_rows += 2
    for i in range(6):
        inp = tgrpc.InferInput("input", [MAX_ROWS, 64], "FP32")
        inp.set_data_from_numpy(np.roll(np.resize(digits, (MAX_ROWS, 64)), i, axis=0))
        grpc_client.infer(MODEL, [inp], client_timeout=30)
        sent_rows += MAX_ROWS
    sent = 15
    # Refused before a batch: counted as failures, never in the engines' counts.
    r = httpx.post(f"{url}/predict", json={"inputs": [[1.0] * 63]}, timeout=TIMEOUT)
    assert r.status_code == 422
    with pytest.raises(InferenceServerException):
        inp = tgrpc.InferInput("input", [MAX_ROWS + 1, 64], "FP32")
        inp.set_data_from_numpy(np.resize(digits, (MAX_ROWS + 1, 64)))
        grpc_client.infer(MODEL, [inp], client_timeout=30)

    after = _settled(url, before, sent)
    d = _delta(after, before)
    assert d["success"]["count"] == sent and d["fail"]["count"] == 2
    for phase in PHASES:
        assert d[phase]["count"] == sent, (phase, d)
    assert d["inference_count"] == sent_rows and d["execution_count"] == sent
    assert d["cache_hit"] == d["cache_miss"] == {"count": 0, "ns": 0}
    for k in ("success", "fail", *PHASES):
        assert d[k]["ns"] > 0, (k, d)
    # Each answered request's four phases lie inside its success time, one after another.
    assert d["queue"]["ns"] + d["compute_infer"]["ns"] <= sum(d[p]["ns"] for p in PHASES) <= d["success"]["ns"], d
    assert t0_ms <= after["last_inference"] <= time.time() * 1000
    assert after["name"] == MODEL and after["version"] == "1"
    # Numbers, not strings, in every count: perf_analyzer reads them with rapidjson's GetUint64.
    assert all(isinstance(after["inference_stats"][k][f], int) for k in STATS for f in ("count", "ns"))

    # Quiet now: every way of asking gives the same numbers.
    assert httpx.get(f"{url}/v2/models/stats", timeout=TIMEOUT).json() == {"model_stats": [after]}
    assert httpx.get(f"{url}/v2/models/{MODEL}/versions/1/stats", timeout=TIMEOUT).json()["model_stats"] == [after]
    assert http.get_inference_statistics(MODEL)["model_stats"] == [after]
    response = grpc_client.get_inference_statistics(MODEL)
    (stat,) = response.model_stats
    assert (stat.name, stat.version, stat.last_inference) == (MODEL, "1", after["last_inference"])
    assert (stat.inference_count, stat.execution_count) == (after["inference_count"], after["execution_count"])
    for k in STATS:
        got = getattr(stat.inference_stats, k)
        assert (got.count, got.ns) == (after["inference_stats"][k]["count"], after["inference_stats"][k]["ns"]), k
    assert grpc_client.get_inference_statistics("").model_stats[0] == stat  # every model's: the one
