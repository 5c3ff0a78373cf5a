"""bench/serve/perf_analyzer.py: perf_analyzer's CSV and summary parsed from canned output (a real run of perf_analyzer
2.41 against fusedserve), the checks of the server's counts, a run's plumbing with a stand-in binary, and, where the
real perf_analyzer runs (the GPU host: its wheel needs glibc 2.38), a real run against the real service."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from bench.serve import perf_analyzer as pa

from .server import REPO, free_port, running_servers

# `perf_analyzer ... -i http -b 1 --concurrency-range 1:4:3 ... -f` against fusedserve unfused on a loaded CPU host.
CSV = """\
Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,Server Compute Input,\
Server Compute Infer,Server Compute Output,Client Recv,p50 latency,p90 latency,p95 latency,p99 latency
4,342.789,54,7092,2660,51,503,1342,0,11677,16660,18863,28982
1,1291.79,45,256,115,14,120,219,0,617,813,880,5125
"""
STDOUT = """\
*** Measurement Settings ***
  Batch size: 1
  Service Kind: Triton
  Using "count_windows" mode for stabilization

Request concurrency: 1
  Client: 
    Request count: 3896
    Throughput: 1291.79 infer/sec
    p99 latency: 5125 usec
    Avg HTTP time: 769 usec (send/recv 45 usec + response wait 724 usec)
  Server: 
    Inference count: 3896
    Execution count: 3896
    Successful request count: 3895
    Avg request latency: 440 usec (overhead 0 usec + queue 115 usec + compute input 14 usec + compute infer 120 \
usec + compute output 219 usec)

Request concurrency: 4
Failed to obtain stable measurement within 10 measurement windows for concurrency 4. Please try to increase the \
--measurement-request-count.
Inferences/Second vs. Client Average Batch Latency
Concurrency: 1, throughput: 1291.79 infer/sec, latency 771 usec
"""  # noqa: W291 (perf_analyzer's own trailing spaces)


def test_csv_rows_in_report_keys():
    rows = pa.parse_csv(CSV, rows=256)
    assert [r["concurrency"] for r in rows] == [1, 4]
    one = rows[0]
    assert one["infer_per_s"] == 1291.79 and one["req_per_s"] == pytest.approx(1291.79 / 256)
    assert (one["server_queue_us"], one["server_compute_infer_us"], one["network_us"]) == (115, 120, 256)
    assert (one["p50_us"], one["p99_us"], one["client_send_us"], one["client_recv_us"]) == (617, 5125, 45, 0)
    assert pa.parse_csv("", rows=1) == []


def test_summary_counts_and_unstable_levels():
    levels = pa.parse_stdout(STDOUT)
    assert levels[1] == {"client_requests": 3896, "server_inferences": 3896, "server_executions": 3896,
                         "server_requests": 3895}  # fmt: skip
    assert 4 not in levels and levels["unstable"] == [4]


def _stat(requests: int, failed: int, rows: int, batches: int, ns: int = 1000) -> dict:
    d = {"count": requests, "ns": ns * requests}
    return {
        "inference_count": rows, "execution_count": batches,
        "inference_stats": {"success": d, "fail": {"count": failed, "ns": 5 * failed}, "queue": d,
                            "compute_input": d, "compute_infer": d, "compute_output": d},
    }  # fmt: skip


def test_server_counts_are_checked():
    before = _stat(10, 0, 10 * 256, 10)
    d = pa.stats_delta(before, _stat(110, 0, 110 * 256, 40))
    assert d["requests"] == 100 and d["failed"] == 0 and d["rows"] == 100 * 256 and d["batches"] == 30
    assert d["queue_us"] == 1.0
    run = {"rows": 256, "concurrency": 4, "server": d, "window": {"client_requests": 90, "server_requests": 93}}
    assert pa.check(run) == []
    run["window"]["server_requests"] = 95  # 5 apart, with 4 in flight and 1% of 90 under 1
    run["server"] = pa.stats_delta(before, _stat(110, 2, 110 * 256 - 3, 40))
    problems = pa.check(run)
    assert len(problems) == 3, problems
    assert "failed 2 requests" in problems[0] and "rows" in problems[1] and "90 requests by the client" in problems[2]
    assert pa.stats_delta(before, before)["queue_us"] is None  # no request: no mean


def test_command_asks_for_what_fusedserve_answers(tmp_path):
    argv = pa.command("pa", "h:1", "grpc", 256, 64, tmp_path / "x.csv", extra=("-s", "20"))
    assert argv[:11] == ["pa", "-m", "digits-mlp", "-u", "h:1", "-i", "grpc", "-b", "256", "--concurrency-range", "64"]
    text = " ".join(argv)
    for flag in ("--async", "--measurement-mode count_windows", "--input-data zero", f"-f {tmp_path / 'x.csv'}"):
        assert flag in text
    assert argv[-2:] == ["-s", "20"]


FAKE = """\
#!{python}
import sys
args = sys.argv[1:]
if args == ["--version"]:
    print("Perf Analyzer Version 9.9.9 (fake)")
    sys.exit(0)
