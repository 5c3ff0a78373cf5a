"""`bench serve`: the nothing-lost accounting, the load generator against a real uvicorn app, and a quick
end-to-end run on the CPU (empty@1, empty_grpc@1 and fusedserve unfused@1, tiny windows)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from bench.serve import cli as serve_cli
from bench.serve import report as serve_report
from bench.serve.accounting import OUTCOMES, account, delta, parse_metrics, server_split
from bench.serve.loadgen import ClientPool, PhaseSpec, make_bodies, merge, percentiles
from bench.serve.report import targets

from .server import REPO, ManagedProcess, dump_new_logs, free_port, service_env

# ---------------------------------------------------------------------------------------- accounting


def _client(status: dict, sent: int | None = None, errors: dict | None = None, events=()) -> dict:
    answered = sum(status.values())
    return {
        "sent": answered + sum((errors or {}).get(k, 0) for k in ("lost", "timeout")) if sent is None else sent,
        "status": status,
        "errors": errors or {},
        "events": list(events),
        "why": {},
        "backlog": 0,
        "warmup": {"sent": 5, "status": {200: 5}, "errors": {}},
    }


def _server(**outcomes) -> dict:
    return {f"outcome:{k}": float(v) for k, v in outcomes.items()}


def test_a_clean_phase_passes():
    acc = account(_client({200: 100}), _server(ok=100))
    assert acc["problems"] == [] and acc["lost"] == 0


def test_a_request_sent_and_never_answered_fails():
    # The client's books do not balance: 100 sent, 99 answered, no error recorded.
    acc = account(_client({200: 99}, sent=100), _server(ok=99))
    assert acc["lost"] == 1 and any("sent 100 != answered 99" in p for p in acc["problems"])
    # A connection closed under a request.
    acc = account(_client({200: 99}, errors={"lost": 1}), _server(ok=99))
    assert acc["lost"] == 1 and any("got no answer" in p for p in acc["problems"])
    # Unanswered when the drain timed out.
    acc = account(_client({200: 99}, errors={"timeout": 1}), _server(ok=99))
    assert acc["lost"] == 1 and any("drain timed out" in p for p in acc["problems"])


def test_an_unexplained_500_fails_even_when_the_server_counted_it():
    acc = account(_client({200: 99, 500: 1}), _server(ok=99, error=1))
    assert acc["lost"] >= 1
    assert any("HTTP 500 (unexplained 5xx)" in p for p in acc["problems"])
    assert any("server counted 1 error" in p for p in acc["problems"])


def test_503s_pass_only_when_the_server_counted_them_overloaded():
    acc = account(_client({200: 90, 503: 10}), _server(ok=90, overloaded=10))
    assert acc["problems"] == [] and any("503 overloaded" in n for n in acc["notes"])
    acc = account(_client({200: 90, 503: 10}), _server(ok=90, overloaded=4))
    assert any("10 x 503" in p for p in acc["problems"])
    acc = account(_client({200: 90, 503: 10}), None, has_metrics=False)  # the empty app: nothing to match
    assert any("unexplained" in p for p in acc["problems"])


def test_server_and_client_must_agree_on_ok():
    acc = account(_client({200: 100}), _server(ok=97))
    assert any("server counted 97 ok" in p for p in acc["problems"]) and acc["lost"] == 3


def test_connection_errors_fail_except_refusals_after_a_sigterm():
    acc = account(_client({200: 10}, errors={"refused": 1}, events=[("refused", 5.0)]), _server(ok=10))
    assert any("refused" in p for p in acc["problems"])
    events = [("refused", 4.0), ("refused", 6.0), ("refused", 7.0)]
    acc = account(_client({200: 10, 503: 2}, errors={"refused": 3}, events=events), None, sigterm_at=5.0)
    assert acc["refused_after_sigterm"] == 2
    assert acc["problems"] == ["1 connection(s) refused before the SIGTERM"]
    assert acc["lost"] == 1


def test_warmup_errors_fail_the_phase():
    c = _client({200: 10})
    c["warmup"]["errors"] = {"lost": 1}
    assert any("warm-up" in p for p in account(c, _server(ok=10))["problems"])


def test_metrics_are_summed_over_labels_and_split_per_phase():
    from service.metrics import EngineMetrics, RequestMetrics

    front, engine = RequestMetrics("digits-mlp", "fused"), EngineMetrics("digits-mlp", "fused", "cpu", "float32")

    def scrape() -> dict:  # what /metrics shows of a deployment: both processes' families
        return parse_metrics(front.render().decode() + engine.render().decode())

    before = scrape()
    for _ in range(3):
        front.observe_request("ok", 0.001)
    front.observe_request("overloaded")
    engine.queue_waits([0.002, 0.004])
    engine.observe_forward(10e-6)
    engine.batch(2)
    d = delta(before, scrape())
    split = server_split(d)
    assert split["outcomes"] == {"ok": 3, "overloaded": 1}
    assert split["queue_wait_ms"] == pytest.approx(3.0)
    assert split["forward_us"] == pytest.approx(10.0)
    assert split["batch_rows"] == pytest.approx(2.0) and split["batches"] == 1
    # A whole-deployment /metrics with an extra label (one series per engine) sums the same way.
    text = (
        'fusedserve_requests_total{model="m",mode="fused",engine="0",outcome="ok"} 5.0\n'
        'fusedserve_requests_total{model="m",mode="fused",engine="1",outcome="ok"} 7.0\n'
        'fusedserve_forward_seconds_sum{model="m",mode="fused",engine="0"} 0.5\n'
        'fusedserve_forward_seconds_sum{model="m",mode="fused",engine="1"} 0.25\n'
    )
    parsed = parse_metrics(text)
    assert parsed["outcome:ok"] == 12.0 and parsed["forward_seconds_sum"] == 0.75


def _phase(system: str, rows: int, conns: int, rps: float, p50: float = 1.0, p99: float = 5.0, fwd=None) -> dict:
    name, workers = system.split("@")
    return {
        "system": system, "name": name, "workers": int(workers), "kind": "closed", "rows": rows,
        "connections": conns, "rate": None, "req_per_s": rps, "rows_per_s": rps * rows,
        "latency_ms": {"p50": p50, "p90": p99, "p99": p99}, "server": {"forward_us": fwd} if fwd else {},
        "ok": True, "lost": 0, "accounting": {"problems": [], "notes": []},
    }  # fmt: skip


def test_targets_read_the_phases():
    phases = [
        _phase("empty@8", 1, 256, 36_000),
        _phase("fused@8", 1, 256, 31_000, p99=12.0, fwd=9.0),
        _phase("unfused@8", 1, 256, 32_000, p99=12.0, fwd=30.0),
        _phase("fused@8", 64, 256, 20_000, fwd=12.0),
        _phase("unfused@8", 64, 256, 19_000, fwd=40.0),
        _phase("empty@1", 1, 1, 3000, p50=0.27),
        _phase("fused@1", 1, 1, 1000, p50=0.60, fwd=9.0),
    ]
    t = {x["target"].split(":")[0]: x for x in targets({"meta": {"workers": 8}, "phases": phases})}
    assert t["fused, 8 workers"]["met"] is True  # 31,000 with p99 12 ms
    assert t["64-row requests"]["met"] is True  # 1.28 M rows/s
    assert t["one connection"]["met"] is False  # 0.33 ms slower
    # 31,000 against 32,000 is 3% slower: outside the 2% noise band.
    assert next(x for x in t.values() if x["target"].startswith("fused at least as fast"))["met"] is False
    assert next(x for x in t.values() if x["target"].startswith("fused forward"))["met"] is True
    assert t["nothing lost in any phase, a SIGTERM in the middle of one included"]["met"] is None  # no SIGTERM phase


def test_single_row_grpc_target_shows_the_empty_grpc_servers_ceiling_beside_it():
    def grpc(system: str, rps: float) -> dict:
        return {**_phase(system, 1, 256, rps), "protocol": "v2_grpc"}

    phases = [_phase("fused@8", 1, 256, 72_573), grpc("fused@8", 17_766)]
    label = "single-row gRPC"

    def target(phases: list[dict]) -> dict:
        return next(x for x in targets({"meta": {"workers": 8}, "phases": phases}) if x["target"].startswith(label))

    assert target(phases)["measured"] == "17,766 against 72,573 req/s"  # no empty_grpc phase: the target alone
    t = target([*phases, grpc("empty_grpc@8", 71_000), grpc("empty_grpc@1", 9_000)])
    assert t["met"] is False  # the criterion is the target's own: /predict's req/s, not the ceiling
    assert t["measured"] == (
        "17,766 against 72,573 req/s; fused gRPC 17,766 req/s = 25% of the empty grpc.aio server's 71,000 req/s at 8 "
        "workers (the ceiling of grpcio's asyncio server on this host)"
    )
    t = target([grpc("empty_grpc@8", 71_000)])  # a run narrowed to the ceiling
    assert t["met"] is None and t["measured"].startswith("not measured; the empty grpc.aio server's 71,000 req/s")


def test_default_workers_and_system_parsing():
    assert [serve_cli.default_workers(c) for c in (16, 6, 2, 1)] == [8, 4, 1, 1]
    systems = serve_cli.parse_systems("empty,fused@N,unfused@2,empty@1", 8)
    assert [s.key for s in systems] == ["empty@1", "empty@8", "fused@8", "unfused@2"]
    with pytest.raises(Exception, match="unknown system"):
        serve_cli.parse_systems("nginx@1", 8)


def test_merge_and_percentiles():
    lat = np.array([0.001, 0.002, 0.003], dtype=np.float64)
    part = {
        "sent": 3, "status": {200: 3}, "errors": {}, "events": [], "why": {}, "latency": lat.tobytes(),
        "service": b"", "first_send": 0.0, "last_done": 1.5, "backlog": 0,
        "warmup": {"sent": 1, "status": {200: 1}, "errors": {}},
    }  # fmt: skip
    m = merge([part, part], start_at=0.0, duration_s=1.0, rate=0.0)
    assert m["sent"] == 6 and m["status"] == {200: 6} and m["answered"] == 6
    assert m["req_per_s"] == pytest.approx(6 / 1.5)  # the window plus the drain
    assert percentiles(m["latency"])["p50"] == pytest.approx(2.0)


# ------------------------------------------------------------------------------------ real servers


@pytest.fixture
def empty_app(tmp_path):
    port = free_port()
    argv = [sys.executable, "-m", "uvicorn", "bench.serve.apps.empty:app", "--host", "127.0.0.1", "--port", str(port)]
    proc = ManagedProcess(f"empty:{port}", [*argv, "--no-access-log"], service_env(), REPO, tmp_path / "empty.log")
    try:
        proc.wait_http(f"http://127.0.0.1:{port}/health/ready", 30)
        yield port
    finally:
        proc.stop()
        dump_new_logs()


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("client", ["raw", "aiohttp"])
def test_loadgen_closed_and_open_loop_against_uvicorn(empty_app, client):
    if client == "aiohttp":
        pytest.importorskip("aiohttp")
    bodies = tuple(make_bodies(2, count=4))
    with ClientPool(2) as pool:
        spec = PhaseSpec("127.0.0.1", empty_app, "/predict", bodies, 6, 0.2, 0.6, client=client)
        ready = []
        r = pool.run(spec, on_ready=lambda: ready.append(True))
        assert ready == [True] and r["processes"] == 2
        assert r["errors"] == {} and r["sent"] > 50
        assert r["sent"] == r["answered"] == r["status"][200] == len(r["latency"])
        assert r["warmup"]["sent"] == r["warmup"]["status"][200] > 0
        # Open loop at 200 req/s for 0.6 s: slots at k/rate inside the window, every one sent and answered.
        spec = PhaseSpec("127.0.0.1", empty_app, "/predict", bodies, 4, 0.2, 0.6, rate=200.0, client=client)
        r = pool.run(spec)
        assert r["errors"] == {} and r["backlog"] == 0
        assert r["sent"] == r["status"][200] == len(r["latency"]) == len(r["service"]) == 120
        # From the due time is never shorter than from the send.
        assert np.percentile(r["latency"], 50) >= np.percentile(r["service"], 50) - 1e-6


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_quick_end_to_end_run_on_the_cpu(tmp_path):
    """empty@1, empty_grpc@1 and fusedserve unfused@1: closed loop at 1 and 4 connections (the empty gRPC server:
    its 1-row gRPC phase only), one open-loop rate, and the SIGTERM phase; every phase but the SIGTERM one must be
    clean. The SIGTERM phase's books must balance and the server must exit cleanly; whether the single-process
    service (uvicorn's shutdown closes connections whose request it has not read yet) loses requests there is the
    benchmark's finding, not this test's."""
    argv = [sys.executable, "-m", "bench.serve", "--quick", "--device", "cpu", "--out", str(tmp_path)]
    argv += ["--duration", "0.4", "--warmup", "0.1", "--time-budget", "60"]
    has_grpc = importlib.util.find_spec("grpc") is not None  # in the dependencies; the GPU host may lack the wheel
    if not has_grpc:
        argv += ["--v2", "binary"]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=80)
    out = proc.stdout + proc.stderr
    assert (tmp_path / "serve_cpu.md").is_file(), out
    results = json.loads((tmp_path / "serve_cpu.json").read_text())
    assert (tmp_path / "serve_cpu.png").is_file() or "matplotlib" in out
    phases = results["phases"]
    kinds = {(r["system"], r["kind"], r["connections"]) for r in phases}
    assert {("empty@1", "closed", 1), ("empty@1", "closed", 4), ("unfused@1", "closed", 1)} <= kinds, out
    assert any(r["kind"] == "open" for r in phases)
    for r in phases:
        if r["kind"] != "sigterm":
            assert r["ok"] and r["lost"] == 0, (r["system"], r["accounting"])
            assert r["sent"] == r["status"]["200"] > 0
    unfused = [r for r in phases if r["system"] == "unfused@1" and r["kind"] == "closed"]
    assert all(r["server"]["outcomes"]["ok"] == r["status"]["200"] for r in unfused)
    # The Open Inference Protocol phases: binary REST and gRPC with 256-row requests, gRPC with 1-row ones, each
    # answered in full (every request 200 / OK, the server's ok count agreeing) with 256 rows a request.
    v2 = {(r["protocol"], r["rows"]): r for r in unfused if r["protocol"] != "predict"}
    want = {("v2_binary", 256), ("v2_grpc", 256), ("v2_grpc", 1)} if has_grpc else {("v2_binary", 256)}
    assert set(v2) == want, out
    assert all(r["rows_per_s"] == r["req_per_s"] * r["rows"] > 0 for r in v2.values())
    assert all(r["server"]["forward_us"] > 0 and r["server"]["batch_rows"] >= 1 for r in unfused)
    # The gRPC ceiling: the empty grpc.aio server, 1-row ModelInfer at the gRPC phases' connections, and only that.
    ceiling = [(r["protocol"], r["rows"], r["connections"], r["ok"]) for r in phases if r["name"] == "empty_grpc"]
    assert ceiling == ([("v2_grpc", 1, 4, True)] if has_grpc else []), out
    (sig,) = [r for r in phases if r["kind"] == "sigterm"]
    errors = sig["errors"]
    assert sig["sent"] == sig["answered"] + errors.get("lost", 0) + errors.get("timeout", 0)
    assert set(sig["status"]) <= {"200", "503"}
    assert sig["exit"]["graceful"], sig["exit"]
    assert all(s["exit"]["graceful"] for s in results["servers"][:-1]), results["servers"]  # the last: SIGTERM phase
    md = (tmp_path / "serve_cpu.md").read_text()
    assert "## Targets (issue 18)" in md and "## SIGTERM in the middle of a phase" in md
    assert "## Open Inference Protocol (closed loop)" in md and "| unfused (v2_binary) | 1 | 256 |" in md
    assert proc.returncode == (1 if results["problems"] else 0), out
    assert all(p.startswith("unfused@1 sigterm") for p in results["problems"]), results["problems"]
    # a run with problems keeps its servers' logs beside its report (the run's temporary directory does not last)
    assert bool(sorted(tmp_path.glob("server-*.log"))) == bool(results["problems"]), out


@pytest.mark.slow
@pytest.mark.timeout(240)  # two bench runs of a server each; a loaded 2-core machine took 30 s to one's ready
def test_bench_api_key_reaches_a_server_with_keys_on(tmp_path):
    """fusedserve unfused@1 started with FUSEDSERVE_API_KEY (passed on from the bench's environment), its /predict,
    binary v2 and gRPC phases at one connection: with BENCH_API_KEY every request is answered 200; without it every
    one is refused 401 (gRPC UNAUTHENTICATED), the server counts them unauthorized, and the run fails."""
    key = "bench-key-5d1f0c2a"
    has_grpc = importlib.util.find_spec("grpc") is not None
    argv = [sys.executable, "-m", "bench.serve", "--quick", "--device", "cpu", "--systems", "unfused@1",
            "--connections", "1", "--no-open", "--no-sigterm", "--duration", "0.3", "--warmup", "0.1",
            "--time-budget", "80", "--v2", "binary,grpc" if has_grpc else "binary"]  # fmt: skip
    base = {k: v for k, v in service_env().items() if k not in ("BENCH_API_KEY", "FUSEDSERVE_API_KEYS_FILE")}
    runs = {}
    for name, extra in (("with", {"BENCH_API_KEY": key}), ("without", {})):
        out = tmp_path / name
        env = {**base, "FUSEDSERVE_API_KEY": key, **extra}
        proc = subprocess.run([*argv, "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=100)  # fmt: skip
        assert (out / "serve_cpu.json").is_file(), proc.stdout + proc.stderr
        runs[name] = (proc, json.loads((out / "serve_cpu.json").read_text())["phases"])
    protocols = {"predict", "v2_binary", "v2_grpc"} if has_grpc else {"predict", "v2_binary"}
    proc, phases = runs["with"]
    assert proc.returncode == 0 and {r["protocol"] for r in phases} == protocols, proc.stdout + proc.stderr
    for r in phases:
        assert r["ok"] and r["sent"] == r["status"]["200"] == r["server"]["outcomes"]["ok"] > 0, r["accounting"]
    proc, phases = runs["without"]
    assert proc.returncode == 1 and {r["protocol"] for r in phases} == protocols, proc.stdout + proc.stderr
    assert (tmp_path / "without" / "server-unfused-1.log").is_file() and not list((tmp_path / "with").glob("*.log"))
    for r in phases:
        assert not r["ok"] and r["sent"] == r["status"]["401"] > 0 and "200" not in r["status"], r["status"]
        assert r["server"]["outcomes"]["unauthorized"] == r["sent"], r["server"]["outcomes"]


def test_the_accounting_reads_every_outcome_the_service_counts():
    """bench/serve/accounting.py keeps its own copy of service/metrics.py's outcomes: a phase fails on any but ok and
    overloaded only if it sees them."""
    from service.metrics import OUTCOMES as SERVICE_OUTCOMES

    assert set(OUTCOMES) == set(SERVICE_OUTCOMES)


def test_phase_plan_and_open_loop_rates():
    from bench.serve.run import _open_rates, phase_list, pick_sigterm_system

    args = argparse.ArgumentParser()
    serve_cli.add_arguments(args)
    plan = serve_cli.resolve(args.parse_args(["--workers", "8"]))
    # The gRPC ceiling before fusedserve: a run short of time keeps it with fused@8's gRPC phases.
    assert [s.key for s in plan.systems][:6] == ["empty@1", "empty@8", "empty_grpc@1", "empty_grpc@8", "fused@1",
                                                 "fused@8"]  # fmt: skip
    assert plan.systems[-2].key == "eager@8"  # the optional eager app last: a run short of time loses it first
    assert all(not s.grpc_only for s in plan.open_systems)
    # empty_grpc: only 1-row gRPC phases at fused's gRPC connection counts, essential at N workers.
    for workers, prio in ((8, 1), (1, 2)):
        grpc_ceiling = phase_list(serve_cli.System("empty_grpc", workers), plan, None)
        assert [(p["protocol"], p["rows"], p["connections"], p["priority"]) for p in grpc_ceiling] == [
            ("v2_grpc", 1, 64, prio), ("v2_grpc", 1, 256, prio)
        ]  # fmt: skip
    # A run narrowed to single-row gRPC against /predict: --v2-rows 1 gives fused@8 each 1-row gRPC phase once.
    narrow = ["--workers", "8", "--systems", "empty_grpc@N,fused@N", "--v2", "grpc", "--v2-rows", "1", "--rows", "1"]
    narrow += ["--connections", "64,256", "--no-open", "--no-sigterm"]
    narrowed = serve_cli.resolve(args.parse_args(narrow))
    fused = phase_list(narrowed.systems[1], narrowed, pick_sigterm_system(narrowed))
    assert [(p.get("protocol", "predict"), p["rows"], p["connections"]) for p in fused] == [
        ("predict", 1, 64), ("predict", 1, 256), ("v2_grpc", 1, 64), ("v2_grpc", 1, 256)
    ]  # fmt: skip
    # Without gRPC phases the defaults leave it out, and asking for it is an error.
    assert not any(s.grpc_only for s in serve_cli.resolve(args.parse_args(["--v2", "binary"])).systems)
    with pytest.raises(SystemExit, match="empty_grpc runs only gRPC phases"):
        serve_cli.resolve(args.parse_args(["--v2", "none", "--systems", "empty_grpc@1,fused@1"]))
    sig = pick_sigterm_system(plan)
    assert sig.key == "fused@8"
    phases = phase_list(sig, plan, sig)
    assert phases[-1]["kind"] == "sigterm" and phases[-1]["connections"] == 256
    assert {p["connections"] for p in phases if p["priority"] == 1 and p["kind"] == "closed"} == {1, 64, 256}
    v2 = [(p["protocol"], p["rows"], p["connections"]) for p in phases if p.get("protocol", "predict") != "predict"]
    assert sorted(v2) == sorted(
        (proto, rows, c) for proto, rows in (("v2_binary", 256), ("v2_grpc", 256), ("v2_grpc", 1)) for c in (64, 256)
    )
    assert all(p["priority"] == 1 for p in phases if p.get("protocol", "predict") != "predict")
    assert all(p["priority"] == 2 for p in phase_list(serve_cli.System("fused", 1), plan, sig) if "protocol" in p)
    # auto: 25/50/75% of the empty route's peak at N, the same rates for every system...
    peaks = {"empty@8": 36_000.0, "fused@8": 31_000.0, "unfused@8": 2_400.0}
    assert _open_rates(plan, serve_cli.System("fused", 8), peaks) == [(9000.0, None), (18000.0, None), (27000.0, None)]
    # ...and a system too slow for all of them runs at 50 and 75% of its own peak instead.
    slow = _open_rates(plan, serve_cli.System("unfused", 8), peaks)
    assert [r for r, why in slow if why is None] == [1200.0, 1800.0]
    assert all("above 1.1x" in why for r, why in slow if r >= 9000)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_empty_grpc_server_answers_as_fusedserve_and_exits_0_on_sigterm(tmp_path):
    """The gRPC ceiling as `bench serve` runs it: ready through its own ServerReady probe, a Triton client's
    ModelInfer answered with fusedserve's outputs (1 row: logits FP32 [1, 10], label BYTES [1]), and SIGTERM to the
    parent stops every worker, exit 0. (tritonclient, in this process: the server's stubs stay in its own.)

    Two workers: one worker runs the same code (serve() forks `workers` alike, readiness counts them), and
    test_quick_end_to_end_run_on_the_cpu runs empty_grpc@1 through bench serve (one server fewer; issue 51)."""
    workers = 2
    tgrpc = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is not installed (the test extra)")
    port = free_port()
    argv = [sys.executable, "-m", "bench.serve.apps.empty_grpc", "--port", str(port), "--workers", str(workers)]
    proc = ManagedProcess(f"empty_grpc:{port}", argv, service_env(), REPO, tmp_path / "empty_grpc.log")
    try:
        probe = [sys.executable, "-m", "bench.serve.apps.empty_grpc", "--port", str(port), "--wait-ready", "20"]
        ready = subprocess.run(probe, cwd=REPO, env=service_env(), capture_output=True, text=True, timeout=40)
        assert ready.returncode == 0, ready.stdout + ready.stderr + proc.describe()
        client = tgrpc.InferenceServerClient(f"127.0.0.1:{port}")
        try:
            assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("digits-mlp")
            inp = tgrpc.InferInput("input", [1, 64], "FP32")
            inp.set_data_from_numpy(np.arange(64, dtype=np.float32).reshape(1, 64) % 17)
            answer = client.infer("digits-mlp", [inp], client_timeout=10.0)
        finally:
            client.close()
        logits = answer.as_numpy("logits")
        assert logits.dtype == np.float32 and logits.shape == (1, 10) and not logits.any()
        assert answer.as_numpy("label").tolist() == [b"0"]
        response = answer.get_response()
        assert (response.model_name, response.model_version) == ("digits-mlp", "1")
        proc.proc.send_signal(signal.SIGTERM)  # the parent alone, as bench serve stops a server
        assert proc.proc.wait(20) == 0, proc.describe()
        with pytest.raises(ProcessLookupError):  # no worker outlived it
            os.killpg(proc.proc.pid, 0)
        assert proc.log().count("serving on") == workers and f"{workers} worker(s) stopped" in proc.log()
    finally:
        proc.stop()


def test_fused_and_unfused_at_one_worker_count_run_together_and_take_turns():
    from bench.serve.run import interleave, pair_up, phase_list, pick_sigterm_system

    args = argparse.ArgumentParser()
    serve_cli.add_arguments(args)
    plan = serve_cli.resolve(args.parse_args(["--workers", "8"]))
    sig = pick_sigterm_system(plan)
    groups = pair_up([(s, phase_list(s, plan, sig)) for s in plan.systems])
    keys = [[s.key for s, _ in g] for g in groups]
    # Each pair at the first one's place; everything else alone, in the order given.
    assert keys == [["empty@1"], ["empty@8"], ["empty_grpc@1"], ["empty_grpc@8"], ["fused@1", "unfused@1"],
                    ["fused@8", "unfused@8"], ["eager@8"], ["eager@1"]]  # fmt: skip
    fused8, unfused8 = groups[5]
    order = interleave([fused8[1], unfused8[1]])
    # Every phase of both, once; shared phases back to back with the first mover alternating; SIGTERM last.
    assert sorted(map(repr, order)) == sorted(repr((m, p)) for m, ps in enumerate([fused8[1], unfused8[1]]) for p in ps)
    assert order[-1][0] == 0 and order[-1][1]["kind"] == "sigterm"
    shared = order[:-1]
    assert len(shared) == 2 * (len(fused8[1]) - 1) == 2 * len(unfused8[1])
    for i in range(0, len(shared), 2):
        (m1, p1), (m2, p2) = shared[i], shared[i + 1]
        assert {m1, m2} == {0, 1} and {**p1, "priority": 0} == {**p2, "priority": 0}  # v2: essential for fused
        assert m1 == (i // 2) % 2  # fused first, then unfused first, ...
    # A member alone keeps its own order.
    assert interleave([fused8[1]]) == [(0, p) for p in fused8[1]]
    # Rounds: the shared phases again and again (each repeat marked), still alternating; the SIGTERM phase once, last.
    three = interleave([fused8[1], unfused8[1]], rounds=3)
    assert len(three) == 3 * len(shared) + 1 and three[-1][1]["kind"] == "sigterm"
    assert [p.get("round", 0) for _, p in three[:-1]] == [r for r in range(3) for _ in shared]
    assert [m for m, _ in three[:-1]] == [(i // 2 + (i % 2)) % 2 for i in range(3 * len(shared))]


def test_fused_against_unfused_is_judged_on_the_median_of_the_rounds():
    def phase(name, rnd, req_s, forward):
        return {"system": f"{name}@1", "name": name, "workers": 1, "kind": "closed", "protocol": "predict", "rows": 1,
                "connections": 64, "round": rnd, "req_per_s": req_s, "rows_per_s": req_s, "ok": True,
                "server": {"forward_us": forward, "batch_rows": 8.0}}  # fmt: skip

    # Round 2 alone would read 0.80 (a slow window); the median of 1.05, 0.80 and 1.01 is 1.01.
    rounds = [(1050, 1000), (800, 1000), (1010, 1000)]
    phases = [
        p for r, (f, u) in enumerate(rounds) for p in (phase("fused", r, f, 40.0 + r), phase("unfused", r, u, 50.0))
    ]
    results = {"phases": phases}
    (pair,) = serve_report.fused_unfused_pairs(results)
    assert serve_report.pair_ratio(*pair) == (1.01, [1.05, 0.8, 1.01])
    table = "\n".join(serve_report.fused_unfused_table(results))
    assert "| 1 | predict | 1 | 64 | 1,010 | 1,000 | 1.010 (0.80-1.05) | 41.0 / 50.0 | 8.0 / 8.0 |" in table
    # One round at 0.80 is a miss.
    single = serve_report.fused_unfused_pairs({"phases": phases[2:4]})
    assert serve_report.pair_ratio(*single[0])[0] == 0.8
