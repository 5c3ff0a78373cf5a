"""`fusedserve bench soak` on the CPU, briefly: the real server under 8 s of good, bad, oversized, slow and
disconnecting clients; nothing lost, memory sampled, the report written. The GPU run (minutes) is the lead's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_argument_module_imports_no_torch_or_numpy():
    code = "import sys, bench.soak.cli; print('torch' in sys.modules or 'numpy' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_quick_soak_on_the_cpu_loses_nothing(tmp_path):
    argv = [sys.executable, "-m", "fusedserve", "bench", "soak", "--quick", "--device", "cpu", "--mode", "unfused"]
    run = subprocess.run([*argv, "--out", str(tmp_path)], capture_output=True, text=True, timeout=170)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    doc = json.loads((tmp_path / "soak_cpu.json").read_text())
    assert (tmp_path / "soak_cpu.md").is_file()
    assert doc["passed"] and not doc["problems"], doc["problems"]
    counts = doc["client_outcomes"]
    assert not [k for k in counts if k.startswith("lost:")], counts
    assert counts.get("good:200", 0) > 100 and counts.get("oversized:413", 0) > 0, counts
    assert counts.get("bad:400", 0) > 0 and counts.get("bad:422", 0) > 0, counts
    assert counts.get("slow:408", 0) > 0, counts  # cut by the 2 s header timeout within the 8 s
    assert any(k.startswith("disconnect:") for k in counts), counts
    server = doc["server_outcomes"]
    assert server["ok"] >= counts["good:200"] and server["too_large"] >= counts["oversized:413"], (server, counts)
    assert server["error"] == 0
    assert {"rss_mb:fs-frontend-0", "rss_mb:fs-engine-0"} <= set(doc["memory"]), doc["memory"]
    assert len(doc["samples"]) >= 5
