"""The dashboard's A/B row against a real Prometheus scraping a real service in ab mode (CPU), configured from
deploy/prometheus.yml as tests/test_prometheus_scrape.py does: every A/B panel's every query returns data (finite
values), the A/B row's variables resolve to the service, and `fusedserve ab-report` reads the same service through
Prometheus and through its /metrics. Without the `prometheus` binary (Debian package `prometheus`) the test is
skipped, except under CI=true, where it fails.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import time

import httpx
import pytest

from .server import PROMETHEUS_MISSING, require_binary, running_prometheus, running_servers
from .test_deploy_static import AB_ROW, all_panels, dashboard
from .test_prometheus_scrape import scrape_config_for

pytestmark = pytest.mark.slow

MODEL = "digits-mlp"
POLL_S = 90.0
RATE_WINDOW = "2m"  # for $__rate_interval: the whole test's traffic, scraped every second


def _query(client: httpx.Client, prom: str, expr: str) -> list[dict]:
    r = client.get(f"{prom}/api/v1/query", params={"query": expr})
    assert r.status_code == 200, f"{expr}: {r.text[:500]}"
    doc = r.json()
    assert doc["status"] == "success", doc
    return doc["data"]["result"]


def _finite(result: list[dict]) -> bool:
    return any(math.isfinite(float(x["value"][1])) for x in result)


def _ab_queries(instance: str) -> dict[str, list[str]]:
    """Each A/B panel's queries with Grafana's variables as Grafana would fill them for this service."""
    values = {"$model": MODEL, "$kernel": ".*", "$instance": re.escape(instance).replace("\\", "\\\\"),
              "$__rate_interval": RATE_WINDOW, "$a": "fused", "$b": "unfused"}  # fmt: skip
    out = {}
    for p in all_panels(dashboard()):
        if not p["title"].startswith(AB_ROW) or not p.get("targets"):
            continue
        exprs = []
        for t in p["targets"]:
            expr = t["expr"]
            for var, value in values.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, expr
            exprs.append(expr)
        out[p["title"]] = exprs
    return out


@pytest.mark.timeout(300)
def test_every_ab_panel_returns_data_and_ab_report_reads_the_service(tmp_path, capsys):
    if shutil.which("prometheus") is None:  # before starting the server: no wasted start-up
        require_binary("prometheus", PROMETHEUS_MISSING)
    conf = tmp_path / "fusedserve.env"
    conf.write_text("FUSEDSERVE_MODE=ab\nFUSEDSERVE_SHADOW_EVERY=2\n")
    env = {"config_file": conf, "max_batch_size": 8, "kernel_timing_every": 1, "workers": 1}
    rows = [[float((i * 7 + j) % 17) for j in range(64)] for i in range(8)]
    with running_servers({"s": (None, env)}, log_dir=tmp_path) as servers:
        server = servers["s"]
        base = server.url
        target = base.removeprefix("http://")
        with running_prometheus(scrape_config_for(target), tmp_path) as (prom, _), httpx.Client(timeout=30) as client:
            end = time.monotonic() + POLL_S
            while not _finite(_query(client, prom, f'up{{instance="{target}"}} == 1')):  # scraped once, before traffic
                assert time.monotonic() < end, "Prometheus never scraped the service"
                time.sleep(0.2)
            # Traffic in waves a scrape apart, so that every rate sees it grow; a reload between them.
            for wave in range(3):
                for n in range(1, 9):
                    r = client.post(f"{base}/predict", json={"inputs": rows[:n]})
                    assert r.status_code == 200 and r.json()["mode"] in ("fused", "unfused"), r.text
                if wave == 1:
                    conf.write_text("FUSEDSERVE_MODE=ab\nFUSEDSERVE_SHADOW_EVERY=2\nFUSEDSERVE_AB_UNFUSED_PERCENT=40\n")
                    os.kill(server.process.proc.pid, signal.SIGHUP)
                time.sleep(1.5)

            queries = _ab_queries(target)
            assert len(queries) >= 8, sorted(queries)
            missing: dict[str, list[str]] = {}
            while True:
                missing = {
                    title: [e for e in exprs if not _finite(_query(client, prom, e))]
                    for title, exprs in queries.items()
                }
                missing = {t: e for t, e in missing.items() if e}
                if not missing or time.monotonic() > end:
                    break
                time.sleep(1.0)
            assert not missing, f"A/B panels without data after {POLL_S:g} s: {missing}"

            # The row's variables: the service in ab mode is the A/B instance; both executors' modes are listed.
            series = client.get(
                f"{prom}/api/v1/series", params={"match[]": f'fusedserve_model_info{{model="{MODEL}", mode="ab"}}'}
            )
            assert {s["instance"] for s in series.json()["data"]} == {target}
            # A and B ($a, $b): the two executors the service compares, from fusedserve_ab_info
            for var, value in (("a", "fused"), ("b", "unfused")):
                got = client.get(f"{prom}/api/v1/label/{var}/values", params={"match[]": "fusedserve_ab_info"})
                assert got.json()["data"] == [value], got.text
            modes = client.get(
                f"{prom}/api/v1/label/mode/values", params={"match[]": "fusedserve_forward_seconds_count"}
            )
            assert set(modes.json()["data"]) == {"fused", "unfused"}
            reloads = _query(client, prom, 'fusedserve_config_reloads_total{outcome="applied"}')
            assert reloads and float(reloads[0]["value"][1]) == 1, reloads

            from service.cli import main

            capsys.readouterr()
            assert main(["ab-report", "--prometheus", prom, "--since", "5m"]) == 0
            via_prom = capsys.readouterr().out
            assert main(["ab-report", "--url", f"{base}/metrics"]) == 0
            via_url = capsys.readouterr().out
    for out in (via_prom, via_url):
        assert out.startswith(f"# A/B report: {MODEL}, fused against unfused"), out
        for row in ("| step `mlp_0_2` |", "| forward (host, per batch) |", "| request (in the server) |"):
            line = next((x for x in out.splitlines() if x.startswith(row)), None)
            assert line is not None and line.count(" - ") == 0, out  # every cell filled, both modes
        assert re.search(r"Shadow: \d+ batches run in both fused and unfused", out), out
    assert f"instances {target}" in via_prom
    # The service's own totals: 24 requests, 24 batches (one at a time), 12 compared (SHADOW_EVERY=2).
    assert re.search(r"Batches: fused 1\d \(mean [\d.]+ rows\), unfused 1\d ", via_url), via_url
    assert "Shadow: 12 batches" in via_url, via_url
