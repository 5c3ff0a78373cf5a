"""Request ids: the client's `X-Request-Id` (or the Open Inference Protocol's `id`) when it is printable ASCII of
at most 128 characters, else one made here; returned with the answer (`X-Request-Id`, and the v2 `id` where the
request had none) and named in the front end's log line of a failure.

A made id is 16 hex characters: 8 random per process, drawn once at import, then a counter. Unique across front
ends and replicas (a collision needs two processes to draw the same 32 random bits), and cheaper than 8 bytes of
os.urandom per request, which is a system call: here one bytes format, the id's only allocation. A client's id is
used as the bytes the server already holds.

The id does not travel to the engine. Each request already carries a numeric id there (service/link/wire.py
REQUEST), which the front end makes unique across the host by starting its counter at its pid << 32
(`wire.request_name` gives it as `PID-N`). An engine names requests by that id in its warnings, and a front end
logs the mapping (the request id next to the engine's name for it) only on a failure, so the wire and the hot path
carry nothing more. (A string field on every REQUEST record would cost up to 128 bytes per request on the link
and a copy in the engine's one thread, for a line logged once in a great while.)
"""

from __future__ import annotations

import itertools
import os

from .asgi import header

HEADER = b"x-request-id"
MAX_LENGTH = 128
_PREFIX = os.urandom(4).hex().encode()
_counter = itertools.count(1)
_PRINTABLE = bytes(range(0x20, 0x7F))


def valid(value: object) -> bool:
    """Whether `value` (a header's bytes, a JSON `id` of any type) is an id to keep: printable ASCII, 1 to 128."""
    if isinstance(value, bytes):
        return 0 < len(value) <= MAX_LENGTH and not value.translate(None, _PRINTABLE)
    if isinstance(value, str):
        return 0 < len(value) <= MAX_LENGTH and value.isascii() and value.isprintable()
    return False


def new() -> bytes:
    return b"%s%08x" % (_PREFIX, next(_counter) & 0xFFFFFFFF)


def of_scope(scope: dict) -> bytes:
    """The request's id: its valid X-Request-Id, else a new one."""
    value = header(scope, HEADER)
    return value if value is not None and valid(value) else new()


def given(scope: dict) -> bytes | None:
    """The request's X-Request-Id if it has a valid one, else None (the v2 routes then look at the body's `id`)."""
    value = header(scope, HEADER)
    return value if value is not None and valid(value) else None
