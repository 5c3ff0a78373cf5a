"""`bench serve`'s outputs: serve_<gpu>.md (tables, targets), serve_<gpu>.json (every number), serve_<gpu>.png
(throughput against connections, latency percentiles and CDF), and the summary printed last.

`python -m bench.serve.report RESULTS.json` re-renders the markdown, plot and summary from a run's JSON.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from . import perf_analyzer
from .gpu_busy import text as gpu_text

CDF_POINTS = (*range(0, 100), 99.5, 99.9, 99.99, 100)  # percentiles of each phase's latency CDF

UNFUSED_NOISE = 0.02  # fused counts as "at least as fast" within 2% (run-to-run noise when both hit the HTTP ceiling)
IMAGE_SPEEDUP = 1.25  # issue 34: fused at least 1.25x unfused images/s, 32-image binary requests at 64 connections
IMAGE_RATE = 25_000  # issue 34: 32-image UINT8 224x224 binary requests reach the engines at 25,000 images/s or more


def _f(v, fmt: str = ".2f", dash: str = "-") -> str:
    return dash if v is None else format(v, fmt)


def _n(v) -> str:
    return "-" if v is None else f"{v:,.0f}"


def closed(results: dict, system: str, rows: int, conns: int | None = None, protocol: str = "predict") -> list[dict]:
    return [
        r
        for r in results["phases"]
        if r["system"] == system and r["kind"] == "closed" and r["rows"] == rows
        and r.get("protocol", "predict") == protocol and (conns is None or r["connections"] == conns)
    ]  # fmt: skip


def best(phases: list[dict], key: str = "req_per_s") -> dict | None:
    return max(phases, key=lambda r: r[key], default=None)


# ------------------------------------------------------------------------------------------- targets


def image_model(results: dict) -> dict | None:
    """The run's model where it is an image model (meta's "model"), else None (the digits MLP, or an older run)."""
    model = results["meta"].get("model")
    return model if model and model.get("image") else None


def targets(results: dict) -> list[dict]:
    """Issue 18's targets (issue 34's for an image model), each {"target", "measured", "met": True | False | None
    (not measured)}."""
    if image_model(results):
        return image_targets(results)
    n = results["meta"]["workers"]
    out = []

    def add(target: str, measured: str, met: bool | None) -> None:
        out.append({"target": target, "measured": measured, "met": met})

    fused_n, empty_n, fused_1, empty_1 = f"fused@{n}", f"empty@{n}", "fused@1", "empty@1"
    ok_p99 = [r for r in closed(results, fused_n, 1) if (r["latency_ms"]["p99"] or 1e9) < 15.0]
    b = best(ok_p99)
    if b:
        add(f"fused, {n} worker{'s' if n > 1 else ''}: >= 30,000 single-row req/s with p99 < 15 ms",
            f"{_n(b['req_per_s'])} req/s at {b['connections']} connections (p99 {b['latency_ms']['p99']:.2f} ms)",
            b["req_per_s"] >= 30_000)  # fmt: skip
    else:
        seen = closed(results, fused_n, 1)
        add(f"fused, {n} worker{'s' if n > 1 else ''}: >= 30,000 single-row req/s with p99 < 15 ms",
            "no phase with p99 < 15 ms" if seen else "not measured", False if seen else None)  # fmt: skip

    def ratio(a_key: str, b_key: str, label: str) -> None:
        a, e = best(closed(results, a_key, 1)), best(closed(results, b_key, 1))
        if a and e and e["req_per_s"] > 0:
            x = a["req_per_s"] / e["req_per_s"]
            add(label, f"{x:.0%}: {_n(a['req_per_s'])} against {_n(e['req_per_s'])} req/s (best of each)", x >= 0.8)
        else:
            add(label, "not measured", None)

    ratio(fused_n, empty_n, f"fused, {n} workers: >= 80% of the empty route's single-row throughput at {n}")
    b64 = best(closed(results, fused_n, 64), "rows_per_s")
    add("64-row requests: >= 1,000,000 rows/s (fused, N workers)",
        f"{_n(b64['rows_per_s'])} rows/s at {b64['connections']} connections" if b64 else "not measured",
        (b64["rows_per_s"] >= 1_000_000) if b64 else None)  # fmt: skip
    ratio(fused_1, empty_1, "one worker: fused >= 80% of the one-worker empty route")
    f1 = closed(results, fused_1, 1, 1) or closed(results, fused_n, 1, 1)
    e1 = closed(results, empty_1, 1, 1) or closed(results, empty_n, 1, 1)
    if f1 and e1 and f1[0]["latency_ms"]["p50"] is not None and e1[0]["latency_ms"]["p50"] is not None:
        d = f1[0]["latency_ms"]["p50"] - e1[0]["latency_ms"]["p50"]
        a, b = f1[0]["latency_ms"]["p50"], e1[0]["latency_ms"]["p50"]
        add(
            "one connection: fused p50 within 0.2 ms of the empty route's",
            f"{a:.3f} against {b:.3f} ms (+{d:.3f})",
            d <= 0.2,
        )
    else:
        add("one connection: fused p50 within 0.2 ms of the empty route's", "not measured", None)

    pairs = fused_unfused_pairs(results)
    if pairs:
        ratios = [(pair_ratio(f, u)[0], f[0]) for f, u in pairs]
        slower = [x for x, _ in ratios if x < 1 - UNFUSED_NOISE]
        worst, wr = min(ratios, key=lambda t: t[0])
        rounds = max(len(f) for f, _ in pairs)
        of = f" (median of {rounds} rounds)" if rounds > 1 else ""
        add(f"fused at least as fast as unfused in every phase (within {UNFUSED_NOISE:.0%})",
            f"{len(pairs) - len(slower)} of {len(pairs)} phases{of}; lowest fused/unfused {worst:.3f} "
            f"({_phase_name(wr)})", not slower)  # fmt: skip
        fw = [(median_of(f, "forward_us"), median_of(u, "forward_us")) for f, u in pairs]
        fw = [(a, b) for a, b in fw if a is not None and b is not None]
        if fw:
            lower = sum(1 for a, b in fw if a < b)
            mean_f, mean_u = sum(a for a, _ in fw) / len(fw), sum(b for _, b in fw) / len(fw)
            text = f"lower in {lower} of {len(fw)} phases; mean {mean_f:.1f} against {mean_u:.1f} µs"
            add("fused forward time per batch (metrics) lower than unfused", text, lower == len(fw))
        else:
            add("fused forward time per batch (metrics) lower than unfused", "not measured", None)
    else:
        add("fused at least as fast as unfused in every phase", "not measured (needs both)", None)
    v2_targets(results, fused_n, add)
    phases = results["phases"]
    bad = [r for r in phases if not r["ok"]]
    sig = [r for r in phases if r["kind"] == "sigterm"]
    text = f"{len(phases) - len(bad)} of {len(phases)} phases clean"
    if sig:
        text += "; SIGTERM phase " + ("clean" if sig[0]["ok"] else "LOST")
    else:
        text += "; no SIGTERM phase"
    add("nothing lost in any phase, a SIGTERM in the middle of one included", text,
        (False if bad else (True if sig else None)) if phases else None)  # fmt: skip
    return out


def _client_note(r: dict) -> str:
    cpu = r.get("client_cpu") or {}
    return "; CLIENT-BOUND: the clients may be the limit" if cpu.get("bound") else ""


def image_targets(results: dict) -> list[dict]:
    """Issue 34's end-to-end targets for an image model: fused >= 1.25x unfused images/s with N-image binary requests
    at 64 connections (N: --images), and images/s into the engines in UINT8 with the clients shown not to be the
    limit; nothing lost anywhere."""
    m = results["meta"]
    n, images, model, dtype = m["workers"], m["v2_rows"], image_model(results), m.get("input_dtype", "FP32")
    out = []

    def add(target: str, measured: str, met: bool | None) -> None:
        out.append({"target": target, "measured": measured, "met": met})

    label = (f"{model['name']}, {images}-image binary requests at 64 connections: fused >= {IMAGE_SPEEDUP}x unfused "
             f"images/s at {n} worker{'s' if n > 1 else ''}, nothing lost")  # fmt: skip
    pair = next(
        ((f, u) for f, u in fused_unfused_pairs(results) if f[0]["workers"] == n and f[0]["connections"] == 64
         and f[0]["rows"] == images and f[0]["protocol"] == "v2_binary"), None,
    )  # fmt: skip
    if pair:
        x, each = pair_ratio(*pair)
        f, u = pair
        clean = all(r["ok"] for r in (*f, *u))
        text = (f"{x:.2f}x: {_n(statistics.median(r['rows_per_s'] for r in f))} against "
                f"{_n(statistics.median(r['rows_per_s'] for r in u))} images/s ({dtype})"
                + ("" if clean else "; LOST requests") + _client_note(f[0]) + _client_note(u[0]))  # fmt: skip
        add(label, text, x >= IMAGE_SPEEDUP and clean)
    else:
        add(label, "not measured (needs fused and unfused at N workers, 64 connections, binary)", None)
    label = (f"{images}-image UINT8 binary requests reach the engines at >= {IMAGE_RATE:,} images/s (fused@{n}), "
             "the clients not the limit")  # fmt: skip
    b = best([r for r in closed(results, f"fused@{n}", images, protocol="v2_binary") if r["ok"]], "rows_per_s")
    if b is None:
        add(label, "no clean phase", None)
    else:
        text = (f"{_n(b['rows_per_s'])} images/s, {_f(b.get('request_mb_per_s'), ',.0f')} MB/s of requests in {dtype} "
                f"at {b['connections']} connections; clients {_cores(b)}" + _client_note(b))  # fmt: skip
        empty = [r for r in closed(results, f"empty@{n}", images, protocol="v2_binary") if r["ok"]]
        if (ceiling := best(empty, "rows_per_s")) is not None:
            text += (f"; the empty route's ceiling (each body received and dropped): {_n(ceiling['rows_per_s'])} "
                     f"images/s at {ceiling['connections']} connections, clients {_cores(ceiling)}")  # fmt: skip
        bound = (b.get("client_cpu") or {}).get("bound")
        met = None if dtype != "UINT8" else (b["rows_per_s"] >= IMAGE_RATE and bound is False)
        add(label, text + ("" if dtype == "UINT8" else " (the target is for UINT8: --input-dtype UINT8)"), met)
    phases = results["phases"]
    bad = [r for r in phases if not r["ok"]]
    sig = [r for r in phases if r["kind"] == "sigterm"]
    text = f"{len(phases) - len(bad)} of {len(phases)} phases clean"
    text += ("; SIGTERM phase " + ("clean" if sig[0]["ok"] else "LOST")) if sig else "; no SIGTERM phase"
    add("nothing lost in any phase, a SIGTERM in the middle of one included", text,
        (False if bad else (True if sig else None)) if phases else None)  # fmt: skip
    return out


def _cores(r: dict) -> str:
    """The clients' CPU over a phase, as a cell: '1.23 of 4 cores', or '-' (an older run)."""
    cpu = r.get("client_cpu") or {}
    if cpu.get("cores_used") is None:
        return "-"
    return f"{cpu['cores_used']:.2f} of {cpu['cores_given']}" + (" **client-bound**" if cpu.get("bound") else "")


