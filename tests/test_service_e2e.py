"""End to end: the real service under real uvicorn on a loopback port, in both modes, over HTTP.

Each mode's server starts once per module (`python -m service.cli serve`, see tests/server.py);
the tests send real held-out digits, bad bodies, concurrent bursts and disconnecting clients, and
read back /metrics. Fused kernels run in Triton's interpreter here (no GPU), which is slow but
exercises the same code path.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .digits import held_out_split
from .server import free_port, running_servers, service_env

pytestmark = pytest.mark.slow

MODES = ("fused", "unfused")
MODEL = "digits-mlp"
KERNELS = ("mlp_0_2",)  # the whole digits MLP is one kernel (one plan, both modes)
FEATURES = 64
MAX_BATCH = 64  # small, so that "too many rows" is cheap to send
# 20 ms: long enough that a concurrent burst shares batches, short enough for serial requests.
TIMING_EVERY = 2  # every 2nd batch times its kernels (on CUDA: its bucket's timed graph); the others replay a graph
# float32 in both places (DTYPE's default is float16 on CUDA): the fused-vs-unfused tolerances below are float32's.
# The access log in JSON lines: a line per request on the server's standard output (test_access_log_...).
MAIN_ENV = {"max_batch_size": MAX_BATCH, "max_delay_ms": 20, "kernel_timing_every": TIMING_EVERY, "dtype": "float32",
            "access_log": "json"}  # fmt: skip
# A queue of one and a long batch delay: bursts overflow, and a client can leave before its batch runs.
SLOW_DELAY_MS = 500
SLOW_ENV = {"max_batch_size": MAX_BATCH, "max_delay_ms": SLOW_DELAY_MS, "max_queue_requests": 1}
CHUNK = 32  # rows per request for the held-out set
TIMEOUT = httpx.Timeout(30.0, connect=5.0)
RTOL_VS_UNFUSED = 1e-4  # float32, fused vs unfused, relative to |x| + rms(row)
RTOL_BATCHED = 1e-5  # one row alone vs the same row inside a larger batch (block shapes may differ)


# ----------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("e2e-logs")


@pytest.fixture(scope="module")
def servers(log_dir) -> dict[str, str]:
    """One fused and one unfused server (started together), {mode: base URL}."""
    with running_servers({m: (m, MAIN_ENV) for m in MODES}, log_dir) as s:
        yield {m: srv.url for m, srv in s.items()}


@pytest.fixture(scope="module")
def slow_servers(log_dir) -> dict[str, str]:
    with running_servers({m: (m, SLOW_ENV) for m in MODES}, log_dir) as s:
        yield {m: srv.url for m, srv in s.items()}


@pytest.fixture(params=MODES)
def mode(request) -> str:
    return request.param


@pytest.fixture
def url(servers, mode) -> str:
    return servers[mode]


@pytest.fixture(scope="module")
def digits() -> tuple[np.ndarray, np.ndarray]:
    """The 360 held-out rows of sklearn's digits (raw pixels 0..16) and their labels."""
    X_test, y_test = held_out_split()
    assert X_test.shape == (360, FEATURES)
    return X_test, y_test


@pytest.fixture(scope="module")
def held_out(servers, digits) -> dict[str, dict]:
    """Every held-out row through each server in requests of CHUNK rows: {mode: {"docs", "outputs"}}."""
    X, _ = digits
    result = {}
    with httpx.Client(timeout=TIMEOUT) as client:
        for m, base in servers.items():
            docs = []
            for start in range(0, len(X), CHUNK):
                r = client.post(f"{base}/predict", json={"inputs": X[start : start + CHUNK].tolist()})
                assert r.status_code == 200, f"{m}: rows {start}..: {r.status_code} {r.text[:500]}"
                docs.append(r.json())
            outputs = np.concatenate([np.asarray(d["outputs"], dtype=np.float32) for d in docs])
            result[m] = {"docs": docs, "outputs": outputs}
    return result


# ----------------------------------------------------------------------------------------- helpers


