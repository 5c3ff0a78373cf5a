"""How `fusedserve serve` starts (service/supervisor.py): the supervisor resolves the device without importing torch
where the host has no GPU driver (service/backend.py's device_type), engine 0 reads the model and hands its
ModelInfo over, and a model the loader refuses is reported by `serve` as it always was (exit 2, the loader's words,
no traceback, no process left behind).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from service import backend
from tests.server import free_port

REPO = Path(__file__).resolve().parents[1]


def test_cpu_and_auto_without_a_driver_need_no_torch(monkeypatch, tmp_path):
    def no_torch(name):
        raise AssertionError(f"resolve_device({name!r}) imported torch")

    monkeypatch.setattr(backend, "resolve_device", no_torch)
    monkeypatch.setattr(backend, "GPU_DRIVER_PATHS", (str(tmp_path / "nvidiactl"), str(tmp_path / "kfd")))
    assert backend.device_type("cpu") == "cpu"
    assert backend.device_type("auto") == "cpu"


def test_a_driver_or_an_explicit_device_asks_torch(monkeypatch, tmp_path):
    driver = tmp_path / "nvidiactl"
    driver.write_text("")
    asked = []

    class Found:
        type = "cuda"

    def resolve(name):
        asked.append(name)
        return Found()

    monkeypatch.setattr(backend, "resolve_device", resolve)
    monkeypatch.setattr(backend, "GPU_DRIVER_PATHS", (str(driver),))
    assert backend.device_type("auto") == "cuda"
    assert backend.device_type("cuda") == "cuda"  # an explicit cuda is checked by torch: no silent CPU fallback
    assert asked == ["auto", "cuda"]


# The supervisor's start as far as its processes, in a fresh interpreter (this one has torch imported by other tests):
# _run replaced by a report of what the supervisor process imported by then.
_UP_TO_RUN = """
import sys
from service import backend, supervisor
backend.GPU_DRIVER_PATHS = ("/nonexistent/nvidiactl",)
supervisor.Supervisor._run = lambda self, devices, workers, run_dir: print("torch imported:", "torch" in sys.modules,
                                                                          "devices:", devices) or 0
