"""What the ASGI fast paths share (frontend/predict.py's POST /predict, v2/rest.py's /v2 routes): the answer
tuple, common headers, and the request body read with its size limit counted as the bytes arrive."""

from __future__ import annotations

import asyncio

from ..link import wire

Answer = tuple[int, bytes, list[tuple[bytes, bytes]]]  # status, body, headers
JSON = (b"content-type", b"application/json")
RETRY = (b"retry-after", b"1")
CLOSE = (b"connection", b"close")
# Which executor computed an answer (fused or unfused, or MODE:DTYPE where the A/B compares precisions), on every
# inference answer: in ab mode they take turns.
MODE_HEADER = {m: (b"x-fusedserve-mode", m.encode()) for m in wire.MODES}


class ClientGone(Exception):
    pass


# The request's headers as a dict (the first value of each name), made by the first `header` call and kept in its
# scope: a /predict reads five or six headers (type, length, coding twice, request id), each a look-up, not a scan.
HEADERS = "fusedserve.headers"


def header(scope: dict, name: bytes) -> bytes | None:
    """The first value of header `name` (lower case), or None."""
    headers = scope.get(HEADERS)
    if headers is None:
        headers = scope[HEADERS] = dict(reversed(scope["headers"]))  # reversed: the first value of a name stays
    return headers.get(name)


def content_length(scope: dict) -> int | None:
    value = header(scope, b"content-length")
    return int(value) if value is not None and value.isdigit() else None


async def watch_disconnect(receive, fut: asyncio.Future) -> None:
    # After the body is read, the next ASGI message for this request is http.disconnect: the client went away
    # (or the response finished, by which time this task is cancelled).
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not fut.done():
                fut.set_exception(ClientGone())
            return