def assert_rows_close(got: np.ndarray, want: np.ndarray, rtol: float, what: str) -> None:
    """|got - want| <= rtol * (|want| + rms(want's row)): relative, anchored to the row's scale near 0."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.isfinite(got).all(), f"{what}: non-finite outputs"
    bound = rtol * (np.abs(want) + np.sqrt((want**2).mean(axis=-1, keepdims=True)))
    err = np.abs(got - want)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), (
        f"{what}: error {err[worst]:.3e} > bound {bound[worst]:.3e} at {worst}: "
        f"got {got[worst]!r}, want {want[worst]!r}"
    )


def labels_of(outputs: np.ndarray) -> list[str]:
    return [str(i) for i in np.argmax(outputs, axis=1)]


def scrape(base: str) -> dict[str, object]:
    """GET /metrics, parsed: {family name: Metric}."""
    r = httpx.get(f"{base}/metrics", timeout=TIMEOUT)
    assert r.status_code == 200, r.text[:500]
    assert r.headers["content-type"].startswith("text/plain"), r.headers["content-type"]
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def sample_value(families: dict, family: str, sample: str, **labels: str) -> float:
    """The one sample `sample` of `family` whose labels include `labels` (0.0 when there is none)."""
    found = [
        s.value
        for s in families[family].samples
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(found) <= 1, f"{sample}{labels}: {len(found)} samples"
    return found[0] if found else 0.0


def body(inputs, **extra) -> bytes:
    return orjson.dumps({"inputs": inputs, **extra})


async def _post_all(base: str, bodies: list[bytes], timeout: httpx.Timeout = TIMEOUT) -> list[httpx.Response]:
    """POST every body to /predict at once; the whole burst is bounded in time."""
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(base_url=base, timeout=timeout, limits=limits) as client:
        tasks = [client.post("/predict", content=b, headers=headers) for b in bodies]
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout=90)


def post_all(base: str, bodies: list[bytes], timeout: httpx.Timeout = TIMEOUT) -> list[httpx.Response]:
    return asyncio.run(_post_all(base, bodies, timeout))


# ----------------------------------------------------------------------------------------- health


@pytest.mark.timeout(150)
def test_health_and_model(url, mode):
    with httpx.Client(base_url=url, timeout=TIMEOUT) as client:
        r = client.get("/health/live")
        assert r.status_code == 200 and r.json() == {"status": "live"}, r.text
        r = client.get("/health/ready")
        assert r.status_code == 200, r.text
        doc = r.json()
        assert doc["status"] == "ready" and doc["model"] == MODEL and doc["mode"] == mode, doc
        assert doc["device"].split(":")[0] in ("cpu", "cuda"), doc
        r = client.get("/model")
        assert r.status_code == 200, r.text
        info = r.json()
    assert info["name"] == MODEL and info["mode"] == mode and info["status"] == "ready", info
    assert info["input_shape"] == [FEATURES] and info["output_features"] == 10
    assert info["labels"] == [str(i) for i in range(10)]
    assert info["max_batch_size"] == MAX_BATCH and info["max_rows_per_request"] == MAX_BATCH, info
    kernels = [step["kernel"] for step in info["plan"] if step["kernel"]]
    assert kernels == list(KERNELS), info["plan"]
    (mlp,) = info["plan"]
    assert [(s["in"], s["out"], s["activation"]) for s in mlp["layers"]] == [
        (64, 256, "relu"),
        (256, 256, "relu"),
        (256, 10, "none"),
    ], info["plan"]


# ----------------------------------------------------------------------------------------- predictions


@pytest.mark.timeout(150)
def test_predicts_held_out_digits(held_out, mode, digits):
    X, y = digits
    docs = held_out[mode]["docs"]
    for i, doc in enumerate(docs):
        n = min(CHUNK, len(X) - i * CHUNK)
        assert set(doc) == {"outputs", "predictions", "model", "mode"}, sorted(doc)
        assert doc["model"] == MODEL and doc["mode"] == mode, (doc["model"], doc["mode"])
        out = doc["outputs"]
        assert len(out) == n and all(len(row) == 10 for row in out), f"request {i}: outputs not {n} x 10"
        assert all(isinstance(v, float) for row in out for v in row), f"request {i}: outputs not all floats"
        assert doc["predictions"] == labels_of(np.asarray(out)), f"request {i}: predictions != argmax(outputs)"
    predictions = [p for doc in docs for p in doc["predictions"]]
    assert len(predictions) == len(y)
    accuracy = float(np.mean(np.asarray(predictions) == y.astype(str)))
    assert accuracy >= 0.95, f"{mode}: held-out accuracy {accuracy:.4f} < 0.95"


@pytest.mark.timeout(150)
def test_fused_matches_unfused(held_out):
    fused, unfused = held_out["fused"]["outputs"], held_out["unfused"]["outputs"]
    assert_rows_close(fused, unfused, RTOL_VS_UNFUSED, "fused vs unfused outputs")
    assert labels_of(fused) == labels_of(unfused)


# ----------------------------------------------------------------------------------------- validation

GOOD_ROW = [float(v % 17) for v in range(FEATURES)]


def _row_with(index: int, value) -> list:
    row = list(GOOD_ROW)
    row[index] = value
    return row


def _raw_row_with(index: int, literal: bytes) -> bytes:
    values = [orjson.dumps(v) for v in GOOD_ROW]
    values[index] = literal
    return b'{"inputs": [[' + b", ".join(values) + b"]]}"


# (id, body, status, substrings every one of which the detail must contain)
BAD_BODIES = [
    ("short-row", body([GOOD_ROW[:63]]), 422, ["inputs[0] has 63 values", "64"]),
    ("short-second-row", body([GOOD_ROW, GOOD_ROW[:63]]), 422, ["inputs[1] has 63 values"]),
    ("long-row", body([[*GOOD_ROW, 1.0]]), 422, ["inputs[0] has 65 values"]),
    ("string", body([_row_with(5, "7")]), 422, ["inputs[0][5]", "string"]),
    ("boolean", body([_row_with(3, True)]), 422, ["inputs[0][3]", "boolean"]),
    ("null", body([_row_with(7, None)]), 422, ["inputs[0][7]", "null"]),
    ("nested-list", body([_row_with(9, [1, 2])]), 422, ["inputs[0][9]", "list"]),
    ("row-not-list", body([GOOD_ROW, 3]), 422, ["inputs[1]"]),
    ("nan-literal", _raw_row_with(4, b"NaN"), 422, ["NaN"]),
    ("infinity-literal", _raw_row_with(4, b"-Infinity"), 422, ["Infinity"]),
    ("1e39", _raw_row_with(2, b"1e39"), 422, ["inputs[0][2]", "float32 range"]),
    ("empty-inputs", body([]), 422, ["empty"]),
    ("inputs-not-list", orjson.dumps({"inputs": 5}), 422, ["inputs must be a list"]),
    ("missing-inputs", b"{}", 422, ["missing field 'inputs'"]),
    ("unknown-field", body([GOOD_ROW], extra=1), 422, ["unknown field", "'extra'"]),
    ("not-json", b"inputs=1,2,3", 400, ["not valid JSON"]),
    ("truncated-json", body([GOOD_ROW])[:-3], 400, ["not valid JSON"]),
    ("not-an-object", body([GOOD_ROW])[len(b'{"inputs":') : -1], 422, ["JSON object", "list"]),
    ("too-many-rows", body([GOOD_ROW] * (MAX_BATCH + 1)), 413, [f"{MAX_BATCH + 1} rows", f"at most {MAX_BATCH}"]),
]


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("payload", "status", "needles"), [c[1:] for c in BAD_BODIES], ids=[c[0] for c in BAD_BODIES])
def test_bad_body_is_refused_with_reason(url, payload, status, needles):
    r = httpx.post(f"{url}/predict", content=payload, headers={"content-type": "application/json"}, timeout=TIMEOUT)
    assert r.status_code == status, f"{r.status_code} {r.text[:500]}"
    assert r.headers["content-type"] == "application/json"
    detail = r.json()["detail"]
    assert isinstance(detail, str)
    for needle in needles:
        assert needle in detail, f"{needle!r} not in detail {detail!r}"


@pytest.mark.timeout(150)
def test_access_log_has_a_json_line_per_request(url, mode, log_dir):
    """FUSEDSERVE_ACCESS_LOG=json: one object a line per request with its id, route, status, rows, mode, latency,
    and a refusal's reason (issue 51: a refused request left no trace but a counter)."""
    port = url.rsplit(":", 1)[1]
    ok_id, bad_id = f"ok-{mode}-{port}", f"bad-{mode}-{port}"
    with httpx.Client(timeout=TIMEOUT) as client:
        ok = client.post(f"{url}/predict", json={"inputs": [GOOD_ROW] * 3}, headers={"x-request-id": ok_id})
        assert ok.status_code == 200, ok.text
        bad = client.post(f"{url}/predict", json={"inputs": [[1.0] * 3]}, headers={"x-request-id": bad_id})
        assert bad.status_code == 422
    (log,) = log_dir.glob(f"fusedserve-{mode}-{port}.log")
    lines: dict = {}
    deadline = time.monotonic() + 10  # written by the front end's access-log thread, a moment later
    while len(lines) < 2 and time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith("{") and (ok_id in line or bad_id in line):
                doc = json.loads(line)
                lines[doc["request_id"]] = doc
        time.sleep(0.1)
    ok, refused = lines[ok_id], lines[bad_id]  # the access log's lines of the two
    assert (ok["method"], ok["route"], ok["status"], ok["rows"], ok["mode"]) == ("POST", "/predict", 200, 3, mode)
    assert 0 < ok["latency_ms"] < 30_000 and "reason" not in ok and ok["time"].endswith("Z")
    assert (refused["status"], refused["rows"], refused["mode"]) == (422, None, None)
    assert refused["reason"] == bad.json()["detail"]


