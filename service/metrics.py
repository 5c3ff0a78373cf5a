"""Every Prometheus metric of the service, one prefix `fusedserve_`, histograms in seconds.

Three owners: a front end counts requests (`RequestMetrics`), an engine times batches and kernels
(`EngineMetrics`, labelled with its `engine` index and, in `fusedserve_model_info`, its device), and the supervisor
counts engine restarts and configuration reloads (`SupervisorMetrics`). Labels:
`model`, `mode` everywhere (the executor that ran the batch or answered the request: fused|unfused, in `ab` mode
too, so one service's series compare the two; where no executor ran, the configured mode, fused|unfused|ab),
`kernel` (a plan step name such as `linear_0_relu`) on kernel time, `outcome` on the request counter. The shadow
comparison (`fusedserve_shadow_*`) is per engine and names the two executors it compares in `a` and `b` (their `mode`
labels: fused and unfused, or MODE:DTYPE such as fused:float8 and fused:float16 where FUSEDSERVE_AB_OTHER names another
precision; service/engine/ab.py). Histograms, not summaries, so processes and replicas aggregate.

The service runs several processes (front ends and engines), so it uses prometheus-client's
multiprocess mode: the supervisor sets PROMETHEUS_MULTIPROC_DIR before any child imports this module,
every process writes its values there, and `/metrics` on any front end renders the whole deployment
once (counters and histograms summed over processes, the queue gauge summed over live engines).
Without that variable (tests, a library user) each object has its own registry, as a single process would.

The same values answer Triton's statistics extension (service/v2/extensions.py): `inference_totals` reads them, merged
over processes as `/metrics` renders them.
"""

from __future__ import annotations

import asyncio
import bisect
import os
import time
from dataclasses import dataclass, field

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
# Why a connection or a request head was refused before any route ran (fusedserve_connections_refused).
REFUSAL_REASONS = ("request_line", "header_bytes", "header_count", "per_client", "tls_capacity", "connect_rate")
# How the request came: POST /predict, the Open Inference Protocol over REST (/v2/...), or over gRPC.
PROTOCOLS = ("predict", "v2_rest", "v2_grpc")

# The parts of an answered request's time in its engine, back to back (Engine._answered in service/engine/core.py
# says which interval each is): the `phase` label of fusedserve_inference_phase_seconds, and Triton's names for them.
PHASES = ("queue", "compute_input", "compute_infer", "compute_output")
# An engine keeps its answered-request counts in memory and writes them out at most this often, and whenever it goes
# idle: writing them per batch (6 locked writes to memory-mapped files in multiprocess mode, ~2 us each on a CI core)
# would add ~5-10% to a loaded engine's host time per batch. So under load they lag by up to this much.
ANSWERED_WRITE_EVERY_S = 0.02

CONTENT_TYPE = CONTENT_TYPE_LATEST
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_mode() -> bool:
    return bool(os.environ.get(MULTIPROC_ENV))


def use_multiprocess_dir(path: str | None) -> None:
    """Write this process's metrics, and those of the children it starts from now on, to `path` (the supervisor,
    before it starts any); None: back to in-process values. prometheus-client picks in-process or file-backed values
    once, when it is imported, which may be before this: so the choice is made again here, for the supervisor's own
    counters (engine restarts, configuration reloads), created after this."""
    from prometheus_client import values

    if path is None:
        os.environ.pop(MULTIPROC_ENV, None)
    else:
        os.environ[MULTIPROC_ENV] = path
    values.ValueClass = values.get_value_class()


def _registry() -> CollectorRegistry:
    r = CollectorRegistry()
    if not multiprocess_mode():  # these describe one process; in multiprocess mode they would describe one of many
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
    return r


def served_modes(mode: str) -> tuple[str, ...]:
    """The modes whose executors answer requests under the configured `mode` (fused, unfused or ab)."""
    return ("fused", "unfused") if mode == "ab" else (mode,)


