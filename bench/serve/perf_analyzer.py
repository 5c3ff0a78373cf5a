"""perf_analyzer (NVIDIA's load generator for Triton Inference Server) against a running fusedserve, with the server's
own statistics (Triton's statistics extension) read before and after each run, so that the report shows the server's
counts agreeing with the client's.

    python -m bench.serve.perf_analyzer --http 127.0.0.1:8000 --grpc 127.0.0.1:8001 --out bench/results

needs a fusedserve serving the model on both ports (`fusedserve serve --grpc-port 8001`) and perf_analyzer on the
PATH (or beside this Python); its wheel's binary needs glibc 2.38 or newer, so it runs on the GPU host, not in CI.
`bench serve` runs the same against its fused@N server when the binary runs (bench/serve/run.py), with the model it
serves (an image model: batch 1 and its --images).

For each protocol (http, grpc), rows per request (1, 256) and concurrency (1, 4, 64, 256: bench serve's connection
counts, so the rows compare with its own), one run:

    perf_analyzer -m digits-mlp -u HOST:PORT -i PROTOCOL -b ROWS --concurrency-range C --async
        --measurement-mode count_windows --measurement-request-count 1000 --input-data zero -f RUN.csv

`--input-data zero`: perf_analyzer's default, random, fills FP32 inputs with random bytes, of which about 1 in 256
elements is NaN or infinite; fusedserve refuses such rows with 400, as it refuses non-finite input everywhere.
`--async`: C requests in flight from perf_analyzer's 16 threads, rather than C threads beside the server's processes.
One run per concurrency: a --concurrency-range's steps are linear, bench serve's counts are not.

Each run gives perf_analyzer's CSV row (throughput, client-side latency percentiles, and its split of the server's
time from the statistics: queue, compute input, compute infer, compute output, and the rest as network+server
send/recv), the client's and the server's request counts over its last windows (its stdout), and the server's
statistics over the whole run. A level perf_analyzer reports unstable is run once more with 4x the requests a
window and -r 20 before it is reported unstable. A run fails its checks when the server failed any request, when the
server's rows are not its requests times the rows per request, or when the window counts differ by more than the
requests in flight (the concurrency) or 1%.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

BINARY = "perf_analyzer"
MODEL = "digits-mlp"
PROTOCOLS = ("http", "grpc")
ROWS = (1, 256)
CONCURRENCY = (1, 4, 64, 256)
REQUEST_COUNT = 1000  # per measurement window (perf_analyzer's windows last at least 1 s in count_windows mode)
RUN_TIMEOUT_S = 120.0
UNSTABLE = "Failed to obtain stable measurement"
# A level perf_analyzer could not measure stably is measured once more over windows this many times longer and with
# twice its trials (-r 20), before the report calls it unstable: a GPU run's gRPC batch-256 level at 64 in flight
# did not settle in 1000-request windows.
RETRY_WINDOW = 4
RETRY_ARGS = ("-r", "20")
# perf_analyzer's CSV columns (-f, without --verbose-csv) -> this report's keys; times in microseconds.
COLUMNS = {
    "Concurrency": "concurrency",
    "Inferences/Second": "infer_per_s",
    "Client Send": "client_send_us",
    "Network+Server Send/Recv": "network_us",
    "Server Queue": "server_queue_us",
    "Server Compute Input": "server_compute_input_us",
    "Server Compute Infer": "server_compute_infer_us",
    "Server Compute Output": "server_compute_output_us",
    "Client Recv": "client_recv_us",
}


def candidates() -> list[str]:
    """perf_analyzer beside the running interpreter (a venv used without activating it), the binary inside the
    perf_analyzer wheel's package where Python imports it from (its console script is a wrapper that exits 0
    whatever the binary did), and the one on the PATH: those that exist, in that order."""
    paths = [Path(sys.executable).with_name(BINARY)]
    spec = importlib.util.find_spec(BINARY)
    if spec is not None and spec.origin:
        paths.append(Path(spec.origin).parent / "bin" / BINARY)
    found = [str(p) for p in paths if p.is_file() and os.access(p, os.X_OK)]
    on_path = shutil.which(BINARY)
    return list(dict.fromkeys([*found, *([on_path] if on_path else [])]))


def find() -> str | None:
    """The first of candidates() that runs here (a venv's wheel whose binary needs a newer glibc does not, while one
    on the PATH may), else the first that exists (so the report says which did not run), else None."""
    found = candidates()
    return next((b for b in found if version(b)), found[0] if found else None)


def version(binary: str) -> str | None:
    """Its version line when the binary runs here, else None (a missing shared library, too old a glibc)."""
    try:
        run = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"^Perf Analyzer Version .*$", run.stdout + run.stderr, re.M)
    return found.group(0).strip() if run.returncode == 0 and found else None


def command(
    binary: str, url: str, protocol: str, rows: int, concurrency: int, csv_path: Path,
    model: str = MODEL, request_count: int = REQUEST_COUNT, extra: tuple[str, ...] = (),
) -> list[str]:  # fmt: skip
    """The argv of one run (see the module's docstring for why each flag); `extra` goes last (e.g. -s 20 -r 20:
    perf_analyzer's stability threshold and most windows per level)."""
    return [
        binary, "-m", model, "-u", url, "-i", protocol, "-b", str(rows), "--concurrency-range", str(concurrency),
        "--async", "--measurement-mode", "count_windows", "--measurement-request-count", str(request_count),
        "--input-data", "zero", "-f", str(csv_path), *extra,
    ]  # fmt: skip


def parse_csv(text: str, rows: int) -> list[dict]:
    """perf_analyzer's -f report: one dict per concurrency, in COLUMNS' keys (others lower-cased: `p99 latency` ->
    `p99_us`), numbers as floats, plus req_per_s (its Inferences/Second counts rows: requests times `rows`)."""
    out = []
    for record in csv.DictReader(io.StringIO(text)):
        row = {}
        for name, value in record.items():
            if name is None or value is None or not name.strip():
                continue
            name = name.strip()
            key = COLUMNS.get(name)
            if key is None:
                match = re.fullmatch(r"p(\d+) latency", name)
                key = f"p{match.group(1)}_us" if match else re.sub(r"\W+", "_", name.lower()).strip("_")
            try:
                row[key] = float(value)
            except ValueError:
                row[key] = value.strip()
        if "concurrency" in row:
            row["concurrency"] = int(row["concurrency"])
        if "infer_per_s" in row:
            row["req_per_s"] = row["infer_per_s"] / rows
        out.append(row)
    return sorted(out, key=lambda r: r.get("concurrency", 0))


def parse_stdout(text: str) -> dict:
    """{concurrency: {client_requests, server_requests, server_inferences, server_executions}} from its summary of
    each level's last windows, and "unstable": the levels it could not measure stably."""
    levels: dict = {}
    for block in re.split(r"^Request concurrency: ", text, flags=re.M)[1:]:
        head, _, body = block.partition("\n")
        if not head.strip().isdigit():
            continue
        found = {}
        for key, pattern in (
            ("client_requests", r"Client:\s*\n\s*Request count: (\d+)"),
            ("server_inferences", r"Server:\s*\n\s*Inference count: (\d+)"),
            ("server_executions", r"Execution count: (\d+)"),
            ("server_requests", r"Successful request count: (\d+)"),
        ):
            match = re.search(pattern, body)
            if match:
                found[key] = int(match.group(1))
        if found:
            levels[int(head)] = found
    levels["unstable"] = sorted({int(c) for c in re.findall(UNSTABLE + r" within \d+ measurement windows for "
                                                            r"concurrency (\d+)", text)})  # fmt: skip
    return levels


def server_stats(http: str, model: str = MODEL, timeout_s: float = 10.0) -> dict:
    """The model's statistics (Triton's $model_stat) from GET /v2/models/{model}/stats."""
    with urllib.request.urlopen(f"http://{http}/v2/models/{model}/stats", timeout=timeout_s) as r:
        (stat,) = json.loads(r.read())["model_stats"]
    return stat


def server_config(http: str, model: str = MODEL, timeout_s: float = 10.0) -> dict:
    with urllib.request.urlopen(f"http://{http}/v2/models/{model}/config", timeout=timeout_s) as r:
        return json.loads(r.read())


def stats_delta(before: dict, after: dict) -> dict:
    """What the server counted between two reads: requests answered and failed, rows, batches, and the mean of each
    of its phases per request in microseconds."""
    b, a = before["inference_stats"], after["inference_stats"]

    def count(k: str) -> int:
        return a[k]["count"] - b[k]["count"]

    def mean_us(k: str) -> float | None:
        n = count(k)
        return (a[k]["ns"] - b[k]["ns"]) / n / 1e3 if n else None

    return {
        "requests": count("success"),
        "failed": count("fail"),
        "rows": after["inference_count"] - before["inference_count"],
        "batches": after["execution_count"] - before["execution_count"],
        **{f"{k}_us": mean_us(k) for k in ("success", "queue", "compute_input", "compute_infer", "compute_output")},
    }


def check(run: dict) -> list[str]:
    """A run's problems: the server failed requests, its rows are not requests x rows per request, or the last
    windows' counts of client and server differ by more than the requests in flight or 1%."""
    problems = []
    server, rows, conc = run.get("server") or {}, run["rows"], run["concurrency"]
    if server.get("failed"):
        problems.append(f"the server failed {server['failed']} requests")
    if server and server["rows"] != server["requests"] * rows:
        problems.append(f"the server counted {server['rows']} rows for {server['requests']} requests of {rows} rows")
    window = run.get("window") or {}
    if "client_requests" in window and "server_requests" in window:
        diff = abs(window["client_requests"] - window["server_requests"])
        if diff > max(conc, 0.01 * window["client_requests"]):
            problems.append(f"its last windows: {window['client_requests']} requests by the client, "
                            f"{window['server_requests']} by the server")  # fmt: skip
    return problems


def run_one(
    binary: str, http: str, url: str, protocol: str, rows: int, concurrency: int, work: Path,
    model: str = MODEL, request_count: int = REQUEST_COUNT, timeout_s: float = RUN_TIMEOUT_S,
    extra: tuple[str, ...] = (), tag: str = "",
) -> dict:  # fmt: skip
    """One perf_analyzer run with the server's statistics read before and after it (its CSV and log named by the
    level, and `tag`)."""
    name = f"pa_{protocol}_b{rows}_c{concurrency}{tag}"
    csv_path = work / f"{name}.csv"
    argv = command(binary, url, protocol, rows, concurrency, csv_path, model, request_count, extra)
    out = {"protocol": protocol, "rows": rows, "concurrency": concurrency, "command": shlex.join(argv)}
    before = server_stats(http, model)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd=work)
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = None, e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    out["seconds"] = round(time.monotonic() - t0, 1)
    (work / f"{name}.log").write_text(text)
    time.sleep(0.1)  # the engines write their counts when idle
    out["server"] = stats_delta(before, server_stats(http, model))
    out["rc"] = rc
    levels = parse_stdout(text)
    out["window"] = levels.get(concurrency, {})
    table = parse_csv(csv_path.read_text(), rows) if csv_path.is_file() else []
    out["csv"] = next((r for r in table if r.get("concurrency") == concurrency), None)
    if rc == 0 and out["csv"] is not None:
        out["status"] = "ok"
    elif concurrency in levels["unstable"] or UNSTABLE in text:
        out["status"] = "unstable"  # a measurement perf_analyzer gave up on, not a failure of the server
    else:
        out["status"] = "failed"
        last = [line for line in text.strip().splitlines() if line.strip()][-1:] or ["no output"]
        out["error"] = f"exit {rc if rc is not None else f'none (killed after {timeout_s:g} s)'}: {last[0]}"
    # Killed at its timeout, it left requests in flight, answered or failed after the second read: no count to check.
    out["problems"] = ([] if rc is None else check(out)) + (
        [f"perf_analyzer failed: {out['error']}"] if out["status"] == "failed" else []
    )
    return out


