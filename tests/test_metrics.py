"""service/metrics.py: observe_many is observe, value by value, in fewer writes."""

from __future__ import annotations

import math

import numpy as np
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from service.metrics import SECONDS_BUCKETS, observe_many


def _pair():
    r1, r2 = CollectorRegistry(), CollectorRegistry()
    h1 = Histogram("h", "h", ["engine"], buckets=SECONDS_BUCKETS, registry=r1).labels(engine="0")
    h2 = Histogram("h", "h", ["engine"], buckets=SECONDS_BUCKETS, registry=r2).labels(engine="0")
    return (r1, h1), (r2, h2)


def test_observe_many_renders_what_observing_each_value_renders():
    (r1, one), (r2, many) = _pair()
    rng = np.random.default_rng(1)
    values = list(rng.lognormal(-9, 2, 500)) + [SECONDS_BUCKETS[3], SECONDS_BUCKETS[0], 0.0, 1e9]
    for v in values:
        one.observe(v)
    for chunk in (values[:1], values[1:7], values[7:]):  # one value alone takes the plain path
        observe_many(many, chunk)

    def samples(r) -> list[bytes]:  # less the creation timestamps, which differ, and the sum (below)
        return [ln for ln in generate_latest(r).splitlines() if b"_created" not in ln and not ln.startswith(b"h_sum")]

    def total(r) -> float:
        return r.get_sample_value("h_sum", {"engine": "0"})

    assert samples(r1) == samples(r2)  # every bucket and the count
    assert b'h_count{engine="0"} 504.0' in samples(r2)
    assert math.isclose(total(r1), total(r2), rel_tol=1e-12)  # summed in another order


def test_refusals_before_any_route_count_in_the_processs_front_end_by_reason():
    from service.metrics import REFUSAL_REASONS, RequestMetrics, connection_refused

    metrics = RequestMetrics("m-refusals", "fused")
    for reason in ("per_client", "per_client", "tls_capacity"):
        connection_refused(reason)
    got = {s.labels["reason"]: s.value for f in metrics.registry.collect() if f.name == "fusedserve_connections_refused"
           for s in f.samples if s.name.endswith("_total")}  # fmt: skip
    assert got == {r: {"per_client": 2.0, "tls_capacity": 1.0}.get(r, 0.0) for r in REFUSAL_REASONS}


def test_requests_counted_on_a_loop_are_written_at_the_end_of_its_turn_as_they_are_without_one():
    """RequestMetrics.observe_request on an event loop keeps its values until the turn ends (one write per touched
    value, issue 50), then holds what observing each request at once holds; render() writes them first."""
    import asyncio

    from service.metrics import RequestMetrics

    def samples(m: RequestMetrics) -> dict:
        return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model"))): s.value
                for f in m.registry.collect() if f.name.startswith(("fusedserve_request", "fusedserve_failed"))
                for s in f.samples if not s.name.endswith("_created")}  # fmt: skip

    cases = [("ok", 3e-4, "predict", "fused")] * 5 + [
        ("ok", 2e-3, "v2_rest", None),
        ("ok", None, "predict", "unfused"),
        ("invalid", 1e-4, "predict", None),
        ("invalid", 3e-4, "predict", None),
        ("overloaded", None, "v2_grpc", None),
    ]
    now, later, rendered = (RequestMetrics(f"m-{k}", "fused") for k in ("now", "later", "rendered"))
    for c in cases:
        now.observe_request(*c)

    async def one_turn() -> tuple[dict, dict]:
        for c in cases:
            later.observe_request(*c)
            rendered.observe_request(*c)
        unwritten = samples(later)
        text = rendered.render().decode()  # in the same turn
        assert 'fusedserve_requests_total{mode="fused",model="m-rendered",outcome="ok",protocol="predict"} 5.0' in text
        await asyncio.sleep(0)  # the turn ends: the flush runs
        return unwritten, samples(later)

    unwritten, written = asyncio.run(one_turn())
    assert written == samples(now) == samples(rendered)
    assert written[("fusedserve_requests_total", (("mode", "fused"), ("outcome", "ok"), ("protocol", "predict")))] == 5
    failed = written[("fusedserve_failed_request_seconds_total", (("mode", "fused"), ("protocol", "predict")))]
    assert math.isclose(failed, 4e-4, rel_tol=1e-12)
    assert not any(unwritten.values())  # nothing was written during the turn
