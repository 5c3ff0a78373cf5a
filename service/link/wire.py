"""The messages between front ends and engines: fixed-size headers and raw rows (service/link/stream.py carries them).

Engine -> front end, first on every connection: HELLO (magic, the engine's wire dtype, FLAGS: DECODES_JPEG where the
    engine decodes JPEGs itself, on its GPU).
Front end -> engine, first on every connection: an empty message carrying the front end's arena (service/link/arena.py)
    as a file descriptor (SCM_RIGHTS), when it has one.
Front end -> engine, one message per event-loop turn (or per FLUSH_EVERY requests of a long one), holding the
    requests the front end took in since its last message:
    COUNT (records), then that many REQUEST records (kind, dtype, id, rows, offset, deadline, arrival), one per
    request or cancellation, then the rows of each SUBMIT record in order (C-contiguous, (rows, *input_shape), in
    its dtype); a SUBMIT_SHARED record's rows are in the arena at `offset` instead. SUBMIT_IMAGES (and
    SUBMIT_IMAGES_SHARED, in the arena at `offset`) carries `rows` images as an IMAGES block instead of rows (below):
    the files the front end found to be JPEGs nvJPEG takes, encoded, and any other image of the request as its
    prepared row (uint8, channels x height x width)
Engine -> front end, one message per front end per batch:
    COUNT, then REPLY records (id, status, mode, rows, payload bytes), then the payloads in order: the outputs
    (rows, output_features) in the engine's wire dtype when OK, else a UTF-8 message. `mode` says which executor
    computed the outputs (MODES: fused, unfused, or MODE:DTYPE such as fused:float16 where the A/B compares precisions;
    NO_MODE where no forward ran), so that in `ab` mode every answer
    and the front end's request metrics name it. Every submitted request
    gets exactly one REPLY, a cancelled one too (CANCELLED), so that the front end knows when the engine is done
    with its rows. DECODE_ON_CPU: the engine's GPU decoder did not take a JPEG of a SUBMIT_IMAGES request (nvJPEG
    refused it): the front end decodes the request's files itself (Pillow) and submits rows; nothing else of the batch
    is affected.

An IMAGES block: IMAGES (its bytes after this header), then one IMAGE record (kind, bytes, height, width) per image,
then each image's bytes in order: ENCODED_JPEG a JPEG file as the client sent it (its size from its header: the
engine bounds the pixels of one GPU decode call), PREPARED_ROW a row of the model's input as uint8 pixels. Its size
is bounded by the request body's limit (FUSEDSERVE_MAX_IMAGE_BODY_BYTES), as the files are.

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
IMAGES = struct.Struct("<I")  # bytes of the IMAGE records and the files after it
IMAGE = struct.Struct("<BIHH")  # kind (ENCODED_JPEG, PREPARED_ROW), bytes, height, width (a JPEG's header's)
ENCODED_JPEG = 0
PREPARED_ROW = 1
REPLY = struct.Struct("<QBBII")  # id, status, mode (an index into MODES, or NO_MODE), rows, payload bytes
# fused and unfused, then MODE:DTYPE for an A/B of two precisions (FUSEDSERVE_AB_OTHER; service/engine/ab.py's labels)
MODES = ("fused", "unfused") + tuple(
    f"{m}:{d}" for m in ("fused", "unfused") for d in ("float32", "float16", "bfloat16", "float8")
)
NO_MODE = 255

SUBMIT = 1
CANCEL = 2
SUBMIT_SHARED = 3
SUBMIT_IMAGES = 4
SUBMIT_IMAGES_SHARED = 5

# a request's rows, a HELLO's wire dtype: by index. uint8: a uint8 model's pixels, sent as they are whatever the
# HELLO says (a quarter of float32's bytes); a HELLO never names it (outputs are float).
DTYPES = (np.dtype("<f4"), np.dtype("<f2"), np.dtype("u1"))
FLOAT32 = 0
UINT8 = 2
HELLO = struct.Struct("<4sBB")  # magic, wire dtype, flags
MAGIC = b"FSE3"  # FSE2: REPLY carries the mode; FSE3: HELLO carries flags
DECODES_JPEG = 1  # a HELLO flag: the engine takes SUBMIT_IMAGES (service/images/gpu_decode.py)

OK = 0
OVERLOADED = 1  # the engine's queue was full: 503
TIMEOUT = 2  # the deadline passed before the batch ran: 504
FAILED = 3  # the forward raised: 500
SHUTTING_DOWN = 4  # the engine is stopping: 503
CANCELLED = 5  # the front end cancelled it and the engine dropped it unrun: nothing to answer, its rows are free
DECODE_ON_CPU = 6  # a SUBMIT_IMAGES request the GPU decoder did not take: the front end decodes it and sends rows

STATUS_NAMES = {
    OK: "ok", OVERLOADED: "overloaded", TIMEOUT: "timeout", FAILED: "failed", SHUTTING_DOWN: "stopping",
    CANCELLED: "cancelled", DECODE_ON_CPU: "decode_on_cpu",
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


def hello(dtype: np.dtype, flags: int = 0) -> bytes:
    return HELLO.pack(MAGIC, DTYPES.index(np.dtype(dtype)), flags)


def read_hello(message) -> tuple[int, int]:
    """(the wire dtype a HELLO announces, as its index into DTYPES; its flags); ValueError for anything else (an
    engine of another version)."""
    if len(message) != HELLO.size:
        raise ValueError(f"expected the engine's HELLO ({HELLO.size} bytes), got {len(message)} bytes")
    magic, code, flags = HELLO.unpack(message)
    if magic != MAGIC or code >= UINT8:
        raise ValueError(f"the engine's HELLO is {bytes(message)!r}; this front end speaks {MAGIC!r}")
    return code, flags


def images_size(items: list[tuple[int, bytes, int, int]]) -> int:
    """The bytes of the IMAGES block of `items` ((kind, bytes, height, width) per image), its header included."""
    return IMAGES.size + sum(IMAGE.size + len(item[1]) for item in items)


def pack_images(items: list[tuple[int, bytes, int, int]], out=None) -> bytes | None:
    """The IMAGES block of `items` ((kind, bytes-like, height, width) per image): returned, or written into `out` (a
    writable buffer of images_size(items) bytes)."""
    heads = [IMAGE.pack(kind, len(data), h, w) for kind, data, h, w in items]
    parts = [IMAGES.pack(sum(len(h) + len(item[1]) for h, item in zip(heads, items, strict=True))), *heads,
             *(item[1] for item in items)]  # fmt: skip
    if out is None:
        return b"".join(parts)
    at = 0
    for p in parts:
        n = len(p) if not isinstance(p, memoryview) else p.nbytes
        out[at : at + n] = p
        at += n
    return None


def unpack_images(buf, at: int, count: int, end: int) -> tuple[list[tuple[int, memoryview, int, int]], int]:
    """The `count` images of the IMAGES block at `at` of `buf` (views of it, no copy) and where the block ends;
    ValueError where the block does not fit within `end` or does not hold `count` images."""
    view = memoryview(buf)
    if at + IMAGES.size > end:
        raise ValueError("the images block's header is cut")
    (size,) = IMAGES.unpack_from(view, at)
    start, stop = at + IMAGES.size, at + IMAGES.size + size
    if stop > end or count * IMAGE.size > size:
        raise ValueError(f"the images block of {size} bytes for {count} images does not fit")
    heads = list(IMAGE.iter_unpack(view[start : start + count * IMAGE.size]))
    at = start + count * IMAGE.size
    out = []
    for kind, n, height, width in heads:
        if at + n > stop or kind not in (ENCODED_JPEG, PREPARED_ROW):
            raise ValueError("an image of the images block runs past its end, or is of an unknown kind")
        out.append((kind, view[at : at + n], height, width))
        at += n
    return out, stop


def unpack(message, record: struct.Struct) -> tuple[list[tuple], memoryview, int]:
    """(records, the message as a memoryview, offset of the first payload)."""
    (n,) = COUNT.unpack_from(message)
    end = COUNT.size + n * record.size
    return list(record.iter_unpack(message[COUNT.size : end])), memoryview(message), end