@pytest.mark.timeout(150)
def test_bad_requests_leave_concurrent_good_ones_alone(url, mode, digits, held_out):
    X, _ = digits
    want = held_out[mode]["outputs"]
    bad = [*BAD_BODIES, *BAD_BODIES][:20]
    plan = []  # (kind, row slice or bad case) interleaved: good, good, bad, ...
    good_i = bad_i = 0
    while good_i < 40 or bad_i < len(bad):
        for _ in range(2):
            if good_i < 40:
                start = (good_i * 7) % (len(X) - 3)
                plan.append(("good", slice(start, start + 1 + good_i % 3)))
                good_i += 1
        if bad_i < len(bad):
            plan.append(("bad", bad[bad_i]))
            bad_i += 1
    bodies = [body(X[p].tolist()) if kind == "good" else p[1] for kind, p in plan]
    responses = post_all(url, bodies)
    n_good = n_bad = 0
    for (kind, p), r in zip(plan, responses, strict=True):
        if kind == "good":
            n_good += 1
            assert r.status_code == 200, f"good rows {p}: {r.status_code} {r.text[:300]}"
            doc = r.json()
            got = np.asarray(doc["outputs"], dtype=np.float32)
            assert_rows_close(got, want[p], RTOL_BATCHED, f"good rows {p}")
            assert doc["predictions"] == labels_of(want[p]), f"good rows {p}"
        else:
            n_bad += 1
            name, _, status, needles = p
            assert r.status_code == status, f"{name}: {r.status_code} {r.text[:300]}"
            assert all(n in r.json()["detail"] for n in needles), f"{name}: {r.text[:300]}"
    assert (n_good, n_bad) == (40, 20)