def run(http: str, grpc: str | None, work: Path, binary: str | None = None, model: str = MODEL,
        protocols=PROTOCOLS, rows=ROWS, concurrency=CONCURRENCY, request_count: int = REQUEST_COUNT,
        time_budget_s: float = 0.0, extra: tuple[str, ...] = ()) -> dict:  # fmt: skip
    """Every (protocol, rows, concurrency) run that the binary, the server's max_batch_size and the time budget
    (0: none) allow, each run killed at RUN_TIMEOUT_S or at the budget's end; {"version", "runs", "skipped",
    "problems"}."""
    binary = binary or find()
    results: dict = {"binary": binary, "version": None, "runs": [], "skipped": [], "problems": []}
    results["version"] = version(binary) if binary else None
    if not results["version"]:
        results["skipped"].append("every run: " + (f"{binary} does not run here" if binary else f"no {BINARY}"))
        return results
    work.mkdir(parents=True, exist_ok=True)
    max_rows = server_config(http, model).get("max_batch_size", 0)
    end = time.monotonic() + time_budget_s if time_budget_s > 0 else None
    per_run = 8.0  # a first guess; then the mean of the runs so far
    for protocol in protocols:
        url = http if protocol == "http" else grpc
        for b in rows:
            for c in concurrency:
                what = f"{protocol} rows={b} concurrency={c}"
                if url is None:
                    results["skipped"].append(f"{what}: no gRPC address")
                elif b > max_rows:
                    results["skipped"].append(f"{what}: above the server's max_batch_size {max_rows}")
                elif end is not None and time.monotonic() + per_run > end:
                    results["skipped"].append(f"{what}: time budget")
                else:
                    timeout_s = RUN_TIMEOUT_S if end is None else min(RUN_TIMEOUT_S, end - time.monotonic())
                    r = run_one(binary, http, url, protocol, b, c, work, model, request_count, timeout_s, extra)
                    if r["status"] == "unstable":
                        r = retry_unstable(r, binary, http, url, work, model, request_count, end, extra)
                    results["runs"].append(r)
                    results["problems"] += [f"perf_analyzer {what}: {p}" for p in r["problems"]]
                    per_run = sum(x["seconds"] for x in results["runs"]) / len(results["runs"])
                    print(describe(r), flush=True)
    return results


