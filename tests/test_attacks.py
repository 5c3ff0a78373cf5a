"""The attack suite of issue 53: what an unauthenticated client sends cannot exhaust a front end's memory, CPU,
connections or logs, and API keys close what tells about the model. Each item against the real service on loopback
(real uvicorn, grpcio and TLS; CPU, one front end so that the process measured is the one every connection reaches),
with the issue's bounds asserted on the front end's own counters in /proc: resident memory (VmRSS), bytes read
(rchar: uvloop reads sockets with read(2)), CPU time (utime + stime).

Bounds (docs/security.md names each with its test here):
- a request head: request line 8 KiB (414), head 32 KiB or 100 headers (431); one connection sending 100 MB of
  headers and a flood of 200 such connections grow the front end by at most 50 MB, back near its baseline after;
- an unauthenticated body: nothing read after its 401 (the bound asserted is the issue's 64 KB), in plain HTTP and TLS;
- 1,000 refused TLS uploads whose clients keep writing: the front end grows by at most 50 MB and comes back;
- a stalled TLS handshake: dropped within the header timeout, counted against MAX_CONNECTIONS meanwhile;
- MAX_CONNECTIONS_PER_CLIENT: one address's connections past it are refused at the accept, others served;
- PER_CLIENT_CONNECT_RATE: an address opening connections faster is refused at the accept, before any TLS handshake
  (held unread a second, then closed), counted (connect_rate), while another address's requests are all answered;
- gRPC: 1,000 unauthenticated 2 MB ModelInfer calls (200 at once) refused at their metadata, the front end growing by
  at most 50 MB and back near its baseline; a message past the size limit and metadata past 32 KiB refused;
- the metrics port: resets are no tracebacks, threads stay bounded, the backlog is 128;
- with keys on: docs, /model, statistics and model configuration need the key; no redirect takes the Host header; the
  docs pages load pinned scripts with integrity;
- a 20 s soak mixing these attacks (from other loopback addresses) with authorised HTTP and gRPC traffic: every
  authorised request answered, the front end never restarted, its memory within 50 MB of where it was and back near
  it after. The throughput authorised traffic keeps under the attacks is a benchmark's number (bench/soak/attacks.py),
  printed here, not asserted.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import ssl
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from .procs import children, rss_bytes
from .server import free_port, running_servers
from .tlscerts import make_certs

pytestmark = pytest.mark.slow
grpc = pytest.importorskip("grpc")
pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is not installed (pip install -e '.[test]')")
from tritonclient.grpc import service_pb2 as pb  # noqa: E402  (tritonclient's copy of the protocol's messages)

KEY = "attack-suite-key-5e21"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "digits-mlp"
ROW = [0.5] * 64
HEADER_TIMEOUT_S = 2.0
MB = 1_000_000
GROWTH = 50 * MB  # the bound on a front end's growth under one attack
SETTLED = 25 * MB  # how far above its baseline a front end may stay once an attack is over (allocator caches)
INFER = "/inference.GRPCInferenceService/ModelInfer"
# Loopback addresses of attackers (Linux routes all of 127/8 to lo): authorised traffic comes from 127.0.0.1.
ATTACKERS = [f"127.0.0.{i}" for i in range(2, 10)]
PER_CLIENT = 64
TLS_CAP = 256


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    pytest.importorskip("cryptography", reason="cryptography is not installed (pip install -e '.[test]')")
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def servers(tmp_path_factory, certs):
    """`plain`: keys, gRPC, /metrics on its own port, a 2.1 MB body limit (1,024 rows); `tls`: keys and TLS on both
    ports, a cap of 256 connections, 64 per client."""
    common = {"workers": 1, "dtype": "float32", "api_key": KEY, "header_timeout_s": HEADER_TIMEOUT_S,
              "body_timeout_s": HEADER_TIMEOUT_S}  # fmt: skip
    ports = {"plain_grpc": free_port(), "tls_grpc": free_port(), "metrics": free_port()}
    tls = {"tls_cert": certs.server_cert, "tls_key": certs.server_key}
    specs = {
        "plain": ("unfused", {**common, "max_batch_size": 1024, "grpc_port": ports["plain_grpc"],
                              "metrics_port": ports["metrics"], "max_connections": 1024}),
        "tls": ("unfused", {**common, **tls, "max_batch_size": 64, "grpc_port": ports["tls_grpc"],
                            "max_connections": TLS_CAP, "max_connections_per_client": PER_CLIENT},
                {"verify": ssl.create_default_context(cafile=str(certs.ca))}),
    }  # fmt: skip
    with running_servers(specs, tmp_path_factory.mktemp("attacks")) as s:
        yield {**s, **ports}


# ------------------------------------------------------------------ what /proc says of a process


def frontend_pid(server) -> int:
    return children(server.process.proc.pid)["fs-frontend-0"]


def bytes_read(pid: int) -> int:
    """rchar: bytes `pid` read by read(2) and its kin, sockets included (uvloop reads them with read(2))."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError(f"no rchar for pid {pid}")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def threads(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/task").iterdir()))


