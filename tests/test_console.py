"""service/console.py: the ready banner names every endpoint, and a terminal sees the engines' start-up progress
redrawn in place (what /health/ready reports), nothing where standard error is not a terminal (issue 51)."""

from __future__ import annotations

import io

from service.config import Settings
from service.console import TerminalProgress, ready_banner, render

WARMING = {
    "phase": "warming", "mode": "fused", "bucket": 64, "buckets_done": 3, "buckets": 8, "step": "conv_1_relu",
    "steps_done": 1, "steps": 4, "elapsed_s": 12.3, "kernel_keys_timed": 5, "step_buckets_left": 19,
    "estimate_left_s": 31.0,
}  # fmt: skip


def test_the_banner_names_every_endpoint():
    s = Settings(_env_file=None, host="0.0.0.0", port=8000, grpc_port=8001, metrics_port=9100)
    assert ready_banner(s, 1) == (
        "fusedserve ready (1 engine): HTTP http://0.0.0.0:8000 (/predict, /v2), gRPC 0.0.0.0:8001, metrics "
        "http://0.0.0.0:9100/metrics, docs http://0.0.0.0:8000/docs, health http://0.0.0.0:8000/health/ready"
    )
    off = ready_banner(Settings(_env_file=None, docs=False), 2)
    assert "(2 engines)" in off and "gRPC off" in off and "docs off" in off
    assert "metrics http://127.0.0.1:8000/metrics" in off


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_sees_the_progress_redrawn_in_place_and_cleared_at_ready(monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    clock = [100.0]
    out = _Tty()
    bar = TerminalProgress(out, now=lambda: clock[0])
    bar.update(lambda: {"0": WARMING})
    bar.update(lambda: {"0": {**WARMING, "steps_done": 2}})  # within REDRAW_EVERY_S: not drawn, not even read
    text = out.getvalue()
    assert text == "\r\x1b[2K[########------------] warming fused: bucket 64 (4/8), step 2/4; 12 s, ~31 s left\r"
    clock[0] += 1
    bar.update(lambda: {"0": {**WARMING, "capturing": True, "steps_done": 4}})
    assert "capturing" in out.getvalue().rsplit("\x1b[2K", 1)[1]
    bar.clear()
    assert out.getvalue().endswith("\r\x1b[2K\r")


def test_no_terminal_no_bar():
    out = io.StringIO()
    bar = TerminalProgress(out)
    bar.update(lambda: {"0": WARMING})
    bar.clear()
    assert out.getvalue() == ""


def test_several_engines_show_the_one_with_most_left():
    line = render({"0": {**WARMING, "step_buckets_left": 2}, "1": WARMING})
    assert "engine 1 warming" in line
    assert render({"0": {"phase": "loading", "elapsed_s": 2.0}}) == "loading... 2 s"
