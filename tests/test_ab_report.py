"""`fusedserve ab-report` (service/ab_report.py) on metrics made here: the quantiles are histogram_quantile's, the
speedup's bracket always holds the true ratio of the two p50s, and the report names every step, the forward, the
request, the split and the shadow. tests/test_ab_dashboard.py runs it against a real service and Prometheus."""

from __future__ import annotations

import numpy as np
import pytest

from service.ab_report import Hist, from_metrics_text, render, speedup
from service.cli import main
from service.metrics import SECONDS_BUCKETS, EngineMetrics, RequestMetrics


def hist_of(values) -> Hist:
    h = Hist()
    for le in (*SECONDS_BUCKETS, float("inf")):
        h.add_bucket(le, float(np.count_nonzero(np.asarray(values) <= le)))
    h.sum, h.count = float(np.sum(values)), float(len(values))
    return h


def test_quantile_interpolates_within_its_bucket_as_prometheus_does():
    h = Hist({1.0: 0, 2.0: 10, 4.0: 30, float("inf"): 40})
    assert h.quantile(0.5) == (3.0, 2.0, 4.0)  # rank 20: half way through (2, 4]
    assert h.quantile(0.1) == pytest.approx((1.4, 1.0, 2.0))  # rank 4: 4/10 of the way through (1, 2]
    assert h.quantile(0.99)[2] == float("inf") and h.quantile(0.99)[0] == 4.0  # in +Inf: the last finite bound
    assert Hist().quantile(0.5) is None and h.highest() == float("inf")


@pytest.mark.parametrize("seed", range(20))
def test_the_speedup_bracket_holds_the_true_ratio_of_the_p50s(seed):
    rng = np.random.default_rng(seed)
    fused = rng.lognormal(np.log(rng.uniform(3e-6, 3e-5)), rng.uniform(0.05, 0.6), 2001)
    unfused = rng.lognormal(np.log(rng.uniform(1e-5, 1e-4)), rng.uniform(0.05, 0.6), 2001)
    est, lo, hi = speedup(hist_of(fused), hist_of(unfused))
    truth = np.median(unfused) / np.median(fused)
    assert lo <= truth <= hi and lo <= est <= hi
    assert hi / lo <= 4.0 + 1e-9  # x2 buckets: the bracket spans at most 4x


def test_report_from_a_service_metrics_text():
    engine = EngineMetrics("digits-mlp", "ab", "cpu", "float32")
    front = RequestMetrics("digits-mlp", "ab")
    for mode, step, forward, request in (("fused", 5e-6, 30e-6, 200e-6), ("unfused", 20e-6, 60e-6, 250e-6)):
        for _ in range(100):
            engine.observe_kernel("mlp_0_2", step, mode)
            engine.observe_forward(forward, mode)
            engine.batch(4, mode)
            front.observe_request("ok", request, mode=mode)
    front.observe_request("invalid")  # mode "ab": no executor ran it, in no row
    for _ in range(10):
        engine.shadow(2e-4, 0)
    engine.shadow(3e-3, 1)
    text = engine.render().decode() + front.render().decode()
    r = from_metrics_text(text, "test")
    out = render(r)
    assert r.model == "digits-mlp" and set(r.steps) == {("mlp_0_2", "fused"), ("mlp_0_2", "unfused")}
    step = next(line for line in out.splitlines() if line.startswith("| step `mlp_0_2`"))
    cells = [c.strip() for c in step.split("|")[1:-1]]
    assert cells[3] == "100" and cells[6] == "100", cells
    assert cells[8] == "4.00x", cells  # the means: exact
    est, lo, hi = speedup(r.steps["mlp_0_2", "fused"], r.steps["mlp_0_2", "unfused"])
    assert lo <= 4.0 <= hi and cells[7].startswith(f"{est:.2f}x ["), cells
    assert "| forward (host, per batch) |" in out and "| request (in the server) |" in out
    assert "Batches: fused 100 (mean 4.0 rows), unfused 100 (mean 4.0 rows); 50.0% unfused." in out
    assert "Shadow: 11 batches" in out and "largest ≤ 0.0032" in out and "1 rows predicted another label" in out


def test_the_cli_reads_a_metrics_url(monkeypatch, capsys, tmp_path):
    engine = EngineMetrics("m", "ab", "cpu", "float32")
    engine.observe_forward(1e-4, "fused")
    monkeypatch.setattr("service.ab_report._get", lambda url, timeout_s=10.0: engine.render().decode())
    out = tmp_path / "ab.md"
    assert main(["ab-report", "--url", "http://x/metrics", "--out", str(out)]) == 0
    assert out.read_text().startswith("# A/B report: m, fused against unfused")
    with pytest.raises(SystemExit):
        main(["ab-report", "--url", "http://x/metrics", "--model", "other"])
    with pytest.raises(SystemExit):
        main(["ab-report"])  # --url or --prometheus
    capsys.readouterr()