class PeakRss:
    """Samples a process's RSS every 20 ms on a thread while in the `with` block; `peak` is the largest seen."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, rss_bytes(pid), threading.Event()

    def __enter__(self) -> PeakRss:
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, rss_bytes(self.pid))

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes(self.pid))


def settle(pid: int, baseline: int, timeout_s: float = 10.0) -> int:
    """The RSS of `pid` once it is within SETTLED of `baseline`, or after `timeout_s`."""
    end = time.monotonic() + timeout_s
    while (now := rss_bytes(pid)) > baseline + SETTLED and time.monotonic() < end:
        time.sleep(0.2)
    return now


# ------------------------------------------------------------------ clients


def connect(port: int, source: str = "127.0.0.1", tls: ssl.SSLContext | None = None, timeout: float = 5.0):
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(source, 0))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return tls.wrap_socket(sock, server_hostname="127.0.0.1") if tls is not None else sock


def read_all(sock, timeout_s: float = 5.0) -> bytes:
    """What the server sends until it closes (or `timeout_s`), tolerating a reset after its answer."""
    sock.settimeout(timeout_s)
    data = b""
    with contextlib.suppress(OSError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def client_tls(certs) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(certs.ca))


def infer_request(rows: int) -> bytes:
    request = pb.ModelInferRequest(
        model_name=MODEL,
        inputs=[pb.ModelInferRequest.InferInputTensor(name="input", datatype="FP32", shape=[rows, 64])],
        raw_input_contents=[np.full((rows, 64), 0.5, np.float32).tobytes()],
    )
    return request.SerializeToString()


async def grpc_calls(channel, payload: bytes, n: int, at_once: int, metadata=(), method: str = INFER) -> dict:
    """`n` calls of `method` with the raw bytes `payload`, `at_once` in flight: {status code name: count}."""
    call = channel.unary_unary(method)
    codes: dict[str, int] = {}
    gate = asyncio.Semaphore(at_once)

    async def one() -> None:
        async with gate:
            try:
                await call(payload, timeout=60, metadata=metadata)
                code = "OK"
            except grpc.aio.AioRpcError as e:
                code = e.code().name
            codes[code] = codes.get(code, 0) + 1

    await asyncio.gather(*(one() for _ in range(n)))
    return codes


def grpc_channel(port: int, certs=None):
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    if certs is None:
        return grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options)
    creds = grpc.ssl_channel_credentials(root_certificates=certs.ca.read_bytes())
    return grpc.aio.secure_channel(f"127.0.0.1:{port}", creds, options=options)


def unauthorized_count(metrics_url: str, protocol: str) -> float:
    text = httpx.get(metrics_url, timeout=10).text
    pattern = rf'^fusedserve_requests_total{{[^}}]*outcome="unauthorized"[^}}]*protocol="{protocol}"[^}}]*}} (\S+)$'
    found = re.findall(pattern, text, re.M)
    return float(found[0]) if found else 0.0


def refused_counts(metrics_url: str) -> dict[str, float]:
    """fusedserve_connections_refused_total by reason, summed over the front ends."""
    text = httpx.get(metrics_url, timeout=10).text
    out: dict[str, float] = {}
    for reason, value in re.findall(
        r'^fusedserve_connections_refused_total{[^}]*reason="(\w+)"[^}]*} (\S+)$', text, re.M
    ):
        out[reason] = out.get(reason, 0.0) + float(value)
    return out


# ------------------------------------------------------------------ a request's head


@pytest.mark.timeout(120)
def test_a_request_head_past_its_limits_is_refused_and_closed(servers):
    port = servers["plain"].port
    metrics = f"http://127.0.0.1:{servers['metrics']}/metrics"
    before = refused_counts(metrics)
    cases = [
        (b"GET /health/live?" + b"a" * 8200 + b" HTTP/1.1\r\nhost: t\r\n\r\n", b"414"),
        (b"GET /health/live HTTP/1.1\r\nhost: t\r\nx-big: " + b"a" * 33_000 + b"\r\n\r\n", b"431"),
        (b"GET /health/live HTTP/1.1\r\nhost: t\r\n" + b"".join(b"x-%d: 1\r\n" % i for i in range(101)) + b"\r\n",
         b"431"),
        (b"GET /health/live HTTP/1.1\r\nhost: t\r\n" + b"x-ok: 1\r\n" * 90 + b"x-big: " + b"a" * 30_000 + b"\r\n\r\n",
         b"200"),  # under every limit
        (b"GET /health/live?" + b"a" * 8000 + b" HTTP/1.1\r\nhost: t\r\n\r\n", b"200"),
    ]  # fmt: skip
    for request, status in cases:
        with connect(port) as sock:
            sock.sendall(request)
            answer = read_all(sock, 5.0) if status != b"200" else sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 " + status), (status, answer[:200])
        if status != b"200":
            assert b"connection: close" in answer.lower(), answer[:300]
    # Each refusal is counted by its reason (no request count sees them: no route ran).
    want = {"request_line": 1, "header_bytes": 1, "header_count": 1}
    end = time.monotonic() + 5  # the front ends' counters reach the metrics port's rendering within a moment
    while True:
        after = refused_counts(metrics)
        grown = {r: after.get(r, 0.0) - before.get(r, 0.0) for r in want}
        if all(grown[r] >= n for r, n in want.items()) or time.monotonic() > end:
            break
        time.sleep(0.1)
    assert grown == want, grown


@pytest.mark.timeout(180)
def test_header_floods_grow_a_front_end_by_at_most_50_mb_and_it_comes_back(servers):
    """The issue's attack (one connection, 100 MB of headers: 132 -> 1,241 MB before), then 200 connections at once
    each offering 2 MB of 64 KiB header values (324 MB that stayed, before)."""
    server = servers["plain"]
    pid = frontend_pid(server)
    baseline = rss_bytes(pid)
    read_before = bytes_read(pid)
    value = b"x-pad: " + b"a" * (64 * 1024 - 9) + b"\r\n"

    def offer(total: int, source: str) -> bytes:
        with connect(server.port, source=source, timeout=10) as sock:
            sock.sendall(b"GET /health/live HTTP/1.1\r\nhost: t\r\n")
            sent = 0
            with contextlib.suppress(OSError):
                while sent < total:
                    sent += sock.send(value)
            return read_all(sock, 5.0)

    with PeakRss(pid) as one:
        answer = offer(100 * MB, "127.0.0.2")
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    read = bytes_read(pid) - read_before
    assert read < 2 * MB, f"the front end read {read / MB:.1f} MB of a head it refuses past 32 KiB"
    with PeakRss(pid) as flood, ThreadPoolExecutor(50) as pool:
        answers = list(pool.map(lambda i: offer(2 * MB, ATTACKERS[i % len(ATTACKERS)]), range(200)))
    refused = sum(a.startswith(b"HTTP/1.1 431") for a in answers)
    assert refused >= 190, f"{refused} of 200 flooding connections got their 431"  # the rest: reset first
    after = settle(pid, baseline)
    print(f"header floods: RSS {baseline / MB:.0f} MB, peak {one.peak / MB:.0f} MB (one connection) and "
          f"{flood.peak / MB:.0f} MB (200), {after / MB:.0f} MB after")  # fmt: skip
    assert one.peak - baseline <= GROWTH and flood.peak - baseline <= GROWTH, (baseline, one.peak, flood.peak)
    assert after - baseline <= SETTLED, (baseline, after)
    assert httpx.get(server.url + "/health/ready", timeout=10).status_code == 200


# ------------------------------------------------------------------ an unauthenticated body


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scheme", ["http", "https"])
def test_an_unauthenticated_body_is_not_read_after_its_401(servers, certs, scheme):
    """A 10 GB upload without a key: the 401 comes at once; then 2 s of the client pushing its body: the front end
    reads none of it (the bound asserted is the issue's 64 KB) and spends almost no CPU (before: read and dropped at
    2.2-2.6 GB/s, 2.4-3.5 s of CPU per connection over TLS). Over TLS the connection is aborted once the 401 is
    written (guard.drop_unread), so the client's pushing stops at its first write."""
    server = servers["plain" if scheme == "http" else "tls"]
    tls = client_tls(certs) if scheme == "https" else None
    pid = frontend_pid(server)
    piece = b"1" * 65536
    for _ in range(3):
        read0, cpu0 = bytes_read(pid), cpu_seconds(pid)
        with connect(server.port, tls=tls) as sock:
            sock.sendall(b"POST /predict HTTP/1.1\r\nhost: t\r\ncontent-length: 10000000000\r\n\r\n")
            with contextlib.suppress(OSError):  # over TLS the server may have aborted already, its answer sent
                sock.sendall(piece)
            sock.settimeout(5)
            answer = sock.recv(65536)
            at_401 = bytes_read(pid)
            sock.settimeout(0.2)
            pushed, end = 0, time.monotonic() + 2.0
            while time.monotonic() < end:
                try:
                    pushed += sock.send(piece)
                except (TimeoutError, ssl.SSLWantWriteError):
                    continue
                except OSError:
                    break
            time.sleep(0.2)
            after = bytes_read(pid) - at_401
            before = at_401 - read0
        cpu = cpu_seconds(pid) - cpu0
        print(f"{scheme} 401: {before} bytes read up to the answer, {after} after it while the client pushed "
              f"{pushed / MB:.1f} MB; {cpu:.2f} s CPU")  # fmt: skip
        assert answer.startswith(b"HTTP/1.1 401") and b"connection: close" in answer.lower(), answer[:300]
        assert after <= 64 * 1024, f"{after} bytes read after the 401"
        assert before <= 64 * 1024 + 256_000 + 4096, f"{before} bytes read up to the 401 (one read of the socket)"
        assert cpu < 0.5, f"{cpu:.2f} s of front-end CPU for one refused upload"