def retry_unstable(
    first: dict, binary: str, http: str, url: str, work: Path, model: str, request_count: int,
    end: float | None, extra: tuple[str, ...],
) -> dict:  # fmt: skip
    """The level again with RETRY_WINDOW times the requests a window and RETRY_ARGS, when the time budget holds it
    (the first try's seconds times RETRY_WINDOW); the retry's result, with the first try's kept under "attempts"."""
    need = first["seconds"] * RETRY_WINDOW
    protocol, rows, conc = first["protocol"], first["rows"], first["concurrency"]
    if end is not None and time.monotonic() + need > end:
        first["retry"] = f"not retried: the time budget does not hold {RETRY_WINDOW}x longer windows"
        return first
    timeout_s = RUN_TIMEOUT_S * RETRY_WINDOW
    if end is not None:
        timeout_s = min(timeout_s, end - time.monotonic())
    count = request_count * RETRY_WINDOW
    again = run_one(binary, http, url, protocol, rows, conc, work, model, count, timeout_s, (*extra, *RETRY_ARGS),
                    tag="_retry")  # fmt: skip
    again["attempts"] = [{k: first[k] for k in ("status", "command", "seconds", "window", "csv", "server")}]
    again["retry"] = f"unstable in {request_count}-request windows; again in {count}-request windows, -r 20"
    return again


