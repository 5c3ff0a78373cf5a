"""A real Prometheus scrapes a real fused server, configured from deploy/prometheus.yml.

The deployed config is loaded, its `fusedserve` job retargeted at the test server on 127.0.0.1
and every interval cut to 1 s; everything else (job name, metrics path, target labels) is kept, so
the test checks what the deployment would collect. Without the `prometheus` binary (Debian package
`prometheus`) the test is skipped, except under CI=true, where it fails.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from .server import PROMETHEUS_MISSING, dump_new_logs, require_binary, running_prometheus, running_server

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
DEPLOYED = REPO / "deploy" / "prometheus.yml"
JOB = "fusedserve"
MODEL = "digits-mlp"
POLL_S = 60.0


@pytest.fixture(autouse=True)
def _process_logs():
    yield
    dump_new_logs()  # shown by pytest only when the test failed


def scrape_config_for(target: str) -> str:
    """deploy/prometheus.yml with the fusedserve job aimed at `target` and 1 s intervals.

    The result holds `{listen}` where Prometheus' own address goes (see running_prometheus)."""
    deployed = yaml.safe_load(DEPLOYED.read_text())
    config = copy.deepcopy(deployed)
    config.setdefault("global", {}).update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert JOB in jobs, f"{DEPLOYED} has no {JOB!r} job (jobs: {sorted(jobs)})"
    job = jobs[JOB]
    assert job.get("metrics_path", "/metrics") == "/metrics", job
    # Keep the first static target group (the fused service) with its labels, retargeted; the other
    # groups name hosts that exist only inside docker-compose.
    first = job["static_configs"][0]
    job["static_configs"] = [{**first, "targets": [target]}]
    for other in config["scrape_configs"]:
        other.pop("scrape_interval", None)
        other.pop("scrape_timeout", None)
        if other is not job:
            for group in other.get("static_configs", []):
                group["targets"] = ["{listen}"]  # e.g. the self-scrape of localhost:9090
    return yaml.safe_dump(config, sort_keys=False)


def test_deployed_config_passes_promtool(tmp_path):
    promtool = require_binary("promtool", "the `promtool` binary is not installed (apt-get install prometheus)")
    r = subprocess.run([promtool, "check", "config", str(DEPLOYED)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"promtool check config {DEPLOYED}:\n{r.stdout}\n{r.stderr}"
    derived = tmp_path / "derived.yml"
    derived.write_text(scrape_config_for("127.0.0.1:9").replace("{listen}", "127.0.0.1:9"))
    r = subprocess.run([promtool, "check", "config", str(derived)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, (
        f"promtool check config on the derived config:\n{r.stdout}\n{r.stderr}\n{derived.read_text()}"
    )


def _query(client: httpx.Client, prom: str, query: str) -> list[dict]:
    r = client.get(f"{prom}/api/v1/query", params={"query": query})
    assert r.status_code == 200, r.text[:500]
    doc = r.json()
    assert doc["status"] == "success", doc
    return doc["data"]["result"]


@pytest.mark.timeout(180)
def test_prometheus_scrapes_the_service(tmp_path):
    if shutil.which("prometheus") is None:  # before starting the server: no wasted start-up
        require_binary("prometheus", PROMETHEUS_MISSING)
    rows = [[float((i * 7 + j) % 17) for j in range(64)] for i in range(4)]
    with running_server("fused", log_dir=tmp_path, max_batch_size=64, kernel_timing_every=1) as base:
        target = base.removeprefix("http://")
        with running_prometheus(scrape_config_for(target), tmp_path) as (prom, _), httpx.Client(timeout=10) as client:
            # Traffic: 3 good requests (6 rows in all) and 2 bad ones.
            for n in (1, 2, 3):
                assert client.post(f"{base}/predict", json={"inputs": rows[:n]}).status_code == 200
            for bad in ({"inputs": [[1.0]]}, {"inputs": []}):
                assert client.post(f"{base}/predict", json=bad).status_code == 422

            deadline = time.monotonic() + POLL_S
            last: object = None
            while True:
                targets = client.get(f"{prom}/api/v1/targets").json()["data"]["activeTargets"]
                ours = [t for t in targets if t["labels"].get("job") == JOB]
                ok = _query(client, prom, f'fusedserve_requests_total{{job="{JOB}",protocol="predict",outcome="ok"}}')
                rows_seen = _query(client, prom, "fusedserve_batch_rows_sum")
                kernels = _query(client, prom, "fusedserve_kernel_seconds_count")
                last = {"targets": ours, "ok": ok, "rows": rows_seen, "kernels": kernels}
                done = (
                    len(ours) == 1 and ours[0]["health"] == "up"
                    and ok and float(ok[0]["value"][1]) >= 3
                    and rows_seen and float(rows_seen[0]["value"][1]) >= 6
                    and len(kernels) == 1
                )  # fmt: skip
                if done or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert done, f"Prometheus did not collect the service's metrics within {POLL_S:g} s: {last}"

            target_info = ours[0]
            assert target_info["scrapeUrl"] == f"{base}/metrics", target_info
            assert target_info["lastError"] == "", target_info
            labels = ok[0]["metric"]
            assert labels["model"] == MODEL and labels["mode"] == "fused", labels
            assert labels["job"] == JOB and labels["instance"] == target, labels
            deployed_labels = yaml.safe_load(DEPLOYED.read_text())
            group = next(j for j in deployed_labels["scrape_configs"] if j["job_name"] == JOB)["static_configs"][0]
            for k, v in group.get("labels", {}).items():  # the deployed target labels arrive too
                assert labels.get(k) == v, (k, labels)
            assert {k["metric"]["kernel"] for k in kernels} == {"mlp_0_2"}
            assert all(k["metric"]["mode"] == "fused" for k in kernels), kernels

            query = f'fusedserve_requests_total{{job="{JOB}",protocol="predict",outcome="invalid"}}'
            invalid = _query(client, prom, query)
            assert invalid and float(invalid[0]["value"][1]) == 2, invalid
            # A PromQL aggregation across the service's series works as the dashboards use it.
            by_outcome = _query(client, prom, "sum by (outcome) (fusedserve_requests_total)")
            assert {r["metric"]["outcome"] for r in by_outcome} >= {"ok", "invalid", "cancelled"}, by_outcome
            info = _query(client, prom, "fusedserve_model_info")
            assert len(info) == 1 and info[0]["metric"]["device"].split(":")[0] in ("cpu", "cuda"), info

            self_targets = [t for t in targets if t["labels"].get("job") != JOB]
            assert all(t["health"] in ("up", "unknown") for t in self_targets), self_targets