@pytest.mark.timeout(120)
def test_refused_tls_uploads_whose_clients_keep_writing_leave_nothing_behind(servers, certs):
    """1,000 TLS uploads without a key whose clients push 2 MB past the 401 (8 at once, from the attackers'
    addresses): the front end grows by at most 50 MB and comes back. Before, each such connection (aborted by
    drop_unread) stayed alive 30 s in uvicorn's keep-alive timer, which a connection lost with an error never
    cancelled, with its SSLProtocol and SSLObject: 2,400 of them in 11 s took a front end from 70 to 409 MB."""
    server = servers["tls"]
    pid = frontend_pid(server)
    baseline = rss_bytes(pid)
    tls = client_tls(certs)
    piece = b"1" * 65536

    def upload(i: int) -> bytes:
        with contextlib.suppress(OSError), connect(server.port, ATTACKERS[i % 4], tls) as sock:
            sock.sendall(b"POST /predict HTTP/1.1\r\nhost: t\r\ncontent-length: 10000000000\r\n\r\n")
            sock.settimeout(1.0)
            for _ in range(32):
                sock.sendall(piece)
        return b""

    with PeakRss(pid) as peak, ThreadPoolExecutor(8) as pool:
        list(pool.map(upload, range(1000)))
    after = settle(pid, baseline)
    print(f"1,000 refused TLS uploads: RSS {baseline / MB:.0f} MB, peak {peak.peak / MB:.0f} MB, "
          f"{after / MB:.0f} MB after")  # fmt: skip
    assert peak.peak - baseline <= GROWTH, (baseline, peak.peak)
    assert after - baseline <= SETTLED, (baseline, after)