conc = args[args.index("--concurrency-range") + 1]
open(args[args.index("-f") + 1], "w").write({csv!r}.replace("\\n1,", "\\n" + conc + ",", 1) if {ok} else "")
print({stdout!r}.replace("concurrency: 1\\n", "concurrency: " + conc + "\\n"))
sys.exit(0 if {ok} else 1)
"""


def _fake(tmp_path, ok: bool = True) -> str:
    path = tmp_path / "perf_analyzer"
    csv = "Concurrency,Inferences/Second,p99 latency\n1,1000,900\n"
    stdout = "Request concurrency: 1\n  Client: \n    Request count: 50\n  Server: \n    Inference count: 50\n" \
             "    Successful request count: 50\n"  # fmt: skip
    path.write_text(FAKE.format(python=sys.executable, csv=csv, stdout=stdout, ok=ok))
    path.chmod(0o755)
    return str(path)


def test_a_run_with_a_stand_in_binary(tmp_path, monkeypatch):
    """run(): one perf_analyzer per level, the server's statistics read around each, a row too large skipped."""
    reads = iter(range(100))

    def stats(http, model=pa.MODEL):
        n = next(reads) * 50
        return _stat(n, 0, n, n)

    monkeypatch.setattr(pa, "server_stats", stats)
    monkeypatch.setattr(pa, "server_config", lambda http, model=pa.MODEL: {"max_batch_size": 1})
    binary = _fake(tmp_path)
    assert pa.version(binary) == "Perf Analyzer Version 9.9.9 (fake)"
    results = pa.run("h:1", None, tmp_path / "work", binary, rows=(1, 2), concurrency=(1, 4))
    assert [(r["protocol"], r["rows"], r["concurrency"], r["status"]) for r in results["runs"]] == [
        ("http", 1, 1, "ok"), ("http", 1, 4, "ok"),
    ]  # fmt: skip
    assert results["runs"][1]["csv"]["concurrency"] == 4 and results["runs"][1]["csv"]["req_per_s"] == 1000
    assert results["runs"][1]["window"] == {"client_requests": 50, "server_inferences": 50, "server_requests": 50}
    assert results["runs"][0]["server"]["requests"] == 50 and results["problems"] == []
    assert any("rows=2" in s and "max_batch_size 1" in s for s in results["skipped"])
    assert any(s.startswith("grpc") and "no gRPC address" in s for s in results["skipped"])
    lines = pa.markdown(results)
    assert "## perf_analyzer" in lines and any(line.startswith("| http | 1 | 4 | 1000 |") for line in lines)
    json.dumps(results)  # the report's .json holds it as it is

    (tmp_path / "failing").mkdir()
    failing = pa.run(
        "h:1", None, tmp_path / "work2", _fake(tmp_path / "failing", ok=False), rows=(1,), concurrency=(1,)
    )
    (r,) = failing["runs"]
    assert r["status"] == "failed" and failing["problems"] and "exit 1" in r["error"]


