"""Every Prometheus metric of the service, one prefix `fusedserve_`, histograms in seconds.

Labels: `model`, `mode` (fused|unfused) everywhere, `kernel` (a plan step name such as
`linear_0_relu`) on kernel time, `outcome` on the request counter. Histograms, not summaries, so
replicas aggregate. Each app gets its own registry, so several apps can live in one process (tests).
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

# Geometric buckets, x2 from 1 us to ~16.8 s: a 5 us kernel and a 2 s interpreted forward both land
# in a bucket no wider than 2x. 25 buckets.
SECONDS_BUCKETS = tuple(1e-6 * 2**i for i in range(25))
# Batch rows in powers of two, 1 .. 65536 (the largest max_batch_size the settings allow).
ROWS_BUCKETS = tuple(float(2**i) for i in range(17))
OUTCOMES = ("ok", "invalid", "too_large", "overloaded", "timeout", "cancelled", "error")

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self, model: str, mode: str, device: str, dtype: str):
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        lm = ["model", "mode"]
        self.kernel_seconds = Histogram(
            "fusedserve_kernel_seconds",
            "Device time of one fused group (fused: 1 kernel; unfused: its torch ops) per batch",
            [*lm, "kernel"], buckets=SECONDS_BUCKETS, registry=r,
        )  # fmt: skip
        self.forward_seconds = Histogram(
            "fusedserve_forward_seconds", "Wall time of one batch forward, host to host (copies included)",
            lm, buckets=SECONDS_BUCKETS, registry=r,
        )  # fmt: skip
        self.request_seconds = Histogram(
            "fusedserve_request_seconds",
            "Time from the request reaching the handler (body not yet read) to response ready, in the server",
            lm, buckets=SECONDS_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_wait_seconds = Histogram(
            "fusedserve_queue_wait_seconds", "Time a request waited in the queue before its batch formed",
            lm, buckets=SECONDS_BUCKETS, registry=r,
        )  # fmt: skip
        self.batch_rows = Histogram(
            "fusedserve_batch_rows", "Rows per forward batch", lm, buckets=ROWS_BUCKETS, registry=r
        )
        self.requests = Counter("fusedserve_requests", "Requests by outcome", [*lm, "outcome"], registry=r)
        self.queue_depth_gauge = Gauge("fusedserve_queue_depth", "Requests waiting for a batch", lm, registry=r)
        self.model_info = Gauge(
            "fusedserve_model_info", "The model being served (value 1)", [*lm, "device", "dtype"], registry=r
        )
        self._labels = {"model": model, "mode": mode}
        self.model_info.labels(model=model, mode=mode, device=device, dtype=dtype).set(1)
        # Every outcome visible from the start, at 0, so rates are defined.
        self._outcomes = {o: self.requests.labels(**self._labels, outcome=o) for o in OUTCOMES}
        self.queue_depth_gauge.labels(**self._labels).set(0)
        # Children resolved once: labels() costs a dict lookup and a lock per call otherwise.
        self._forward = self.forward_seconds.labels(**self._labels)
        self._request = self.request_seconds.labels(**self._labels)
        self._queue_wait = self.queue_wait_seconds.labels(**self._labels)
        self._rows = self.batch_rows.labels(**self._labels)
        self._depth = self.queue_depth_gauge.labels(**self._labels)
        self._kernels: dict[str, object] = {}

    # -- runner hooks (worker thread) --
    def observe_kernel(self, kernel: str, seconds: float) -> None:
        child = self._kernels.get(kernel)
        if child is None:
            child = self._kernels[kernel] = self.kernel_seconds.labels(**self._labels, kernel=kernel)
        child.observe(seconds)

    def observe_forward(self, seconds: float) -> None:
        self._forward.observe(seconds)

    # -- request hooks (event loop) --
    def observe_request(self, outcome: str, seconds: float | None = None) -> None:
        self._outcomes[outcome].inc()
        if seconds is not None:
            self._request.observe(seconds)

    # -- batcher observer (service.batching.BatchObserver) --
    def queue_depth(self, requests: int) -> None:
        self._depth.set(requests)

    def queue_wait(self, seconds: float) -> None:
        self._queue_wait.observe(seconds)

    def batch(self, rows: int, requests: int) -> None:
        self._rows.observe(rows)

    def dropped(self, reason: str) -> None:
        # Counted by the request handler under the matching outcome ("timeout", "cancelled"), which
        # sees every dropped request; counting here too would count them twice.
        pass

    def render(self) -> bytes:
        return generate_latest(self.registry)