# ------------------------------------------------------------------ connections: TLS handshakes, per client


def stall_handshakes(port: int, sources: list[str], per_source: int) -> list[socket.socket]:
    """Connections that send 3 bytes of a ClientHello and then nothing (the issue's attack)."""
    socks = []
    for source in sources:
        for _ in range(per_source):
            sock = connect(port, source=source)
            sock.sendall(b"\x16\x03\x01")
            socks.append(sock)
    return socks


def closed_by_server(sock: socket.socket, deadline: float) -> float | None:
    """When the server closed `sock` (EOF or reset), or None if it had not by `deadline`."""
    sock.settimeout(max(0.01, deadline - time.monotonic()))
    try:
        sock.recv(1024)
    except TimeoutError:
        return None
    except OSError:
        pass
    return time.monotonic()


def authorised_tls(server, certs) -> int | str:
    try:
        return httpx.get(server.url + "/model", headers=AUTH, verify=client_tls(certs), timeout=5).status_code
    except httpx.HTTPError as e:
        return type(e).__name__


@pytest.mark.timeout(120)
def test_stalled_tls_handshakes_are_counted_and_dropped_within_the_header_timeout(servers, certs):
    server = servers["tls"]
    pid = frontend_pid(server)
    baseline = rss_bytes(pid)
    assert authorised_tls(server, certs) == 200
    started = time.monotonic()
    # 4 addresses x 64 (the per-client limit) = 256, the cap: counted from the accept, they leave no room.
    socks = stall_handshakes(server.port, ATTACKERS[:4], PER_CLIENT)
    try:
        held = authorised_tls(server, certs)
        assert held != 200, "a request was served with the cap taken by stalled handshakes: they were not counted"
        deadline = started + HEADER_TIMEOUT_S + 2.0  # the sweep is not involved: uvloop's own timer drops them
        times = [closed_by_server(s, deadline) for s in socks]
        late = sum(t is None for t in times)
        assert late == 0, f"{late} of {len(socks)} stalled handshakes still open {deadline - started:.1f} s after"
        print(f"stalled handshakes: last dropped {max(times) - started:.2f} s after the first opened; an authorised "
              f"request meanwhile: {held}; RSS {baseline / MB:.0f} -> {rss_bytes(pid) / MB:.0f} MB")  # fmt: skip
    finally:
        for s in socks:
            s.close()
    end = time.monotonic() + 5
    while authorised_tls(server, certs) != 200:
        assert time.monotonic() < end, "the service did not recover after the handshakes were dropped"
        time.sleep(0.1)
    assert rss_bytes(pid) - baseline <= GROWTH


@pytest.mark.timeout(120)
def test_past_the_per_client_limit_an_address_is_refused_at_the_accept_and_others_are_served(servers, certs):
    server = servers["tls"]
    tls = client_tls(certs)
    source = ATTACKERS[5]
    idle = [connect(server.port, source=source, tls=tls) for _ in range(PER_CLIENT)]  # handshakes done, then idle
    try:
        with pytest.raises((ssl.SSLError, OSError)):
            extra = connect(server.port, source=source, tls=tls)  # closed before any handshake
            extra.close()
        assert authorised_tls(server, certs) == 200  # another address is served
    finally:
        for s in idle:
            s.close()
    end = time.monotonic() + 5
    while True:
        try:
            connect(server.port, source=source, tls=tls).close()
            break
        except OSError:
            assert time.monotonic() < end, "the address stayed refused after its connections closed"
            time.sleep(0.1)


CONNECT_RATE, CONNECT_BURST = 2.0, 5


@pytest.fixture(scope="module")
def rate_server(tmp_path_factory, certs):
    """Keys and TLS on, new connections per client address bounded to CONNECT_RATE a second after CONNECT_BURST."""
    env = {"workers": 1, "dtype": "float32", "api_key": KEY, "header_timeout_s": HEADER_TIMEOUT_S,
           "tls_cert": certs.server_cert, "tls_key": certs.server_key, "per_client_connect_rate": CONNECT_RATE,
           "per_client_connect_burst": CONNECT_BURST}  # fmt: skip
    specs = {"rate": ("unfused", env, {"verify": ssl.create_default_context(cafile=str(certs.ca))})}
    with running_servers(specs, tmp_path_factory.mktemp("rate")) as s:
        yield s["rate"]


def test_the_connect_rate_is_a_token_bucket_per_address_that_forgets_full_buckets():
    from service.frontend.accept import ConnectRate

    rate = ConnectRate(2.0, 3)
    assert [rate.take("a", 0.0) for _ in range(4)] == [True, True, True, False]  # the burst, then refused
    assert rate.take("b", 0.0)  # another address has its own bucket
    assert not rate.take("a", 0.4) and rate.take("a", 0.5) and not rate.take("a", 0.5)  # 2 a second
    assert not rate.take("a", 0.6)  # a refused connection takes no token, and earns none either
    assert rate.take("a", 1.0)
    rate.prune(1.2)
    assert set(rate.buckets) == {"a"}  # b's bucket is full again: forgotten; a's is not
    rate.prune(10.0)
    assert rate.buckets == {}