def test_a_run_killed_at_its_timeout_is_a_failure_and_nothing_else(tmp_path, monkeypatch):
    """Killed, it leaves requests in flight that the server answers (or fails) after the second read: the counts
    would disagree for that reason alone, so only the failure is reported."""
    reads = iter([_stat(0, 0, 0, 0), _stat(10, 1, 11, 11)])
    monkeypatch.setattr(pa, "server_stats", lambda http, model=pa.MODEL: next(reads))
    slow = tmp_path / "perf_analyzer"
    slow.write_text(f"#!{sys.executable}\nimport time\nprint('Request concurrency: 1', flush=True)\ntime.sleep(30)\n")
    slow.chmod(0o755)
    r = pa.run_one(str(slow), "h:1", "h:1", "http", 1, 1, tmp_path, timeout_s=1.0)
    assert r["status"] == "failed" and r["rc"] is None and "killed after 1 s" in r["error"]
    assert r["problems"] == [f"perf_analyzer failed: {r['error']}"]


def test_without_a_binary_that_runs_nothing_runs(tmp_path):
    # The wheel's console script exits 0 whatever its binary did: an error on a 0 exit is no version.
    wrapper = tmp_path / "wrapper"
    wrapper.write_text("#!/bin/sh\necho 'perf_analyzer: error while loading shared libraries: libb64.so.0d' >&2\n")
    wrapper.chmod(0o755)
    assert pa.version(str(wrapper)) is None
    missing = pa.run("h:1", None, tmp_path, binary=str(tmp_path / "nope"))
    assert missing["runs"] == [] and "does not run here" in missing["skipped"][0]
    assert pa.markdown(missing)[-1].startswith("Not run:")
    assert pa.markdown(None) == []


# ------------------------------------------------------------------------------------ the real perf_analyzer


@pytest.mark.slow
def test_real_perf_analyzer_against_the_service(tmp_path):
    binary = pa.find()
    if not binary or not pa.version(binary):
        pytest.skip(f"{pa.BINARY} is not installed or does not run here (its wheel needs glibc 2.38: the GPU host)")
    grpc_port = free_port()
    env = {"dtype": "float32", "grpc_port": grpc_port, "max_batch_size": 64}
    (tmp_path / "logs").mkdir()
    with running_servers({"s": ("unfused", env)}, tmp_path / "logs") as servers:
        http = servers["s"].url.removeprefix("http://")
        results = pa.run(http, f"127.0.0.1:{grpc_port}", tmp_path / "runs", binary, rows=(1, 8), concurrency=(2,),
                         request_count=50, extra=("-s", "50"))  # fmt: skip
    print(textwrap.indent("\n".join(pa.markdown(results)), "  "))
    assert len(results["runs"]) == 4 and results["problems"] == [], results["problems"]
    for r in results["runs"]:
        assert r["server"]["failed"] == 0 and r["server"]["requests"] > 0, r
        assert r["status"] in ("ok", "unstable"), r  # unstable: perf_analyzer's own verdict on a busy host


# ------------------------------------------------------------------------------------ unstable levels, bench serve

