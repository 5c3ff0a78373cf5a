"""Who may call what (issue 38, docs/security.md): API keys for inference, restricted routes, the metrics port, docs
off, TLS and mutual TLS, request ids.

The settings and the key file's parsing are checked in process; the rest against real servers on loopback (real
uvicorn, real grpcio), through the clients a user has: httpx, raw sockets, and tritonclient's HTTP and gRPC clients
unmodified. Certificates are made at test time (tests/tlscerts.py). Three servers, started once for the module:
`keys` (API keys, restricted routes, gRPC, docs off, and an injected forward failure for the request-id log line),
`tls` (API keys over TLS, gRPC over TLS, /metrics on a port of its own) and `mtls` (mutual TLS).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import socket
import ssl
from functools import partial
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest

from service.config import ENV_PREFIX, SettingsError, load_settings, parse_restricted
from service.frontend import requestid
from service.frontend.auth import ApiKeys, Restrictions, SecurityFileError, api_of_path, check_tls, read_keys

from .server import free_port, running_servers
from .tlscerts import make_certs

MODEL = "digits-mlp"
KEY = "k-3f9a1c0d5e7b2a64"  # in the keys file as itself
HASHED_KEY = "second-key-8d2e"  # in the keys file as sha256:<hex> only
ENV_KEY = "env-key-77aa"  # FUSEDSERVE_API_KEY
ADMIN = ("X-Admin-Key", "adm-51c9")
ROW = [0.5] * 64
TIMEOUT = httpx.Timeout(30.0, connect=5.0)


def trusting(ca: Path, client=None) -> ssl.SSLContext:
    """An httpx `verify` context that trusts `ca`, presenting `client` ((cert, key) paths) when given."""
    ctx = ssl.create_default_context(cafile=str(ca))
    if client is not None:
        ctx.load_cert_chain(*map(str, client))
    return ctx


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def keys_file(path: Path) -> Path:
    digest = hashlib.sha256(HASHED_KEY.encode()).hexdigest()
    path.write_text(f"# fusedserve API keys\n\n{KEY}\n  # a comment\nsha256:{digest.upper()}\n")
    return path


# ------------------------------------------------------------------ in process: settings, keys, paths, ids


def _settings(monkeypatch, **env):
    for k in [k for k in os.environ if k.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(ENV_PREFIX + k.upper(), str(v))
    return load_settings()


def test_restricted_api_format_and_its_errors_never_show_the_value(monkeypatch):
    rules = parse_restricted("metrics, statistics:X-Admin-Key=a=b ; docs:X-Docs=w")
    assert set(rules) == {"metrics", "statistics", "docs"}
    assert rules["metrics"] == ("x-admin-key", hashlib.sha256(b"a=b").digest())  # a value may hold '='
    for bad, said in [
        ("metrics", "expected API[,API...]:HEADER=VALUE"),
        ("health:X-A=topsecret", "health is always open"),
        ("metricz:X-A=topsecret", "unknown API 'metricz'"),
        ("metrics:X A=topsecret", "is not an HTTP header name"),
        ("metrics:X-A=", "must be printable ASCII"),
        ("metrics:X-A=topsecret;metrics:X-B=topsecret", "metrics is restricted twice"),
        ("metrics:X-A=top,secret", "holds ','"),
    ]:
        with pytest.raises(SettingsError) as e:
            _settings(monkeypatch, restricted_api=bad)
        assert said in str(e.value) and "RESTRICTED_API" in str(e.value), str(e.value)
        assert "topsecret" not in str(e.value) and "secret" not in str(e.value).replace("RESTRICTED", ""), str(e.value)
    s = _settings(monkeypatch, restricted_api="model:X-A=topsecret", api_key="topsecret")
    assert "topsecret" not in repr(s) and "topsecret" not in str(s.model_dump())


def test_tls_and_port_settings_are_checked_together(monkeypatch):
    for env, said in [
        ({"tls_cert": "/c.pem"}, "TLS_CERT is set without FUSEDSERVE_TLS_KEY"),
        ({"tls_key": "/k.pem"}, "TLS_KEY is set without FUSEDSERVE_TLS_CERT"),
        ({"tls_client_ca": "/ca.pem"}, "TLS_CLIENT_CA needs"),
        ({"metrics_port": 8000}, "METRICS_PORT (8000) must differ"),
    ]:
        with pytest.raises(SettingsError, match=re.escape(said)):
            _settings(monkeypatch, **env)


def test_keys_file_lines_comments_hashes_and_errors(tmp_path, monkeypatch):
    path = keys_file(tmp_path / "keys")
    digests, source = read_keys(_settings(monkeypatch, api_keys_file=path, api_key=ENV_KEY))
    assert sorted(digests) == sorted(hashlib.sha256(k.encode()).digest() for k in (KEY, HASHED_KEY, ENV_KEY))
    assert "API_KEYS_FILE" in source and "API_KEY" in source
    (tmp_path / "bad").write_text(f"{KEY}\nnot a key because spaces\n")
    with pytest.raises(SecurityFileError, match="line 2") as e:
        read_keys(_settings(monkeypatch, api_keys_file=tmp_path / "bad"))
    assert "spaces" not in str(e.value).replace("without spaces", "") and KEY not in str(e.value)
    (tmp_path / "short").write_text("sha256:abcd\n")
    with pytest.raises(SecurityFileError, match="64 hex digits"):
        read_keys(_settings(monkeypatch, api_keys_file=tmp_path / "short"))
    with pytest.raises(SecurityFileError, match=re.escape(str(tmp_path / "missing"))):
        read_keys(_settings(monkeypatch, api_keys_file=tmp_path / "missing"))
    (tmp_path / "empty").write_text("# no key yet\n\n")
    assert read_keys(_settings(monkeypatch, api_keys_file=tmp_path / "empty"))[0] is None  # off, and said so
    assert read_keys(_settings(monkeypatch))[0] is None


def test_bearer_keys_are_checked_and_a_reload_tightens_but_never_opens(tmp_path, monkeypatch):
    path = keys_file(tmp_path / "keys")
    keys = ApiKeys(_settings(monkeypatch, api_keys_file=path))
    assert keys.on and "2 keys" in keys.describe() and KEY not in keys.describe()
    for value, ok in [
        (f"Bearer {KEY}", True), (f"bearer {HASHED_KEY}", True), (f"BEARER  {KEY} ", True),
        (f"Bearer {KEY}x", False), (f"Basic {KEY}", False), (KEY, False), ("Bearer ", False), (None, False),
        (f"Bearer {ENV_KEY}", False), (f"Bearer sha256:{hashlib.sha256(HASHED_KEY.encode()).hexdigest()}", False),
    ]:  # fmt: skip
        assert keys.allows(value) is ok, value
        assert keys.allows(value.encode() if value else None) is ok, value
    path.write_text(f"{ENV_KEY}\n")  # a new key: SIGHUP's reload takes it, the old ones go
    assert keys.reload() == 1 and keys.allows(f"Bearer {ENV_KEY}") and not keys.allows(f"Bearer {KEY}")
    path.write_text("# emptied by mistake\n")
    with pytest.raises(SecurityFileError, match="keeping the 1 in force"):
        keys.reload()
    path.unlink()
    with pytest.raises(SecurityFileError, match="cannot read it"):
        keys.reload()
    assert keys.allows(f"Bearer {ENV_KEY}") and not keys.allows(None)  # still the keys in force
    off = ApiKeys(_settings(monkeypatch))
    assert not off.on and off.allows(None) and "open" in off.describe()
    path.write_text(f"{KEY}\n")
    assert off.reload(_settings(monkeypatch, api_keys_file=path)) == 1 and not off.allows(None)  # off -> on


def test_many_keys_are_one_lookup_and_each_still_counts(tmp_path, monkeypatch):
    """1,000 keys (half as sha256 lines) are held as one set of digests: each one passes, near misses do not."""
    keys = [f"key-{i:04d}-{i * 7919 % 10007:05d}" for i in range(1000)]
    lines = [k if i % 2 else "sha256:" + hashlib.sha256(k.encode()).hexdigest() for i, k in enumerate(keys)]
    path = tmp_path / "keys"
    path.write_text("\n".join(lines) + "\n")
    api_keys = ApiKeys(_settings(monkeypatch, api_keys_file=path))
    assert isinstance(api_keys.digests, frozenset) and len(api_keys.digests) == 1000
    assert all(api_keys.allows(f"Bearer {k}") for k in keys)
    assert not any(api_keys.allows(f"Bearer {k[:-1]}") or api_keys.allows(f"Bearer {k}0") for k in keys[::50])


def test_a_401_is_answered_before_the_body_and_counted_without_time(tmp_path, monkeypatch):
    """In process, through the ASGI app a front end serves: a request without a valid key is refused before anything
    else (its body never read, the engines never asked), carries its request id and the challenge, and closes the
    connection only when its body is large; counted `unauthorized` with no time, like the 404 of an unknown model."""
    from service.frontend.fastpath import PredictFastPath
    from service.frontend.state import FrontendState, ModelInfo
    from service.metrics import RequestMetrics

    metrics = RequestMetrics(MODEL, "unfused")
    state = FrontendState(
        _settings(monkeypatch, api_key=ENV_KEY), ModelInfo(MODEL, None, (64,), 10, None), None, metrics, tmp_path
    )  # fmt: skip  (engines None: touching them would raise)
    app = PredictFastPath(None, state)

    async def receive():
        raise AssertionError("the body of a request without a valid key was read")

    def call(path: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, dict, bytes]:
        sent = []

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": path, "headers": headers, "query_string": b""}
        asyncio.run(app(scope, receive, send))
        return sent[0]["status"], dict(sent[0]["headers"]), sent[1]["body"]

    for path, error_key, protocol in (
        ("/predict", "detail", "predict"),
        (f"/v2/models/{MODEL}/infer", "error", "v2_rest"),
    ):
        for auth in ([], [(b"authorization", b"Bearer wrong")], [(b"authorization", ENV_KEY.encode())]):
            status, headers, body = call(path, [(b"content-length", b"300"), (b"x-request-id", b"rid-9"), *auth])
            assert status == 401 and headers[b"www-authenticate"] == b"Bearer" and headers[b"x-request-id"] == b"rid-9"
            assert "API key" in orjson.loads(body)[error_key] and b"connection" not in headers
            assert int(headers[b"content-length"]) == len(body)
        status, headers, _ = call(path, [(b"content-length", b"200000000")])
        assert status == 401 and headers[b"connection"] == b"close" and len(headers[b"x-request-id"]) == 16
        assert call(path, [(b"transfer-encoding", b"chunked")])[1][b"connection"] == b"close"
        text = metrics.render().decode()
        assert _metric(text, protocol, "unauthorized") == 5
        assert not re.search(rf'^fusedserve_failed_request_seconds_total{{[^}}]*protocol="{protocol}"', text, re.M)


def test_which_api_a_path_is():
    assert [api_of_path(p) for p in ("/metrics", "/model", "/docs", "/redoc", "/openapi.json")] == [
        "metrics", "model", "docs", "docs", "docs",
    ]  # fmt: skip
    for path in ("/v2/models/stats", "/v2/models/m/stats", "/v2/models/m/versions/1/stats", "/v2/models/m/stats/"):
        assert api_of_path(path) == "statistics", path
    for path in ("/v2/models/m/config", "/v2/models/m/versions/1/config", "/v2//models/m/config"):
        assert api_of_path(path) == "model-config", path
    for path in ("/predict", "/v2/models/m/infer", "/v2/models/m", "/v2", "/health/ready", "/v2/health/live",
                 "/v2/models/config", "/metricsx", "/models"):  # fmt: skip
        assert api_of_path(path) is None, path
    rules = Restrictions(parse_restricted("metrics:X-A=v"))
    assert rules.allows("metrics", b"v") and not rules.allows("metrics", b"w") and not rules.allows("metrics", None)
    assert rules.allows("model", None) and rules.allows(None, None)


def test_request_ids():
    made = {requestid.new() for _ in range(1000)}
    assert len(made) == 1000 and all(re.fullmatch(rb"[0-9a-f]{16}", m) for m in made)
    assert requestid.valid(b"abc-123 x") and requestid.valid("a" * 128) and requestid.valid(b"~")
    for bad in (b"", b"a" * 129, b"tab\there", b"nl\n", "é", "\x7f", None, 7, ["id"], {"id": 1}):
        assert not requestid.valid(bad), bad
    scope = {"headers": [(b"x-request-id", b"mine")]}
    assert requestid.of_scope(scope) == b"mine" and requestid.given(scope) == b"mine"
    assert requestid.given({"headers": [(b"x-request-id", b"\x01")]}) is None
    assert len(requestid.of_scope({"headers": [(b"x-request-id", b"x" * 200)]})) == 16


def test_tls_files_are_checked_before_anything_starts(tmp_path, monkeypatch):
    pytest.importorskip("cryptography", reason="cryptography is not installed (pip install -e '.[test]')")
    certs = make_certs(tmp_path)
    ctx = check_tls(_settings(monkeypatch, tls_cert=certs.server_cert, tls_key=certs.server_key,
                              tls_client_ca=certs.ca))  # fmt: skip
    assert ctx.verify_mode == ssl.CERT_REQUIRED
    with pytest.raises(SecurityFileError, match=re.escape(f"TLS_KEY={tmp_path / 'nope.key'}: cannot read it")):
        check_tls(_settings(monkeypatch, tls_cert=certs.server_cert, tls_key=tmp_path / "nope.key"))
    with pytest.raises(SecurityFileError, match="not a PEM certificate and its private key"):
        check_tls(_settings(monkeypatch, tls_cert=certs.server_cert, tls_key=certs.client_key))  # not its key
    # The command line says the same and starts nothing.
    from service.cli import main

    monkeypatch.setenv(ENV_PREFIX + "TLS_KEY", str(tmp_path / "nope.key"))
    monkeypatch.setenv(ENV_PREFIX + "TLS_CERT", str(certs.server_cert))
    assert main(["serve"]) == 2


# ------------------------------------------------------------------ real servers

pytest.importorskip("tritonclient.grpc", reason="tritonclient[http,grpc] is not installed (pip install -e '.[test]')")
import tritonclient.grpc as tgrpc  # noqa: E402
import tritonclient.http as thttp  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    pytest.importorskip("cryptography", reason="cryptography is not installed (pip install -e '.[test]')")
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def servers(tmp_path_factory, certs):
    work = tmp_path_factory.mktemp("security")
    keys = keys_file(work / "api-keys")
    grpc_ports = {k: free_port() for k in ("keys", "tls", "mtls")}
    metrics_port = free_port()
    common = {"workers": 1, "max_batch_size": 8, "dtype": "float32"}
    tls = {"tls_cert": certs.server_cert, "tls_key": certs.server_key}
    specs = {
        "keys": ("unfused", {
            **common, "api_keys_file": keys, "api_key": ENV_KEY, "grpc_port": grpc_ports["keys"], "docs": "false",
            "restricted_api": f"metrics,model,statistics,model-config:{ADMIN[0]}={ADMIN[1]}",
            "log_level": "info",
        }),
        "tls": ("unfused", {**common, **tls, "api_keys_file": keys, "grpc_port": grpc_ports["tls"],
                            "metrics_port": metrics_port}, {"verify": trusting(certs.ca)}),
        "mtls": ("unfused", {**common, **tls, "tls_client_ca": certs.ca, "grpc_port": grpc_ports["mtls"]},
                 {"verify": trusting(certs.ca, (certs.client_cert, certs.client_key))}),
    }  # fmt: skip
    # A forward of more than one row fails (500): the request-id log test's failure (every other request is one row).
    os.environ["FS_INJECT_FAULT"] = "fail_above=1"
    try:
        with running_servers(specs, work) as s:
            yield {
                k: {"url": srv.url, "grpc": f"127.0.0.1:{grpc_ports[k]}", "server": srv, "client": srv.client_args}
                for k, srv in s.items()
            } | {"metrics_port": metrics_port}
    finally:
        os.environ.pop("FS_INJECT_FAULT", None)


def _metric(text: str, protocol: str, outcome: str) -> float:
    pattern = rf'^fusedserve_requests_total{{[^}}]*outcome="{outcome}"[^}}]*protocol="{protocol}"[^}}]*}} (\S+)$'
    found = re.findall(pattern, text, re.M)
    assert found, f"no fusedserve_requests_total for {protocol} {outcome}"
    return float(found[0])


@pytest.mark.slow
def test_no_inference_without_a_valid_key_over_http_json(servers):
    url = servers["keys"]["url"]
    with httpx.Client(timeout=TIMEOUT) as c:
        metrics = c.get(url + "/metrics", headers=dict([ADMIN])).text
        before = _metric(metrics, "predict", "unauthorized"), _metric(metrics, "predict", "ok")
        for headers in ({}, bearer("wrong"), {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
            r = c.post(url + "/predict", json={"inputs": [ROW]}, headers=headers)
            assert r.status_code == 401, (headers, r.text)
            assert r.headers["www-authenticate"] == "Bearer" and "API key" in r.json()["detail"], r.headers
            assert KEY not in r.text
        for key in (KEY, HASHED_KEY, ENV_KEY):  # as written in the file, as its sha256 there, from the environment
            r = c.post(url + "/predict", json={"inputs": [ROW]}, headers=bearer(key))
            assert r.status_code == 200 and r.json()["model"] == MODEL, r.text
        # Refused before the body is read: even a body that is not JSON, or too large, gets 401.
        r = c.post(url + "/predict", content=b"not json", headers={"content-type": "application/json"})
        assert r.status_code == 401, r.text
        metrics = c.get(url + "/metrics", headers=dict([ADMIN])).text
        assert _metric(metrics, "predict", "unauthorized") == before[0] + 5
        assert _metric(metrics, "predict", "ok") == before[1] + 3
        # Health, metadata and readiness stay open.
        for path in ("/health/live", "/health/ready", "/v2/health/ready", f"/v2/models/{MODEL}", "/v2"):
            assert c.get(url + path).status_code == 200, path


@pytest.mark.slow
def test_a_refused_body_is_never_read(servers):
    """401 for a request that announces 200 MB comes at once and closes the connection; a small body keeps it."""
    port = int(servers["keys"]["url"].rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"POST /predict HTTP/1.1\r\nhost: t\r\ncontent-length: 200000000\r\n\r\n" + b"1" * 65536)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 401") and b"connection: close" in answer.lower(), answer[:300]
    with httpx.Client(timeout=TIMEOUT) as c:  # a small body: the connection is kept for the next request
        r = c.post(servers["keys"]["url"] + "/predict", json={"inputs": [ROW]})
        assert r.status_code == 401 and r.headers.get("connection") != "close"


@pytest.mark.slow
def test_no_inference_without_a_valid_key_over_binary_v2_and_grpc(servers):
    url, grpc_addr = servers["keys"]["url"], servers["keys"]["grpc"]
    rows = np.full((1, 64), 0.5, np.float32)
    http = thttp.InferenceServerClient(url.removeprefix("http://"))
    grpc = tgrpc.InferenceServerClient(grpc_addr)
    try:
        with httpx.Client(timeout=TIMEOUT) as c:
            metrics = c.get(url + "/metrics", headers=dict([ADMIN])).text
        before = {p: _metric(metrics, p, "unauthorized") for p in ("v2_rest", "v2_grpc")}

        inp = thttp.InferInput("input", [1, 64], "FP32")
        inp.set_data_from_numpy(rows, binary_data=True)
        out = [thttp.InferRequestedOutput("logits", binary_data=True)]
        for headers in (None, bearer("wrong")):
            with pytest.raises(InferenceServerException) as e:
                http.infer(MODEL, [inp], outputs=out, headers=headers)
            assert e.value.status() == "401", e.value
        got = http.infer(MODEL, [inp], outputs=out, headers=bearer(KEY)).as_numpy("logits")
        assert got.shape == (1, 10)

        ginp = tgrpc.InferInput("input", [1, 64], "FP32")
        ginp.set_data_from_numpy(rows)
        for headers in (None, {"authorization": "Bearer wrong"}):
            with pytest.raises(InferenceServerException) as e:
                grpc.infer(MODEL, [ginp], headers=headers)
            assert e.value.status() == "StatusCode.UNAUTHENTICATED", e.value
        ggot = grpc.infer(MODEL, [ginp], headers={"authorization": f"Bearer {HASHED_KEY}"}).as_numpy("logits")
        np.testing.assert_allclose(ggot, got, rtol=1e-6)
        assert grpc.is_server_ready() and grpc.is_model_ready(MODEL)  # health and metadata stay open on gRPC too
        assert grpc.get_model_metadata(MODEL).name == MODEL

        with httpx.Client(timeout=TIMEOUT) as c:
            metrics = c.get(url + "/metrics", headers=dict([ADMIN])).text
        assert {p: _metric(metrics, p, "unauthorized") for p in before} == {p: n + 2 for p, n in before.items()}
    finally:
        http.close()
        grpc.close()


@pytest.mark.slow
def test_restricted_routes_need_their_header_and_docs_can_be_off(servers):
    url = servers["keys"]["url"]
    with httpx.Client(timeout=TIMEOUT) as c:
        for path in ("/metrics", "/model"):
            r = c.get(url + path)
            assert r.status_code == 403 and "X-Admin-Key".lower() in r.json()["detail"].lower(), r.text
            assert c.get(url + path, headers={ADMIN[0]: "wrong"}).status_code == 403
            assert c.get(url + path, headers=dict([ADMIN])).status_code == 200
        # The statistics and model-configuration extensions' routes, by shape: refused without the header whether
        # or not this build serves them yet; with it, the route answers (404 where it does not exist).
        for path in ("/v2/models/stats", f"/v2/models/{MODEL}/stats", f"/v2/models/{MODEL}/versions/1/stats",
                     f"/v2/models/{MODEL}/config", f"/v2/models/{MODEL}/versions/1/config"):  # fmt: skip
            r = c.get(url + path)
            assert r.status_code == 403 and "error" in r.json(), (path, r.text)
            assert c.get(url + path, headers=dict([ADMIN])).status_code != 403, path
        for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):  # FUSEDSERVE_DOCS=false
            assert c.get(url + path, headers=dict([ADMIN])).status_code == 404, path
        assert c.get(url + "/health/ready").status_code == 200


@pytest.mark.slow
def test_restricted_grpc_rpcs_need_their_metadata(servers):
    grpc = tgrpc.InferenceServerClient(servers["keys"]["grpc"])
    try:
        for call in (partial(grpc.get_model_config, MODEL), partial(grpc.get_inference_statistics, MODEL)):
            with pytest.raises(InferenceServerException) as e:
                call()
            assert e.value.status() == "StatusCode.PERMISSION_DENIED", e.value
            try:  # with the metadata the RPC runs (UNIMPLEMENTED where this build lacks it yet)
                call(headers={ADMIN[0].lower(): ADMIN[1]})
            except InferenceServerException as e2:
                assert e2.status() != "StatusCode.PERMISSION_DENIED", e2
    finally:
        grpc.close()


@pytest.mark.slow
def test_request_ids_round_trip_and_name_a_failure_in_the_logs(servers):
    url = servers["keys"]["url"]
    server = servers["keys"]["server"]
    with httpx.Client(timeout=TIMEOUT, headers=bearer(KEY)) as c:
        r = c.post(url + "/predict", json={"inputs": [ROW]}, headers={"X-Request-Id": "client id 1"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "client id 1"
        r = c.post(url + "/predict", json={"inputs": [ROW]})
        made = r.headers["x-request-id"]
        assert re.fullmatch(r"[0-9a-f]{16}", made), made
        assert c.post(url + "/predict", json={"inputs": [ROW]}).headers["x-request-id"] != made
        r = c.post(url + "/predict", json={"inputs": [ROW]}, headers={"X-Request-Id": "x" * 129})
        assert re.fullmatch(r"[0-9a-f]{16}", r.headers["x-request-id"]), r.headers  # too long: a new one
        r = c.post(url + "/predict", json={"inputs": [ROW]}, headers={"Authorization": "Bearer no"})
        assert r.status_code == 401 and re.fullmatch(r"[0-9a-f]{16}", r.headers["x-request-id"])
        # v2: the body's id is kept (echoed, and the header), else the header's, else a new one in both.
        v2 = f"{url}/v2/models/{MODEL}/infer"
        tensor = {"name": "input", "datatype": "FP32", "shape": [1, 64], "data": ROW}
        r = c.post(v2, json={"id": "v2-id-7", "inputs": [tensor]})
        assert r.json()["id"] == "v2-id-7" and r.headers["x-request-id"] == "v2-id-7", r.text
        r = c.post(v2, json={"inputs": [tensor]}, headers={"X-Request-Id": "hdr-9"})
        assert r.json()["id"] == "hdr-9" and r.headers["x-request-id"] == "hdr-9"
        r = c.post(v2, json={"inputs": [tensor]})
        assert r.json()["id"] == r.headers["x-request-id"] and len(r.json()["id"]) == 16

        # A failure (the injected fault fails forwards of 2+ rows with 500): the id is in the answer, and in the
        # front end's log line, which names the engine's number for the request, which the engine's line names.
        r = c.post(url + "/predict", json={"inputs": [ROW, ROW]}, headers={"X-Request-Id": "fail-me-38"})
        assert r.status_code == 500 and r.headers["x-request-id"] == "fail-me-38", r.text
    grpc = tgrpc.InferenceServerClient(servers["keys"]["grpc"])
    try:
        ginp = tgrpc.InferInput("input", [1, 64], "FP32")
        ginp.set_data_from_numpy(np.full((1, 64), 0.5, np.float32))
        res = grpc.infer(MODEL, [ginp], headers={"authorization": f"Bearer {KEY}", "x-request-id": "grpc-id-3"})
        assert res.get_response().id == "grpc-id-3"
        res = grpc.infer(MODEL, [ginp], request_id="own-id", headers={"authorization": f"Bearer {KEY}"})
        assert res.get_response().id == "own-id"
        assert len(grpc.infer(MODEL, [ginp], headers={"authorization": f"Bearer {KEY}"}).get_response().id) == 16
    finally:
        grpc.close()
    log = server.log()
    line = next((ln for ln in log.splitlines() if "fail-me-38" in ln), None)
    assert line is not None and "engine request" in line and "500" in line, log[-3000:]
    engine_name = re.search(r"engine request (\d+-\d+)", line).group(1)
    assert any("forward failed" in ln and engine_name in ln for ln in log.splitlines()), log[-3000:]
    for secret in (KEY, HASHED_KEY, ENV_KEY, ADMIN[1]):
        assert secret not in log, "a secret reached the log"
    assert "API keys on: 3 keys" in log and "docs off" in log, log[:2000]


@pytest.mark.slow
def test_tls_over_http_and_grpc_with_keys_and_a_metrics_port(servers, certs):
    url, grpc_addr = servers["tls"]["url"], servers["tls"]["grpc"]
    assert url.startswith("https://")
    rows = np.full((1, 64), 0.25, np.float32)
    with httpx.Client(timeout=TIMEOUT, verify=trusting(certs.ca)) as c:
        assert c.post(url + "/predict", json={"inputs": [ROW]}).status_code == 401
        r = c.post(url + "/predict", json={"inputs": [ROW]}, headers=bearer(KEY))
        assert r.status_code == 200, r.text
        # /metrics lives on its own port (plain HTTP, only /metrics); the service's port answers 404.
        assert c.get(url + "/metrics").status_code == 404
    with httpx.Client(timeout=TIMEOUT) as c:
        r = c.get(f"http://127.0.0.1:{servers['metrics_port']}/metrics")
        assert r.status_code == 200 and 'outcome="unauthorized",protocol="predict"} 1.0' in r.text, r.text[:500]
        assert c.get(f"http://127.0.0.1:{servers['metrics_port']}/model").status_code == 404
    with (
        httpx.Client(timeout=TIMEOUT, verify=trusting(certs.other_ca)) as c,
        pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"),
    ):
        c.get(url + "/health/ready")  # a client that trusts another CA refuses the server
    with pytest.raises(httpx.HTTPError):
        httpx.get(url.replace("https", "http") + "/health/ready", timeout=5)  # plain HTTP on the TLS port: no answer

    import gevent.ssl

    def trusting_the_ca(*_args, **_kwargs):
        # geventhttpclient >= 2.6 calls the factory with its own cafile= (certifi's): this test's CA, whatever it asks
        return gevent.ssl.create_default_context(cafile=str(certs.ca))

    http = thttp.InferenceServerClient(url.removeprefix("https://"), ssl=True, ssl_context_factory=trusting_the_ca)
    grpc = tgrpc.InferenceServerClient(grpc_addr, ssl=True, root_certificates=str(certs.ca))
    try:
        inp = thttp.InferInput("input", [1, 64], "FP32")
        inp.set_data_from_numpy(rows, binary_data=True)
        got = http.infer(MODEL, [inp], headers=bearer(KEY)).as_numpy("logits")
        ginp = tgrpc.InferInput("input", [1, 64], "FP32")
        ginp.set_data_from_numpy(rows)
        with pytest.raises(InferenceServerException, match="UNAUTHENTICATED|API key"):
            grpc.infer(MODEL, [ginp])
        ggot = grpc.infer(MODEL, [ginp], headers={"authorization": f"Bearer {KEY}"}).as_numpy("logits")
        np.testing.assert_allclose(ggot, got, rtol=1e-6)
    finally:
        http.close()
        grpc.close()
    plain = tgrpc.InferenceServerClient(grpc_addr)  # a plain-text gRPC client gets no service
    try:
        with pytest.raises(InferenceServerException):
            plain.is_server_live(client_timeout=5)
    finally:
        plain.close()


@pytest.mark.slow
def test_mutual_tls_refuses_a_client_without_a_certificate(servers, certs):
    url, grpc_addr = servers["mtls"]["url"], servers["mtls"]["grpc"]
    with httpx.Client(timeout=TIMEOUT, verify=trusting(certs.ca, (certs.client_cert, certs.client_key))) as c:
        assert c.post(url + "/predict", json={"inputs": [ROW]}).status_code == 200  # no keys on this server
    with pytest.raises(httpx.HTTPError), httpx.Client(timeout=TIMEOUT, verify=trusting(certs.ca)) as c:
        c.get(url + "/health/ready")  # the handshake fails (TLS 1.3: on the first read)

    import gevent.ssl

    def with_cert(*_args, **_kwargs):  # whatever cafile= geventhttpclient passes (see trusting_the_ca)
        ctx = gevent.ssl.create_default_context(cafile=str(certs.ca))
        ctx.load_cert_chain(str(certs.client_cert), str(certs.client_key))
        return ctx

    rows = np.full((1, 64), 0.5, np.float32)
    http = thttp.InferenceServerClient(url.removeprefix("https://"), ssl=True, ssl_context_factory=with_cert)
    grpc = tgrpc.InferenceServerClient(
        grpc_addr, ssl=True, root_certificates=str(certs.ca), private_key=str(certs.client_key),
        certificate_chain=str(certs.client_cert),
    )  # fmt: skip
    anonymous = tgrpc.InferenceServerClient(grpc_addr, ssl=True, root_certificates=str(certs.ca))
    try:
        inp = thttp.InferInput("input", [1, 64], "FP32")
        inp.set_data_from_numpy(rows, binary_data=True)
        assert http.infer(MODEL, [inp]).as_numpy("logits").shape == (1, 10)
        ginp = tgrpc.InferInput("input", [1, 64], "FP32")
        ginp.set_data_from_numpy(rows)
        assert grpc.infer(MODEL, [ginp]).as_numpy("logits").shape == (1, 10)
        with pytest.raises(InferenceServerException, match="UNAVAILABLE|handshake|certificate"):
            anonymous.infer(MODEL, [ginp], client_timeout=10)
    finally:
        http.close()
        grpc.close()
        anonymous.close()


def test_docs_security_md_matches_the_code():
    """docs/security.md's example rule parses, and its table of APIs is the code's."""
    from service.config import RESTRICTABLE_APIS

    text = (Path(__file__).resolve().parents[1] / "docs" / "security.md").read_text()
    example = re.search(r"`([\w,-]+:X-Admin-Key=[^`]+)`", text).group(1)
    assert set(parse_restricted(example)) == {"metrics", "statistics", "model-config", "docs"}
    table = re.findall(r"^\| `([\w-]+)` \|", text, re.M)
    assert tuple(table) == RESTRICTABLE_APIS, table


def test_a_front_ends_reload_takes_new_keys_and_keeps_them_on_a_bad_file(tmp_path, monkeypatch, caplog):
    """FrontendState.reload_access, the hook a SIGHUP reload calls in each front end."""
    from service.frontend.state import FrontendState

    path = keys_file(tmp_path / "keys")
    settings = _settings(monkeypatch, api_keys_file=path)
    state = FrontendState(settings, None, None, None, tmp_path)  # model, engines, metrics: unused here
    assert state.api_keys.allows(f"Bearer {KEY}")
    path.write_text(f"{ENV_KEY}\n")
    assert state.reload_access() and state.api_keys.allows(f"Bearer {ENV_KEY}")
    assert not state.api_keys.allows(f"Bearer {KEY}")
    path.write_text("")
    assert not state.reload_access() and state.api_keys.allows(f"Bearer {ENV_KEY}")
    assert "API keys not reloaded" in caplog.text and ENV_KEY not in caplog.text
    tighter = _settings(monkeypatch, api_keys_file=tmp_path / "keys", api_key=KEY, restricted_api="metrics:X-A=v")
    path.write_text(f"{ENV_KEY}\n")
    assert state.reload_access(tighter) and state.api_keys.allows(f"Bearer {KEY}") and state.restrictions


def test_a_sighup_with_a_changed_keys_file_is_published_for_the_front_ends(tmp_path, monkeypatch):
    """The supervisor's reload (in process, no children): a keys file that changed is a change to publish even when
    no live setting did; one that cannot be read changes nothing."""
    from types import SimpleNamespace

    from service.supervisor import Supervisor

    path = keys_file(tmp_path / "keys")
    monkeypatch.chdir(tmp_path)
    sup = Supervisor(_settings(monkeypatch, api_keys_file=path))
    sup._run_dir = tmp_path
    sup._shared_generation = SimpleNamespace(value=0)
    sup._keys = ApiKeys(sup.settings)
    assert sup.reload() == "unchanged"
    path.write_text(f"{ENV_KEY}\n")
    assert sup.reload() == "applied" and sup._shared_generation.value == 1
    path.unlink()
    assert sup.reload() == "unchanged" and sup._keys.allows(f"Bearer {ENV_KEY}")


@pytest.mark.slow
def test_sighup_takes_a_new_keys_file_on_a_real_service(servers, tmp_path):
    import signal
    import time

    server = servers["keys"]["server"]
    path = Path(server.env["api_keys_file"])
    before = path.read_text()
    url = servers["keys"]["url"] + "/predict"

    def status(key: str) -> int:
        return httpx.post(url, json={"inputs": [ROW]}, headers=bearer(key), timeout=TIMEOUT).status_code

    def after_hup(want: dict[str, int]) -> None:
        os.kill(server.process.proc.pid, signal.SIGHUP)
        end = time.monotonic() + 10
        while {k: status(k) for k in want} != want:
            assert time.monotonic() < end, {k: status(k) for k in want}
            time.sleep(0.1)

    try:
        path.write_text("rotated-key-5b\n")
        after_hup({"rotated-key-5b": 200, KEY: 401, ENV_KEY: 200})  # FUSEDSERVE_API_KEY stays
        path.unlink()  # unreadable: logged, and the keys in force stay
        os.kill(server.process.proc.pid, signal.SIGHUP)
        end = time.monotonic() + 10
        while "API keys not reloaded, those in force stay" not in server.log():
            assert time.monotonic() < end, server.log()[-2000:]
            time.sleep(0.1)
        assert status("rotated-key-5b") == 200 and status("nope") == 401
        path.write_text("# emptied\n")  # the file's keys go; FUSEDSERVE_API_KEY's stays, so keys stay on
        after_hup({"rotated-key-5b": 401, ENV_KEY: 200, "nope": 401})
    finally:
        path.write_text(before)
        after_hup({KEY: 200})