@pytest.mark.timeout(120)
def test_an_address_opening_connections_too_fast_is_refused_at_the_accept_and_others_are_answered(rate_server, certs):
    """One address opens TLS connections flat out from 8 threads for 3 s: it gets CONNECT_BURST, then about
    CONNECT_RATE a second; the rest are refused at the accept, before their handshake, each held unread
    REFUSED_HOLD_S and then closed, and counted (reason="connect_rate"). Meanwhile 127.0.0.1's authorised requests on
    a keep-alive connection are all answered."""
    from service.frontend.accept import REFUSED_HOLD_S

    server = rate_server
    tls = client_tls(certs)
    flood_s = 3.0
    source = ATTACKERS[6]
    answers: list = []
    admitted: list[float] = []
    refused: list[float] = []  # how long each refused attempt waited for its close
    stop = threading.Event()
    with httpx.Client(verify=tls, timeout=30, headers=AUTH) as client:

        def refused_now() -> float:
            text = client.get(server.url + "/metrics").text
            found = re.findall(r'^fusedserve_connections_refused_total{[^}]*reason="connect_rate"[^}]*} (\S+)$', text,
                               re.M)  # fmt: skip
            return sum(map(float, found))

        def authorised() -> None:
            while not stop.is_set():
                try:
                    answers.append(client.post(server.url + "/predict", json={"inputs": [ROW]}).status_code)
                except httpx.HTTPError as e:
                    answers.append(type(e).__name__)

        def flood() -> None:
            while time.monotonic() - started < flood_s:
                t0 = time.monotonic()
                try:
                    connect(server.port, source=source, tls=tls).close()
                    admitted.append(t0)
                except OSError:  # ssl.SSLError too: closed before any handshake
                    refused.append(time.monotonic() - t0)

        before = refused_now()
        worker = threading.Thread(target=authorised)
        worker.start()
        started = time.monotonic()
        floods = [threading.Thread(target=flood) for _ in range(8)]
        try:
            for f in floods:
                f.start()
            for f in floods:
                f.join(30)
            took = max(admitted) - started
        finally:
            stop.set()
            worker.join(30)
        counted = refused_now() - before
    print(f"connect rate: {len(admitted)} admitted and {len(refused)} refused (each closed {min(refused):.2f}-"
          f"{max(refused):.2f} s after its connect) from one address in {flood_s:g} s, counted {counted:.0f}; "
          f"{len(answers)} authorised requests beside them")  # fmt: skip
    assert refused, "no connection refused: the rate was not applied"
    assert CONNECT_BURST <= len(admitted) <= CONNECT_BURST + CONNECT_RATE * took + 1, (len(admitted), took)
    assert min(refused) >= 0.9 * REFUSED_HOLD_S, min(refused)
    assert counted == len(refused), (counted, len(refused))
    assert answers and set(answers) == {200}, {a: answers.count(a) for a in set(answers)}
    time.sleep(1.0 / CONNECT_RATE + 0.1)  # a token earned: the address is admitted again
    connect(server.port, source=source, tls=tls).close()


# ------------------------------------------------------------------ gRPC


@pytest.mark.timeout(180)
def test_unauthenticated_grpc_calls_are_refused_at_their_metadata(servers):
    """1,000 ModelInfer calls of 2 MB (under the 2.1 MB limit), 200 at once, without a key: all UNAUTHENTICATED and
    counted; the front end grows by at most 50 MB and comes back (before: 177 -> 703 MB, staying at 622 MB)."""
    server = servers["plain"]
    pid = frontend_pid(server)
    metrics = f"http://127.0.0.1:{servers['metrics']}/metrics"
    counted = unauthorized_count(metrics, "v2_grpc")
    baseline = rss_bytes(pid)

    async def attack() -> tuple[dict, dict, dict, dict]:
        async with grpc_channel(servers["plain_grpc"]) as channel:
            flood = await grpc_calls(channel, b"\x01" * (2 * MB), 1000, 200)
            wrong = await grpc_calls(channel, infer_request(1), 10, 10, (("authorization", "Bearer wrong"),))
            big = await grpc_calls(channel, b"\x01" * (50 * MB), 3, 3, (("authorization", f"Bearer {KEY}"),))
            fat = await grpc_calls(channel, infer_request(1), 3, 3, (("authorization", f"Bearer {KEY}"),
                                                                       ("x-fat", "a" * 40_000)))  # fmt: skip
            return flood, wrong, big, fat

    with PeakRss(pid) as peak:
        flood, wrong, big, fat = asyncio.run(attack())
    assert flood == {"UNAUTHENTICATED": 1000} and wrong == {"UNAUTHENTICATED": 10}, (flood, wrong)
    assert big == {"RESOURCE_EXHAUSTED": 3}, big  # past max_receive_message_length, with a key
    assert "OK" not in fat, fat  # metadata past 32 KiB
    after = settle(pid, baseline)
    print(f"gRPC flood: RSS {baseline / MB:.0f} MB, peak {peak.peak / MB:.0f} MB, {after / MB:.0f} MB after")
    assert peak.peak - baseline <= GROWTH, (baseline, peak.peak)
    assert after - baseline <= SETTLED, (baseline, after)
    end = time.monotonic() + 5  # the front end's counters reach the metrics port's rendering within a moment
    while unauthorized_count(metrics, "v2_grpc") < counted + 1010:
        assert time.monotonic() < end, unauthorized_count(metrics, "v2_grpc") - counted
        time.sleep(0.1)

    async def keyed() -> list[dict]:
        key = (("authorization", f"Bearer {KEY}"),)
        async with grpc_channel(servers["plain_grpc"]) as channel:
            out = []
            for method, request in (("ModelStatistics", pb.ModelStatisticsRequest(name=MODEL)),
                                    ("ModelConfig", pb.ModelConfigRequest(name=MODEL))):  # fmt: skip
                path = "/inference.GRPCInferenceService/" + method
                body = request.SerializeToString()
                out.append(await grpc_calls(channel, body, 1, 1, method=path))
                out.append(await grpc_calls(channel, body, 1, 1, key, method=path))
            out.append(await grpc_calls(channel, infer_request(2), 4, 4, key))
            return out

    assert asyncio.run(keyed()) == [{"UNAUTHENTICATED": 1}, {"OK": 1}] * 2 + [{"OK": 4}]


