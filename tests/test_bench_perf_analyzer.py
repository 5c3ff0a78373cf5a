"""bench/serve/perf_analyzer.py: perf_analyzer's CSV and summary parsed from canned output (a real run of perf_analyzer
2.41 against fusedserve), the checks of the server's counts, a run's plumbing with a stand-in binary, and, where the
real perf_analyzer runs (the GPU host: its wheel needs glibc 2.38), a real run against the real service."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from bench.serve import perf_analyzer as pa

from .server import free_port, running_servers

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