from service.cli import main
sys.exit(main(["serve", "--port", sys.argv[1], "--no-warmup", "--workers", "1"]))
"""


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FUSEDSERVE_")}
    # the repository first, then what the caller's path held (the GPU host's wheels live in a directory of their own)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return env


def test_the_supervisor_starts_its_processes_without_torch(tmp_path):
    argv = [sys.executable, "-c", _UP_TO_RUN, str(free_port())]
    res = subprocess.run(argv, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "torch imported: False devices: [None]" in res.stdout, (res.stdout, res.stderr)


@pytest.mark.timeout(120)
def test_a_refused_model_is_reported_by_serve_and_leaves_no_process(tmp_path):
    model = tmp_path / "broken"
    model.mkdir()
    (model / "config.json").write_text('{"name": "broken", "layers": []}')
    argv = [sys.executable, "-m", "fusedserve", "serve", "--model", str(model), "--device", "cpu",
            "--port", str(free_port()), "--no-warmup", "--workers", "1"]  # fmt: skip
    res = subprocess.run(argv, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=100)
    assert res.returncode == 2, res.stderr
    err = res.stderr
    assert f"fusedserve: cannot serve: {model}/config.json: " in err, err
    assert "Traceback" not in err and "failed to start" not in err, err
    # The engine that read it exited, and nothing else was started: no front end line, no banner.
    assert "front end 0" not in err and "fusedserve ready" not in err, err


@pytest.mark.timeout(120)
def test_sigterm_while_engine_0_reads_the_model_stops_cleanly(tmp_path):
    """A stop that comes before the front ends exist (engine 0 still importing torch and reading the model): exit 0,
    the engine stopped with it."""
    import signal
    import time

    from bench.local_server import children

    argv = [
        sys.executable,
        "-m",
        "fusedserve",
        "serve",
        "--device",
        "cpu",
        "--port",
        str(free_port()),
        "--workers",
        "1",
    ]
    proc = subprocess.Popen(argv, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while "fs-engine-0" not in (kids := children(proc.pid)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "slow"
            time.sleep(0.02)
        # Engine 0 is importing torch (~2.5 s here) before it reads the model; no front end exists before that.
        early = not any(name.startswith("fs-frontend") for name in kids)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "fusedserve stopped (exit 0)" in out and "Traceback" not in out, out
    if early:  # the stop came first: no front end was started after it
        assert "front end 0" not in out, out
    engine = kids["fs-engine-0"]
    assert not Path(f"/proc/{engine}").exists() or "fs-engine" not in Path(f"/proc/{engine}/comm").read_text()


@pytest.mark.timeout(180)
@pytest.mark.cpu_interpreter
def test_sigterm_while_the_engine_warms_up_stops_at_once(tmp_path):
    """A stop during the warm-up (Triton's interpreter running a ResNet stem at 224x224 on the CPU, seconds a step) is
    not held to the warm-up's end and the grace: nothing is served before ready, so the engine exits at once and the
    front end skips its drain delay (its health check read 503 all along). Exit 0, well inside the 20 s drain delay
    set here; before, the engine warmed on and was killed after the grace, exit 1."""
    import json
    import signal
    import time
    import urllib.error
    import urllib.request

    subprocess.run([sys.executable, "tools/build_resnet.py", "resnet-stem", "--out", str(tmp_path)], cwd=REPO,
                   env=_env(), check=True, capture_output=True)  # fmt: skip
    port = free_port()
    argv = [sys.executable, "-m", "fusedserve", "serve", "--model", str(tmp_path / "resnet-stem.onnx"), "--device",
            "cpu", "--port", str(port), "--workers", "1"]  # fmt: skip
    env = _env() | {"FUSEDSERVE_DRAIN_DELAY_S": "20", "FUSEDSERVE_LOG_LEVEL": "info"}
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, state = time.monotonic() + 90, None
        while state != "warming":
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else state
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health/ready", timeout=2)
                state = "ready"  # 200: the warm-up ended before the test saw it (not expected at seconds a step)
            except urllib.error.HTTPError as e:
                state = json.loads(e.read()).get("status")
            except OSError:
                pass  # not listening yet
            assert state != "ready", "the warm-up ended before a stop could come during it"
            time.sleep(0.1)
        t = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - t
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "stopping before ready" in out and "fusedserve stopped (exit 0)" in out, out
    assert "did not stop in time" not in out and "Traceback" not in out, out
    assert took < 15, f"{took:.1f} s to stop: a drain delay or the warm-up's end waited for\n{out}"


@pytest.mark.timeout(180)
def test_sighups_to_the_group_during_the_start_neither_kill_a_child_nor_stop_the_service():
    """SIGHUP to the service's process group (a terminal's hangup, `kill -HUP -PGID`) every 0.25 s from 1.5 s after the
    start until ready: each is a reload for the supervisor, and a child still starting (its interpreter importing
    torch, before it ignores SIGHUP) holds it blocked instead of dying of it (processes.signals_held_for_children).
    Before, the first one to reach engine 0 ended it and the service stopped before it had read the model."""
    import contextlib
    import signal
    import time
    import urllib.request

    port = free_port()
    argv = [sys.executable, "-m", "fusedserve", "serve", "--device", "cpu", "--port", str(port), "--workers", "1"]
    proc = subprocess.Popen(argv, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    sent, ready = 0, False
    try:
        time.sleep(1.5)  # the supervisor's own handler is set by then (before it, SIGHUP ends any process)
        deadline = time.monotonic() + 90
        while not ready and proc.poll() is None and time.monotonic() < deadline:
            os.killpg(proc.pid, signal.SIGHUP)
            sent += 1
            time.sleep(0.25)
            with contextlib.suppress(OSError):  # not listening yet, or 503
                ready = urllib.request.urlopen(f"http://127.0.0.1:{port}/health/ready", timeout=1).status == 200
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert ready and sent >= 4, (sent, out)
    assert proc.returncode == 0 and "fusedserve stopped (exit 0)" in out, out
    assert " ERROR " not in out and "Traceback" not in out, out


def test_a_childs_end_is_named_as_a_code_or_a_signal():
    from service.supervisor import _exit_status

    assert _exit_status(3) == "code 3" and _exit_status(None) == "code None"
    assert _exit_status(-9) == "signal SIGKILL" and _exit_status(-1) == "signal SIGHUP"


def _any_child(pid: int) -> bool:
    """Whether the process `pid` has a child yet, whatever its name (a spawned child is named only in child_setup)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    return True
            except (OSError, ValueError, IndexError):
                continue
    return False


@pytest.mark.timeout(120)
def test_ctrl_c_to_the_group_as_engine_0_starts_stops_cleanly():
    """Ctrl-C (SIGINT to the process group) the moment engine 0 exists, while its interpreter starts and imports
    torch: the supervisor stops the service, exit 0, and the engine, which ignores SIGINT from its start, prints no
    KeyboardInterrupt traceback (before, it did: Python unblocks SIGINT in a new interpreter)."""
    import signal
    import time

    port = free_port()
    argv = [sys.executable, "-m", "fusedserve", "serve", "--device", "cpu", "--port", str(port), "--workers", "1"]
    proc = subprocess.Popen(argv, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not _any_child(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "slow"
            time.sleep(0.01)
        time.sleep(0.3)  # the child's interpreter is up and importing
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "fusedserve stopped (exit 0)" in out, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
