"""The messages between front ends and engines: fixed-size headers and raw float32 (service/link.py carries them).

Front end -> engine, one message per event-loop turn, holding every request the front end took in that turn:
    COUNT (records), then that many REQUEST records (kind, id, rows, deadline, arrival), one per request or
    cancellation, then the float32 rows of each SUBMIT record in order (C-contiguous, (rows, *input_shape))
Engine -> front end, one message per front end per batch:
    COUNT, then REPLY records (id, status, rows, payload bytes), then the payloads in order: the float32
    outputs (rows, output_features) when OK, else a UTF-8 message

No JSON, msgpack or pickle on this path: headers are struct-packed and the rows travel as the bytes numpy
already holds, joined into one buffer, so a message is one write.
"""

from __future__ import annotations

import struct

COUNT = struct.Struct("<I")
# kind, id, rows, deadline, arrival (time.monotonic(), shared by the host's processes). The arrival travels on its own:
# a gRPC client's deadline can end a request sooner than request_timeout, so it is not deadline - timeout.
REQUEST = struct.Struct("<BQIdd")
REPLY = struct.Struct("<QBII")  # id, status, rows, payload bytes

SUBMIT = 1
CANCEL = 2

OK = 0
OVERLOADED = 1  # the engine's queue was full: 503
TIMEOUT = 2  # the deadline passed before the batch ran: 504
FAILED = 3  # the forward raised: 500
SHUTTING_DOWN = 4  # the engine is stopping: 503

STATUS_NAMES = {OK: "ok", OVERLOADED: "overloaded", TIMEOUT: "timeout", FAILED: "failed", SHUTTING_DOWN: "stopping"}

# Engine states, shared with front ends and the supervisor through one integer per engine.
# BROKEN: a sticky device error; the engine is exiting and /health/live reads 503.
LOADING, WARMING, READY, FAILED_START, STOPPED, BROKEN = 0, 1, 2, 3, 4, 5
ENGINE_STATES = {
    LOADING: "loading", WARMING: "warming", READY: "ready", FAILED_START: "failed", STOPPED: "stopped",
    BROKEN: "broken",
}  # fmt: skip


def pack(records: list[bytes], payloads: list) -> bytes:
    """One message: the count, the packed records, then every payload (bytes or C-contiguous arrays)."""
    return b"".join([COUNT.pack(len(records)), *records, *payloads])


def unpack(message: bytes, record: struct.Struct) -> tuple[list[tuple], memoryview, int]:
    """(records, the message as a memoryview, offset of the first payload)."""
    (n,) = COUNT.unpack_from(message)
    end = COUNT.size + n * record.size
    return list(record.iter_unpack(message[COUNT.size : end])), memoryview(message), end