def _f(v, fmt: str = ".0f") -> str:
    return "-" if v is None else format(v, fmt)


def describe(r: dict) -> str:
    c, s, w = r.get("csv") or {}, r["server"], r["window"]
    return (f"  perf_analyzer {r['protocol']:<4} rows={r['rows']:<3} conc={r['concurrency']:<3} {r['status']:<8} "
            f"{_f(c.get('req_per_s'))} req/s, p99 {_f(c.get('p99_us'))} us; window client/server requests "
            f"{w.get('client_requests', '-')}/{w.get('server_requests', '-')}; server: {s['requests']} requests, "
            f"{s['failed']} failed, {s['rows']} rows in {s['batches']} batches")  # fmt: skip


def markdown(results: dict | None) -> list[str]:
    """The report's section (bench serve's serve_<gpu>.md, or this module's own perf_analyzer.md)."""
    if not results:
        return []
    lines = ["", "## perf_analyzer", ""]
    if not results["runs"]:
        return lines + [f"Not run: {'; '.join(results['skipped']) or 'nothing planned'}."]
    lines += [
        f"{results['version']}, against the server's HTTP and gRPC ports"
        + (f" ({results['system']}, `bench serve`'s)" if results.get("system") else "")
        + ", closed loop (`--async`, the concurrency in "
        "flight), `count_windows` of at least 1 s; zero-filled FP32 inputs. Latency is perf_analyzer's, client-side; "
        "queue and compute are the server's means per request from Triton's statistics over the run's last "
        "windows, as perf_analyzer reports them (compute: input + infer + output). Requests, client / server: its "
        "last windows' counts (perf_analyzer's, and the server's statistics over the same windows). Server over the "
        "run: the statistics' difference across the whole run, read by this benchmark (requests answered, "
        "failures, rows per batch).",
        "",
        "| protocol | rows | conc | req/s | rows/s | p50 ms | p99 ms | queue µs | compute µs | network+server µs | "
        "requests, client / server | server over the run: requests, failed, rows/batch | status |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results["runs"]:
        c, s, w = r.get("csv") or {}, r["server"], r["window"]
        compute = [c.get(k) for k in ("server_compute_input_us", "server_compute_infer_us", "server_compute_output_us")]
        per_batch = s["rows"] / s["batches"] if s["batches"] else None
        status = r["status"] + (" (retried in longer windows)" if r.get("attempts") else "")
        status += "" if not r["problems"] else ": " + "; ".join(r["problems"])
        lines.append(
            f"| {r['protocol']} | {r['rows']} | {r['concurrency']} | {_f(c.get('req_per_s'))} | "
            f"{_f(c.get('infer_per_s'))} | {_f(_ms(c.get('p50_us')), '.2f')} | {_f(_ms(c.get('p99_us')), '.2f')} | "
            f"{_f(c.get('server_queue_us'))} | {_f(None if None in compute else sum(compute))} | "
            f"{_f(c.get('network_us'))} | {w.get('client_requests', '-')} / {w.get('server_requests', '-')} | "
            f"{s['requests']}, {s['failed']}, {_f(per_batch, '.1f')} | {status} |"
        )
    if results["skipped"]:
        lines += ["", *[f"- skipped: {s}" for s in results["skipped"]]]
    lines += ["", "Commands (one per row): `" + results["runs"][0]["command"] + "`, and the same with the row's "
              "`-i`, `-b` and `--concurrency-range`."]  # fmt: skip
    return lines


def _ms(us: float | None) -> float | None:
    return None if us is None else us / 1e3


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 every run passed its checks, 1 a run failed or disagreed, 2 perf_analyzer does not run here."""
    p = argparse.ArgumentParser(
        prog="python -m bench.serve.perf_analyzer",
        description=__doc__.splitlines()[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--http", default="127.0.0.1:8000", help="fusedserve's HTTP host:port [127.0.0.1:8000]")
    p.add_argument("--grpc", default="127.0.0.1:8001", help="its gRPC host:port (none: HTTP only) [127.0.0.1:8001]")
    p.add_argument("--model", default=MODEL, help=f"[{MODEL}]")
    p.add_argument("--binary", help=f"perf_analyzer's path [beside this Python, else {BINARY} on the PATH]")
    p.add_argument("--protocols", default=",".join(PROTOCOLS), help="[http,grpc]")
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="rows per request (-b) [1,256]")
    p.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)), help="[1,4,64,256]")
    p.add_argument("--request-count", type=int, default=REQUEST_COUNT, help=f"per window [{REQUEST_COUNT}]")
    p.add_argument("--time-budget", type=float, default=0.0, help="seconds for every run; 0: none [0]")
    p.add_argument("--pa-args", default="", help="more perf_analyzer flags for every run, e.g. '-s 20 -r 20' []")
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="where perf_analyzer.{md,json} go")
    args = p.parse_args(argv)
    grpc = None if args.grpc == "none" else args.grpc
    work = args.out / "perf_analyzer_runs"
    results = run(args.http, grpc, work, args.binary, args.model, tuple(args.protocols.split(",")),
                  tuple(int(v) for v in args.rows.split(",")), tuple(int(v) for v in args.concurrency.split(",")),
                  args.request_count, args.time_budget, tuple(shlex.split(args.pa_args)))  # fmt: skip
    if not results["version"]:
        print(f"{BINARY}: {results['skipped'][0]}", file=sys.stderr)
        return 2
    (args.out / "perf_analyzer.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "perf_analyzer.md").write_text("\n".join(["# perf_analyzer against fusedserve", *markdown(results)[2:]])
                                               + "\n")  # fmt: skip
    for problem in results["problems"]:
        print(f"problem: {problem}", file=sys.stderr)
    return 1 if results["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