class RequestMetrics:
    """A front end's metrics: requests by outcome and their latency in the server.

    `mode` is the label of the executor that computed the answer (the engine's reply says which); a request that
    no executor ran (invalid, refused, timed out in the queue) carries the configured mode (`ab` in ab mode)."""

    def __init__(self, model: str, mode: str):
        self.registry = r = _registry()
        lm = ["model", "mode", "protocol"]
        self.request_seconds = Histogram(
            "fusedserve_request_seconds",
            "Time from the request reaching the handler (body not yet read) to response ready, in the server",
            lm, buckets=SECONDS_BUCKETS, registry=r,
        )  # fmt: skip
        self.requests = Counter("fusedserve_requests", "Requests by outcome", [*lm, "outcome"], registry=r)
        self.failed_seconds = Counter(
            "fusedserve_failed_request_seconds",
            "Time from the request reaching the handler to its error answer, summed over requests answered with an "
            "error (any outcome but ok); one refused before any work (unauthorized, an unknown model) adds no time",
            lm, registry=r,
        )  # fmt: skip
        # Refused before any route ran, so in no request count (service/frontend/guard.py and accept.py).
        self.connections_refused = Counter(
            "fusedserve_connections_refused",
            "Connections or request heads refused before any route ran, by reason: request_line (414), header_bytes "
            "and header_count (431), per_client (MAX_CONNECTIONS_PER_CLIENT), tls_capacity (a TLS connection past "
            "MAX_CONNECTIONS, refused at the accept), connect_rate (PER_CLIENT_CONNECT_RATE, refused at the accept)",
            ["model", "reason"], registry=r,
        )  # fmt: skip
        self._refused = {why: self.connections_refused.labels(model=model, reason=why) for why in REFUSAL_REASONS}
        global _FRONT_END
        _FRONT_END = self  # the process's front end: connection_refused() counts there
        self._model = model
        # Children resolved once (labels() costs a dict lookup and a lock per call), keyed (protocol, outcome, mode)
        # and (protocol, mode).
        self._outcomes: dict[tuple[str, str, str], object] = {}
        self._request: dict[tuple[str, str], object] = {}
        self._failed: dict[tuple[str, str], object] = {}
        # Requests counted on an event loop: kept here and written once at the end of the loop's turn (`flush`), as
        # many requests as the turn answered in one write per touched value. In multiprocess mode each write takes a
        # lock, a getpid() and a write to a memory-mapped file: three per request cost ~15 us of the ~75 a single-row
        # /predict takes in process on the 2-core CI machine (bench/results/cpu/request_cost_cpu.md).
        self._pending: list[tuple[str, str, str, float | None]] = []
        self._flush_loop: asyncio.AbstractEventLoop | None = None  # the loop a flush is scheduled on
        self.mode = mode
        self.set_mode(mode)

    def set_mode(self, mode: str) -> None:
        """The configured mode changed (a reload): its series visible from now on, at 0, so rates are defined."""
        self.mode = mode
        for m in served_modes(mode):
            for p in PROTOCOLS:
                self._request_child(p, m)
                for o in OUTCOMES:
                    self._outcome_child(p, o, m)
        if mode not in served_modes(mode):  # ab: the label of requests no executor ran; never "ok"
            for p in PROTOCOLS:
                for o in OUTCOMES:
                    if o != "ok":
                        self._outcome_child(p, o, mode)

    def _outcome_child(self, protocol: str, outcome: str, mode: str):
        key = (protocol, outcome, mode)
        child = self._outcomes.get(key)
        if child is None:
            child = self._outcomes[key] = self.requests.labels(
                model=self._model, mode=mode, protocol=protocol, outcome=outcome
            )
        return child

    def _seconds_child(self, metric, children: dict, protocol: str, mode: str):
        """`metric`'s child for (protocol, mode), kept in `children`: request_seconds's or failed_seconds's."""
        child = children.get((protocol, mode))
        if child is None:
            child = children[protocol, mode] = metric.labels(model=self._model, mode=mode, protocol=protocol)
        return child

    def _request_child(self, protocol: str, mode: str):
        return self._seconds_child(self.request_seconds, self._request, protocol, mode)

    def observe_request(
        self, outcome: str, seconds: float | None = None, protocol: str = "predict", mode: str | None = None
    ) -> None:
        """Count one request; `mode`: the executor that answered it (None: no executor ran it). `seconds` (handler
        to answer) goes to fusedserve_request_seconds when it is ok, to fusedserve_failed_request_seconds when not.
        On an event loop the values are written when the loop's turn ends (`flush`); elsewhere at once."""
        mode = mode or self.mode
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop in this thread: written now
            self._write(protocol, outcome, mode, 1, [] if seconds is None else [seconds])
            return
        self._pending.append((protocol, outcome, mode, seconds))
        if self._flush_loop is not loop:  # (a loop closed with its flush unrun is another loop: scheduled again)
            self._flush_loop = loop
            loop.call_soon(self.flush)

    def flush(self) -> None:
        """Write the requests counted since the last flush: a count per (protocol, outcome, mode), and their seconds
        as observe_many writes them. Runs at the end of the turn that counted them, and before any read."""
        self._flush_loop = None
        pending, self._pending = self._pending, []
        if not pending:
            return
        groups: dict[tuple[str, str, str], list] = {}
        for protocol, outcome, mode, seconds in pending:
            key = (protocol, outcome, mode)
            group = groups.get(key)
            if group is None:
                group = groups[key] = [0, []]
            group[0] += 1
            if seconds is not None:
                group[1].append(seconds)
        for (protocol, outcome, mode), (n, seconds) in groups.items():
            self._write(protocol, outcome, mode, n, seconds)

    def _write(self, protocol: str, outcome: str, mode: str, n: int, seconds: list[float]) -> None:
        """Count n requests of (protocol, outcome, mode), `seconds` the time of each that has one."""
        child = self._outcomes.get((protocol, outcome, mode))
        (child or self._outcome_child(protocol, outcome, mode)).inc(n)
        if not seconds:
            return
        if outcome == "ok":
            observe_many(self._request.get((protocol, mode)) or self._request_child(protocol, mode), seconds)
        else:
            self._seconds_child(self.failed_seconds, self._failed, protocol, mode).inc(sum(seconds))

    def render(self) -> bytes:
        self.flush()
        return render(self.registry)


