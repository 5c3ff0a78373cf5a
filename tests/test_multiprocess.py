"""The multi-process service on the CPU, as it runs: the supervisor, its engines and front ends as real processes,
real uvicorn on a loopback port, real signals and kills.

- two engines and two front ends share the traffic, and /metrics of any front end counts it once;
- an engine that dies: what it held gets 503 at once, /health/ready reads 503 until the supervisor has started it
  again in place, and the third death within the window stops the service with exit 1;
- a front end that dies loses only its own connections and is started again;
- SIGTERM: every accepted request is answered, and the service exits 0 within the grace period;
- on a host with two GPUs or more (skipped elsewhere): one fused engine per GPU, each serving batches, every answer
  equal to a one-engine server's for the same rows.

The unfused mode keeps each forward cheap (no Triton interpreter); the paths under test are the same in both.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .procs import children
from .server import running_servers

pytestmark = pytest.mark.slow

FEATURES = 64
TIMEOUT = httpx.Timeout(30.0, connect=5.0)


def rows(n: int, seed: int) -> list[list[float]]:
    return np.random.default_rng(seed).uniform(0, 16, (n, FEATURES)).round(1).tolist()


async def post_many(url: str, bodies: list[dict], *, connections: int) -> list[httpx.Response | Exception]:
    limits = httpx.Limits(max_connections=connections)
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT, limits=limits) as client:
        return await asyncio.gather(*(client.post("/predict", json=b) for b in bodies), return_exceptions=True)


def scrape(url: str) -> dict:
    r = httpx.get(url + "/metrics", timeout=TIMEOUT)
    assert r.status_code == 200, r.text[:300]
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def total(fam: dict, family: str, sample: str, **labels: str) -> float:
    return sum(
        s.value
        for s in fam[family].samples
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    )


def wait_exit(server, timeout_s: float) -> int:
    proc = server.process.proc
    try:
        return proc.wait(timeout_s)
    except Exception as e:
        raise AssertionError(f"the service did not exit within {timeout_s} s\n{server.log()}") from e


@pytest.fixture(scope="module")
def two_by_two():
    """Two engines and two front ends, shared by the traffic test and the front-end death test (one start less, ~10
    CPU-s): the traffic test counts from its own first scrape, and the death test kills a front end alone."""
    env = {"workers": 2, "engines": 2, "max_batch_size": 64, "max_delay_ms": 5}
    with running_servers({"s": ("unfused", env)}) as servers:
        yield servers["s"]


@pytest.mark.timeout(120)
def test_two_engines_share_the_traffic_and_metrics_count_it_once(two_by_two):
    url = two_by_two.url
    # Ready means every front end listens (tests/server.py waits for the supervisor's banner): all four are named.
    names = children(two_by_two.process.proc.pid)
    assert set(names) == {"fs-engine-0", "fs-engine-1", "fs-frontend-0", "fs-frontend-1"}, names
    before = scrape(url)  # the server is the module's: counts are taken from here
    sizes = [1 + (i * 7) % 13 for i in range(60)]
    responses = asyncio.run(post_many(url, [{"inputs": rows(n, i)} for i, n in enumerate(sizes)], connections=16))
    for n, r in zip(sizes, responses, strict=True):
        assert not isinstance(r, Exception), r
        assert r.status_code == 200, r.text[:300]
        assert len(r.json()["outputs"]) == n
    # Serial requests too: the tie-break alternates between idle engines.
    for i in range(6):
        assert httpx.post(url + "/predict", json={"inputs": rows(1, 100 + i)}, timeout=TIMEOUT).status_code == 200
    # Every front end answers for the whole deployment: two scrapes over fresh connections agree.
    first, second = scrape(url), scrape(url)
    for fam in (first, second):
        ok = total(fam, "fusedserve_requests", "fusedserve_requests_total", outcome="ok") - total(
            before, "fusedserve_requests", "fusedserve_requests_total", outcome="ok"
        )
        assert ok == 66, f"{ok} ok requests counted for 66 answered"
        batched = total(fam, "fusedserve_batch_rows", "fusedserve_batch_rows_sum") - total(
            before, "fusedserve_batch_rows", "fusedserve_batch_rows_sum"
        )
        assert batched == sum(sizes) + 6, f"the engines saw {batched} rows for {sum(sizes) + 6} sent"
        was, now = batches_per_engine(before), batches_per_engine(fam)
        per_engine = {e: n - was.get(e, 0) for e, n in now.items()}
        assert set(per_engine) == {"0", "1"} and min(per_engine.values()) > 0, per_engine
        info = [s for s in fam["fusedserve_model_info"].samples]
        assert sorted(s.labels["engine"] for s in info) == ["0", "1"], info
    doc = httpx.get(url + "/health/ready", timeout=TIMEOUT).json()
    assert doc["engines"] == ["ready", "ready"], doc


def batches_per_engine(fam: dict) -> dict[str, float]:
    return {
        s.labels["engine"]: s.value
        for s in fam["fusedserve_batch_rows"].samples
        if s.name == "fusedserve_batch_rows_count"
    }


def wait_engine_back(server, old_pid: int, timeout_s: float) -> int:
    """The pid of the engine started in place of `old_pid`, once /health/ready reads 200 again."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = httpx.get(server.url + "/health/ready", timeout=TIMEOUT)
        pid = children(server.process.proc.pid).get("fs-engine-0")
        if r.status_code == 200 and pid not in (None, old_pid):
            return pid
        time.sleep(0.1)
    raise AssertionError(f"the engine was not back within {timeout_s} s\n{server.log()}")


