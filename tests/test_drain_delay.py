"""FUSEDSERVE_DRAIN_DELAY_S (issue 51): after SIGTERM a replica goes on accepting and answering, /health/ready reading
503, for the delay, so that load balancers that check every few seconds take it out before it stops accepting (it
stopped 0.2 s after SIGTERM before); a second SIGTERM stops it at once."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from .server import running_servers

pytestmark = pytest.mark.slow

DELAY_S = 5.0
ROW = {"inputs": [[float(v % 17) for v in range(64)]]}
ENV = {"device": "cpu", "workers": 1, "drain_delay_s": DELAY_S, "shutdown_grace_s": 10}


@pytest.mark.timeout(180)
def test_a_stopping_replica_serves_through_its_drain_delay_and_a_second_signal_stops_it_now():
    with running_servers({"delayed": ("unfused", ENV), "hurried": ("unfused", ENV)}) as servers:
        delayed, hurried = servers["delayed"], servers["hurried"]
        signalled = time.monotonic()
        os.kill(delayed.process.proc.pid, signal.SIGTERM)
        os.kill(hurried.process.proc.pid, signal.SIGTERM)
        time.sleep(0.5)
        os.kill(hurried.process.proc.pid, signal.SIGTERM)  # again: no delay
        served = 0
        while time.monotonic() - signalled < DELAY_S - 1.0:
            with httpx.Client(timeout=5.0) as client:  # a new connection each time: still accepted
                assert client.get(f"{delayed.url}/health/ready").status_code == 503
                r = client.post(f"{delayed.url}/predict", json=ROW)
                assert r.status_code == 200 and r.headers["connection"] == "close", r.text
                served += 1
            time.sleep(0.2)
        assert served >= 5
        assert hurried.process.proc.poll() == 0, "the second SIGTERM did not cut the delay short"
        assert delayed.process.proc.wait(DELAY_S + 15) == 0
        stopped = time.monotonic() - signalled
        assert stopped >= DELAY_S, f"stopped accepting {stopped:.1f} s after SIGTERM"
        log = delayed.log()
        u = delayed.url  # the ready banner names every endpoint
        banner = f"fusedserve ready (1 engine): HTTP {u} (/predict, /v2), gRPC off, metrics {u}/metrics, docs {u}/docs"
        assert banner in log, log
        assert "WARNING" not in log, "a clean stop warns of nothing"
        assert f"still serving for {DELAY_S:g} s (FUSEDSERVE_DRAIN_DELAY_S)" in log, log
        assert "SIGTERM again: stopping now" in hurried.log()