# Shadow comparison (service/engine/ab.py): max |fused - unfused| over a batch relative to its outputs' scale, in
# half-decade buckets from 1e-8 (float32 agrees to ~1e-7, float16 to ~1e-3) to 1 (unrelated outputs).
ERROR_BUCKETS = tuple(10.0 ** (e / 2) for e in range(-16, 1))
# A shadow batch's share of rows whose top-1 label agrees: fine near 1, where a precision is judged (95% and 99% are
# the marks issue 52 sets for float8 against float16).
AGREEMENT_BUCKETS = (0.5, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 1.0)
RELOAD_OUTCOMES = ("applied", "unchanged", "invalid", "failed")


class _ModeMetrics:
    """An engine's children of one mode (the executor that ran the batch)."""

    __slots__ = ("forward", "queue_wait", "rows", "faults", "kernels")

    def __init__(self, m: EngineMetrics, labels: dict[str, str]):
        self.forward = m.forward_seconds.labels(**labels)
        self.queue_wait = m.queue_wait_seconds.labels(**labels)
        self.rows = m.batch_rows.labels(**labels)
        self.faults = {k: m.gpu_faults.labels(**labels, kind=k) for k in ("oom", "sticky")}
        self.kernels: dict[str, object] = {}


class EngineMetrics:
    """An engine's metrics: its queue, batches, forwards and kernels, each labelled with the mode that ran it, and the
    shadow comparison of the two modes.

    `mode` is the configured mode (fused, unfused or ab): the label of the queue depth and of fusedserve_model_info,
    which say what the engine serves as a whole; `set_mode` moves them on a reload."""

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
            "fusedserve_model_info", "The model being served, in its configured mode (value 1)",
            [*lm, "device", "dtype"], registry=r, multiprocess_mode="livemax",
        )  # fmt: skip
        self.gpu_faults = Counter(
            "fusedserve_gpu_faults", "Forwards that failed on a device fault, by kind (oom, sticky)",
            [*lm, "kind"], registry=r,
        )  # fmt: skip
        # Requests answered with outputs, for Triton's statistics (service/v2/extensions.py), labelled with the
        # configured mode: the statistics sum over modes.
        self.inference_requests = Counter(
            "fusedserve_inference_requests", "Requests answered with outputs", lm, registry=r
        )
        self.inference_phase_seconds = Counter(
            "fusedserve_inference_phase_seconds",
            "Time of each answered request in each phase in its engine, summed over requests (a batch's time counts "
            "once per request in it): queue, compute_input, compute_infer, compute_output",
            [*lm, "phase"], registry=r,
        )  # fmt: skip
        self.last_inference = Gauge(
            "fusedserve_last_inference_timestamp_seconds", "Unix time at which the last batch was answered",
            lm, registry=r, multiprocess_mode="max",
        )  # fmt: skip
        le = ["model", "engine"]
        ab = [*le, "a", "b"]  # the two executors compared, by their mode labels (A: the configured one)
        self.shadow_error = Histogram(
            "fusedserve_shadow_error",
            "Shadow comparison: max |a - b| over a batch, relative to the batch's largest |output|",
            ab, buckets=ERROR_BUCKETS, registry=r,
        )  # fmt: skip
        self.shadow_mismatches = Counter(
            "fusedserve_shadow_argmax_mismatch",
            "Shadow comparison: rows whose predicted label differs between a and b", ab, registry=r,
        )  # fmt: skip
        self.shadow_batches = Counter(
            "fusedserve_shadow_batches", "Batches run in both configurations (a and b) and compared", ab, registry=r
        )
        self.shadow_rows = Counter(
            "fusedserve_shadow_rows", "Rows of the shadow's compared batches (top-1 agreement: 1 - mismatch / rows)",
            ab, registry=r,
        )  # fmt: skip
        self.shadow_agreement = Histogram(
            "fusedserve_shadow_top1_agreement",
            "Shadow comparison: a batch's share of rows whose predicted label is the same in a and b",
            ab, buckets=AGREEMENT_BUCKETS, registry=r,
        )  # fmt: skip
        self.ab_info = Gauge(
            "fusedserve_ab_info",
            "The two executors an engine compares while it runs both (ab mode, or a shadow), by their mode labels: "
            "a the configured one, b FUSEDSERVE_AB_OTHER's or the other mode (value 1; 0 once it runs one alone)",
            ab, registry=r, multiprocess_mode="livemax",
        )  # fmt: skip
        # Background tuning (FUSEDSERVE_TUNING_BACKGROUND, kernels/tuning_background.py): how far it has come.
        self.tuning_pending_keys = Gauge(
            "fusedserve_tuning_pending_keys",
            "Kernel tuning keys (kernel, shape, batch bucket) running an untimed config, queued to be timed while the "
            "engine is idle",
            le, registry=r, multiprocess_mode="livesum",
        )  # fmt: skip
        self.tuning_background_keys = Counter(
            "fusedserve_tuning_background_keys",
            "Kernel tuning keys timed in the background, by whether the timed pick replaced the untimed one",
            [*le, "changed"], registry=r,
        )  # fmt: skip
        self.graph_recaptures = Counter(
            "fusedserve_graph_recaptures", "CUDA graphs of a batch bucket captured again to run new kernel picks",
            le, registry=r,
        )  # fmt: skip
        # The compile deadline (FUSEDSERVE_COMPILE_DEADLINE_S, kernels/compile_deadline.py).
        self.compiles_late = Counter(
            "fusedserve_kernel_compiles_late",
            "Triton kernel compiles that missed the compile deadline: that launch config was dropped",
            le, registry=r,
        )  # fmt: skip
        self.steps_unfused_fallback = Gauge(
            "fusedserve_steps_unfused_fallback",
            "Fused steps running their unfused op because none of their kernel's configs compiled within the "
            "deadline (GET /model names them)",
            le, registry=r, multiprocess_mode="livemax",
        )  # fmt: skip
        self._model, self._engine, self._device, self._dtype = model, engine, device, dtype
        self._shadow: dict[tuple[str, str], tuple] = {}  # (a, b) -> the shadow's children
        self._ab = None  # fusedserve_ab_info's child at 1
        tuning_labels = {"model": model, "engine": engine}
        self._tuning = (
            self.tuning_pending_keys.labels(**tuning_labels),
            {c: self.tuning_background_keys.labels(**tuning_labels, changed=str(c).lower()) for c in (True, False)},
            self.graph_recaptures.labels(**tuning_labels),
        )
        self._modes: dict[str, _ModeMetrics] = {}
        self.mode = mode
        self._info = self.model_info.labels(model=model, mode=mode, engine=engine, device=device, dtype=dtype)
        self._info.set(1)
        self._depth = self.queue_depth_gauge.labels(model=model, mode=mode, engine=engine)
        self._depth.set(0)
        for m in served_modes(mode):
            self._of(m)
        labels = {"model": model, "mode": mode, "engine": engine}
        self._answered_children = (
            self.inference_requests.labels(**labels),
            *(self.inference_phase_seconds.labels(**labels, phase=p) for p in PHASES),
        )
        self._last = self.last_inference.labels(**labels)
        self._answered = [0] + [0.0] * len(PHASES)  # what answered() took in and has not written yet
        self._answered_at = 0.0  # time.monotonic() of the last batch answered
        self._written_at = time.monotonic()

    def answered(self, requests: int, phase_seconds: tuple[float, ...], now: float) -> None:
        """One batch answered with outputs at `now` (time.monotonic()): its `requests`, and each phase's seconds
        (PHASES' order) summed over them. Kept here, and written out once ANSWERED_WRITE_EVERY_S has passed since the
        last write, or by write_answered."""
        pending = self._answered
        pending[0] += requests
        for i, seconds in enumerate(phase_seconds, 1):
            pending[i] += seconds
        self._answered_at = now
        if now - self._written_at >= ANSWERED_WRITE_EVERY_S:
            self.write_answered()

    def write_answered(self) -> None:
        """Write what answered() kept (the engine calls this when it goes idle, so that an idle service's counts are
        exact): every count from the same batches, so the requests counter is each phase's count."""
        pending = self._answered
        now = time.monotonic()
        self._written_at = now
        if not pending[0]:
            return
        for child, value in zip(self._answered_children, pending, strict=True):
            child.inc(value)
        self._last.set(time.time() - (now - self._answered_at))  # the last batch's time, as Unix time
        self._answered = [0] + [0.0] * len(PHASES)

    def _mode_name(self, mode: str | None) -> str:
        """`mode`, or for a caller that names none (a single-mode engine's), the configured mode."""
        return mode or (self.mode if self.mode != "ab" else "fused")

    def _of(self, mode: str | None) -> _ModeMetrics:
        mode = self._mode_name(mode)
        children = self._modes.get(mode)
        if children is None:
            children = self._modes[mode] = _ModeMetrics(self, {"model": self._model, "mode": mode,
                                                               "engine": self._engine})  # fmt: skip
        return children

    def set_mode(self, mode: str) -> None:
        """The configured mode changed (a reload): fusedserve_model_info and the queue depth move to its label."""
        if mode == self.mode:
            return
        labels = {"model": self._model, "engine": self._engine}
        self._info.set(0)
        self._info = self.model_info.labels(**labels, mode=mode, device=self._device, dtype=self._dtype)
        self._info.set(1)
        self._depth.set(0)
        self._depth = self.queue_depth_gauge.labels(**labels, mode=mode)
        self._depth.set(0)
        self.mode = mode
        for m in served_modes(mode):
            self._of(m)

    def observe_kernel(self, kernel: str, seconds: float, mode: str | None = None) -> None:
        kernels = self._of(mode).kernels
        child = kernels.get(kernel)
        if child is None:
            child = kernels[kernel] = self.kernel_seconds.labels(
                model=self._model, mode=self._mode_name(mode), engine=self._engine, kernel=kernel
            )
        child.observe(seconds)

    def observe_forward(self, seconds: float, mode: str | None = None) -> None:
        self._of(mode).forward.observe(seconds)

    def gpu_fault(self, kind: str, mode: str | None = None) -> None:
        self._of(mode).faults[kind].inc()

    def queue_depth(self, requests: int) -> None:
        self._depth.set(requests)

    def queue_waits(self, seconds: list[float], mode: str | None = None) -> None:
        """Every request's wait of one batch, in one update (per-request observes cost ~14% of a loaded engine's
        time in multiprocess mode, where each is two locked writes to a memory-mapped file)."""
        observe_many(self._of(mode).queue_wait, seconds)

    def batch(self, rows: int, mode: str | None = None) -> None:
        self._of(mode).rows.observe(rows)

    def _shadow_children(self, a: str, b: str) -> tuple:
        children = self._shadow.get((a, b))
        if children is None:
            labels = {"model": self._model, "engine": self._engine, "a": a, "b": b}
            children = self._shadow[a, b] = tuple(
                m.labels(**labels)
                for m in (self.shadow_error, self.shadow_mismatches, self.shadow_batches, self.shadow_rows,
                          self.shadow_agreement)
            )  # fmt: skip
        return children

    def shadow(self, error: float, mismatches: int, rows: int = 0, a: str = "fused", b: str = "unfused") -> None:
        """One batch of `rows` rows compared in executors `a` and `b`: its relative error and how many of its rows'
        labels differ."""
        hist, mismatch, batches, rows_total, agreement = self._shadow_children(a, b)
        hist.observe(error)
        if mismatches:
            mismatch.inc(mismatches)
        batches.inc()
        if rows:
            rows_total.inc(rows)
            agreement.observe(1.0 - mismatches / rows)

    def set_ab(self, a: str | None, b: str | None) -> None:
        """fusedserve_ab_info: the engine now compares `a` with `b` (None: it runs one executor alone)."""
        if self._ab is not None:
            self._ab.set(0)
            self._ab = None
        if a is not None:
            self._ab = self.ab_info.labels(model=self._model, engine=self._engine, a=a, b=b)
            self._ab.set(1)
            self._shadow_children(a, b)  # the shadow's series from 0, so that rates are defined

    def tuning(self, pending: int, tuned: bool | None = None, recaptured: int = 0) -> None:
        """Background tuning: the keys still queued; `tuned`: one key was timed (True: its pick changed); graphs
        captured again."""
        pending_keys, tuned_keys, recaptures = self._tuning
        pending_keys.set(pending)
        if tuned is not None:
            tuned_keys[tuned].inc()
        if recaptured:
            recaptures.inc(recaptured)

    def compile_late(self, kernel: str = "") -> None:
        """One kernel compile missed its deadline."""
        self.compiles_late.labels(model=self._model, engine=self._engine).inc()

    def unfused_fallbacks(self, steps: int) -> None:
        """How many fused steps run their unfused op for want of a kernel compiled in time."""
        self.steps_unfused_fallback.labels(model=self._model, engine=self._engine).set(steps)

    def render(self) -> bytes:
        return render(self.registry)


