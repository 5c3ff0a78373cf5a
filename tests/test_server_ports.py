"""The harness's ports (tests/server.py free_port): each xdist worker draws from its own block below the kernel's
ephemeral range, skips a port something holds, and falls back to bind(0) where no block fits."""

from __future__ import annotations

import itertools
import socket

from . import server


def test_each_worker_walks_its_own_block_below_the_ephemeral_range(monkeypatch):
    monkeypatch.setattr(server, "_ephemeral_low", lambda: 32768)
    blocks = {}
    for worker in ("gw0", "gw3", "gw15"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        ports = list(itertools.islice(server._worker_ports(), server._PORT_BLOCK + 1))
        first = server._PORT_BASE + server._PORT_BLOCK * int(worker[2:])
        assert set(ports[: server._PORT_BLOCK]) == set(range(first, first + server._PORT_BLOCK)), worker
        assert ports[server._PORT_BLOCK] == first  # round again from the block's start
        blocks[worker] = set(ports)
    assert not blocks["gw0"] & blocks["gw3"] and not blocks["gw3"] & blocks["gw15"]
    assert max(blocks["gw15"]) < 32768


def test_a_held_port_is_passed_over(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            free = probe.getsockname()[1]
        monkeypatch.setattr(server, "_ports", iter([taken, free]))
        assert server.free_port() == free


def test_without_room_below_the_ephemeral_range_the_port_comes_from_bind_0(monkeypatch):
    ephemeral_low = server._ephemeral_low()  # the machine's own range, where bind(0) draws
    monkeypatch.setattr(server, "_ephemeral_low", lambda: server._PORT_BASE + server._PORT_BLOCK - 1)
    assert next(server._worker_ports(), None) is None  # gw0's block would reach the range: no block
    monkeypatch.setattr(server, "_ports", server._worker_ports())
    port = server.free_port()
    assert port >= ephemeral_low
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))