# A stand-in perf_analyzer that answers --version, sends its requests to the real server (binary v2, zero-filled, as
# the real one does with --input-data zero) and reports them as perf_analyzer does: -f CSV and the summary on stdout.
# A level of concurrency 4 is "unstable" in windows under 4000 requests (4x bench serve's 1000), so the runner's
# retry is what measures it.
FAKE_SERVING = """\
#!{python}
import json, sys, urllib.request
args = sys.argv[1:]
if args == ["--version"]:
    print("Perf Analyzer Version 9.9.9 (fake)")
    sys.exit(0)
flag = lambda name: args[args.index(name) + 1]
model, url, rows, conc = flag("-m"), flag("-u"), int(flag("-b")), int(flag("--concurrency-range"))
count = int(flag("--measurement-request-count"))
with open({log!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
if conc == 4 and count < 4000:
    print("Request concurrency: 4")
    print("Failed to obtain stable measurement within 10 measurement windows for concurrency 4. Please try to "
          "increase the --measurement-request-count.")
    sys.exit(1)
meta = json.load(urllib.request.urlopen(f"http://{{url}}/v2/models/{{model}}"))
shape = [rows, *meta["inputs"][0]["shape"][1:]]
size = 4
for d in shape:
    size *= d
head = json.dumps({{"inputs": [{{"name": "input", "datatype": "FP32", "shape": shape,
                                  "parameters": {{"binary_data_size": size}}}}]}}).encode()
sent = 3
for _ in range(sent):
    req = urllib.request.Request(f"http://{{url}}/v2/models/{{model}}/infer", data=head + bytes(size),
                                 headers={{"Inference-Header-Content-Length": str(len(head))}})
    assert urllib.request.urlopen(req).status == 200
csv = f"Concurrency,Inferences/Second,p50 latency,p99 latency\\n{{conc}},{{sent * rows}},800,900\\n"
open(flag("-f"), "w").write(csv)
print(f"Request concurrency: {{conc}}\\n  Client: \\n    Request count: {{sent}}\\n  Server: \\n"
      f"    Inference count: {{sent * rows}}\\n    Successful request count: {{sent}}\\n")
"""


def _fake_serving(folder, log) -> str:
    folder.mkdir(exist_ok=True)
    path = folder / "perf_analyzer"
    path.write_text(FAKE_SERVING.format(python=sys.executable, log=str(log)))
    path.chmod(0o755)
    return str(path)


def test_an_unstable_level_is_measured_again_in_longer_windows(tmp_path, monkeypatch):
    reads = iter(range(100))

    def stats(http, model=pa.MODEL):
        n = next(reads) * 3
        return _stat(n, 0, n, n)

    monkeypatch.setattr(pa, "server_stats", stats)
    monkeypatch.setattr(pa, "server_config", lambda http, model=pa.MODEL: {"max_batch_size": 8})
    calls = []

    def run_one(binary, http, url, protocol, rows, conc, work, model, count, timeout_s, extra, tag=""):
        calls.append((conc, count, extra, tag))
        unstable = conc == 4 and (count < 200 or "-r" not in extra)
        return {"protocol": protocol, "rows": rows, "concurrency": conc, "command": f"pa {count}", "seconds": 1.0,
                "window": {}, "csv": None if unstable else {"req_per_s": 1.0},
                "server": {"requests": 3, "failed": 0, "rows": 3, "batches": 3},
                "status": "unstable" if unstable else "ok", "problems": []}  # fmt: skip

    monkeypatch.setattr(pa, "run_one", run_one)
    results = pa.run("h:1", None, tmp_path, _fake(tmp_path), rows=(1,), concurrency=(1, 4), request_count=100)
    assert calls == [(1, 100, (), ""), (4, 100, (), ""), (4, 400, ("-r", "20"), "_retry")]
    one, four = results["runs"]
    assert "attempts" not in one and four["status"] == "ok" and four["attempts"][0]["status"] == "unstable"
    assert "again in 400-request windows" in four["retry"]
    assert any("retried in longer windows" in line for line in pa.markdown(results))
    # No time for a 4x retry: reported unstable, and why.
    calls.clear()
    late = pa.retry_unstable({**four, "status": "unstable", "seconds": 10.0}, "pa", "h:1", "h:1", tmp_path,
                             pa.MODEL, 100, time.monotonic() + 5.0, ())  # fmt: skip
    assert late["status"] == "unstable" and "not retried" in late["retry"] and calls == []