class SupervisorMetrics:
    """The supervisor's metrics: engines it started again after they died, and configuration reloads (SIGHUP)."""

    def __init__(self, model: str = "MODEL"):
        self.registry = r = _registry()
        self.engine_restarts = Counter(
            "fusedserve_engine_restarts", "Engines started again in place after they died", ["engine"], registry=r
        )
        self.config_reloads = Counter(
            "fusedserve_config_reloads", "Configuration reloads (SIGHUP) by outcome", ["model", "outcome"], registry=r
        )
        self._reloads = {o: self.config_reloads.labels(model=model, outcome=o) for o in RELOAD_OUTCOMES}

    def engine_restarted(self, engine: int) -> None:
        self.engine_restarts.labels(engine=str(engine)).inc()

    def config_reloaded(self, outcome: str) -> None:
        """One SIGHUP reload: applied (a live setting changed), unchanged, invalid (the file was refused whole),
        failed (an engine could not load the executor the new mode needs, or the supervisor could not publish the
        API keys to the front ends: the configuration and keys in force stay)."""
        self._reloads[outcome].inc()


_ENGINE_RELOADS: Counter | None = None
# The front end of this process (the last RequestMetrics made), for refusals made where no request state is at hand.
_FRONT_END: RequestMetrics | None = None


