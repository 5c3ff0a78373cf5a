"""`fusedserve ab-report`: A against B (fused against unfused, or two precisions such as fused:float8 against
fused:float16 with FUSEDSERVE_AB_OTHER), per plan step, for the whole forward and for the request, from one service
that runs both (ab mode, or a shadow), as a markdown table. A and B are the `mode` labels fusedserve_ab_info names
(fused and unfused where it is absent).

    fusedserve ab-report --url http://localhost:8001/metrics                 # everything since the service started
    fusedserve ab-report --prometheus http://localhost:9090 --since 1h       # the last hour, from Prometheus

Each row gives, per configuration, the p50 and p99 (interpolated within their bucket, as Prometheus' histogram_quantile
does) and the count, then the speedup: B p50 / A p50 (unfused / fused), with the interval the histogram's buckets allow
(written here for fused and unfused). The p50 of each mode lies for certain in the bucket where its cumulative count
crosses half its total, between that bucket's lower and upper bounds; so the true ratio of the two p50s lies between
(the unfused bucket's lower bound / the fused bucket's upper bound) and (the unfused upper / the fused lower). With
fusedserve's x2 buckets that interval spans up to 4x: it bounds the bucketing's error, not the sampling's. The ratio of
the means is exact (each mode's _sum / _count) and is given beside it. Steps are device time (CUDA events on every
KERNEL_TIMING_EVERY-th batch), the forward is host wall time per batch, the request is the time in the server of the
requests each mode answered.

With --prometheus the counts are increases over --since (the window of `increase()`), from the instances that compare
two executors now (fusedserve_ab_info == 1: ab mode, or a shadow) unless --instance names others; with --url they are
the service's totals. The shadow's top-1 agreement is 1 - mismatched rows / compared rows.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

MODES = ("fused", "unfused")
INF = float("inf")


@dataclass
class Hist:
    """One histogram's buckets (upper bound -> cumulative count), sum and count, summed over the series it merges."""

    buckets: dict[float, float] = field(default_factory=dict)
    sum: float = 0.0
    count: float = 0.0

    def add_bucket(self, le: float, n: float) -> None:
        self.buckets[le] = self.buckets.get(le, 0.0) + n

    def quantile(self, q: float) -> tuple[float, float, float] | None:
        """(estimate, lower bound, upper bound) of the q-quantile, or None without observations. The estimate
        interpolates linearly within the bucket as histogram_quantile does (the first bucket's lower bound is 0; a
        quantile in the +Inf bucket is estimated at the largest finite bound)."""
        bounds = sorted(self.buckets)
        if not bounds or self.buckets[bounds[-1]] <= 0:
            return None
        total = self.buckets[bounds[-1]]
        rank = q * total
        below, lower = 0.0, 0.0
        for le in bounds:
            cum = self.buckets[le]
            if cum >= rank and cum > below:
                if le == INF:
                    return lower, lower, INF
                est = lower + (le - lower) * (rank - below) / (cum - below)
                return est, lower, le
            below, lower = cum, le
        return lower, lower, INF

    def highest(self) -> float | None:
        """The upper bound of the highest bucket that holds an observation (the maximum is at most this)."""
        prev = 0.0
        top = None
        for le in sorted(self.buckets):
            if self.buckets[le] > prev:
                top = le
            prev = self.buckets[le]
        return top

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None


@dataclass
class Readings:
    """What a report needs: histograms by (family, mode[, kernel]) and the shadow counters; `a` and `b`: the two
    executors' mode labels."""

    model: str
    source: str
    a: str = MODES[0]
    b: str = MODES[1]
    steps: dict[tuple[str, str], Hist] = field(default_factory=dict)  # (kernel, mode)
    forward: dict[str, Hist] = field(default_factory=dict)
    request: dict[str, Hist] = field(default_factory=dict)
    rows: dict[str, Hist] = field(default_factory=dict)
    shadow_error: Hist = field(default_factory=Hist)
    shadow_batches: float = 0.0
    shadow_mismatches: float = 0.0
    shadow_rows: float = 0.0