def test_candidates_prefer_one_that_runs(tmp_path, monkeypatch):
    """A venv's perf_analyzer whose binary does not run here (glibc) yields to a working one on the PATH."""
    broken = tmp_path / "venv" / "perf_analyzer"
    broken.parent.mkdir()
    broken.write_text("#!/bin/sh\nexit 1\n")
    broken.chmod(0o755)
    working = _fake(tmp_path)
    monkeypatch.setattr(pa, "candidates", lambda: [str(broken), working])
    assert pa.find() == working
    monkeypatch.setattr(pa, "candidates", lambda: [str(broken)])
    assert pa.find() == str(broken)  # none runs: the first, so the report says it does not run


def test_bench_serve_finds_perf_analyzer_on_the_path(tmp_path, monkeypatch):
    """Without --perf-analyzer the plan names no binary and the run takes perf_analyzer.find()'s (`binary or find()`
    in perf_analyzer.run): a stand-in on the PATH, before the venv's own, which needs glibc 2.38. From there a run is
    the same as with the flag, which the test below runs in full (one bench run fewer: ~20 CPU-s; issue 51)."""
    from bench.serve import cli as serve_cli

    binary = _fake_serving(tmp_path / "bin", tmp_path / "pa_calls.jsonl")
    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    assert serve_cli.resolve(p.parse_args(["--quick", "--device", "cpu"])).perf_analyzer is None
    assert serve_cli.resolve(p.parse_args(["--perf-analyzer", binary])).perf_analyzer == binary
    assert pa.find() != binary  # not on the PATH yet
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    assert pa.find() == binary


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_bench_serve_runs_perf_analyzer_phases(tmp_path):
    """`bench serve` with a (stand-in) perf_analyzer given with --perf-analyzer (found on the PATH: the test above): it
    runs against the server the run started (unfused@1 in this smoke run: fused@N where the run has it), once per
    level, the level that did not settle again in longer windows, and its rows go into serve_cpu.md beside the
    server's counts, which agree with what the stand-in sent."""
    log = tmp_path / "pa_calls.jsonl"
    binary = _fake_serving(tmp_path / "bin", log)
    argv = [sys.executable, "-m", "bench.serve", "--quick", "--device", "cpu", "--out", str(tmp_path / "out"),
            "--systems", "unfused@1", "--v2", "binary", "--v2-rows", "4", "--connections", "1,4", "--no-open",
            "--duration", "0.3", "--warmup", "0.1", "--time-budget", "120", "--perf-analyzer", binary]  # fmt: skip
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=140)  # not on the PATH: the flag
    out = proc.stdout + proc.stderr
    results = json.loads((tmp_path / "out" / "serve_cpu.json").read_text())
    got = results["perf_analyzer"]
    assert got["version"] == "Perf Analyzer Version 9.9.9 (fake)" and got["system"] == "unfused@1", out
    levels = [(r["protocol"], r["rows"], r["concurrency"], r["status"]) for r in got["runs"]]
    assert levels == [("http", b, c, "ok") for b in (1, 4) for c in (1, 4)], out
    for r in got["runs"]:
        assert r["server"]["requests"] == 3 == r["window"]["client_requests"] and r["server"]["failed"] == 0, r
        assert r["server"]["rows"] == 3 * r["rows"] and r["problems"] == [], r
        assert ("attempts" in r) == (r["concurrency"] == 4)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 6 and all(c[c.index("-m") + 1] == "digits-mlp" for c in calls)
    assert sum("-r" in c for c in calls) == 2  # the retries of the two levels at concurrency 4
    md = (tmp_path / "out" / "serve_cpu.md").read_text()
    assert "## perf_analyzer" in md and "(unfused@1, `bench serve`'s)" in md
    assert "| http | 4 | 4 | 3 | 12 |" in md and "| 3 / 3 | 3, 0, 4.0 |" in md and "retried in longer windows" in md
    assert got["problems"] == [] and not [p for p in results["problems"] if "perf_analyzer" in p], results["problems"]