def test_refusal_pace_is_a_bucket_per_address_and_a_bounded_count_held():
    from service.v2.grpc_guard import RefusalPace

    pace = RefusalPace(burst=2, rate=1.0, held_max=3)
    assert [pace.hold("ipv4:127.0.0.2:5001") for _ in range(3)] == [False, False, True]  # the burst, then held
    assert not pace.hold("ipv4:127.0.0.3:5001")  # another address: its own burst
    assert pace.hold("ipv4:127.0.0.2:6002")  # the same address from another port: the same bucket
    pace.held = 3
    assert not pace.hold("ipv4:127.0.0.2:5001")  # held_max held: answered at once
    pace.held = 0
    assert [pace.hold("ipv6:[::1]:7") for _ in range(3)] == [False, False, True]


@pytest.mark.timeout(120)
def test_unauthenticated_grpc_calls_past_an_address_burst_are_held_and_keyed_calls_are_not(servers):
    """80 ModelInfer calls without a key at once from one address: past its burst (20, refilled 10 a second) each is
    held 1 s before its UNAUTHENTICATED (grpc_guard.py: a client refused as fast as it sends comes back once a second
    per call in flight); calls with the key, sent meanwhile, are answered at once."""
    from service.v2.grpc_guard import REFUSE_BURST, REFUSE_HOLD_S

    key = (("authorization", f"Bearer {KEY}"),)

    async def timed(channel, metadata, n: int) -> list[tuple[str, float]]:
        call = channel.unary_unary(INFER)

        async def one() -> tuple[str, float]:
            t0 = time.monotonic()
            try:
                await call(infer_request(1), timeout=30, metadata=metadata)
                return "OK", time.monotonic() - t0
            except grpc.aio.AioRpcError as e:
                return e.code().name, time.monotonic() - t0

        return await asyncio.gather(*(one() for _ in range(n)))

    async def attack():
        async with grpc_channel(servers["plain_grpc"]) as channel:
            await timed(channel, key, 1)  # the channel connected
            refused = asyncio.ensure_future(timed(channel, (), 80))
            await asyncio.sleep(0.3)
            keyed = await timed(channel, key, 4)
            return await refused, keyed

    refused, keyed = asyncio.run(attack())
    assert {code for code, _ in refused} == {"UNAUTHENTICATED"}, refused
    held = sorted(t for _, t in refused if t >= REFUSE_HOLD_S * 0.9)
    assert len(held) >= 80 - REFUSE_BURST - 5, sorted(t for _, t in refused)  # 5: refilled while they were sent
    assert max(t for _, t in refused) < REFUSE_HOLD_S + 5, sorted(t for _, t in refused)
    assert [code for code, _ in keyed] == ["OK"] * 4 and max(t for _, t in keyed) < REFUSE_HOLD_S * 0.9, keyed


# ------------------------------------------------------------------ the metrics port


@pytest.mark.timeout(120)
def test_the_metrics_port_takes_resets_and_floods_without_tracebacks_or_unbounded_threads(servers):
    server = servers["plain"]
    port = servers["metrics"]
    supervisor = server.process.proc.pid
    at = len(server.log())
    base_threads = threads(supervisor)
    for _ in range(300):  # half a request, then a reset (SO_LINGER 0)
        sock = connect(port)
        sock.sendall(b"GET /metrics HTTP/1.1\r\nhost: t\r\n")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    idle = [connect(port) for _ in range(100)]  # open, silent: at most MAX_THREADS served, the rest closed
    try:
        time.sleep(0.5)
        most = threads(supervisor)
        assert most - base_threads <= 8, f"{most - base_threads} threads more for 100 idle connections"
    finally:
        for s in idle:
            s.close()
    end = time.monotonic() + 15
    while True:  # the served idle ones time out (10 s) or see their client gone, freeing the slots
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
            if r.status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < end, "the metrics port did not serve a scrape after the flood"
        time.sleep(0.2)
    log = server.log()[at:]
    assert "Traceback" not in log and "ConnectionResetError" not in log, log[-3000:]
    listening = os.popen(f"ss -ltnH 'sport = :{port}'").read().split()
    assert listening and int(listening[2]) == 128, listening  # Send-Q of a listening socket: its backlog


# ------------------------------------------------------------------ secure defaults with keys on