def v2_targets(results: dict, fused_n: str, add) -> None:
    """Issue 21's: 256-row binary REST or gRPC >= 5M rows/s, nothing lost; 1-row gRPC >= 1-row JSON /predict."""
    n = results["meta"].get("v2_rows", 256)
    big = [r for p in ("v2_binary", "v2_grpc") for r in closed(results, fused_n, n, protocol=p)]
    b = best([r for r in big if r["ok"]], "rows_per_s")
    label = f"binary REST or gRPC, {n}-row requests: >= 5,000,000 rows/s, nothing lost"
    if b:
        add(label, f"{_n(b['rows_per_s'])} rows/s ({b['protocol']}, {b['connections']} connections)",
            b["rows_per_s"] >= 5_000_000)  # fmt: skip
    else:
        add(label, "no clean phase" if big else "not measured", False if big else None)
    g, j = best(closed(results, fused_n, 1, protocol="v2_grpc")), best(closed(results, fused_n, 1))
    label = "single-row gRPC: at least the single-row JSON /predict's req/s (fused, N workers, best of each)"
    ceiling = grpc_ceiling_text(results, results["meta"]["workers"], g)
    if g and j:
        add(label, f"{_n(g['req_per_s'])} against {_n(j['req_per_s'])} req/s" + (f"; {ceiling}" if ceiling else ""),
            g["req_per_s"] >= j["req_per_s"])  # fmt: skip
    else:
        add(label, "not measured" + (f"; {ceiling}" if ceiling else ""), None)


