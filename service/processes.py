"""What every child process of the service does first, and how it logs."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator

# A child's exit code for a start that cannot succeed (its app's start-up failed): the supervisor does not start it
# again, since a new process would fail the same way, again and again. 3 is uvicorn's own code for this.
STARTUP_FAILED = 3
# What a front-end process serves (supervisor.frontend_roles hands each its own; frontend.app.frontend_main).
HTTP, GRPC, HTTP_AND_GRPC = "http", "grpc", "http+grpc"
LOG_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"


# Signals a child must not die of before child_setup has ignored them: a group's SIGHUP (a reload meant for the
# supervisor, a terminal's hangup) or SIGINT (Ctrl-C) arriving while the child's interpreter starts and imports (torch
# in an engine: seconds) ended it, and a start before the model was read then stopped the whole service.
STARTUP_SIGNALS = (signal.SIGHUP, signal.SIGINT)


@contextlib.contextmanager
def signals_held_for_children() -> Iterator[None]:
    """Around starting a child: STARTUP_SIGNALS blocked, so that the child, which inherits the mask through fork and
    exec, holds them until child_setup ignores them; and SIGINT ignored too, since a new interpreter unblocks SIGINT
    but leaves an ignored one ignored. Here they are taken once the block ends, as before (Linux keeps a blocked
    signal pending even while it is ignored)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STARTUP_SIGNALS)
    main = threading.current_thread() is threading.main_thread()  # signal.signal works there alone
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        yield
    finally:
        if main:
            signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def child_setup(name: str) -> None:
    """Leave the supervisor's process group, so that a signal to the group (Ctrl-C, `kill -- -PGID`) reaches
    the supervisor alone and each child is stopped once, in order (front ends, then engines); and die with the
    supervisor, so that no child outlives it even when it is killed outright. `name` (15 bytes at most) is the
    process's name in ps and top, and in /proc/<pid>/comm."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A SIGHUP meant for the supervisor (a reload) that reaches a child must not end it: children take new settings
    # from the supervisor (service/link/live.py), never from a signal.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STARTUP_SIGNALS)  # held since the start (signals_held_for_children)
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            pr_set_pdeathsig, pr_set_name = 1, 15
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
            libc.prctl(pr_set_name, ctypes.c_char_p(name.encode()[:15]))
        except (OSError, AttributeError):
            pass
    if os.getppid() == 1:  # the supervisor died before prctl took effect
        os._exit(1)


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)


def set_log_level(level: str) -> None:
    """A new log level for this process (a reload): the root logger's, and uvicorn's, which it sets on its own."""
    for name in ("", "uvicorn", "uvicorn.error"):
        logging.getLogger(name).setLevel(level.upper())