@pytest.mark.timeout(120)
def test_with_keys_on_docs_model_and_statistics_need_the_key(servers):
    url = servers["plain"].url
    keyed = [
        "/docs",
        "/redoc",
        "/openapi.json",
        "/docs/oauth2-redirect",
        "/model",
        "/v2/models/stats",
        f"/v2/models/{MODEL}/stats",
        f"/v2/models/{MODEL}/config",
        f"/v2/models/{MODEL}/versions/1/config",
    ]
    with httpx.Client(timeout=10) as c:
        for path in keyed:
            r = c.get(url + path)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (path, r.status_code)
            assert c.get(url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
            assert c.get(url + path, headers=AUTH).status_code == 200, path
        for path in ("/health/live", "/health/ready", "/v2", "/v2/health/ready", f"/v2/models/{MODEL}"):
            assert c.get(url + path).status_code == 200, path  # probes and metadata stay open


def test_public_api_opens_what_it_names_and_nothing_else(tmp_path, monkeypatch):
    """In process, through the ASGI app a front end serves: FUSEDSERVE_PUBLIC_API=docs,model opens those two with
    keys on; statistics still needs the key; an unknown name stops the start."""
    from service.config import ENV_PREFIX, SettingsError, load_settings
    from service.frontend.fastpath import PredictFastPath
    from service.frontend.state import FrontendState, ModelInfo
    from service.metrics import RequestMetrics

    for k in [k for k in os.environ if k.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(k)
    monkeypatch.setenv(ENV_PREFIX + "API_KEY", KEY)
    monkeypatch.setenv(ENV_PREFIX + "PUBLIC_API", "docs, model")
    settings = load_settings()
    state = FrontendState(settings, ModelInfo(MODEL, None, (64,), 10, None), None, RequestMetrics(MODEL, "unfused"),
                          tmp_path)  # fmt: skip

    async def inner(scope, receive, send):  # stands in for FastAPI: every route it is handed answers 200
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    app = PredictFastPath(inner, state)

    def status(path: str, headers=()) -> int:
        sent = []

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        scope = {"type": "http", "method": "GET", "path": path, "headers": list(headers), "query_string": b""}
        asyncio.run(app(scope, receive, send))
        return sent[0]["status"]

    for path in ("/docs", "/openapi.json", "/redoc", "/model"):
        assert status(path) == 200, path
    assert status("/v2/models/stats") == 401
    assert status("/v2/models/stats", [(b"authorization", f"Bearer {KEY}".encode())]) != 401
    monkeypatch.setenv(ENV_PREFIX + "PUBLIC_API", "docs,metrics")
    with pytest.raises(SettingsError, match="PUBLIC_API: unknown API 'metrics'"):
        load_settings()


@pytest.mark.timeout(60)
def test_no_redirect_takes_the_host_header(servers):
    url = servers["plain"].url
    with httpx.Client(timeout=10, follow_redirects=False) as c:
        for method, path in (("POST", "/predict/"), ("GET", "/model/"), ("GET", "/docs/"), ("GET", "/health/ready/"),
                             ("GET", "/health/live/"), ("GET", "/v2/"), ("GET", "/openapi.json/")):  # fmt: skip
            for headers in ({"host": "evil.example"}, {"host": "evil.example", **AUTH}):
                r = c.request(method, url + path, headers=headers)
                assert "location" not in r.headers and "evil" not in r.text, (path, r.status_code, r.headers)
                assert r.status_code not in (301, 302, 307, 308), (path, r.status_code)


@pytest.mark.timeout(60)
def test_the_docs_pages_load_pinned_scripts_with_integrity(servers):
    from service.frontend.docs_pages import INTEGRITY

    url = servers["plain"].url
    for path in ("/docs", "/redoc"):
        html = httpx.get(url + path, headers=AUTH, timeout=10).text
        fetched = re.findall(r'(?:src|href)="(https?://[^"]+)"([^>]*)>', html)
        assert fetched, html[:500]
        for address, rest in fetched:
            assert re.search(r"@\d+\.\d+\.\d+/", address), f"{path} loads {address}: not an exact version"
            assert f'integrity="{INTEGRITY[address]}"' in rest and 'crossorigin="anonymous"' in rest, (path, address)
        assert "fonts.googleapis" not in html and "fastapi.tiangolo.com" not in html, path
    for digest in INTEGRITY.values():
        assert re.fullmatch(r"sha384-[A-Za-z0-9+/]{64}", digest), digest


# ------------------------------------------------------------------ a soak: the attacks together, with real traffic


SOAK_S = 20.0


@pytest.mark.timeout(240)
def test_a_soak_of_attacks_beside_authorised_traffic_loses_no_authorised_request(servers, certs):
    """For SOAK_S, from the attackers' addresses at once: header floods, 10 GB uploads without a key, stalled TLS
    handshakes, idle connections up to the per-client limit, and unauthenticated 2 MB gRPC calls; meanwhile from
    127.0.0.1 authorised /predict over HTTPS (keep-alive) and ModelInfer over gRPC with TLS, one at a time each. Every
    authorised request must be answered 200 (OK), the front end never restarted. The throughput beside the attacks is
    printed against two quiet seconds before them (the issue's target: 80%; here the attackers' own Python shares the
    two cores; bench/soak/attacks.py measures it), and the front end's memory: at most 50 MB above where it was, and
    back near it once the attacks stop."""
    server = servers["tls"]
    pid = frontend_pid(server)
    baseline = rss_bytes(pid)
    tls = client_tls(certs)
    stop = threading.Event()
    attacks: dict[str, int] = {}
    lock = threading.Lock()

    def count(name: str, n: int = 1) -> None:
        with lock:
            attacks[name] = attacks.get(name, 0) + n

    def header_flood(source: str) -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError), connect(server.port, source=source, tls=tls) as sock:
                sock.sendall(b"GET /model HTTP/1.1\r\nhost: t\r\n")
                for _ in range(16):
                    sock.sendall(b"x-pad: " + b"a" * 8192 + b"\r\n")
                count("header floods")

    def upload(source: str) -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError), connect(server.port, source=source, tls=tls) as sock:
                sock.sendall(b"POST /predict HTTP/1.1\r\nhost: t\r\ncontent-length: 10000000000\r\n\r\n")
                sock.settimeout(1.0)
                for _ in range(32):
                    sock.sendall(b"1" * 65536)
            count("unauthenticated uploads")

    def stalls(source: str) -> None:
        while not stop.is_set():
            socks = []
            with contextlib.suppress(OSError):
                socks = stall_handshakes(server.port, [source], 24)
                count("stalled handshakes", len(socks))
            stop.wait(HEADER_TIMEOUT_S + 0.5)
            for s in socks:
                s.close()

    def idle(source: str) -> None:
        while not stop.is_set():
            socks = []
            for _ in range(PER_CLIENT + 8):  # past the limit: the rest refused at the accept
                try:
                    socks.append(connect(server.port, source=source))
                except OSError:
                    break
            count("idle connections", len(socks))
            stop.wait(1.0)
            for s in socks:
                s.close()

    async def grpc_flood() -> None:
        async with grpc_channel(servers["tls_grpc"], certs) as channel:
            while not stop.is_set():
                codes = await grpc_calls(channel, b"\x01" * (2 * MB), 100, 50)
                count("unauthenticated gRPC calls", sum(codes.values()))
                assert set(codes) == {"UNAUTHENTICATED"}, codes

    answered: dict[str, list] = {"http": [], "grpc": []}

    def authorised_http(seconds: float) -> list:
        out = []
        end = time.monotonic() + seconds
        with httpx.Client(verify=tls, timeout=30, headers=AUTH) as c:
            while time.monotonic() < end and not (stop.is_set() and seconds == SOAK_S):
                try:
                    out.append(c.post(server.url + "/predict", json={"inputs": [ROW]}).status_code)
                except httpx.HTTPError as e:
                    out.append(type(e).__name__)
        return out

    async def authorised_grpc(seconds: float) -> list:
        out = []
        end = time.monotonic() + seconds
        async with grpc_channel(servers["tls_grpc"], certs) as channel:
            call = channel.unary_unary(INFER)
            while time.monotonic() < end:
                try:
                    await call(infer_request(1), timeout=30, metadata=(("authorization", f"Bearer {KEY}"),))
                    out.append("OK")
                except grpc.aio.AioRpcError as e:
                    out.append(e.code().name)
        return out

    quiet = len(authorised_http(2.0)) / 2.0
    restarts_before = server.log().count("starting it again")
    workers = [threading.Thread(target=f, args=(a,), daemon=True)
               for f, a in ((header_flood, ATTACKERS[0]), (upload, ATTACKERS[1]), (stalls, ATTACKERS[2]),
                            (stalls, ATTACKERS[3]), (idle, ATTACKERS[4]))]  # fmt: skip
    workers.append(threading.Thread(target=lambda: asyncio.run(grpc_flood()), daemon=True))
    with PeakRss(pid) as peak:
        for w in workers:
            w.start()
        started = time.monotonic()
        rpc = threading.Thread(target=lambda: answered["grpc"].extend(asyncio.run(authorised_grpc(SOAK_S))))
        rpc.start()
        answered["http"] = authorised_http(SOAK_S)
        took = time.monotonic() - started
        rpc.join()
        stop.set()
        for w in workers:
            w.join(30)
    http, rpcs = answered["http"], answered["grpc"]
    print(f"soak {took:.0f} s: attacks {attacks}; authorised: {len(http)} HTTP ({len(http) / took:.0f}/s beside the "
          f"attacks, {quiet:.0f}/s quiet), {len(rpcs)} gRPC; RSS {baseline / MB:.0f} MB, peak {peak.peak / MB:.0f} "
          f"MB")  # fmt: skip
    assert http and set(http) == {200}, {s: http.count(s) for s in set(http)}
    assert rpcs and set(rpcs) == {"OK"}, {s: rpcs.count(s) for s in set(rpcs)}
    assert all(attacks.get(k, 0) > 0 for k in ("header floods", "unauthenticated uploads", "stalled handshakes",
                                               "idle connections", "unauthenticated gRPC calls")), attacks  # fmt: skip
    assert server.process.proc.poll() is None and frontend_pid(server) == pid
    assert server.log().count("starting it again") == restarts_before
    # The front end's memory under all of these at once: within the 50 MB of where it was, and back near it
    # once they stop (service/frontend/heap.py hands freed memory back every second).
    after = settle(pid, baseline)
    print(f"soak: front end RSS {after / MB:.0f} MB after")
    assert peak.peak - baseline <= GROWTH, (baseline, peak.peak)
    assert after - baseline <= SETTLED, (baseline, after)