def grpc_ceiling_text(results: dict, workers: int, fused_grpc: dict | None) -> str:
    """Beside the single-row gRPC target, not part of it: the empty grpc.aio server's best single-row req/s at
    `workers` workers, the most grpcio's asyncio server answers on this host, and fused's best as a share of it
    ("" when the empty server did not run)."""
    e = best(closed(results, f"empty_grpc@{workers}", 1, protocol="v2_grpc"))
    if not e or e["req_per_s"] <= 0:
        return ""
    what = f"the empty grpc.aio server's {_n(e['req_per_s'])} req/s at {workers} workers"
    why = "(the ceiling of grpcio's asyncio server on this host)"
    if fused_grpc is None:
        return f"{what} {why}"
    share = fused_grpc["req_per_s"] / e["req_per_s"]
    return f"fused gRPC {_n(fused_grpc['req_per_s'])} req/s = {share:.0%} of {what} {why}"


def _phase_name(r: dict) -> str:
    proto = r.get("protocol", "predict")
    base = f"{r['system']}{'' if proto == 'predict' else ' ' + proto} {r['rows']} row{'s' if r['rows'] > 1 else ''}, "
    base += f"{r['connections']} conns"
    return base + (f", {r['rate']:.0f}/s" if r.get("rate") else "")