# ----------------------------------------------------------------------------------------- batching


def batch_rows_stats(base: str) -> tuple[float, float, float]:
    """(sum of rows, number of batches, batches of <= 1 row) from fusedserve_batch_rows."""
    fam = scrape(base)
    return (
        sample_value(fam, "fusedserve_batch_rows", "fusedserve_batch_rows_sum"),
        sample_value(fam, "fusedserve_batch_rows", "fusedserve_batch_rows_count"),
        sample_value(fam, "fusedserve_batch_rows", "fusedserve_batch_rows_bucket", le="1.0"),
    )


@pytest.mark.timeout(150)
def test_concurrent_single_rows_share_batches(url, digits):
    X, _ = digits
    rows = X[:64]
    # The reference: each row alone, one request after the other (each one its own batch).
    with httpx.Client(base_url=url, timeout=TIMEOUT) as client:
        alone = []
        for row in rows:
            r = client.post("/predict", json={"inputs": [row.tolist()]})
            assert r.status_code == 200, r.text[:300]
            alone.append(r.json()["outputs"][0])
    alone = np.asarray(alone, dtype=np.float32)

    rows_before, batches_before, ones_before = batch_rows_stats(url)
    responses = post_all(url, [body([row.tolist()]) for row in rows])
    rows_after, batches_after, ones_after = batch_rows_stats(url)

    for i, r in enumerate(responses):
        assert r.status_code == 200, f"row {i}: {r.status_code} {r.text[:300]}"
        doc = r.json()
        assert_rows_close(np.asarray(doc["outputs"], dtype=np.float32), alone[i : i + 1], RTOL_BATCHED, f"row {i}")
        assert doc["predictions"] == labels_of(alone[i : i + 1]), f"row {i}"
    rows_seen = rows_after - rows_before
    batches = batches_after - batches_before
    single_row_batches = ones_after - ones_before
    assert rows_seen == 64, f"the forward saw {rows_seen} rows for 64 single-row requests"
    assert 1 <= batches < 64, f"{batches} batches for 64 concurrent single-row requests: nothing was batched"
    assert single_row_batches < batches, "every batch held one row"


# ----------------------------------------------------------------------------------------- overload


