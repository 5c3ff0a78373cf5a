"""What `fusedserve serve` tells the person who started it: the start-up progress the engines publish (the same that
/health/ready shows) as one line redrawn in place while standard error is a terminal, and a banner at ready with
every endpoint (issue 51: the banner gave the HTTP URL alone, and a CNN's minute of warm-up showed nothing).
"""

from __future__ import annotations

import os
import time

BAR_WIDTH = 20
REDRAW_EVERY_S = 0.5


def ready_banner(settings, engines: int) -> str:
    """`fusedserve ready: HTTP http://127.0.0.1:8000 (/predict, /v2), gRPC 127.0.0.1:8001, ...`: every endpoint."""
    s = settings
    scheme = "https" if s.tls else "http"
    host = f"[{s.host}]" if ":" in s.host else s.host
    base = f"{scheme}://{host}:{s.port}"
    grpc = f"gRPC {host}:{s.grpc_port}{' (TLS)' if s.tls else ''}" if s.grpc_port is not None else "gRPC off"
    metrics = f"http://{host}:{s.metrics_port}/metrics" if s.metrics_port is not None else f"{base}/metrics"
    docs = f"{base}/docs" if s.docs else "off"
    return (
        f"fusedserve ready ({engines} engine{'s' if engines != 1 else ''}): HTTP {base} (/predict, /v2), {grpc}, "
        f"metrics {metrics}, docs {docs}, health {base}/health/ready"
    )


class TerminalProgress:
    """The engines' start-up progress ({engine: snapshot}, service/engine/startup.py) as one line redrawn in place,
    where `stream` is a terminal; elsewhere nothing (the engines log a line every 5 s anyway)."""

    def __init__(self, stream, now=time.monotonic):
        self.stream = stream
        self.on = _is_terminal(stream)
        self.now = now
        self.last = 0.0
        self.shown = False

    def update(self, read) -> None:
        """Redraw from `read()` ({engine: snapshot}), called at most every REDRAW_EVERY_S: the files are read then."""
        if not self.on or self.now() - self.last < REDRAW_EVERY_S:
            return
        self.last = self.now()
        progress = read()
        if progress:
            self._draw(render(progress))

    def clear(self) -> None:
        if self.shown:
            self._draw("")
            self.shown = False

    def _draw(self, text: str) -> None:
        # Clear the line, draw, and leave the cursor at its start: a log line from another process then writes over
        # the bar instead of after it.
        self.stream.write("\r\x1b[2K" + text + "\r")
        self.stream.flush()
        self.shown = bool(text)


def render(progress: dict[str, dict]) -> str:
    """One line for the slowest engine: a bar of its mode's buckets done, what it is on, the time so far and left."""
    key, doc = max(progress.items(), key=lambda kv: kv[1].get("step_buckets_left", 0))
    prefix = f"engine {key} " if len(progress) > 1 else ""
    if "bucket" not in doc:
        return f"{prefix}{doc.get('phase', 'starting')}... {doc.get('elapsed_s', 0):.0f} s"
    fraction = (doc["buckets_done"] + doc["steps_done"] / max(1, doc["steps"])) / max(1, doc["buckets"])
    filled = int(round(fraction * BAR_WIDTH))
    bar = "#" * filled + "-" * (BAR_WIDTH - filled)
    what = "capturing" if doc.get("capturing") else f"step {doc['steps_done'] + 1}/{doc['steps']}"
    eta = f", ~{doc['estimate_left_s']:.0f} s left" if "estimate_left_s" in doc else ""
    return (
        f"[{bar}] {prefix}{doc['phase']} {doc['mode']}: bucket {doc['bucket']} ({doc['buckets_done'] + 1}/"
        f"{doc['buckets']}), {what}; {doc.get('elapsed_s', 0):.0f} s{eta}"
    )


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False
