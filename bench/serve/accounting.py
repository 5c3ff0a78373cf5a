"""Nothing lost: the checks every `bench serve` phase must pass, and the server's split from /metrics.

Pure functions over the load generator's merged result and two /metrics readings, so tests can feed
them a phase that lost a request or got an unexplained 500 and see it fail.
"""

from __future__ import annotations

import urllib.request

# fusedserve_requests_total{outcome}: every outcome the service counts (service/metrics.py OUTCOMES).
OUTCOMES = ("ok", "invalid", "too_large", "overloaded", "timeout", "cancelled", "error", "unauthorized")
HISTOGRAMS = ("queue_wait_seconds", "forward_seconds", "batch_rows", "request_seconds")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'outcome:ok': n, ..., 'forward_seconds_sum': s, 'forward_seconds_count': n, ...},
    each summed over every other label (model, mode, engine, ...), so one front end's whole-deployment
    /metrics and a single process's read the same."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name
            if name == "fusedserve_requests_total":
                key = "outcome:" + s.labels.get("outcome", "?")
            elif name.startswith("fusedserve_") and name.endswith(("_sum", "_count")):
                key = name.removeprefix("fusedserve_")
                if key.rsplit("_", 1)[0] not in HISTOGRAMS:
                    continue
            else:
                continue
            out[key] = out.get(key, 0.0) + s.value
    return out


def scrape(url: str, timeout: float = 5.0) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=timeout) as r:
        return parse_metrics(r.read().decode())


def delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    if before is None or after is None:
        return None
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(before) | set(after)}


def server_split(d: dict[str, float] | None) -> dict:
    """Per phase, from the counters' deltas: mean queue wait (ms), mean forward per batch (µs), mean rows per
    batch, batches, and the outcome counts."""
    if d is None:
        return {}

    def mean(name: str, scale: float) -> float | None:
        n = d.get(name + "_count", 0.0)
        return d.get(name + "_sum", 0.0) / n * scale if n > 0 else None

    return {
        "queue_wait_ms": mean("queue_wait_seconds", 1e3),
        "forward_us": mean("forward_seconds", 1e6),
        "batch_rows": mean("batch_rows", 1.0),
        "batches": int(d.get("forward_seconds_count", 0.0)),
        "server_request_ms": mean("request_seconds", 1e3),
        "outcomes": {o: int(round(d.get("outcome:" + o, 0.0))) for o in OUTCOMES if d.get("outcome:" + o)},
    }


def account(
    client: dict,
    server_delta: dict[str, float] | None,
    *,
    sigterm_at: float | None = None,
    has_metrics: bool = True,
) -> dict:
    """Check one phase. `client`: loadgen.merge()'s dict; `server_delta`: the outcome counters' change over the
    window (None when the server has no metrics, or was shut down in it). `sigterm_at`: time.monotonic() of a
    SIGTERM sent in the window (connections refused after it are expected, and 503s are the shutdown's).

    Returns {"lost": n, "problems": [...], "notes": [...], "refused_after_sigterm": n}; the phase passes
    when problems is empty."""
    problems: list[str] = []
    notes: list[str] = []
    status = {int(k): v for k, v in client["status"].items()}
    errors = dict(client["errors"])
    answered = sum(status.values())
    lost = errors.get("lost", 0)
    timeouts = errors.get("timeout", 0)
    sent = client["sent"]
    unaccounted = sent - answered - lost - timeouts
    if unaccounted:
        problems.append(f"sent {sent} != answered {answered} + lost {lost} + timed out {timeouts}")
    if lost:
        why = [f"{n} x {w}" for w, n in sorted((client.get("why") or {}).items(), key=lambda x: -x[1]) if "lost" in w]
        problems.append(
            f"{lost} request(s) sent on an open connection got no answer"
            + (f" ({'; '.join(why[:3])})" if why else " (connection closed or reset)")
        )
    if timeouts:
        problems.append(f"{timeouts} request(s) unanswered when the drain timed out")
    refused_events = [t for kind, t in client.get("events", ()) if kind == "refused"]
    refused = errors.get("refused", 0)
    refused_after = 0
    if sigterm_at is None:
        if refused:
            problems.append(f"{refused} connection(s) refused")
    else:
        refused_after = sum(1 for t in refused_events if t >= sigterm_at)
        if refused_events and len(refused_events) < refused:  # more than the events kept: judge by what was kept
            notes.append(f"{refused} refused, {len(refused_events)} with times kept")
        early = len(refused_events) - refused_after
        if early:
            problems.append(f"{early} connection(s) refused before the SIGTERM")
        if refused_after:
            notes.append(f"{refused_after} new connection(s) refused after the SIGTERM (expected)")
    backlog = client.get("backlog", 0)
    if backlog:
        notes.append(f"open loop: {backlog} due request(s) never sent (the client fell behind the rate)")
    warm = client.get("warmup") or {}
    warm_errors = {k: v for k, v in (warm.get("errors") or {}).items() if v}
    if warm_errors:
        problems.append(f"warm-up connection errors {warm_errors}")
    warm_bad = {k: v for k, v in (warm.get("status") or {}).items() if int(k) != 200}
    if warm_bad:
        problems.append(f"warm-up answers other than 200: {warm_bad}")

    n200 = status.get(200, 0)
    n503 = status.get(503, 0)
    others = {k: v for k, v in status.items() if k not in (200, 503)}
    for code, n in sorted(others.items()):
        kind = "unexplained 5xx" if code >= 500 else "unexpected status"
        problems.append(f"{n} x HTTP {code} ({kind})")
    bad_statuses = sum(others.values())
    mismatched = 0
    if server_delta is not None:
        ok = int(round(server_delta.get("outcome:ok", 0.0)))
        overloaded = int(round(server_delta.get("outcome:overloaded", 0.0)))
        if ok != n200:
            problems.append(f"server counted {ok} ok, client got {n200} x 200")
            mismatched += abs(ok - n200)
        if n503 != overloaded:
            problems.append(f"client got {n503} x 503, server counted {overloaded} overloaded")
            mismatched += abs(n503 - overloaded)
        elif n503:
            notes.append(f"{n503} x 503 overloaded (counted by the server)")
        for o in OUTCOMES:
            if o in ("ok", "overloaded"):
                continue
            n = int(round(server_delta.get("outcome:" + o, 0.0)))
            if n:
                problems.append(f"server counted {n} {o}")
                mismatched += n
    elif n503:
        if sigterm_at is not None:
            notes.append(f"{n503} x 503 during the shutdown")
        else:
            why = "no server counters to match" if not has_metrics else "server counters not read"
            problems.append(f"{n503} x 503 ({why}: unexplained)")
            bad_statuses += n503
    total_lost = lost + timeouts + bad_statuses + mismatched + abs(unaccounted)
    if sigterm_at is None:
        total_lost += refused
    else:
        total_lost += len(refused_events) - refused_after
    return {"lost": total_lost, "problems": problems, "notes": notes, "refused_after_sigterm": refused_after}
