"""A large binary REST infer request's tensor bytes, written into an engine's arena as they arrive.

A 32-image UINT8 224x224 request is 4.8 MB (9.6 MB in FP16). Read whole, its chunks are joined into one bytes object
(a fresh allocation of that size, whose pages the kernel faults in and zeroes), checked, then copied into the
engine's arena (service/link/arena.py): two copies of every byte and one large allocation per request, on a front
end's one core. The binary extension says where the tensor starts (Inference-Header-Content-Length) and the body
how long it is (Content-Length), so here the JSON header is read and checked first, a slot of the arena is reserved
for the tensor (EngineClient.reserve), and every later byte is copied there once, as it arrives.

Where the arena is full for now (the requests ahead of this one still in the engine), the request waits for a slot to
go back, up to its timeout, its body left unread meanwhile (TCP holds the client back). Read whole instead, it would
travel to the engine inside its message, copied again on the engine's one reading thread: 32-image UINT8 requests
to the resnet-stem model reached the engine at 29,058 images/s at 64 connections and 16,032 at 256, where the 8
front ends' arenas (77 MB each) hold 16 such requests apiece (H100, bench/results/h100/serve_stem_full_h100.md;
waiting, 32,589 and 33,573: serve_stem_room_h100.md).

Anything unusual takes the ordinary path (the rest of the body read into memory, then service/v2/rest.py's `_parse`,
which answers every error as before): a header that does not parse or check, bytes after the tensor or a tensor
shorter than declared, a datatype that the engine's wire would cast (FP32 to a float16 engine), a tensor larger than
an arena, no room in the arena within the request's timeout, or a body under DIRECT_MIN_BYTES.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import NamedTuple

import numpy as np
import orjson

from ..frontend.asgi import content_length, header
from ..frontend.encoding import decode_body, encoded
from ..frontend.engine_client import Reservation
from ..frontend.inputs import InputError
from ..frontend.serving import Refused, admit, body_chunk, read_chunks
from ..frontend.state import FrontendState
from . import tensors as t

HEADER_LENGTH = b"inference-header-content-length"
# Below this the ordinary path: joining and copying a 256-row float16 digits request (32 KB) costs microseconds.
DIRECT_MIN_BYTES = 256 << 10


class Direct(NamedTuple):
    """A request whose tensor is in an engine's arena: the JSON header, the rows (a view of the slot, checked) and
    the slot."""

    doc: dict
    rows: np.ndarray
    reservation: Reservation


async def read_infer_body(state: FrontendState, scope: dict, receive) -> bytes | Direct:
    """The body of a REST infer request, as bytes for `_parse` (its gzip or deflate coding undone), or its tensor
    already in an engine's arena (Direct); Refused as `read_request` refuses (not ready, too large, a coding it cannot
    decode, the client gone), InputError for rows that are not finite or a coded body that does not decode."""
    limit = admit(state, scope)
    length = content_length(scope)
    given = header(scope, HEADER_LENGTH)
    chunks: list[bytes] = []
    size, more = 0, True
    coded = encoded(scope)  # a gzipped tensor is decoded whole, then parsed: the ordinary path
    if (not coded and length is not None and given is not None and given.isdigit()
            and length - int(given) >= DIRECT_MIN_BYTES):  # fmt: skip
        head_length = int(given)
        # the JSON header, and whatever came with it
        size, more = await read_chunks(receive, limit, chunks, until=head_length)
        if more:
            first = b"".join(chunks)
            chunks = [first]
            planned = _direct_input(state, first[:head_length], length - head_length)
            reservation = await _reserve(state, length - head_length, planned[1]) if planned else None
            if reservation is not None:
                return await _into(
                    state, receive, memoryview(first)[head_length:], planned, reservation, limit, head_length
                )
    if more:
        await read_chunks(receive, limit, chunks, size)
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    return decode_body(scope, body, limit) if coded else body


async def _reserve(state: FrontendState, nbytes: int, dtype: np.dtype) -> Reservation | None:
    """A slot for the tensor, waiting for one to go back while the arenas are only full for now, at most the request's
    timeout; None where no arena could ever take it in place, or none had room in that time."""
    engines = state.engines
    give_up = time.monotonic() + state.settings.request_timeout_ms / 1e3
    while (reservation := engines.reserve(nbytes, dtype)) is None and engines.fits(nbytes, dtype):
        left = give_up - time.monotonic()
        if left <= 0:
            return None
        try:
            await asyncio.wait_for(engines.slot_returned().wait(), left)
        except TimeoutError:
            return None
    return reservation


def _direct_input(state: FrontendState, head: bytes, data_bytes: int) -> tuple[dict, np.dtype, list[int]] | None:
    """(the JSON header, the input's dtype, its shape) where the body after the header is exactly one well-formed
    binary tensor of `data_bytes`; None for anything else (the ordinary path then says what is wrong)."""
    try:
        doc = orjson.loads(head)
    except orjson.JSONDecodeError:
        return None
    inputs = doc.get("inputs") if isinstance(doc, dict) else None
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict) or "data" in inputs[0]:
        return None
    inp = inputs[0]
    size = t.parameter(inp.get("parameters"), "binary_data_size")
    if type(size) is not int or size != data_bytes:
        return None
    shape = inp.get("shape")
    try:
        dtype, _ = t.check_input(state.model, inp.get("name"), inp.get("datatype"), shape,
                                 state.settings.max_rows_per_request)  # fmt: skip
    except InputError:
        return None
    if math.prod(shape) * dtype.itemsize != size:
        return None
    return doc, dtype, shape


async def _into(
    state: FrontendState, receive, start: memoryview, planned: tuple, reservation: Reservation, limit: int, head: int
) -> Direct:
    """The rest of the body copied into `reservation` as it arrives (`start`: the bytes that came with the `head`
    bytes of JSON header), then checked as rows."""
    doc, dtype, shape = planned
    view = reservation.view
    try:
        at, chunk, more = 0, start, True
        while True:
            end = at + len(chunk)
            if end > len(view):  # past Content-Length: the HTTP server never passes that on
                raise Refused(400, "invalid", "the body holds bytes after the input's binary data", close=True)
            view[at:end] = chunk
            at = end
            if not more:
                break
            chunk, more = await body_chunk(receive, head + at, limit)
        if at != len(view):
            raise InputError(400, f"input {t.INPUT!r} has {at} bytes of data; its binary_data_size is {len(view)}")
        rows = t.finite_rows(state.model, np.frombuffer(view, dtype=dtype), shape[0], t.INPUT)
    except BaseException:
        state.engines.release(reservation)
        raise
    return Direct(doc, rows, reservation)
