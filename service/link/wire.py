"""The messages between front ends and engines: fixed-size headers and raw rows (service/link/stream.py carries them).

Engine -> front end, first on every connection: HELLO (magic, the engine's wire dtype).
Front end -> engine, first on every connection: an empty message carrying the front end's arena (service/link/arena.py)
    as a file descriptor (SCM_RIGHTS), when it has one.
Front end -> engine, one message per event-loop turn (or per FLUSH_EVERY requests of a long one), holding the
    requests the front end took in since its last message:
    COUNT (records), then that many REQUEST records (kind, dtype, id, rows, offset, deadline, arrival), one per
    request or cancellation, then the rows of each SUBMIT record in order (C-contiguous, (rows, *input_shape), in
    its dtype); a SUBMIT_SHARED record's rows are in the arena at `offset` instead
Engine -> front end, one message per front end per batch:
    COUNT, then REPLY records (id, status, mode, rows, payload bytes), then the payloads in order: the outputs
    (rows, output_features) in the engine's wire dtype when OK, else a UTF-8 message. `mode` says which executor
    computed the outputs (MODES: fused, unfused; NO_MODE where no forward ran), so that in `ab` mode every answer
    and the front end's request metrics name it. Every submitted request
    gets exactly one REPLY, a cancelled one too (CANCELLED), so that the front end knows when the engine is done
    with its rows.

The wire dtype is the engine's serving dtype where numpy has it (float16; float32 for float32 and bfloat16): a
front end casts its rows to it before sending and widens the outputs to float32 after, so the engine's one thread
receives half the bytes of float32 and copies them into the graph's pinned input with no cast (service/model/
runner.py). Until a front end has the HELLO it sends float32, which an engine always takes: each request says its
dtype. A uint8 model's rows (pixels) travel as uint8 whatever the HELLO says, and the engine copies them to the GPU as
they are.

No JSON, msgpack or pickle on this path: headers are struct-packed and the rows travel as the bytes numpy
already holds, joined into one buffer, so a message is one write.
"""

from __future__ import annotations

import struct

import numpy as np

COUNT = struct.Struct("<I")
# kind, dtype (an index into DTYPES), id, rows, offset in the arena (SUBMIT_SHARED), deadline, arrival
# (time.monotonic(), shared by the host's processes). The arrival travels on its own: a gRPC client's deadline can
# end a request sooner than request_timeout, so it is not deadline - timeout.
REQUEST = struct.Struct("<BBQIQdd")
REPLY = struct.Struct("<QBBII")  # id, status, mode (an index into MODES, or NO_MODE), rows, payload bytes
MODES = ("fused", "unfused")
NO_MODE = 255

SUBMIT = 1
CANCEL = 2
SUBMIT_SHARED = 3

# a request's rows, a HELLO's wire dtype: by index. uint8: a uint8 model's pixels, sent as they are whatever the
# HELLO says (a quarter of float32's bytes); a HELLO never names it (outputs are float).
DTYPES = (np.dtype("<f4"), np.dtype("<f2"), np.dtype("u1"))
FLOAT32 = 0
UINT8 = 2
HELLO = struct.Struct("<4sB")  # magic, wire dtype
MAGIC = b"FSE2"  # FSE2: REPLY carries the mode

OK = 0
OVERLOADED = 1  # the engine's queue was full: 503
TIMEOUT = 2  # the deadline passed before the batch ran: 504
FAILED = 3  # the forward raised: 500
SHUTTING_DOWN = 4  # the engine is stopping: 503
CANCELLED = 5  # the front end cancelled it and the engine dropped it unrun: nothing to answer, its rows are free

STATUS_NAMES = {
    OK: "ok", OVERLOADED: "overloaded", TIMEOUT: "timeout", FAILED: "failed", SHUTTING_DOWN: "stopping",
    CANCELLED: "cancelled",
}  # fmt: skip

# Engine states, shared with front ends and the supervisor through one integer per engine.
# BROKEN: a sticky device error; the engine is exiting and /health/live reads 503.
LOADING, WARMING, READY, FAILED_START, STOPPED, BROKEN = 0, 1, 2, 3, 4, 5
ENGINE_STATES = {
    LOADING: "loading", WARMING: "warming", READY: "ready", FAILED_START: "failed", STOPPED: "stopped",
    BROKEN: "broken",
}  # fmt: skip


def request_name(rid: int) -> str:
    """A request's id as the engine's warnings and the front end's failure lines both write it: `<front end pid>-<n>`
    (a front end numbers its requests from its pid << 32, service/frontend/engine_client.py), so that a front end's
    line that names a request id (service/frontend/requestid.py) leads to the engine's line about it."""
    return f"{rid >> 32}-{rid & 0xFFFFFFFF}"


def pack(records: list[bytes], payloads: list) -> bytes:
    """One message: the count, the packed records, then every payload (bytes or C-contiguous arrays)."""
    return b"".join([COUNT.pack(len(records)), *records, *payloads])


def hello(dtype: np.dtype) -> bytes:
    return HELLO.pack(MAGIC, DTYPES.index(np.dtype(dtype)))


def read_hello(message) -> int:
    """The wire dtype a HELLO announces, as its index into DTYPES; ValueError for anything else (an engine of
    another version)."""
    if len(message) != HELLO.size:
        raise ValueError(f"expected the engine's HELLO ({HELLO.size} bytes), got {len(message)} bytes")
    magic, code = HELLO.unpack(message)
    if magic != MAGIC or code >= UINT8:
        raise ValueError(f"the engine's HELLO is {bytes(message)!r}; this front end speaks {MAGIC!r}")
    return code


def unpack(message, record: struct.Struct) -> tuple[list[tuple], memoryview, int]:
    """(records, the message as a memoryview, offset of the first payload)."""
    (n,) = COUNT.unpack_from(message)
    end = COUNT.size + n * record.size
    return list(record.iter_unpack(message[COUNT.size : end])), memoryview(message), end
