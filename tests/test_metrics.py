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
