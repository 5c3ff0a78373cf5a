"""What the benchmarks that start the real service on loopback share: a free port, a GET that returns the
status of an error too, the service's processes as /proc shows them, and a stop as an orchestrator's."""

from __future__ import annotations

import signal
import socket
import subprocess
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """(status, body) of a GET; an HTTP error status is an answer, not an exception."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def children(pid: int) -> dict[str, int]:
    """{process name (fs-engine-0, fs-frontend-1, ...): pid} of the supervisor `pid`'s children."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name in parentheses may hold spaces
        if ppid == pid and comm.startswith("fs-"):
            out[comm] = int(entry.name)
    return out


def stop(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the service, as an orchestrator would; SIGKILL it if it has not exited after grace_s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
