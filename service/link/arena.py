"""Shared memory for rows on their way from a front end to an engine: the message carries where they are, not them.

A 256-row request is 32 KB in float16. Sent through the Unix socket, its bytes are copied into the kernel and out
again on the engine's one thread: with 256-row requests, reading the sockets was the biggest item of a loaded
engine's profile (19% of its samples, bench/probes/profile_serve.py on the H100 host). Instead each front end
writes rows, cast to the wire dtype, into an arena of its own (an anonymous memfd, so no /dev/shm size limit
applies, as Docker's 64 MB default would) and hands the engine the file descriptor once, over the socket
(SCM_RIGHTS). The engine maps it and reads each request's rows where the request says, copying them once, into
the graph's pinned input.

Slots are taken in a ring and given back when the engine answers the request (every submitted request gets
exactly one answer, a cancelled one included: service/link/wire.py), so the arena never holds rows the engine may
still read. A request that does not fit (the arena full of requests still queued) travels inside its message
as before.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import os

ALIGN = 64  # each slot starts on a cache line


class Arena:
    """One front end's shared memory for one engine, and its ring of slots."""

    def __init__(self, size: int):
        self.fd = os.memfd_create("fusedserve-rows", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.buf = mmap.mmap(self.fd, size)
        except OSError:
            os.close(self.fd)
            raise
        self.size = size
        self._slots: collections.deque[list] = collections.deque()  # [offset, end, live], oldest first
        self._head = 0  # where the next slot starts, if it fits there

    def take(self, nbytes: int) -> list | None:
        """A slot of `nbytes` ([offset, end, live]), or None when the ring has no room for it now."""
        n = -(-nbytes // ALIGN) * ALIGN
        slots = self._slots
        if not slots:
            at = 0 if n <= self.size else None
        else:
            tail, head = slots[0][0], self._head
            if head > tail:  # the live slots do not wrap: room after them and before them
                at = head if head + n <= self.size else (0 if n <= tail else None)
            else:  # wrapped: the only room is between the head and the oldest live slot
                at = head if head + n <= tail else None
        if at is None:
            return None
        slot = [at, at + n, True]
        slots.append(slot)
        self._head = at + n
        return slot

    def give_back(self, slot: list) -> None:
        slot[2] = False
        slots = self._slots
        while slots and not slots[0][2]:
            slots.popleft()
        if not slots:
            self._head = 0

    @property
    def slots_live(self) -> int:
        return sum(1 for s in self._slots if s[2])

    def close(self) -> None:
        os.close(self.fd)
        # A view still alive somewhere keeps the mapping: it goes with the last of them.
        with contextlib.suppress(BufferError):
            self.buf.close()