def connection_refused(reason: str) -> None:
    """One connection or request head refused before any route ran (REFUSAL_REASONS), in this process's front end's
    fusedserve_connections_refused; nothing where no front end runs."""
    metrics = _FRONT_END
    if metrics is not None:
        metrics._refused[reason].inc()


def config_reloaded(model: str, outcome: str) -> None:
    """An engine's share of fusedserve_config_reloads_total (SupervisorMetrics documents it): `failed` when it could
    not load the executor a reload's mode needs. Same family, so /metrics sums it with the supervisor's counts."""
    global _ENGINE_RELOADS
    if _ENGINE_RELOADS is None:
        _ENGINE_RELOADS = Counter(
            "fusedserve_config_reloads", "Configuration reloads (SIGHUP) by outcome", ["model", "outcome"],
            registry=_registry(),
        )  # fmt: skip
    _ENGINE_RELOADS.labels(model=model, outcome=outcome).inc()


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


def _deployment(registry: CollectorRegistry) -> CollectorRegistry:
    """Every process's values merged (counters and histograms summed, gauges by their multiprocess_mode) in
    multiprocess mode, else `registry` itself."""
    if not multiprocess_mode():
        return registry
    merged = CollectorRegistry()
    multiprocess.MultiProcessCollector(merged)
    return merged