def fused_unfused_pairs(results: dict) -> list[tuple[list[dict], list[dict]]]:
    """Every closed-loop phase both modes ran at one worker count: (fused's rounds, unfused's rounds), in run order."""
    index: dict[tuple, list[dict]] = {}
    for r in results["phases"]:
        if r["name"] in ("fused", "unfused") and r["kind"] == "closed":
            k = (r["name"], r["workers"], r["rows"], r["connections"], r.get("protocol", "predict"))
            index.setdefault(k, []).append(r)
    return [
        (rs, index[("unfused", *k[1:])]) for k, rs in index.items() if k[0] == "fused" and ("unfused", *k[1:]) in index
    ]


def pair_ratio(fused: list[dict], unfused: list[dict]) -> tuple[float, list[float]]:
    """fused/unfused req/s: the median over rounds (each round's pair ran back to back), and every round's."""
    ratios = [f["req_per_s"] / max(u["req_per_s"], 1e-9) for f, u in zip(fused, unfused, strict=False)]
    return statistics.median(ratios), ratios


def median_of(phases: list[dict], key: str) -> float | None:
    vals = [r["server"].get(key) for r in phases if r["server"].get(key) is not None]
    return statistics.median(vals) if vals else None


# ------------------------------------------------------------------------------------------- markdown


def by_system(phases: list[dict], protocol: str | None) -> list[dict]:
    """Closed-loop phases (of `protocol`, or of every protocol but /predict's when None) grouped by system, in the
    order systems first ran, each system's in the order they ran (fused and unfused phases interleave in a run)."""
    first: dict[str, int] = {}
    for i, r in enumerate(phases):
        first.setdefault(r["system"], i)
    mine = [
        (first[r["system"]], i, r)
        for i, r in enumerate(phases)
        if r["kind"] == "closed" and (r.get("protocol", "predict") == protocol if protocol else True)
    ]
    return [r for _, _, r in sorted(mine, key=lambda t: t[:2])]