@pytest.mark.timeout(150)
def test_overload_answers_503_with_retry_after(slow_servers, mode, digits):
    X, y = digits
    base = slow_servers[mode]
    # 48 rows: two requests never share a 64-row batch, so one runs, one waits and the rest overflow.
    slices = [slice(s, s + 48) for s in ((i * 11) % (len(X) - 48) for i in range(30))]
    started = time.monotonic()
    responses = post_all(base, [body(X[s].tolist()) for s in slices], timeout=httpx.Timeout(30.0, connect=5.0))
    elapsed = time.monotonic() - started
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 503}, statuses
    assert statuses.count(503) >= 1, f"no request was refused with a queue of 1: {statuses}"
    assert statuses.count(200) >= 1, f"every request was refused: {statuses}"
    for s, r in zip(slices, responses, strict=True):
        if r.status_code == 503:
            assert r.headers.get("retry-after", "").isdigit(), dict(r.headers)
            assert "overloaded" in r.json()["detail"], r.text
        else:
            predictions = r.json()["predictions"]
            accuracy = np.mean(np.asarray(predictions) == y[s].astype(str))
            assert len(predictions) == 48 and accuracy >= 0.85, f"rows {s}: accuracy {accuracy}"
    assert elapsed < 60, f"the burst took {elapsed:.1f} s"
    # Refusing did not break the server: it answers the next request normally.
    r = httpx.post(f"{base}/predict", json={"inputs": X[:2].tolist()}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text[:300]


@pytest.mark.timeout(150)
def test_client_that_leaves_is_counted_cancelled(slow_servers, mode, digits):
    X, _ = digits
    base = slow_servers[mode]
    labels = {"model": MODEL, "mode": mode, "protocol": "predict", "outcome": "cancelled"}
    before = sample_value(scrape(base), "fusedserve_requests", "fusedserve_requests_total", **labels)
    # The batch waits SLOW_DELAY_MS for company; the client gives up long before that.
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{base}/predict", json={"inputs": X[:1].tolist()}, timeout=httpx.Timeout(0.1, connect=5.0))
    deadline = time.monotonic() + 10
    while True:
        now = sample_value(scrape(base), "fusedserve_requests", "fusedserve_requests_total", **labels)
        if now >= before + 1 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert now == before + 1, f"outcome=cancelled went {before} -> {now}"
    r = httpx.post(f"{base}/predict", json={"inputs": X[:1].tolist()}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text[:300]


# ----------------------------------------------------------------------------------------- metrics


@pytest.mark.timeout(150)
def test_metrics_after_traffic(url, mode, digits):
    X, _ = digits
    with httpx.Client(base_url=url, timeout=TIMEOUT) as client:
        # One after another, so each is a batch: at least TIMING_EVERY of them on this server even when this
        # test is the first it serves (under xdist each worker starts its own servers).
        for _ in range(TIMING_EVERY):
            assert client.post("/predict", json={"inputs": X[:5].tolist()}).status_code == 200
        assert client.post("/predict", json={"inputs": [[1.0] * 3]}).status_code == 422
    fam = scrape(url)
    lm = {"model": MODEL, "mode": mode}
    for name in (
        "fusedserve_kernel_seconds", "fusedserve_forward_seconds", "fusedserve_request_seconds",
        "fusedserve_queue_wait_seconds", "fusedserve_batch_rows",
    ):  # fmt: skip
        assert fam[name].type == "histogram", (name, fam[name].type)
        for s in fam[name].samples:
            assert {k: s.labels.get(k) for k in lm} == lm, (name, s)

    def count(name: str, **labels) -> float:
        return sample_value(fam, name, name + "_count", **lm, **labels)

    batches = count("fusedserve_batch_rows")
    assert batches > 0
    assert count("fusedserve_forward_seconds") == batches, "a forward time per batch"
    assert count("fusedserve_queue_wait_seconds") >= batches, "a queue wait per request in a batch"
    assert count("fusedserve_request_seconds", protocol="predict") >= 1
    kernels = {s.labels["kernel"] for s in fam["fusedserve_kernel_seconds"].samples}
    assert kernels == set(KERNELS), kernels
    kernel_sum = 0.0
    for k in KERNELS:
        # batches 2, 4, 6, ... time every kernel (FUSEDSERVE_KERNEL_TIMING_EVERY=2)
        assert count("fusedserve_kernel_seconds", kernel=k) == batches // TIMING_EVERY, k
        kernel_sum += sample_value(fam, "fusedserve_kernel_seconds", "fusedserve_kernel_seconds_sum", **lm, kernel=k)
    forward_sum = sample_value(fam, "fusedserve_forward_seconds", "fusedserve_forward_seconds_sum", **lm)
    assert 0 < kernel_sum <= forward_sum, f"kernels {kernel_sum} s within forwards {forward_sum} s"
    buckets = [
        float(s.labels["le"])
        for s in fam["fusedserve_kernel_seconds"].samples
        if s.name.endswith("_bucket") and s.labels["kernel"] == KERNELS[0]
    ]
    finite = [b for b in buckets if math.isfinite(b)]
    assert min(finite) <= 2e-6, f"smallest kernel bucket {min(finite)} s is too coarse for microsecond kernels"
    assert math.inf in buckets

    requests = fam["fusedserve_requests"]
    assert requests.type == "counter"
    plm = {**lm, "protocol": "predict"}
    assert sample_value(fam, "fusedserve_requests", "fusedserve_requests_total", **plm, outcome="ok") > 0
    assert sample_value(fam, "fusedserve_requests", "fusedserve_requests_total", **plm, outcome="invalid") > 0
    outcomes = {s.labels["outcome"] for s in requests.samples if s.name == "fusedserve_requests_total"}
    protocols = {s.labels["protocol"] for s in requests.samples if s.name == "fusedserve_requests_total"}
    assert protocols == {"predict", "v2_rest", "v2_grpc"}, protocols
    assert {"ok", "invalid", "too_large", "overloaded", "timeout", "cancelled", "error"} <= outcomes, outcomes
    assert sample_value(fam, "fusedserve_requests", "fusedserve_requests_total", **plm, outcome="error") == 0

    # Engine metrics also name their engine (one engine here: "0"), summed over processes by the multiprocess mode.
    depth = [s for s in fam["fusedserve_queue_depth"].samples if s.labels == {**lm, "engine": "0"}]
    assert fam["fusedserve_queue_depth"].type == "gauge" and len(depth) == 1 and depth[0].value == 0, depth
    info = fam["fusedserve_model_info"].samples
    assert len(info) == 1 and info[0].value == 1, info
    assert info[0].labels["device"].split(":")[0] in ("cpu", "cuda"), info[0].labels
    assert info[0].labels["dtype"] == "float32" and {k: info[0].labels[k] for k in lm} == lm, info[0].labels
    assert info[0].labels["engine"] == "0", info[0].labels


def test_readme_demo_body_answers_with_true_labels(url, mode):
    """The README posts model_weights/digits-mlp/examples.json as it is: it must be a valid body."""
    model_dir = Path(__file__).resolve().parents[1] / "model_weights" / "digits-mlp"
    body = (model_dir / "examples.json").read_bytes()
    truth = json.loads((model_dir / "examples_labels.json").read_text())
    r = httpx.post(url + "/predict", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["predictions"] == [str(t) for t in truth] and r.json()["mode"] == mode


# ----------------------------------------------------------------------------------------- startup errors


def _fusedserve() -> list[str]:
    script = Path(sys.executable).with_name("fusedserve")
    if script.exists():
        return [str(script)]
    found = shutil.which("fusedserve")
    return [found] if found else [sys.executable, "-m", "service.cli"]


def _serve_fails(tmp_path: Path, **env) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    proc = subprocess.run(
        [*_fusedserve(), "serve", "--port", str(free_port())], env=service_env(**env), cwd=tmp_path,
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    return proc, time.monotonic() - started


@pytest.mark.timeout(120)
def test_bad_mode_stops_the_start(tmp_path):
    proc, elapsed = _serve_fails(tmp_path, FUSEDSERVE_MODE="bogus")
    assert proc.returncode != 0, proc
    assert "FUSEDSERVE_MODE" in proc.stderr and "bogus" in proc.stderr, proc.stderr
    assert "Uvicorn running" not in proc.stderr + proc.stdout
    assert elapsed < 60, f"took {elapsed:.1f} s to refuse"


@pytest.mark.timeout(120)
def test_missing_model_stops_the_start(tmp_path):
    proc, elapsed = _serve_fails(tmp_path, FUSEDSERVE_MODEL="/nonexistent", FUSEDSERVE_MODE="unfused")
    assert proc.returncode != 0, proc
    assert "/nonexistent" in proc.stderr, proc.stderr
    assert "Uvicorn running" not in proc.stderr + proc.stdout
    assert elapsed < 60, f"took {elapsed:.1f} s to refuse"
