"""SIGHUP: the configuration file is read again and its live settings reach the engines and front ends.

In process (the supervisor's reload alone, its children replaced by the run directory they read):
- a valid file with a live change is applied: the new generation is published for the children, counted `applied`;
- a file with an invalid value (or an unknown FUSEDSERVE_ name) is refused whole, with a log line naming the field,
  and the running configuration stays (`invalid`);
- a file that changes nothing live is `unchanged`; a changed setting that only a restart applies is named in the log
  and not applied; one the environment or the command line overrides is named too.

A real service (CPU, two front ends, the mode in its configuration file): the same four cases by SIGHUP, and a switch
under load (16 connections, a few hundred requests) from fused to unfused (an executor the engine must load first,
while it serves on in fused), to ab and back to fused, with every request answered 200, each answer in the mode that
took it, and the new mode in every answer within a bounded time of the signal.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.config import ENV_PREFIX, LIVE_SETTINGS, changed_settings, load_settings, overridden_in_file
from service.link.live import read_live
from service.supervisor import Supervisor


@pytest.fixture
def isolated(monkeypatch, tmp_path):
    for key in list(os.environ):
        if key.startswith(ENV_PREFIX):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    conf = tmp_path / "fusedserve.env"
    monkeypatch.setenv("FUSEDSERVE_CONFIG_FILE", str(conf))
    return conf


def supervisor(conf, text: str, overrides: dict | None = None) -> Supervisor:
    """A supervisor as it runs (settings read, run directory made), without children."""
    conf.write_text(text)
    sup = Supervisor(load_settings(**(overrides or {})), overrides)
    sup._run_dir = conf.parent
    sup._shared_generation = SimpleNamespace(value=0)
    return sup


def test_a_live_change_is_published_for_the_children(isolated, caplog):
    sup = supervisor(isolated, "FUSEDSERVE_MODE=fused\n")
    isolated.write_text("FUSEDSERVE_MODE=ab\nFUSEDSERVE_SHADOW_EVERY=16\nFUSEDSERVE_MAX_DELAY_MS=0.5\n")
    with caplog.at_level(logging.INFO, logger="service.supervisor"):
        assert sup.reload() == "applied"
    generation, live = read_live(isolated.parent)
    assert generation == sup._shared_generation.value == 1
    assert set(live) == set(LIVE_SETTINGS)
    assert (live["mode"], live["shadow_every"], live["max_delay_ms"]) == ("ab", 16, 0.5)
    assert sup.settings.mode == "ab"  # children started again from now on get it with their arguments
    assert "FUSEDSERVE_MODE=ab" in caplog.text and "FUSEDSERVE_SHADOW_EVERY=16" in caplog.text


def test_an_invalid_file_is_refused_whole_and_names_the_field(isolated, caplog):
    sup = supervisor(isolated, "FUSEDSERVE_MODE=fused\n")
    isolated.write_text("FUSEDSERVE_MODE=unfused\nFUSEDSERVE_AB_UNFUSED_PERCENT=150\n")
    with caplog.at_level(logging.ERROR, logger="service.supervisor"):
        assert sup.reload() == "invalid"
    assert sup.settings.mode == "fused" and sup._shared_generation.value == 0  # the valid MODE is not taken either
    assert not (isolated.parent / "live.json").exists()
    (line,) = [r.getMessage() for r in caplog.records]
    assert "refused whole" in line and "FUSEDSERVE_AB_UNFUSED_PERCENT" in line and "150" in line, line
    isolated.write_text("FUSEDSERVE_MODE=unfused\nFUSEDSERVE_MDOE=ab\n")
    assert sup.reload() == "invalid"
    assert "FUSEDSERVE_MDOE" in caplog.records[-1].getMessage()


def test_unchanged_and_restart_only_settings(isolated, caplog):
    sup = supervisor(isolated, "FUSEDSERVE_MODE=unfused\nFUSEDSERVE_WORKERS=2\n")
    assert sup.reload() == "unchanged"
    isolated.write_text("FUSEDSERVE_MODE=unfused\nFUSEDSERVE_WORKERS=3\nFUSEDSERVE_MAX_BATCH_SIZE=64\n")
    with caplog.at_level(logging.WARNING, logger="service.supervisor"):
        assert sup.reload() == "unchanged"
    line = caplog.records[-1].getMessage()
    # MAX_ROWS_PER_REQUEST follows MAX_BATCH_SIZE when unset: it would change too.
    assert "FUSEDSERVE_MAX_BATCH_SIZE, FUSEDSERVE_MAX_ROWS_PER_REQUEST, FUSEDSERVE_WORKERS changed" in line, line
    assert "only a restart" in line and "keeps max_batch_size=1024" in line, line
    assert sup.settings.workers == 2 and sup.settings.max_batch_size == 1024
    # A live change beside them is applied; they are named again.
    isolated.write_text("FUSEDSERVE_MODE=fused\nFUSEDSERVE_WORKERS=3\n")
    assert sup.reload() == "applied" and sup.settings.mode == "fused" and sup.settings.workers == 2


def test_the_environment_and_the_command_line_beat_the_file_at_a_reload_too(isolated, monkeypatch, caplog):
    monkeypatch.setenv("FUSEDSERVE_MAX_DELAY_MS", "2")
    sup = supervisor(isolated, "FUSEDSERVE_MODE=fused\n", overrides={"log_level": "warning"})
    isolated.write_text("FUSEDSERVE_MAX_DELAY_MS=5\nFUSEDSERVE_LOG_LEVEL=debug\n")
    with caplog.at_level(logging.WARNING, logger="service.supervisor"):
        assert sup.reload() == "unchanged"
    assert "FUSEDSERVE_LOG_LEVEL, FUSEDSERVE_MAX_DELAY_MS" in caplog.text and "overridden" in caplog.text
    assert overridden_in_file(isolated, {"log_level": "warning"}) == ["FUSEDSERVE_LOG_LEVEL", "FUSEDSERVE_MAX_DELAY_MS"]


def test_changed_settings_splits_live_from_restart_only():
    from service.config import Settings

    old = Settings(_env_file=None)
    new = Settings(_env_file=None, mode="ab", port=9000, request_timeout_ms=100)
    assert changed_settings(old, new) == ({"mode": "ab", "request_timeout_ms": 100.0}, ["port"])


# ------------------------------------------------------------------------------------------- a real service

ROW = [float(i % 16) for i in range(64)]
CONNECTIONS = 16
EFFECT_S = 10.0  # on the CPU: the unfused executor loads in ~0.3 s, each forward is interpreted; the GPU target is 2


def _metrics(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(fams, family: str, sample: str, **labels) -> float:
    samples = fams[family].samples
    return sum(s.value for s in samples if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def _reloads(url: str) -> dict[str, float]:
    fams = _metrics(url)
    return {
        o: _value(fams, "fusedserve_config_reloads", "fusedserve_config_reloads_total", outcome=o)
        for o in ("applied", "unchanged", "invalid", "failed")
    }


def _wait_log(server, needle: str, after: int, timeout_s: float = 20.0) -> str:
    end = time.monotonic() + timeout_s
    while True:
        text = server.log()[after:]
        if needle in text:
            return text
        assert time.monotonic() < end, f"{needle!r} not logged within {timeout_s} s:\n{text}"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sighup_on_a_real_service_and_a_switch_under_load_loses_nothing(tmp_path):
    from .server import running_servers

    conf = tmp_path / "fusedserve.env"
    conf.write_text("FUSEDSERVE_MODE=fused\nFUSEDSERVE_WORKERS=2\n")
    env = {"config_file": conf, "max_batch_size": 16}
    with running_servers({"s": (None, env)}, log_dir=tmp_path) as servers:
        server = servers["s"]
        url, pid = server.url, server.process.proc.pid

        def hup(text: str, needle: str) -> str:
            at = len(server.log())
            conf.write_text(text)
            os.kill(pid, signal.SIGHUP)
            return _wait_log(server, needle, at)

        assert httpx.get(url + "/health/ready").json()["mode"] == "fused"
        # Invalid: refused whole, the field named, fused stays.
        line = hup("FUSEDSERVE_MODE=unfused\nFUSEDSERVE_SHADOW_EVERY=-1\nFUSEDSERVE_WORKERS=2\n", "refused whole")
        assert "FUSEDSERVE_SHADOW_EVERY" in line
        # Unchanged, and a restart-only setting named.
        hup("FUSEDSERVE_MODE=fused\nFUSEDSERVE_WORKERS=2\n", "no live setting changed")
        line = hup("FUSEDSERVE_MODE=fused\nFUSEDSERVE_WORKERS=3\n", "only a restart")
        assert "FUSEDSERVE_WORKERS" in line
        r = httpx.post(url + "/predict", json={"inputs": [ROW]}, timeout=30)
        assert r.json()["mode"] == "fused" and r.headers["x-fusedserve-mode"] == "fused"
        assert _reloads(url) == {"applied": 0, "unchanged": 2, "invalid": 1, "failed": 0}

        # The switch under load: fused -> unfused (loaded first) -> ab -> fused.
        results: list[tuple[float, float, int, str | None]] = []  # (sent, answered, status, mode)
        switches: list[tuple[float, str]] = []

        async def client_loop(client: httpx.AsyncClient, stop: asyncio.Event) -> None:
            while not stop.is_set():
                sent = time.monotonic()
                try:
                    r = await client.post("/predict", json={"inputs": [ROW]})
                    mode = r.json().get("mode") if r.status_code == 200 else None
                    results.append((sent, time.monotonic(), r.status_code, mode))
                except httpx.HTTPError as e:
                    results.append((sent, time.monotonic(), -1, type(e).__name__))

        async def load() -> None:
            stop = asyncio.Event()
            limits = httpx.Limits(max_connections=CONNECTIONS, max_keepalive_connections=CONNECTIONS)
            async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
                tasks = [asyncio.create_task(client_loop(client, stop)) for _ in range(CONNECTIONS)]
                loop = asyncio.get_running_loop()
                for mode, text in (
                    ("unfused", "FUSEDSERVE_MODE=unfused\nFUSEDSERVE_WORKERS=2\n"),
                    ("ab", "FUSEDSERVE_MODE=ab\nFUSEDSERVE_WORKERS=2\n"),
                    ("fused", "FUSEDSERVE_MODE=fused\nFUSEDSERVE_WORKERS=2\n"),
                ):
                    await wait_answers(60)  # some load in the old mode first
                    conf.write_text(text)
                    switches.append((time.monotonic(), mode))
                    os.kill(pid, signal.SIGHUP)
                    await wait_for_mode(mode, switches[-1][0], loop)
                await wait_answers(40)
                stop.set()
                await asyncio.wait_for(asyncio.gather(*tasks), 60)

        async def wait_answers(n: int) -> None:
            start = len(results)
            end = time.monotonic() + 60
            while len(results) < start + n:
                assert time.monotonic() < end, f"{len(results) - start} answers in 60 s"
                await asyncio.sleep(0.02)

        async def wait_for_mode(mode: str, since: float, loop) -> None:
            """Until 2 * CONNECTIONS answers in a row to requests sent after the signal are all in `mode`."""
            end = since + EFFECT_S
            while True:
                later = [m for sent, _, status, m in results if sent > since]
                if mode == "ab":
                    if {"fused", "unfused"} <= set(later[-2 * CONNECTIONS :]):
                        return
                elif len(later) >= 2 * CONNECTIONS and set(later[-2 * CONNECTIONS :]) == {mode}:
                    return
                assert time.monotonic() < end, f"mode {mode} not in effect {EFFECT_S} s after SIGHUP: {later[-40:]}"
                await asyncio.sleep(0.02)

        asyncio.run(load())
        failed = [r for r in results if r[2] != 200]
        assert not failed, f"{len(failed)} of {len(results)} requests not answered 200: {failed[:5]}"
        assert len(results) >= 200, len(results)
        # Each answer is in the mode that took it: before each signal the old mode; once the new one is in effect,
        # no answer of the old one (ab: both) comes back.
        (t_unfused, _), (t_ab, _), (t_fused, _) = switches
        before = {m for sent, done, _, m in results if done < t_unfused}
        assert before == {"fused"}
        between = {m for sent, done, _, m in results if t_unfused < done < t_ab}
        assert between <= {"fused", "unfused"} and "unfused" in between
        assert {m for sent, done, _, m in results if t_ab < done < t_fused} >= {"fused", "unfused"}
        tail = [m for sent, _, _, m in results[-20:]]
        assert set(tail) == {"fused"}, tail

        log = server.log()
        assert "loading the unfused executor for mode unfused; serving on in fused meanwhile" in log
        assert log.count("configuration 3 taken") == 3  # one engine and two front ends took the last one
        assert _reloads(url) == {"applied": 3, "unchanged": 2, "invalid": 1, "failed": 0}
        fams = _metrics(url)
        ok = {
            m: _value(
                fams, "fusedserve_requests", "fusedserve_requests_total", outcome="ok", protocol="predict", mode=m
            )
            for m in ("fused", "unfused")
        }
        assert sum(ok.values()) == len(results) + 1 and ok["unfused"] > 0, ok  # + the single request above
        info = {s.labels["mode"]: s.value for s in fams["fusedserve_model_info"].samples}
        assert info == {"fused": 1.0, "unfused": 0.0, "ab": 0.0}, info
        assert httpx.get(url + "/health/ready").json()["mode"] == "fused"