def fused_unfused_table(results: dict) -> list[str]:
    pairs = fused_unfused_pairs(results)
    if not pairs:
        return []
    lines = [
        "", "## Fused against unfused, phase by phase", "",
        "Both servers of a worker count ran at the same time and took turns phase by phase (who went first "
        "alternating), so each pair saw the same minutes of the host. fused/unfused: the ratio of answered "
        "requests per second (with several rounds: the median of each round's ratio, and their range); req/s, "
        "forward and rows per batch (each server's /metrics): medians over the rounds.", "",
        "| workers | protocol | rows | conns | fused req/s | unfused req/s | fused/unfused | forward µs/batch fused "
        "/ unfused | rows/batch fused / unfused |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for f, u in pairs:
        x, each = pair_ratio(f, u)
        mark = f"**{x:.3f}**" if x < 1 - UNFUSED_NOISE else f"{x:.3f}"
        if len(each) > 1:
            mark += f" ({min(each):.2f}-{max(each):.2f})"
        r = f[0]
        lines.append(
            f"| {r['workers']} | {r.get('protocol', 'predict')} | {r['rows']} | {r['connections']} | "
            f"{_n(statistics.median(p['req_per_s'] for p in f))} | {_n(statistics.median(p['req_per_s'] for p in u))}"
            f" | {mark} | {_f(median_of(f, 'forward_us'), '.1f')} / {_f(median_of(u, 'forward_us'), '.1f')} | "
            f"{_f(median_of(f, 'batch_rows'), '.1f')} / {_f(median_of(u, 'batch_rows'), '.1f')} |"
        )
    return lines


def _closed_row(r: dict, name: str) -> str:
    lat, s = r["latency_ms"], r["server"]
    if r.get("round"):
        name += f" (round {r['round'] + 1})"
    return (
        f"| {name} | {r['workers']} | {r['rows']} | {r['connections']} | {_n(r['req_per_s'])} | "
        f"{_n(r['rows_per_s'])} | {_f(lat['p50'])} | {_f(lat['p90'])} | {_f(lat['p99'])} | "
        f"{_f(s.get('queue_wait_ms'), '.3f')} | {_f(s.get('forward_us'), '.1f')} | "
        f"{_f(s.get('batch_rows'), '.1f')} | {r['lost']} |"
    )


def _v2_row(r: dict, name: str) -> str:
    """_closed_row's columns with MB/s after rows/s, and GPU busy and client cores before lost."""
    cells = _closed_row(r, name).split(" | ")
    cells.insert(6, _f(r.get("request_mb_per_s"), ",.1f"))
    cells[-1:-1] = [gpu_text(r.get("gpu_util")), _cores(r)]
    return " | ".join(cells)


def markdown(results: dict) -> str:
    m = results["meta"]
    v = m["versions"]
    gpu = m["gpu"] or "none (CPU run)"
    image = image_model(results)
    model_name = (m.get("model") or {}).get("name", "digits-mlp")
    shape = " x ".join(map(str, (m.get("model") or {}).get("input_shape", [64])))
    dtype = m.get("input_dtype", "FP32")
    bodies = (
        f"{m['v2_rows']} images of {shape} a request ({dtype}), seeded random values, 8 or 16 different bodies"
        if image
        else 'Bodies: 16 different `{"inputs": [[64 pixel values 0..16], ...]}`'
    )
    lines = [
        f"# fusedserve bench serve: {gpu}",
        "",
        f"{m['started']}, commit {m.get('commit') or '?'}. Host: {m['cores']} cores ({m['cpu']}); GPU: {gpu}. "
        f"Python {m['python']}, torch {v.get('torch')}, triton {v.get('triton')}, fastapi {v.get('fastapi')}, "
        f"uvicorn {v.get('uvicorn')} (starlette {v.get('starlette')}, httptools {v.get('httptools')}, "
        f"uvloop {v.get('uvloop')}), orjson {v.get('orjson')}.",
        "",
        f"Command: `{m['command']}` ({m['wall_s']} s in all, budget {m['time_budget_s']:g} s).",
        "",
        f"Every system ran as a real server on loopback; N = {m['workers']} workers; fusedserve and the eager app in "
        f"{m['dtype']}. Load: {m['clients']} client processes ({m['client']} client, {m['client_loop']}), closed loop "
        f"(each connection sends when its last request was answered) for {m['duration_s']:g} s after "
        f"{m['warmup_s']:g} s of warm-up on the same connections. {bodies}. Throughput counts every answer from the "
        "window's start to the last answer; "
        "latency is client-side, request written to answer read. Server split from /metrics deltas over the "
        "window: mean queue wait per request, mean forward per batch, mean rows per batch. `lost`: requests "
        "sent but not answered, connection errors, unexplained statuses, and disagreements with the server's "
        "outcome counters (0 everywhere, or the run fails).",
        "",
        "## Closed loop",
        "",
    ]
    predict = by_system(results["phases"], "predict")
    if predict or not image:
        lines += [
            "| system | workers | rows | conns | req/s | rows/s | p50 ms | p90 ms | p99 ms | queue wait ms | "
            "forward µs/batch | rows/batch | lost |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            *[_closed_row(r, r["name"]) for r in predict],
        ]
    else:
        lines.append(f"No JSON /predict phase: {image['name']} is an image model; its load is the Open Inference "
                     "Protocol's, below.")  # fmt: skip
    v2 = by_system([r for r in results["phases"] if r.get("protocol", "predict") != "predict"], None)
    if v2:
        unit = "images" if image else "rows"
        lines += [
            "", "## Open Inference Protocol (closed loop)", "",
            f"`v2_binary`: POST /v2/models/{model_name}/infer with Triton's binary tensor extension ({dtype} "
            f"{unit} of {shape} in, binary logits and labels out); `v2_grpc`: ModelInfer over gRPC with "
            "raw_input_contents, one HTTP/2 connection per client connection. MB/s: request bytes (header and "
            "tensor) answered per second. GPU busy: nvidia-smi's utilization.gpu, sampled every 100 ms over the "
            "window, mean % (per GPU in brackets; n/a: no GPU). Client cores: the client processes' CPU seconds over "
            "the window and drain, in cores, of the cores given (one event loop a process); **client-bound** above "
            "85% of them, where the load, not the server, may be the limit.", "",
            *([
                "`empty_grpc` (no target): grpcio's asyncio server with fusedserve's gRPC service and server options, "
                "its worker processes sharing one port as fusedserve's front ends do, and no model "
                "(bench/serve/apps/empty_grpc.py). Its ModelInfer returns a constant answer shaped like fusedserve's, "
                "so its single-row req/s is the most a grpc.aio server answers on this host: the gRPC counterpart of "
                "the `empty` route.", "",
            ] if any(r["name"] == "empty_grpc" for r in v2) else []),
            *([
                "`pil` (the CPU-preprocessing peer): a FastAPI front end that opens each file with Pillow, resizes "
                "and crops it there as the model declares, and sends the uint8 batch to a fused fusedserve over "
                "binary REST, as a TorchServe handler or a Python front end before Triton does "
                "(bench/serve/apps/pil.py).", "",
            ] if any(r["name"] == "pil" for r in v2) else []),
            f"| system (protocol) | workers | {unit} | conns | req/s | {unit}/s | MB/s | p50 ms | p90 ms | p99 ms | "
            f"queue wait ms | forward µs/batch | {unit}/batch | GPU busy % | client cores | lost |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]  # fmt: skip
        lines += [_v2_row(r, f"{r['name']} ({r['protocol']})") for r in v2]
        bound = [r for r in results["phases"] if (r.get("client_cpu") or {}).get("bound")]
        if bound:
            lines += ["", "Client-bound phases (their numbers may be the client's limit, not the server's): "
                      + "; ".join(_phase_name(r) for r in bound) + "."]  # fmt: skip
        elif any(r.get("client_cpu", {}).get("busiest") is not None for r in v2):
            top = max((r["client_cpu"]["busiest"] for r in v2 if r.get("client_cpu", {}).get("busiest")), default=0)
            lines += ["", f"No phase was client-bound: the busiest client process used {top:.0%} of its core."]
    lines += fused_unfused_table(results)
    opens = [r for r in results["phases"] if r["kind"] == "open"]
    lines += ["", "## Open loop (fixed rate, single-row)", ""]
    if opens:
        lines += [
            "Latency: a request that fell due while every connection was busy is timed from its due time "
            "(coordinated omission corrected, as wrk2), one sent on time from its send; service: every request from "
            "its actual send. Backlog: due requests never sent (the client gave up on a rate the server could not "
            "follow). Rates (unless given): 25, 50 and 75% of the empty route's closed-loop peak at N "
            "workers, the same for every system; a system too slow for all of them runs at 50 and 75% of its own peak.",
            "",
            "| system | workers | conns | rate /s | achieved /s | p50 ms | p90 ms | p99 ms | p99.9 ms | "
            "service p50 / p99 ms | queue wait ms | rows/batch | backlog | lost |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in opens:
            lat, sv, s = r["latency_ms"], r["service_ms"], r["server"]
            lines.append(
                f"| {r['name']} | {r['workers']} | {r['connections']} | {_n(r['rate'])} | {_n(r['req_per_s'])} | "
                f"{_f(lat['p50'])} | {_f(lat['p90'])} | {_f(lat['p99'])} | {_f(lat['p99.9'])} | "
                f"{_f(sv['p50'])} / {_f(sv['p99'])} | {_f(s.get('queue_wait_ms'), '.3f')} | "
                f"{_f(s.get('batch_rows'), '.1f')} | {r.get('backlog', 0)} | {r['lost']} |"
            )
    else:
        lines.append("No open-loop phase ran.")
    lines += ["", "## SIGTERM in the middle of a phase", ""]
    sig = [r for r in results["phases"] if r["kind"] == "sigterm"]
    if sig:
        r = sig[0]
        ex = r.get("exit") or {}
        what = "single-row" if r.get("protocol", "predict") == "predict" else f"{r['rows']}-row {r['protocol']}"
        lines += [
            f"{r['system']}, {what}, {r['connections']} connections, closed loop; SIGTERM "
            f"{_f(r.get('sigterm_after_s'), '.2f')} s into the {r['duration_s']:g} s window. Sent {r['sent']:,}; "
            f"answers by status {r['status']}; connection errors {r['errors'] or 'none'}; new connections refused "
            f"after the SIGTERM (expected, not lost): {r.get('refused_after_sigterm', 0)}. Server exit: status "
            f"{ex.get('rc')} after {_f(ex.get('seconds'), '.2f')} s ({ex.get('why')}). "
            + ("Nothing lost." if r["ok"] else "LOST: " + "; ".join(r["accounting"]["problems"])),
            "",
            "The server's counters cannot be read after it exits, so this phase is judged on the client's side: "
            "every request written on an open connection must be answered (200, or 503 while shutting down).",
        ]
    else:
        lines.append("No SIGTERM phase ran.")
    lines += ["", f"## Targets (issue {34 if image else 18})", "", "| target | measured | met |", "|---|---|---|"]
    for t in results["targets"]:
        met = {True: "met", False: "**not met**", None: "n/a"}[t["met"]]
        lines.append(f"| {t['target']} | {t['measured']} | {met} |")
    lines += perf_analyzer.markdown(results.get("perf_analyzer"))
    lines += ["", "## Servers", "", "| system | ready after s | exit |", "|---|---:|---|"]
    for s in results["servers"]:
        if not s.get("ready"):
            lines.append(f"| {s['system']} | - | did not start: {s.get('error', '').splitlines()[0]} |")
            continue
        ex = s.get("exit") or {}
        exit_text = f"{ex.get('rc')} in {_f(ex.get('seconds'))} s: {ex.get('why')}"
        lines.append(f"| {s['system']} | {s['ready_s']:.1f} | {exit_text} |")
    lines += ["", "## Skipped", ""]
    if results["skipped"]:
        lines += [f"- {s['system']}: {s['what']} ({s['why']})" for s in results["skipped"]]
    else:
        lines.append("Nothing: every planned phase ran.")
    notes = [
        f"- {r['system']} {r['kind']} rows={r['rows']} conns={r['connections']}: {n}"
        for r in results["phases"]
        for n in r["accounting"]["notes"]
    ]
    if notes:
        lines += ["", "## Notes", "", *notes]
    lines += ["", "## Problems", ""]
    lines += [f"- {p}" for p in results["problems"]] or ["None: nothing lost."]
    return "\n".join(lines) + "\n"


def summary(results: dict, paths: list[Path]) -> str:
    rows = ["", "system (protocol)    rows conns      req/s      rows/s   p50 ms   p99 ms  lost"]
    for r in results["phases"]:
        if r["kind"] != "closed":
            continue
        lat = r["latency_ms"]
        proto = r.get("protocol", "predict")
        name = r["system"] + ("" if proto == "predict" else " " + proto)
        rows.append(
            f"{name:<20} {r['rows']:>4} {r['connections']:>5} {r['req_per_s']:>10,.0f} "
            f"{r['rows_per_s']:>11,.0f} {_f(lat['p50']):>8} {_f(lat['p99']):>8} {r['lost']:>5}"
        )
    t = results["targets"]
    rows.append("")
    for x in t:
        rows.append(f"[{ {True: 'met', False: 'NOT MET', None: 'n/a'}[x['met']]:>7}] {x['target']}: {x['measured']}")
    rows.append("")
    bound = [_phase_name(r) for r in results["phases"] if (r.get("client_cpu") or {}).get("bound")]
    rows.append("client-bound: " + ("; ".join(bound) or "no phase"))
    rows.append("skipped: " + (", ".join(f"{s['system']} {s['what']}" for s in results["skipped"]) or "nothing"))
    rows.append("problems: " + ("; ".join(results["problems"]) or "none, nothing lost"))
    rows.append("wrote " + ", ".join(str(p) for p in paths))
    return "\n".join(rows)


# ------------------------------------------------------------------------------------------- plot


def plot(results: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install -e '.[bench]')", flush=True)
        return None
    phases = [r for r in results["phases"] if r["kind"] == "closed" and r.get("protocol", "predict") == "predict"]
    if not phases:
        return plot_v2(results, path, plt)
    systems = list(dict.fromkeys(r["system"] for r in phases))
    colors = {"empty": "tab:gray", "eager": "tab:orange", "fused": "tab:red", "unfused": "tab:blue", "pil": "tab:green"}
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))

    def style(system: str) -> dict:
        name, workers = system.split("@")
        return {"color": colors.get(name, "k"), "linestyle": "-" if workers != "1" else "--", "marker": "o"}

    for ax, rows, key, label in (
        (axes[0][0], 1, "req_per_s", "single-row requests/s"),
        (axes[0][1], 64, "rows_per_s", "64-row requests: rows/s"),
    ):
        for s in systems:
            pts = sorted((r["connections"], r[key]) for r in phases if r["system"] == s and r["rows"] == rows)
            if pts:
                ax.plot(*zip(*pts, strict=True), label=s, **style(s))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("connections (closed loop)")
        ax.set_ylabel(label)
        ax.set_title(label + " against connections", fontsize=10)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, f"no {rows}-row phases", ha="center", transform=ax.transAxes)
    ax = axes[1][0]
    for s in systems:
        mine = [r for r in phases if r["system"] == s and r["rows"] == 1 and r["latency_ms"]["p50"] is not None]
        pts = sorted((r["connections"], r["latency_ms"]["p50"], r["latency_ms"]["p99"]) for r in mine)
        if pts:
            c, p50, p99 = zip(*pts, strict=True)
            st = style(s)
            ax.plot(c, p50, label=f"{s} p50", **st)
            ax.plot(c, p99, color=st["color"], linestyle=":", marker="x", label=f"{s} p99")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("connections (closed loop)")
    ax.set_ylabel("latency ms")
    ax.set_title("single-row latency p50 (solid/dashed) and p99 (dotted)", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6, ncol=2)
    ax = axes[1][1]
    top = max((r["connections"] for r in phases if r["rows"] == 1), default=None)
    for s in systems:
        r = next((r for r in phases if r["system"] == s and r["rows"] == 1 and r["connections"] == top), None)
        if r and r["latency_ms"].get("cdf"):
            st = style(s)
            ax.plot(r["latency_ms"]["cdf"], CDF_POINTS, label=s, color=st["color"], linestyle=st["linestyle"])
    ax.set_xscale("log")
    ax.set_xlabel("latency ms")
    ax.set_ylabel("percentile")
    ax.set_title(f"single-row latency distribution at {top} connections", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    if ax.lines:
        ax.legend(fontsize=7)
    m = results["meta"]
    fig.suptitle(
        f"fusedserve bench serve: {m['gpu'] or 'CPU'}, {m['cores']} cores, N={m['workers']}, {m['dtype']}", fontsize=11
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_v2(results: dict, path: Path, plt) -> Path | None:
    """An image model's run (no /predict phase): per system and protocol against connections, images (rows) a
    second, p50 and p99, how busy the GPU was, and the clients' cores used."""
    phases = [r for r in results["phases"] if r["kind"] == "closed"]
    if not phases:
        return None
    unit = "images" if image_model(results) else "rows"
    colors = {"fused": "tab:red", "unfused": "tab:blue", "empty_grpc": "tab:gray"}
    series = list(dict.fromkeys((r["system"], r["protocol"]) for r in phases))
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    panels = (
        (axes[0][0], lambda r: r["rows_per_s"], f"{unit}/s"),
        (axes[0][1], lambda r: r["latency_ms"]["p50"], "latency ms: p50 (solid), p99 (dotted)"),
        (axes[1][0], lambda r: (r.get("gpu_util") or {}).get("mean"), "GPU busy % (nvidia-smi)"),
        (axes[1][1], lambda r: (r.get("client_cpu") or {}).get("cores_used"), "client cores used"),
    )
    for ax, value, label in panels:
        for system, protocol in series:
            mine = [r for r in phases if r["system"] == system and r["protocol"] == protocol]
            pts = sorted((r["connections"], value(r)) for r in mine if value(r) is not None)
            color = colors.get(system.split("@")[0], "k")
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", color=color, label=f"{system} {protocol}")
            if ax is axes[0][1]:
                p99 = sorted((r["connections"], r["latency_ms"]["p99"]) for r in mine if r["latency_ms"]["p99"])
                if p99:
                    ax.plot(*zip(*p99, strict=True), marker="x", linestyle=":", color=color)
        ax.set_xscale("log", base=2)
        if ax is axes[0][1] and ax.lines:
            ax.set_yscale("log")
        ax.set_xlabel("connections (closed loop)")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not measured (n/a)", ha="center", transform=ax.transAxes)
    m = results["meta"]
    model = (m.get("model") or {}).get("name", "digits-mlp")
    fig.suptitle(f"fusedserve bench serve: {model}, {m['v2_rows']} {unit} a request ({m.get('input_dtype', 'FP32')}), "
                 f"{m['gpu'] or 'CPU'}, {m['cores']} cores, N={m['workers']}", fontsize=11)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------- files


def write_all(results: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    results["targets"] = targets(results)
    stem = out / f"serve_{results['meta']['slug']}"
    paths = [stem.with_suffix(".md"), stem.with_suffix(".json")]
    paths[1].write_text(json.dumps(results, indent=1, default=str) + "\n")
    paths[0].write_text(markdown(results))
    png = plot(results, stem.with_suffix(".png"))
    if png:
        paths.append(png)
    print(summary(results, paths), flush=True)
    return paths


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m bench.serve.report RESULTS.json", file=sys.stderr)
        return 2
    path = Path(argv[0])
    results = json.loads(path.read_text())
    write_all(results, path.parent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
