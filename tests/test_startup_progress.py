"""Start-up progress (service/engine/startup.py): what an engine's start is doing, logged at least every few seconds
and published for /health/ready; and the real service showing it while it warms."""

from __future__ import annotations

import json
import logging
import time

import httpx
import pytest

from kernels import tuning
from service.engine.startup import StartupProgress
from service.link.startup_progress import read_progress


def test_progress_counts_buckets_and_steps_and_estimates_what_is_left(tmp_path):
    p = StartupProgress(2, tmp_path, log_every_s=3600)
    try:
        assert read_progress(tmp_path) == {"2": {**read_progress(tmp_path)["2"], "phase": "loading"}}
        p.plan(2 * 3)  # 2 buckets of 3 steps
        p.bucket("fused", 1, 0, 2, 3)
        for i, name in enumerate(["conv_0", "conv_1", "linear_2"]):
            p.step(i, name)
        tuning.picks_timed.add()
        snap = p.snapshot()
        assert snap["phase"] == "warming" and snap["mode"] == "fused" and snap["bucket"] == 1
        assert snap["step"] == "linear_2" and snap["steps_done"] == 2 and snap["steps"] == 3
        assert snap["step_buckets_left"] == 4 and snap["estimate_left_s"] >= 0
        assert snap["kernel_keys_timed"] == 1
        p.capturing()
        p.bucket("fused", 256, 1, 2, 3)
        p.step(0, "conv_0")
        line = p.line()
        assert line.startswith("engine 2 warming, fused batch bucket 256 (2 of 2), step 1 of 3 (conv_0)"), line
        assert "3 step-buckets left" in line and "1 kernel keys timed" in line and "s left" in line
        published = read_progress(tmp_path)["2"]  # the bucket's start is written at once
        assert published["bucket"] == 256 and published["buckets_done"] == 1
    finally:
        p.finish()
    assert read_progress(tmp_path) == {}


def test_the_ticker_logs_while_a_step_runs(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="service.engine.startup")
    p = StartupProgress(0, None, log_every_s=0.05)
    try:
        p.plan(9)
        p.bucket("fused", 4, 2, 9, 1)
        p.step(0, "conv_slow")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any("conv_slow" in r.message for r in caplog.records):
            time.sleep(0.02)
    finally:
        p.finish()
    lines = [r.message for r in caplog.records if "conv_slow" in r.message]
    assert lines and "fused batch bucket 4 (3 of 9), step 1 of 1 (conv_slow)" in lines[0]


# ------------------------------------------------------------------------------------ the real service


@pytest.mark.timeout(300)
def test_health_ready_shows_the_warm_up_as_it_goes(tmp_path):
    """A CNN on the CPU warms through Triton's interpreter (seconds per bucket): /health/ready answers 503 with each
    engine's phase, bucket and step until it is ready, then 200 without them."""
    from tests.modelgen import write_cnn_model
    from tests.server import Server, dump_new_logs

    conv = [{"op": "conv2d", "out": 16, "kernel": 3, "padding": 1}, {"op": "relu"}]
    layers = [*conv, *conv, *conv, {"op": "flatten"}, {"op": "linear", "out": 10}]
    model_dir = write_cnn_model(tmp_path / "cnn", [3, 64, 64], layers, seed=1)
    # Fused on the CPU the warm-up runs batch 1 alone, so the model must be big enough for that to outlast the front
    # end's start under a loaded suite: three 16-channel convs at 64x64 take 9.2 s interpreted on an idle 2-core machine
    # beside a 0.6 s front-end start (two 8-channel convs at 24x24 took 0.76 s, and CI's front end came up after them).
    server = Server("fused", tmp_path, {"model": str(model_dir), "workers": 1, "engines": 1,
                                        "max_batch_size": 2, "max_rows_per_request": 2})  # fmt: skip
    server.start()
    seen = []
    try:
        deadline = time.monotonic() + 240
        with httpx.Client(timeout=5) as client:
            while time.monotonic() < deadline:
                try:
                    r = client.get(server.url + "/health/ready")
                except httpx.TransportError:
                    time.sleep(0.1)
                    continue
                doc = r.json()
                if r.status_code == 200:
                    assert "progress" not in doc
                    break
                if "progress" in doc:
                    seen.append(doc["progress"]["0"])
                time.sleep(0.05)
            else:
                pytest.fail("the service did not become ready")
        warming = [p for p in seen if p.get("phase") == "warming" and "bucket" in p]
        assert warming, f"no warm-up progress seen in /health/ready: {json.dumps(seen)[:500]}"
        assert {p["mode"] for p in warming} == {"fused"}
        assert all(p["steps"] >= 3 and 0 <= p["steps_done"] <= p["steps"] for p in warming)
        assert all(p["bucket"] == 1 and p["buckets"] == 1 for p in warming)
    finally:
        server.stop()
        dump_new_logs()
