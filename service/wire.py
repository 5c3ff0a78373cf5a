"""The messages between front ends and engines: ZeroMQ multipart messages of fixed-size headers and raw float32.

Front end -> engine (DEALER -> ROUTER), one message per event-loop turn, holding every request the front
end took in that turn:
    frame 0: records of REQUEST (kind, id, rows, deadline), one per request or cancellation
    frame 1..: the float32 rows of each SUBMIT record, in order (C-contiguous, (rows, *input_shape))
Engine -> front end, one message per front end per batch:
    frame 0: records of REPLY (id, status, rows)
    frame 1..: per record, the float32 outputs (rows, output_features) when OK, else a UTF-8 message

No JSON, msgpack or pickle on this path: a header is struct-packed and the rows travel as the bytes
numpy already holds, so a request costs its copy into the socket and nothing else.
"""

from __future__ import annotations

import struct

REQUEST = struct.Struct("<BQId")  # kind, id, rows, deadline (time.monotonic(), shared by the host's processes)
REPLY = struct.Struct("<QBI")  # id, status, rows

SUBMIT = 1
CANCEL = 2

OK = 0
OVERLOADED = 1  # the engine's queue was full: 503
TIMEOUT = 2  # the deadline passed before the batch ran: 504
FAILED = 3  # the forward raised: 500
SHUTTING_DOWN = 4  # the engine is stopping: 503

STATUS_NAMES = {OK: "ok", OVERLOADED: "overloaded", TIMEOUT: "timeout", FAILED: "failed", SHUTTING_DOWN: "stopping"}

# Engine states, shared with front ends and the supervisor through one integer per engine.
LOADING, WARMING, READY, FAILED_START, STOPPED = 0, 1, 2, 3, 4
ENGINE_STATES = {LOADING: "loading", WARMING: "warming", READY: "ready", FAILED_START: "failed", STOPPED: "stopped"}
