"""The service's processes as /proc shows them: children by name, resident memory."""

from __future__ import annotations

from pathlib import Path

from bench.local_server import children  # noqa: F401  (the tests take both from here)


def rss_bytes(pid: int) -> int:
    """Resident memory of `pid` (VmRSS in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def open_sockets(pid: int) -> int:
    """Sockets `pid` holds open (its listening sockets included)."""
    n = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if fd.readlink().as_posix().startswith("socket:"):
                n += 1
        except OSError:
            continue
    return n
