"""Every Prometheus metric of the service, one prefix `fusedserve_`, histograms in seconds.

Three owners: a front end counts requests (`RequestMetrics`), an engine times batches and kernels
(`EngineMetrics`, labelled with its `engine` index and, in `fusedserve_model_info`, its device), and the
supervisor counts engine restarts (`SupervisorMetrics`). Labels:
`model`, `mode` (fused|unfused) everywhere, `kernel` (a plan step name such as `linear_0_relu`) on
kernel time, `outcome` on the request counter. Histograms, not summaries, so processes and replicas
aggregate.

The service runs several processes (front ends and engines), so it uses prometheus-client's
multiprocess mode: the supervisor sets PROMETHEUS_MULTIPROC_DIR before any child imports this module,
every process writes its values there, and `/metrics` on any front end renders the whole deployment
once (counters and histograms summed over processes, the queue gauge summed over live engines).
Without that variable (tests, a library user) each object has its own registry, as a single process would.
"""

from __future__ import annotations

import bisect
import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
    multiprocess,
)

# Geometric buckets, x2 from 1 us to ~16.8 s: a 5 us kernel and a 2 s interpreted forward both land
# in a bucket no wider than 2x. 25 buckets.
SECONDS_BUCKETS = tuple(1e-6 * 2**i for i in range(25))
# Batch rows in powers of two, 1 .. 65536 (the largest max_batch_size the settings allow).
ROWS_BUCKETS = tuple(float(2**i) for i in range(17))
# unauthorized: an inference request without a valid API key (401), refused before its body was read.
OUTCOMES = ("ok", "invalid", "too_large", "overloaded", "timeout", "cancelled", "error", "unauthorized")
# How the request came: POST /predict, the Open Inference Protocol over REST (/v2/...), or over gRPC.
PROTOCOLS = ("predict", "v2_rest", "v2_grpc")

CONTENT_TYPE = CONTENT_TYPE_LATEST
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_mode() -> bool:
    return bool(os.environ.get(MULTIPROC_ENV))


def _registry() -> CollectorRegistry:
    r = CollectorRegistry()
    if not multiprocess_mode():  # these describe one process; in multiprocess mode they would describe one of many
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
    return r


class RequestMetrics:
    """A front end's metrics: requests by outcome and their latency in the server."""

    def __init__(self, model: str, mode: str):
        self.registry = r = _registry()
        lm = ["model", "mode", "protocol"]
        self.request_seconds = Histogram(
            "fusedserve_request_seconds",
            "Time from the request reaching the handler (body not yet read) to response ready, in the server",
            lm, buckets=SECONDS_BUCKETS, registry=r,
        )  # fmt: skip
        self.requests = Counter("fusedserve_requests", "Requests by outcome", [*lm, "outcome"], registry=r)
        # Every outcome of every protocol visible from the start, at 0, so rates are defined; children resolved
        # once (labels() costs a dict lookup and a lock per call).
        self._outcomes = {
            (p, o): self.requests.labels(model=model, mode=mode, protocol=p, outcome=o)
            for p in PROTOCOLS
            for o in OUTCOMES
        }
        self._request = {p: self.request_seconds.labels(model=model, mode=mode, protocol=p) for p in PROTOCOLS}

    def observe_request(self, outcome: str, seconds: float | None = None, protocol: str = "predict") -> None:
        self._outcomes[protocol, outcome].inc()
        if seconds is not None:
            self._request[protocol].observe(seconds)

    def render(self) -> bytes:
        return render(self.registry)


