"""API keys survive every restart (issue 53, items 1 and 6; docs/security.md): a front end the supervisor starts again
holds the supervisor's keys in force, never what the keys file says by then.

Against the real service (CPU, two front ends, real uvicorn and grpcio on loopback), each test with a keys file of one
key, a SIGHUP, and a front end killed with SIGKILL (a crash, an OOM kill) that the supervisor starts again:
- the file emptied: the restarted front end refuses every request without a key (40 fresh connections over HTTP, 16
  over gRPC; with two front ends, all 40 missing the restarted one has odds of 2^-40), takes the key, and a restored
  file and a SIGHUP leave the same state (the attack as reported: 29 of 40 answered 200);
- the file removed: the service keeps running (no crash loop), refusing requests without a key, taking the old key;
- the file rotated to a new key: the restarted front end takes the new key and refuses the old one.

In process: the supervisor publishes the keys in force (mode 0600) with each new generation and keeps the last good
ones when the file is gone or cannot be published; a front end takes them and, when it cannot, refuses every request
and stops; a front end started with keys configured but none handed refuses to serve.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import stat
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from service.frontend.auth import ApiKeys, SecurityFileError, read_keys_in_force
from service.frontend.state import FrontendState

from .procs import children
from .server import free_port, running_servers, service_env
from .test_reload import _wait_log, isolated, supervisor  # noqa: F401  (isolated: a fixture)
from .test_security import MODEL, ROW, TIMEOUT, bearer

KEY = "restart-key-4c1e9a"
NEW_KEY = "rotated-key-77b0d2"
UNAUTHENTICATED = 40  # fresh connections without a key after the restart: each of them must get 401
RESTART_S = 60.0


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


# ------------------------------------------------------------------ in process


def test_the_supervisor_publishes_the_keys_in_force_and_keeps_the_last_good(isolated, tmp_path, caplog):  # noqa: F811
    keys = tmp_path / "api-keys"
    keys.write_text(f"{KEY}\n")
    sup = supervisor(isolated, f"FUSEDSERVE_API_KEYS_FILE={keys}\n")
    sup._keys = ApiKeys(sup.settings)
    assert sup._keys.in_force()[0] == {digest(KEY)}
    keys.write_text(f"{NEW_KEY}\n")
    assert sup.reload() == "applied" and sup._shared_generation.value == 1
    published = isolated.parent / "api-keys.json"
    assert stat.S_IMODE(published.stat().st_mode) == 0o600
    assert read_keys_in_force(isolated.parent) == (1, ({digest(NEW_KEY)}, sup._keys.source))
    assert KEY not in published.read_text() and NEW_KEY not in published.read_text()  # digests only
    for gone in ("# emptied\n", None):  # emptied, then removed: logged, the last good keys stay, nothing published
        keys.unlink() if gone is None else keys.write_text(gone)
        with caplog.at_level(logging.ERROR, logger="service.supervisor"):
            assert sup.reload() == "unchanged"
        assert "API keys not reloaded, those in force stay" in caplog.records[-1].getMessage()
        assert sup._keys.in_force()[0] == {digest(NEW_KEY)} and read_keys_in_force(isolated.parent)[0] == 1
    # Keys that cannot be published are not taken: the supervisor keeps those the front ends hold.
    keys.write_text(f"{KEY}\n")
    published.unlink()
    published.mkdir()  # os.replace cannot put a file there
    assert sup.reload() == "failed" and sup._keys.in_force()[0] == {digest(NEW_KEY)}
    assert sup._shared_generation.value == 1


def test_a_front_end_takes_the_supervisors_keys_and_refuses_all_when_it_cannot(tmp_path, monkeypatch, caplog):
    from service.config import Settings
    from service.frontend.auth import write_keys_in_force

    settings = Settings(_env_file=None, api_keys_file=tmp_path / "never-read")  # a front end never reads the file
    held = ApiKeys(settings, ({digest(KEY)}, "the supervisor"))
    state = FrontendState(settings, None, None, None, tmp_path, api_keys=held)
    assert state.api_keys.allows(f"Bearer {KEY}") and not state.api_keys.allows(None)
    published = ApiKeys(settings, ({digest(NEW_KEY)}, "the supervisor"))
    write_keys_in_force(tmp_path, 1, published)
    assert (
        state.take_keys() and state.api_keys.allows(f"Bearer {NEW_KEY}") and not state.api_keys.allows(f"Bearer {KEY}")
    )
    with pytest.raises(SecurityFileError):  # keys off in place of keys on: never
        held.take((None, ""))
    stops = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: stops.append((pid, sig)))
    for broken in ("{not json", '{"generation": 2}', None):
        if broken is None:
            (tmp_path / "api-keys.json").unlink()
        else:
            (tmp_path / "api-keys.json").write_text(broken)
        assert not state.take_keys() and stops[-1] == (os.getpid(), signal.SIGTERM)
        assert state.api_keys.on and not state.api_keys.allows(f"Bearer {NEW_KEY}") and not state.api_keys.allows(None)
        assert "cannot take the supervisor's API keys" in caplog.text


def test_a_front_end_handed_no_keys_while_keys_are_configured_does_not_serve(tmp_path):
    code = (
        "from service.config import load_settings\n"
        "from service.frontend.app import frontend_main\n"
        f"frontend_main(load_settings(), None, [], [], {str(tmp_path)!r}, 3)\n"
    )
    env = service_env(api_keys_file=tmp_path / "empty-keys")
    (tmp_path / "empty-keys").write_text("")  # read, it would give no key: inference open
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "front end 3: API keys are configured but the supervisor handed none; not serving" in done.stderr


# ------------------------------------------------------------------ the real service


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """The service with two front ends, API keys from a file holding KEY, and gRPC; yields (server, keys file, gRPC
    address). One for the module's three tests, in file order (two starts less, ~20 CPU-s): the first two leave KEY
    in force, and the rotation, which makes configuration 1, comes last; each reads the log from its own start."""
    tmp_path = tmp_path_factory.mktemp("keys-restart")
    keys = tmp_path / "api-keys"
    keys.write_text(f"{KEY}\n")
    grpc_port = free_port()
    env = {"workers": 2, "max_batch_size": 8, "dtype": "float32", "api_keys_file": keys, "grpc_port": grpc_port,
           "log_level": "info"}  # fmt: skip
    with running_servers({"s": ("unfused", env)}, tmp_path) as servers:
        yield servers["s"], keys, f"127.0.0.1:{grpc_port}"


def hup(server, needle: str) -> None:
    """SIGHUP the supervisor and wait for `needle` in what it logs next."""
    at = len(server.log())
    os.kill(server.process.proc.pid, signal.SIGHUP)
    _wait_log(server, needle, at)


def kill_front_end(server, name: str = "fs-frontend-1") -> None:
    """SIGKILL front end `name` and wait until the supervisor has started it again and its app has started (until then
    the kernel may queue connections at its new socket, which it would answer only then)."""
    pid = server.process.proc.pid
    before = children(pid)[name]
    at = len(server.log())
    os.kill(before, signal.SIGKILL)
    end = time.monotonic() + RESTART_S
    while True:
        assert server.process.proc.poll() is None, f"the service stopped after a front-end restart:\n{server.log()}"
        now = children(pid).get(name)
        text = server.log()[at:]
        started = f"Started server process [{now}]"
        if now not in (None, before) and started in text and "Application startup complete" in text.split(started)[1]:
            return
        assert time.monotonic() < end, f"{name} not started again within {RESTART_S} s:\n{text}"
        time.sleep(0.05)


def statuses(server, key: str | None, n: int) -> list[int]:
    """`n` POST /predict, each on a connection of its own (so that the kernel spreads them over the front ends)."""
    headers = bearer(key) if key is not None else {}
    return [
        httpx.post(server.url + "/predict", json={"inputs": [ROW]}, headers=headers, timeout=TIMEOUT).status_code
        for _ in range(n)
    ]


def grpc_codes(address: str, key: str | None, n: int) -> list[str]:
    """`n` gRPC ModelInfer, each on a channel and connection of its own: "OK" or the status code's name."""
    import tritonclient.grpc as tgrpc
    from tritonclient.utils import InferenceServerException

    inp = tgrpc.InferInput("input", [1, 64], "FP32")
    inp.set_data_from_numpy(np.full((1, 64), 0.5, np.float32))
    headers = {"authorization": f"Bearer {key}"} if key is not None else None
    codes = []
    for _ in range(n):
        client = tgrpc.InferenceServerClient(address, channel_args=[("grpc.use_local_subchannel_pool", 1)])
        try:
            client.infer(MODEL, [inp], headers=headers, client_timeout=30)
            codes.append("OK")
        except InferenceServerException as e:
            codes.append(str(e.status()).removeprefix("StatusCode."))
        finally:
            client.close()
    return codes


