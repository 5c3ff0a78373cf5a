"""The byte stream between a front end and an engine: a Unix domain socket carrying length-prefixed messages
(service/link/wire.py says what is in them).

Why a plain socket and not ZeroMQ: a ZeroMQ message crosses two I/O threads on its way (sender's, receiver's),
so a round trip wakes six threads instead of two. On an idle host each wake-up can land on a sleeping core:
measured on an H100 host with ZeroMQ, one hop (front end to engine, the engine idle) took 0.20 ms and a
single-connection request 0.97 ms against 0.16 for an empty FastAPI route. A socket also tells each side at
once when the other process is gone (end of stream), with no heartbeat.
"""

from __future__ import annotations

import contextlib
import socket

PREFIX = 4  # bytes of the little-endian message length
RECV_BYTES = 1 << 20
SOCKET_BUFFER = 4 << 20  # asked for; the kernel caps it at net.core.{r,w}mem_max


def frame(message: bytes) -> bytes:
    return len(message).to_bytes(PREFIX, "little") + message


def new_socket() -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
    sock.setblocking(False)
    return sock


class Reader:
    """Splits what a socket delivers into messages, copying as little as it can: a message that arrives whole
    inside one chunk (the usual case, several per chunk under load) is returned as a view of that chunk; only a
    message cut by a chunk's end is joined, once, when its last part comes. A 256-row request is 32-64 KB, and
    every copy of it is paid on the engine's one thread."""

    __slots__ = ("_parts", "_have", "_need")

    def __init__(self) -> None:
        self._parts: list = []  # the chunks of the message cut so far (the first holds its start)
        self._have = 0  # bytes in _parts
        self._need = PREFIX  # bytes _parts must hold before the first message in them is whole

    def feed(self, chunk: bytes) -> list[memoryview]:
        """The whole messages completed by `chunk` (none, one or several), as views that stay valid."""
        if self._parts:
            self._parts.append(chunk)
            self._have += len(chunk)
            if self._have < self._need:
                return []
            if self._need == PREFIX:  # the prefix itself was cut: now its length is known
                head = b"".join(self._parts)
                self._parts = [head]
                self._need = PREFIX + int.from_bytes(head[:PREFIX], "little")
                if self._have < self._need:
                    return []
            data = b"".join(self._parts)
            self._parts, self._have, self._need = [], 0, PREFIX
        else:
            data = chunk
        view = memoryview(data)
        out = []
        at, end = 0, len(data)
        while end - at >= PREFIX:
            n = int.from_bytes(view[at : at + PREFIX], "little")
            if end - at < PREFIX + n:
                break
            out.append(view[at + PREFIX : at + PREFIX + n])
            at += PREFIX + n
        if at < end:  # the start of a message the next chunks complete
            rest = view[at:]
            self._parts = [rest]
            self._have = len(rest)
            self._need = PREFIX + int.from_bytes(rest[:PREFIX], "little") if len(rest) >= PREFIX else PREFIX
        return out


def read_available(sock: socket.socket, reader: Reader, fds: list[int] | None = None) -> tuple[list[memoryview], bool]:
    """Everything the socket holds now, as whole messages, and whether the other side closed the stream. With
    `fds`, the first read also takes file descriptors sent with the bytes (SCM_RIGHTS) and appends them there."""
    messages: list[memoryview] = []
    while True:
        try:
            if fds is not None:
                chunk, got, _, _ = socket.recv_fds(sock, RECV_BYTES, 4)
                fds += got
                fds = None
            else:
                chunk = sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return messages, False
        except OSError:
            return messages, True
        if not chunk:
            return messages, True
        messages.extend(reader.feed(chunk))
        if len(chunk) < RECV_BYTES:
            return messages, False  # short read: the socket is empty (saves a recv that would fail)


def send_fd(sock: socket.socket, message: bytes, fd: int | None) -> bool:
    """Send a small message first on a new connection, with `fd` attached (SCM_RIGHTS) when given. False when the
    other side is gone or the socket cannot take it whole (it can: a new socket's buffer is empty)."""
    try:
        n = socket.send_fds(sock, [message], [fd]) if fd is not None else sock.send(message)
    except OSError:
        return False
    return n == len(message)


def send_some(sock: socket.socket, pending: bytearray, data: bytes) -> bool:
    """Send `data` after whatever is `pending`; what the socket does not take stays in `pending`.
    Returns False when the other side is gone."""
    if pending:
        pending += data
        data = bytes(pending)
        pending.clear()
    try:
        n = sock.send(data)
    except (BlockingIOError, InterruptedError):
        n = 0
    except OSError:
        return False
    if n < len(data):
        pending += data[n:]
    return True