class EngineMetrics:
    """An engine's metrics: its queue, batches, forwards and kernels."""

    def __init__(self, model: str, mode: str, device: str, dtype: str, engine: str = "0"):
        self.registry = r = _registry()
        lm = ["model", "mode", "engine"]
        self.kernel_seconds = Histogram(
            "fusedserve_kernel_seconds",
            "Device time of one fused group (fused: 1 kernel; unfused: its torch ops) per batch",
            [*lm, "kernel"], buckets=SECONDS_BUCKETS, registry=r,
        )  # fmt: skip
        self.forward_seconds = Histogram(
            "fusedserve_forward_seconds", "Wall time of one batch forward, host to host (copies included)",
            lm, buckets=SECONDS_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_wait_seconds = Histogram(
            "fusedserve_queue_wait_seconds",
            "Time a request waited in its engine's queue (front end to batch start, the link included)",
            lm, buckets=SECONDS_BUCKETS, registry=r,
        )  # fmt: skip
        self.batch_rows = Histogram(
            "fusedserve_batch_rows", "Rows per forward batch", lm, buckets=ROWS_BUCKETS, registry=r
        )
        self.queue_depth_gauge = Gauge(
            "fusedserve_queue_depth", "Requests waiting for a batch", lm, registry=r, multiprocess_mode="livesum"
        )
        self.model_info = Gauge(
            "fusedserve_model_info", "The model being served (value 1)", [*lm, "device", "dtype"], registry=r,
            multiprocess_mode="livemax",
        )  # fmt: skip
        self.gpu_faults = Counter(
            "fusedserve_gpu_faults", "Forwards that failed on a device fault, by kind (oom, sticky)",
            [*lm, "kind"], registry=r,
        )  # fmt: skip
        self._labels = labels = {"model": model, "mode": mode, "engine": engine}
        self._faults = {k: self.gpu_faults.labels(**labels, kind=k) for k in ("oom", "sticky")}
        self.model_info.labels(**labels, device=device, dtype=dtype).set(1)
        self._forward = self.forward_seconds.labels(**labels)
        self._queue_wait = self.queue_wait_seconds.labels(**labels)
        self._rows = self.batch_rows.labels(**labels)
        self._depth = self.queue_depth_gauge.labels(**labels)
        self._depth.set(0)
        self._kernels: dict[str, object] = {}

    def observe_kernel(self, kernel: str, seconds: float) -> None:
        child = self._kernels.get(kernel)
        if child is None:
            child = self._kernels[kernel] = self.kernel_seconds.labels(**self._labels, kernel=kernel)
        child.observe(seconds)

    def observe_forward(self, seconds: float) -> None:
        self._forward.observe(seconds)

    def gpu_fault(self, kind: str) -> None:
        self._faults[kind].inc()

    def queue_depth(self, requests: int) -> None:
        self._depth.set(requests)

    def queue_waits(self, seconds: list[float]) -> None:
        """Every request's wait of one batch, in one update (per-request observes cost ~14% of a loaded engine's
        time in multiprocess mode, where each is two locked writes to a memory-mapped file)."""
        observe_many(self._queue_wait, seconds)

    def batch(self, rows: int) -> None:
        self._rows.observe(rows)

    def render(self) -> bytes:
        return render(self.registry)


class SupervisorMetrics:
    """The supervisor's metrics: engines it started again after they died."""

    def __init__(self):
        self.registry = r = _registry()
        self.engine_restarts = Counter(
            "fusedserve_engine_restarts", "Engines started again in place after they died", ["engine"], registry=r
        )

    def engine_restarted(self, engine: int) -> None:
        self.engine_restarts.labels(engine=str(engine)).inc()


def observe_many(child, values: list[float]) -> None:
    """`child.observe(v)` for every v, with one write per touched bucket instead of two per value.

    Uses the histogram child's bucket values (`_upper_bounds`, `_buckets`, `_sum`, as prometheus-client has
    kept them since 0.4); without them, one observe per value.
    """
    bounds = getattr(child, "_upper_bounds", None)
    buckets = getattr(child, "_buckets", None)
    if bounds is None or buckets is None or not hasattr(child, "_sum") or len(values) < 2:
        for v in values:
            child.observe(v)
        return
    counts: dict[int, int] = {}
    for v in values:
        i = bisect.bisect_left(bounds, v)  # the first bucket whose upper bound is >= v, as observe() picks
        counts[i] = counts.get(i, 0) + 1
    child._sum.inc(sum(values))
    for i, n in counts.items():
        buckets[i].inc(n)


def render(registry: CollectorRegistry) -> bytes:
    """The exposition text: of every process of the deployment in multiprocess mode, else of `registry`."""
    if multiprocess_mode():
        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged)
        return generate_latest(merged)
    return generate_latest(registry)


def process_exited(pid: int) -> None:
    """Forget an exited process's live gauges (its queue depth), so they stop counting."""
    if multiprocess_mode():
        multiprocess.mark_process_dead(pid)
