"""GPU faults, on the CPU, with the real service (issue 22): a batch that runs out of GPU memory, and a sticky
CUDA error that poisons the context.

Neither fault can be produced here (no GPU) nor on demand on a GPU, so each test injects it at the runner
boundary, the one call the engine makes per forward: FS_INJECT_FAULT (service/engine/faults.py) wraps the engine's
runner so that `oom_above=N` raises torch.OutOfMemoryError for a forward of more than N rows, and
`sticky_at=K` raises CUDA's "an illegal memory access was encountered" RuntimeError from the K-th forward
on. Everything past that call, the engine's handling, the link, the front end, the supervisor, is real.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.engine.faults import INJECT_ENV

from .server import running_servers

pytestmark = pytest.mark.slow

FEATURES = 64
TIMEOUT = httpx.Timeout(30.0, connect=5.0)


def rows(n: int, seed: int) -> list[list[float]]:
    return np.random.default_rng(seed).uniform(0, 16, (n, FEATURES)).round(1).tolist()


def faults_counted(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "fusedserve_gpu_faults":
            for s in fam.samples:
                if s.name == "fusedserve_gpu_faults_total":
                    out[s.labels["kind"]] = out.get(s.labels["kind"], 0) + s.value
    return out


async def post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        return await asyncio.gather(*(client.post("/predict", json=b) for b in bodies))


@pytest.mark.timeout(120)
def test_out_of_memory_splits_the_batch_and_a_request_too_big_alone_gets_503(monkeypatch):
    monkeypatch.setenv(INJECT_ENV, "oom_above=4")  # any forward of more than 4 rows runs out of memory
    # A long max_delay gathers the concurrent requests into one batch of 12 rows.
    env = {"workers": 1, "max_batch_size": 64, "max_delay_ms": 300}
    with running_servers({"s": ("unfused", env)}) as servers:
        url = servers["s"].url
        bodies = [{"inputs": rows(2, i)} for i in range(6)]
        alone = [r.json()["outputs"] for r in asyncio.run(post_all(url, bodies[:1]))]
        answers = asyncio.run(post_all(url, bodies))
        assert [r.status_code for r in answers] == [200] * 6, [r.text[:200] for r in answers]
        assert all(len(r.json()["outputs"]) == 2 for r in answers)
        # The split changes no answer: the first request's outputs equal those it got alone.
        np.testing.assert_allclose(answers[0].json()["outputs"], alone[0], rtol=1e-6)
        split = faults_counted(url).get("oom", 0)
        assert split >= 1, "the 12-row batch ran out of memory and was split: it must be counted"

        too_big = httpx.post(url + "/predict", json={"inputs": rows(8, 99)}, timeout=TIMEOUT)
        assert too_big.status_code == 503, too_big.text
        assert "out of memory" in too_big.json()["detail"] and too_big.headers.get("retry-after")
        assert faults_counted(url)["oom"] == split + 1
        # The service keeps serving.
        after = httpx.post(url + "/predict", json={"inputs": rows(3, 7)}, timeout=TIMEOUT)
        assert after.status_code == 200, after.text
        assert httpx.get(url + "/health/live", timeout=TIMEOUT).status_code == 200
        assert httpx.get(url + "/health/ready", timeout=TIMEOUT).status_code == 200
        assert servers["s"].process.proc.poll() is None


@pytest.mark.timeout(120)
def test_a_sticky_cuda_error_fails_what_is_held_turns_live_false_and_exits_non_zero(monkeypatch):
    monkeypatch.setenv(INJECT_ENV, "sticky_at=3")  # the third forward, and every later one, hits the error
    # Batches of at most 4 rows: of the six 2-row requests sent together, two run and four wait in the queue.
    env = {"workers": 1, "max_batch_size": 4, "max_delay_ms": 300, "shutdown_grace_s": 10}
    with running_servers({"s": ("unfused", env)}) as servers:
        server = servers["s"]
        url = server.url
        for i in range(2):
            assert httpx.post(url + "/predict", json={"inputs": rows(1, i)}, timeout=TIMEOUT).status_code == 200

        async def scenario():
            async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
                started = time.monotonic()
                answers = await asyncio.gather(
                    *(client.post("/predict", json={"inputs": rows(2, 10 + i)}) for i in range(6))
                )
                took = time.monotonic() - started
                live = await client.get("/health/live")
                metrics = await client.get("/metrics")
                return answers, took, live, metrics

        answers, took, live, metrics = asyncio.run(scenario())
        assert [r.status_code for r in answers] == [503] * 6, [r.text[:200] for r in answers]
        details = [r.json()["detail"] for r in answers]
        assert all("illegal memory access" in d or "engine" in d for d in details), details
        assert any("GPU failed" in d for d in details), details
        assert took < 3.0, f"requests held by a broken engine were answered after {took:.2f} s"
        assert live.status_code == 503 and live.json()["status"] == "broken", live.text
        sticky = [
            s.value
            for fam in text_string_to_metric_families(metrics.text)
            if fam.name == "fusedserve_gpu_faults"
            for s in fam.samples
            if s.name == "fusedserve_gpu_faults_total" and s.labels["kind"] == "sticky"
        ]
        assert sum(sticky) == 1, sticky
        try:
            code = server.process.proc.wait(30)
        except Exception as e:
            raise AssertionError(f"the service did not exit after a sticky error\n{server.log()}") from e
        assert code == 1, f"exit {code}\n{server.log()}"
        log = server.log()
        assert "engine 0 exited with code 4" in log, log[-2000:]
