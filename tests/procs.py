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


def listens_on(pid: int, port: int) -> bool:
    """Whether `pid` holds a socket listening on TCP `port` (IPv4 or IPv6; /proc/net/tcp's state 0A)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if fd.readlink().as_posix() in inodes:
                return True
        except OSError:
            continue
    return False