def render(registry: CollectorRegistry) -> bytes:
    """The exposition text: of every process of the deployment in multiprocess mode, else of `registry`."""
    return generate_latest(_deployment(registry))


@dataclass
class InferenceTotals:
    """One model's totals over the deployment, for Triton's statistics extension (service/v2/extensions.py)."""

    ok: int = 0  # requests answered with outputs, by the front ends (fusedserve_request_seconds_count)
    ok_s: float = 0.0  # their time in the front ends, handler to answer
    failed: int = 0  # requests answered with an error (fusedserve_requests_total, every outcome but ok)
    failed_s: float = 0.0
    requests: int = 0  # requests answered with outputs, by the engines (fusedserve_inference_requests_total)
    rows: int = 0  # rows of the batches run (fusedserve_batch_rows_sum)
    batches: int = 0  # batches run (fusedserve_batch_rows_count)
    phase_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    last_inference_s: float = 0.0  # Unix time; 0 before the first batch
    devices: dict[str, str] = field(default_factory=dict)  # engine index -> its device, from fusedserve_model_info


def inference_totals(registry: CollectorRegistry, model: str) -> InferenceTotals:
    """The totals of `model` over every process (in multiprocess mode; else over `registry` alone): what /metrics
    would show at this moment, summed over protocols, outcomes and engines."""
    t = InferenceTotals()
    counts: dict[str, float] = {}
    for family in _deployment(registry).collect():
        for s in family.samples:
            if s.labels.get("model") != model:
                continue
            name = s.name
            if name == "fusedserve_requests_total" and s.labels.get("outcome") != "ok":
                counts["failed"] = counts.get("failed", 0.0) + s.value
            elif name == "fusedserve_inference_phase_seconds_total":
                t.phase_s[s.labels["phase"]] = t.phase_s.get(s.labels["phase"], 0.0) + s.value
            elif name == "fusedserve_last_inference_timestamp_seconds":
                t.last_inference_s = max(t.last_inference_s, s.value)
            elif name == "fusedserve_model_info" and s.value:
                t.devices[s.labels.get("engine", "0")] = s.labels.get("device", "")
            elif name in _TOTALS:
                counts[_TOTALS[name]] = counts.get(_TOTALS[name], 0.0) + s.value
    for key, value in counts.items():
        setattr(t, key, value if key.endswith("_s") else round(value))
    return t


_TOTALS = {  # sample name -> InferenceTotals field, summed over every label but the model
    "fusedserve_request_seconds_count": "ok",
    "fusedserve_request_seconds_sum": "ok_s",
    "fusedserve_failed_request_seconds_total": "failed_s",
    "fusedserve_inference_requests_total": "requests",
    "fusedserve_batch_rows_sum": "rows",
    "fusedserve_batch_rows_count": "batches",
}


def process_exited(pid: int) -> None:
    """Forget an exited process's live gauges (its queue depth), so they stop counting."""
    if multiprocess_mode():
        multiprocess.mark_process_dead(pid)
