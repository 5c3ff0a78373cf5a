"""Issue 37: a test draws the same inputs in every run, so a failure on a rare input can be replayed.

Each check runs pytest in a subprocess on a tiny test file in a temporary directory, with tests/seeding.py loaded
as a plugin (`-p tests.seeding`), and compares what the tests printed across runs with different PYTHONHASHSEED.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from tests.seeding import SEED_ENV, seed_for

ROOT = Path(__file__).resolve().parent.parent

TINY = """
import random

import numpy as np
import pytest
import torch

DRAWN = {}


@pytest.fixture(scope="module")
def shared():
    return torch.rand(2).tolist()


def show(name, shared=None):
    print(f"DRAW {name} torch={torch.rand(3).tolist()} numpy={np.random.rand(2).tolist()} "
          f"random={random.random()} shared={shared}")


def test_plain():
    show("test_plain")


@pytest.mark.parametrize("n", [1, 2])
def test_param(n, shared):
    show(f"test_param[{n}]", shared)


def test_fails(shared):
    show("test_fails", shared)
    assert False, "on purpose"
"""


def run_tiny(tmp_path: Path, *args: str, hashseed: str, seed: str | None = None) -> subprocess.CompletedProcess:
    (tmp_path / "test_tiny.py").write_text(TINY)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {k: v for k, v in os.environ.items() if k != SEED_ENV}
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env.update(PYTHONHASHSEED=hashseed, PYTHONPATH=path, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    if seed is not None:
        env[SEED_ENV] = seed
    cmd = [sys.executable, "-m", "pytest", "-p", "tests.seeding", "-p", "no:cacheprovider", "-s"]
    cmd += ["-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path), *args]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def draws(out: str) -> dict[str, str]:
    return dict(re.findall(r"DRAW (\S+) (.*)$", out, re.M))


@pytest.mark.timeout(240)
def test_two_runs_of_the_same_test_draw_the_same_inputs_whatever_the_hash_salt(tmp_path):
    first = run_tiny(tmp_path, "test_tiny.py", hashseed="1")
    second = run_tiny(tmp_path, "test_tiny.py", hashseed="2")
    assert first.returncode == 1 and "1 failed, 3 passed" in first.stdout, first.stdout + first.stderr
    a, b = draws(first.stdout), draws(second.stdout)
    assert set(a) == {"test_plain", "test_param[1]", "test_param[2]", "test_fails"}
    assert a == b
    # Different tests draw different inputs, and the module-scoped fixture is the same whichever test made it.
    assert len({v.split(" numpy=")[0] for v in a.values()}) == 4
    assert len({v.split(" shared=")[1] for k, v in a.items() if k != "test_plain"}) == 1

    # Run alone (another order: the shared fixture is made for this test, not before it), the test draws the same.
    alone = run_tiny(tmp_path, "test_tiny.py::test_param[2]", hashseed="3")
    assert draws(alone.stdout) == {"test_param[2]": a["test_param[2]"]}

    # The failure names its seed and the command that replays it; that seed is the crc32 of the test's id.
    seed = zlib.crc32(b"test_tiny.py::test_fails") & 0x7FFFFFFF
    assert f"seed: {seed}; rerun with {SEED_ENV}={seed} python -m pytest test_tiny.py::test_fails" in first.stdout
    assert "test seeds: crc32 of each test's id" in first.stdout  # the header says how seeds are chosen

    # FUSEDSERVE_TEST_SEED gives any test that seed: test_plain then draws what test_fails drew.
    replay = run_tiny(tmp_path, "test_tiny.py::test_plain", hashseed="4", seed=str(seed))
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert draws(replay.stdout)["test_plain"].split(" shared=")[0] == a["test_fails"].split(" shared=")[0]


def test_seed_is_the_crc32_of_the_id_and_the_override_wins(monkeypatch):
    monkeypatch.delenv(SEED_ENV, raising=False)
    nodeid = "tests/test_kernels_mlp.py::test_x[torch.float16-3]"
    assert seed_for(nodeid) == zlib.crc32(nodeid.encode()) & 0x7FFFFFFF
    assert seed_for(nodeid) != seed_for(nodeid + "x")
    monkeypatch.setenv(SEED_ENV, "12345")
    assert seed_for(nodeid) == seed_for("anything else") == 12345
    monkeypatch.setenv(SEED_ENV, "nope")
    with pytest.raises(pytest.UsageError, match=SEED_ENV):
        seed_for(nodeid)