def assert_keys(server, address: str | None, allowed: str, refused: tuple[str, ...] = ()) -> None:
    """Every request without a key, or with a key of `refused`, gets 401 (gRPC UNAUTHENTICATED); `allowed` gets 200."""
    answers = statuses(server, None, UNAUTHENTICATED)
    assert answers == [401] * UNAUTHENTICATED, f"{answers.count(401)} of {len(answers)} without a key refused"
    for key in refused:
        answers = statuses(server, key, 10)
        assert answers == [401] * 10, f"a key no longer in force: {answers}"
    answers = statuses(server, allowed, 10)
    assert answers == [200] * 10, f"the key in force: {answers}"
    if address is not None:
        codes = grpc_codes(address, None, 16)
        assert codes == ["UNAUTHENTICATED"] * 16, codes
        assert grpc_codes(address, allowed, 4) == ["OK"] * 4


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_an_emptied_keys_file_never_reaches_a_restarted_front_end(service):
    server, keys, address = service
    keys.write_text("# emptied by mistake\n")
    hup(server, "API keys not reloaded, those in force stay")
    kill_front_end(server)
    assert_keys(server, address, allowed=KEY)
    # Restoring the file and a SIGHUP change nothing: every front end holds the same keys already.
    keys.write_text(f"{KEY}\n")
    hup(server, "no live setting changed")
    assert_keys(server, None, allowed=KEY)
    assert server.process.proc.poll() is None


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_missing_keys_file_keeps_the_last_good_keys_and_no_crash_loop(service):
    server, keys, address = service
    at = len(server.log())
    keys.unlink()
    hup(server, "API keys not reloaded, those in force stay")
    kill_front_end(server)
    kill_front_end(server, "fs-frontend-0")
    assert_keys(server, address, allowed=KEY)
    assert server.process.proc.poll() is None
    log = server.log()[at:]
    assert "front end 1 exited with code -9; starting it again" in log and "-th time in" not in log, log[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_front_end_restarted_after_a_rotation_takes_the_new_key(service):
    server, keys, address = service
    at = len(server.log())
    tmp = keys.with_name("api-keys.new")
    tmp.write_text(f"{NEW_KEY}\n")
    tmp.replace(keys)  # as a secret update does: the whole file at once
    hup(server, "configuration 1 from")
    end = time.monotonic() + 20
    while server.log()[at:].count("configuration 1 taken") < 3:  # the engine and both front ends took it
        assert time.monotonic() < end, server.log()[-3000:]
        time.sleep(0.05)
    assert_keys(server, None, allowed=NEW_KEY, refused=(KEY,))
    kill_front_end(server)
    assert_keys(server, address, allowed=NEW_KEY, refused=(KEY,))
