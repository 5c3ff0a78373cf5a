"""Handing freed memory back to the system (issue 53).

glibc's malloc keeps what a process frees for its next allocations: free chunks in the middle of its heap stay
resident, and so does the top of the heap below M_TRIM_THRESHOLD, which glibc raises as the process frees large
blocks. Connections come and go in bursts (each TLS one has uvloop's 256 KiB read buffer, OpenSSL's buffers, a
parser and a protocol; a gRPC call its frames), so after a burst a front end kept its peak: attacks of every kind of
the attack suite at once for 6 s left a front end at 117 MB from 85 while malloc had 17 MB in use; malloc_trim(0)
took it back to 90. So the front end calls malloc_trim(0) every TRIM_EVERY_TICKS of uvicorn's 0.1 s ticks
(service/frontend/app.py): with nothing to give back it takes under a millisecond; after a burst, a few ms once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

TRIM_EVERY_TICKS = 10  # 1 s: back near its baseline within 1 s of a burst's end; every 5 s the soak's peak was
# +43 MB, every 1 s +33 MB (freed memory left resident between trims)
SLOW_TRIM_S = 0.005  # a trim that took longer is logged (debug)


def trimmer() -> Callable[[], None] | None:
    """A function that trims the process's malloc heaps, or None where the C library has no malloc_trim (musl,
    macOS)."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int

    def run() -> None:
        t0 = time.perf_counter()
        trim(0)
        took = time.perf_counter() - t0
        if took > SLOW_TRIM_S:
            log.debug("malloc_trim took %.1f ms", took * 1e3)

    return run