@pytest.mark.timeout(180)
def test_an_engine_that_dies_fails_its_requests_at_once_and_is_started_again_in_place():
    # A long max_delay: the requests sit in the engine's queue when it is killed.
    env = {"workers": 1, "max_delay_ms": 5000, "max_batch_size": 64, "shutdown_grace_s": 20}
    with running_servers({"s": ("unfused", env)}) as servers:
        server = servers["s"]
        engine = children(server.process.proc.pid)["fs-engine-0"]

        async def scenario():
            async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as client:
                # One kept-alive connection, opened before the kill and used while the engine is away.
                kept = httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT, limits=httpx.Limits(max_connections=1))
                assert (await kept.get("/health/live")).status_code == 200
                posts = [asyncio.ensure_future(client.post("/predict", json={"inputs": rows(2, i)})) for i in range(5)]
                await asyncio.sleep(0.5)
                assert not any(p.done() for p in posts), "the requests should be waiting in the engine"
                killed = time.monotonic()
                os.kill(engine, signal.SIGKILL)
                answers = await asyncio.gather(*posts)
                waited = time.monotonic() - killed
                ready = await kept.get("/health/ready")
                meanwhile = await kept.post("/predict", json={"inputs": rows(1, 99)})
                await kept.aclose()
                return answers, waited, ready, meanwhile

        answers, waited, ready, meanwhile = asyncio.run(scenario())
        assert [r.status_code for r in answers] == [503] * 5, [r.text for r in answers]
        assert all("engine" in r.json()["detail"] and r.headers.get("retry-after") for r in answers)
        assert waited < 1.0, f"the requests of a dead engine were answered {waited:.2f} s after it died"
        assert ready.status_code == 503 and ready.json()["status"] in ("stopped", "loading", "warming"), ready.text
        assert meanwhile.status_code == 503 and meanwhile.headers.get("retry-after"), meanwhile.text
        assert meanwhile.headers.get("connection") != "close", "a restart must not close the clients' connections"

        started = time.monotonic()
        new_engine = wait_engine_back(server, engine, 60)
        back_s = time.monotonic() - started
        r = httpx.post(server.url + "/predict", json={"inputs": rows(3, 7)}, timeout=TIMEOUT)
        assert r.status_code == 200 and len(r.json()["outputs"]) == 3, r.text
        assert server.process.proc.poll() is None, "the service must keep running"
        restarts = total(scrape(server.url), "fusedserve_engine_restarts", "fusedserve_engine_restarts_total")
        assert restarts == 1, f"{restarts} engine restarts counted for one death (back after {back_s:.1f} s)"

        # The third death within the window stops the service: a crash loop is for the orchestrator to handle.
        os.kill(new_engine, signal.SIGKILL)
        third = wait_engine_back(server, new_engine, 60)
        os.kill(third, signal.SIGKILL)
        code = wait_exit(server, 30)
        assert code == 1, f"the service exited {code} after its engine died three times\n{server.log()}"
        assert "engine death 3 within" in server.log()


@pytest.mark.timeout(120)
def test_a_front_end_that_dies_loses_only_its_connections_and_comes_back(two_by_two):
    server = two_by_two  # the traffic test's server, after it (file order): this test counts nothing
    before = children(server.process.proc.pid)
    os.kill(before["fs-frontend-1"], signal.SIGKILL)
    # New connections keep being answered (by the survivor while the other restarts, then by both).
    deadline = time.monotonic() + 20
    codes = []
    while time.monotonic() < deadline:
        try:
            r = httpx.post(server.url + "/predict", json={"inputs": rows(1, 0)}, timeout=TIMEOUT)
            codes.append(r.status_code)
        except httpx.TransportError as e:  # only a connection the dead process had accepted may fail
            codes.append(type(e).__name__)
        now = children(server.process.proc.pid)
        if now.get("fs-frontend-1") not in (None, before["fs-frontend-1"]) and len(codes) >= 20:
            break
        time.sleep(0.05)
    after = children(server.process.proc.pid)
    assert after.get("fs-frontend-1") not in (None, before["fs-frontend-1"]), f"not restarted: {after}"
    assert after["fs-frontend-0"] == before["fs-frontend-0"] and after["fs-engine-0"] == before["fs-engine-0"]
    assert codes.count(200) >= len(codes) - 1, codes
    ready = httpx.get(server.url + "/health/ready", timeout=TIMEOUT)
    assert ready.status_code == 200, ready.text
    assert server.process.proc.poll() is None