def _hist(where: dict, key) -> Hist:
    h = where.get(key)
    if h is None:
        h = where[key] = Hist()
    return h


def _target(r: Readings, family: str, labels: dict[str, str]) -> Hist | None:
    mode = labels.get("mode")
    if family == "fusedserve_shadow_error":
        return r.shadow_error
    if mode not in (r.a, r.b):
        return None
    if family == "fusedserve_kernel_seconds":
        return _hist(r.steps, (labels.get("kernel", "?"), mode))
    where = {"fusedserve_forward_seconds": r.forward, "fusedserve_request_seconds": r.request,
             "fusedserve_batch_rows": r.rows}.get(family)  # fmt: skip
    return None if where is None else _hist(where, mode)


SHADOW_COUNTERS = {
    "fusedserve_shadow_batches": "shadow_batches",
    "fusedserve_shadow_argmax_mismatch": "shadow_mismatches",
    "fusedserve_shadow_rows": "shadow_rows",
}
HISTOGRAMS = (
    "fusedserve_kernel_seconds",
    "fusedserve_forward_seconds",
    "fusedserve_request_seconds",
    "fusedserve_batch_rows",
    "fusedserve_shadow_error",
)


# ------------------------------------------------------------------------------------------- sources


def _get(url: str, timeout_s: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:  # noqa: S310 (an address the user gave)
        return r.read().decode()


def from_metrics_text(text: str, source: str, model: str | None = None) -> Readings:
    """Readings from a service's /metrics (totals since it started), for `model` (default: the one it serves)."""
    from prometheus_client.parser import text_string_to_metric_families

    families = list(text_string_to_metric_families(text))
    models = sorted({s.labels["model"] for f in families if f.name.startswith("fusedserve_") for s in f.samples
                     if "model" in s.labels})  # fmt: skip
    model = _one_model(model, models, source)
    r = Readings(model, source)
    pairs = [(s.value, s.labels["a"], s.labels["b"]) for f in families if f.name == "fusedserve_ab_info"
             for s in f.samples if s.labels.get("model") == model]  # fmt: skip
    if pairs:  # the pair compared now (value 1), else the last one
        r.a, r.b = max(pairs)[1:]
    for f in families:
        if f.name in HISTOGRAMS:
            for s in f.samples:
                if s.labels.get("model") != model:
                    continue
                h = _target(r, f.name, s.labels)
                if h is None:
                    continue
                if s.name.endswith("_bucket"):
                    h.add_bucket(float(s.labels["le"]), s.value)
                elif s.name.endswith("_sum"):
                    h.sum += s.value
                elif s.name.endswith("_count"):
                    h.count += s.value
        elif f.name in SHADOW_COUNTERS:
            total = sum(s.value for s in f.samples if s.name.endswith("_total") and s.labels.get("model") == model)
            setattr(r, SHADOW_COUNTERS[f.name], getattr(r, SHADOW_COUNTERS[f.name]) + total)
    return r


def _one_model(model: str | None, models: list[str], source: str) -> str:
    if model is not None:
        if model not in models:
            raise SystemExit(f"ab-report: {source} has no series of model {model!r} (it has {models or 'none'})")
        return model
    if len(models) != 1:
        raise SystemExit(f"ab-report: {source} has the models {models or 'none'}: name one with --model")
    return models[0]


def _query(prom: str, expr: str) -> list[dict]:
    doc = json.loads(_get(f"{prom.rstrip('/')}/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
    if doc.get("status") != "success":
        raise SystemExit(f"ab-report: Prometheus refused {expr!r}: {doc}")
    return doc["data"]["result"]


def from_prometheus(prom: str, since: str, model: str | None = None, instance: str | None = None) -> Readings:
    """Readings from Prometheus: increases over the last `since` (a PromQL duration such as 1h)."""
    shown = instance
    if instance is None:  # the services that compare two executors now
        live = _query(prom, "fusedserve_ab_info == 1" if model is None else
                      f'fusedserve_ab_info{{model="{model}"}} == 1')  # fmt: skip
        names = sorted({x["metric"].get("instance", "") for x in live})
        if not names:
            raise SystemExit(f"ab-report: no service compares two executors now at {prom} (ab mode, or "
                             "FUSEDSERVE_SHADOW_EVERY); name the services with --instance")  # fmt: skip
        instance = "|".join(n.replace(".", "\\\\.") for n in names)
        shown = ", ".join(names)
    sel = f'instance=~"{instance}"'
    models = sorted(
        {x["metric"]["model"] for x in _query(prom, f"count by (model) (fusedserve_forward_seconds_count{{{sel}}})")}
    )
    model = _one_model(model, models, prom)
    sel += f', model="{model}"'
    r = Readings(model, f"{prom}, the last {since}, instances {shown}")
    pairs = _query(prom, f"max by (a, b) (max_over_time(fusedserve_ab_info{{{sel}}}[{since}]))")
    if pairs:  # the pair compared now (value 1), else the last one
        best = max(pairs, key=lambda x: float(x["value"][1]))["metric"]
        r.a, r.b = best["a"], best["b"]
    for fam in HISTOGRAMS:
        keys = "mode, kernel" if fam == "fusedserve_kernel_seconds" else "mode"
        for part, by in (("bucket", f"le, {keys}"), ("sum", keys), ("count", keys)):
            for x in _query(prom, f"sum by ({by}) (increase({fam}_{part}{{{sel}}}[{since}]))"):
                h = _target(r, fam, x["metric"])
                value = float(x["value"][1])
                if h is None or math.isnan(value):
                    continue
                if part == "bucket":
                    h.add_bucket(float(x["metric"]["le"]), value)
                elif part == "sum":
                    h.sum += value
                else:
                    h.count += value
    for name, attr in SHADOW_COUNTERS.items():
        got = _query(prom, f"sum(increase({name}_total{{{sel}}}[{since}]))")
        setattr(r, attr, float(got[0]["value"][1]) if got else 0.0)
    return r


# ------------------------------------------------------------------------------------------- the report


def _time(s: float | None) -> str:
    if s is None or math.isnan(s):
        return "-"
    if s == INF:
        return "∞"
    if s < 1e-3:
        return f"{s * 1e6:.3g} µs"
    if s < 1:
        return f"{s * 1e3:.3g} ms"
    return f"{s:.3g} s"


def _ratio(x: float | None) -> str:
    if x is None or math.isnan(x):
        return "-"
    return "∞" if x == INF else f"{x:.2f}x"


def _count(n: float) -> str:
    return f"{n:,.0f}"


def speedup(fused: Hist | None, unfused: Hist | None, q: float = 0.5) -> tuple[float, float, float] | None:
    """(unfused / fused q-quantile, its lower bound, its upper bound) from the buckets (module docstring); for two
    configurations A and B, `fused` is A and `unfused` B."""
    if fused is None or unfused is None:
        return None
    f, u = fused.quantile(q), unfused.quantile(q)
    if f is None or u is None or f[0] <= 0:
        return None
    lo = u[1] / f[2] if f[2] > 0 else 0.0
    hi = u[2] / f[1] if f[1] > 0 else INF
    return u[0] / f[0], lo, hi


def _row(name: str, fused: Hist | None, unfused: Hist | None, time_unit=_time) -> str:
    cells = [name]
    for h in (fused, unfused):
        if h is None or not h.count:
            cells += ["-", "-", "0"]
            continue
        p50, p99 = h.quantile(0.5), h.quantile(0.99)
        cells += [time_unit(p50 and p50[0]), time_unit(p99 and p99[0]), _count(h.count)]
    sp = speedup(fused, unfused)
    cells.append("-" if sp is None else f"{_ratio(sp[0])} [{_ratio(sp[1])} – {_ratio(sp[2])}]")
    means = (fused.mean if fused else None), (unfused.mean if unfused else None)
    cells.append(_ratio(means[1] / means[0]) if None not in means and means[0] > 0 else "-")
    return "| " + " | ".join(cells) + " |"


def render(r: Readings) -> str:
    a, b = r.a, r.b
    lines = [
        f"# A/B report: {r.model}, {a} against {b}",
        "",
        f"Source: {r.source}.",
        "",
        f"| | {a} p50 | {a} p99 | {a} n | {b} p50 | {b} p99 | {b} n | speedup (p50) [bucket bounds] "
        "| speedup (means) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for kernel in sorted({k for k, _ in r.steps}):
        lines.append(_row(f"step `{kernel}`", r.steps.get((kernel, a)), r.steps.get((kernel, b))))
    lines.append(_row("forward (host, per batch)", r.forward.get(a), r.forward.get(b)))
    lines.append(_row("request (in the server)", r.request.get(a), r.request.get(b)))
    lines.append("")
    batches = {m: r.rows.get(m, Hist()) for m in (a, b)}
    total = sum(h.count for h in batches.values())
    if total:
        mix = ", ".join(
            f"{m} {_count(h.count)} (mean {h.mean:.1f} rows)" if h.count else f"{m} 0" for m, h in batches.items()
        )
        lines.append(f"Batches: {mix}; {100 * batches[b].count / total:.1f}% {b}.")
    else:
        lines.append("Batches: none counted.")
    lines.append("")
    e = r.shadow_error
    if e.count:
        p50, p99, top = e.quantile(0.5), e.quantile(0.99), e.highest()
        agree = (
            f"top-1 agreement {100 * (1 - r.shadow_mismatches / r.shadow_rows):.2f}% of {_count(r.shadow_rows)} rows"
            if r.shadow_rows
            else "top-1 agreement -"
        )
        lines.append(
            f"Shadow: {_count(r.shadow_batches)} batches run in both {a} and {b} and compared; max |{a} − {b}| over a "
            f"batch ÷ its largest output: p50 ≤ {p50[2]:.2g}, p99 ≤ {p99[2]:.2g}, largest ≤ {top:.2g} (bucket upper "
            f"bounds); {agree}: {_count(r.shadow_mismatches)} rows predicted another label in the other configuration."
        )
    else:
        lines.append("Shadow: no batch compared (FUSEDSERVE_SHADOW_EVERY=0, or no idle moment yet).")
    lines += [
        "",
        f"Speedup: {b} ÷ {a}. The p50 ratio interpolates within x2 buckets; the bracket is what the buckets allow "
        f"(each p50 lies in the bucket where its count crosses half: {b} lower bound ÷ {a} upper bound to {b} upper "
        f"÷ {a} lower). The ratio of the means is exact (_sum ÷ _count). Steps: device time of the kernel-timed "
        "batches; forward: host wall time per batch; request: time in the server.",
    ]
    return "\n".join(lines) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="a service's /metrics, e.g. http://localhost:8001/metrics (totals since its start)")
    src.add_argument(
        "--prometheus", metavar="URL", help="a Prometheus that scrapes the service, e.g. http://localhost:9090"
    )
    p.add_argument("--since", default="1h", help="with --prometheus: the window, a PromQL duration [1h]")
    p.add_argument("--model", help="the model to report on [the only one there]")
    p.add_argument("--instance", help="with --prometheus: a regex of the instances to read [those that compare two "
                   "executors now: fusedserve_ab_info]")  # fmt: skip
    p.add_argument("--out", help="write the markdown here [standard output]")


def run(args: argparse.Namespace) -> int:
    try:
        if args.url:
            readings = from_metrics_text(_get(args.url), args.url, args.model)
        else:
            readings = from_prometheus(args.prometheus, args.since, args.model, args.instance)
    except OSError as e:
        print(f"fusedserve ab-report: cannot read {args.url or args.prometheus}: {e}", file=sys.stderr)
        return 2
    text = render(readings)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0