@pytest.mark.timeout(120)
def test_sigterm_answers_every_accepted_request_and_exits_0_within_the_grace():
    grace = 15
    env = {"workers": 2, "max_delay_ms": 400, "max_batch_size": 64, "shutdown_grace_s": grace}
    with running_servers({"s": ("unfused", env)}) as servers:
        server = servers["s"]

        async def scenario():
            async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as client:
                posts = [asyncio.ensure_future(client.post("/predict", json={"inputs": rows(3, i)})) for i in range(12)]
                await asyncio.sleep(0.2)  # accepted, waiting for their batch
                os.killpg(server.process.proc.pid, signal.SIGTERM)  # as `kill`, Ctrl-C or `docker stop` would
                return await asyncio.gather(*posts, return_exceptions=True)

        started = time.monotonic()
        answers = asyncio.run(scenario())
        for r in answers:
            assert not isinstance(r, Exception), r
            assert r.status_code == 200 and len(r.json()["outputs"]) == 3, r.text[:300]
        code = wait_exit(server, grace + 10)
        elapsed = time.monotonic() - started
        assert code == 0, f"exit {code}\n{server.log()}"
        assert elapsed < grace, f"stopping took {elapsed:.1f} s"
        assert "fusedserve stopped (exit 0)" in server.log()


def _two_gpus() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason="needs two GPUs (run it on a two-GPU host: tests/README.md)")
@pytest.mark.timeout(400)
def test_one_engine_per_gpu_shares_the_traffic_and_answers_as_one_engine():
    """One engine per GPU (the default): both serve batches, and every answer equals a one-engine run's of the same
    model for the same rows, within the dtype's tolerance (batches form differently in the two, so their rows may
    run in other tiles, with sums in another order)."""
    import torch

    from service.config import Settings
    from service.supervisor import engine_devices
    from tests.tolerances import RTOL

    dtype = "float16"
    common = {"workers": 2, "max_batch_size": 64, "dtype": dtype}
    specs = {"gpus": ("fused", common), "one": ("fused", {**common, "engines": 1})}
    with running_servers(specs, timeout_s=380) as servers:
        url, alone = servers["gpus"].url, servers["one"].url
        gpus = torch.cuda.device_count()
        names = children(servers["gpus"].process.proc.pid)
        assert {f"fs-engine-{i}" for i in range(gpus)} <= set(names), names
        assert "fs-engine-1" not in children(servers["one"].process.proc.pid)
        bodies = [{"inputs": rows(1 + i % 7, i)} for i in range(200)]
        got = asyncio.run(post_many(url, bodies, connections=32))
        want = asyncio.run(post_many(alone, bodies, connections=32))
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert not isinstance(g, Exception) and g.status_code == 200, g
            assert not isinstance(w, Exception) and w.status_code == 200, w
            out, ref = np.asarray(g.json()["outputs"], np.float64), np.asarray(w.json()["outputs"], np.float64)
            assert out.shape == ref.shape == (len(bodies[i]["inputs"]), 10), (i, out.shape, ref.shape)
            # Both fused in fp16, each within RTOL of the exact result (relative to |x| + rms(row)): within 2 RTOL
            scale = np.abs(ref) + np.sqrt(np.mean(ref**2, axis=-1, keepdims=True))
            worst = float(np.max(np.abs(out - ref) / scale))
            assert worst <= 2 * RTOL[torch.float16], f"request {i}: {worst:.3g} off the one-engine answer"
        sent = sum(len(b["inputs"]) for b in bodies)
        fam = scrape(url)
        batches, batched = {}, {}
        for sample in fam["fusedserve_batch_rows"].samples:
            if sample.name == "fusedserve_batch_rows_count":
                batches[sample.labels["engine"]] = sample.value
            elif sample.name == "fusedserve_batch_rows_sum":
                batched[sample.labels["engine"]] = sample.value
        engines = [str(i) for i in range(gpus)]
        assert sorted(batches) == engines and min(batches.values()) > 0, f"batches per engine: {batches}"
        assert sum(batched.values()) == sent, f"the engines saw {batched} rows for {sent} sent"
        devices = sorted(s.labels["device"] for s in fam["fusedserve_model_info"].samples)
        visible = engine_devices(Settings(_env_file=None), "cuda")  # the ids the supervisor handed out
        assert devices == sorted(f"cuda:{d}" for d in visible), devices
        assert {s.labels["dtype"] for s in fam["fusedserve_model_info"].samples} == {dtype}
