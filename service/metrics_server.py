"""FUSEDSERVE_METRICS_PORT: /metrics on a port of its own, served by the supervisor on a thread.

A port of its own so that a Kubernetes NetworkPolicy (or a firewall) can keep it inside the cluster while the
inference port is public; the front ends then answer 404 on their /metrics. The supervisor serves it: it lives as
long as the service, and in prometheus-client's multiprocess mode any process renders the whole deployment's
values (service/metrics.py). A thread per scrape, each connection closed after SOCKET_TIMEOUT_S of silence,
answering GET /metrics only (404 elsewhere); plain HTTP, and the `metrics` rule of FUSEDSERVE_RESTRICTED_API (a header
and its value) applies here too.

As robust as the service's port (issue 53): http.server's ThreadingHTTPServer listened with a backlog of 5, started a
thread for every connection, and printed 25 lines of traceback on stderr for each connection reset by its client
(500 resets: 12,500 lines, outside the log format and level). Here the backlog is BACKLOG, at most MAX_THREADS
connections are served at once (one more is closed as it is accepted: Prometheus scrapes one at a time), a client that
resets or times out is a debug line, and any other error one warning line without a traceback. http.server bounds a
request's head itself (a line of 65,536 bytes, 100 headers).
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

log = logging.getLogger(__name__)

SOCKET_TIMEOUT_S = 10.0
BACKLOG = 128  # Prometheus and a few probes; the kernel caps it at net.core.somaxconn
MAX_THREADS = 8  # connections served at once; one scrape renders in ~10 ms


class MetricsServer:
    """GET /metrics on host:port, from a daemon thread; `close()` stops it."""

    def __init__(self, host: str, port: int, restrictions=None):
        from .frontend.auth import Restrictions

        restrictions = restrictions if restrictions is not None else Restrictions({})

        class Handler(BaseHTTPRequestHandler):
            timeout = SOCKET_TIMEOUT_S
            server_version = "fusedserve"
            sys_version = ""

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?", 1)[0] not in ("/metrics", "/metrics/"):
                    self._send(404, b"only /metrics is served on this port\n")
                    return
                if not restrictions.allows("metrics", self.headers.get(restrictions.header_for("metrics") or "")):
                    self._send(403, restrictions.refusal("metrics").encode() + b"\n")
                    return
                from .metrics import CONTENT_TYPE, render

                self._send(200, render(None), CONTENT_TYPE)

            def _send(self, status: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format, *args) -> None:  # scrapes every few seconds: not worth a line each
                pass

        self.httpd = _server_class(host)((host, port), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="metrics-port", daemon=True)
        self.thread.start()
        log.info("/metrics served on http://%s:%d/metrics (and 404 on the service's port)", host, port)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _BoundedServer(HTTPServer):
    """HTTPServer with a real backlog, a thread per connection up to MAX_THREADS, and errors in the log's format."""

    request_queue_size = BACKLOG
    allow_reuse_address = True

    def __init__(self, *args, **kwargs):
        self._slots = threading.BoundedSemaphore(MAX_THREADS)
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            log.debug("metrics port: %d connections served already; %s closed", MAX_THREADS, client_address)
            self.shutdown_request(request)
            return
        threading.Thread(target=self._serve, args=(request, client_address), daemon=True).start()

    def _serve(self, request, client_address) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self._slots.release()

    def handle_error(self, request, client_address) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, TimeoutError, socket.timeout)):  # the client's doing
            log.debug("metrics port: %s from %s", type(error).__name__, client_address)
        else:
            log.warning("metrics port: %s: %s (from %s)", type(error).__name__, error, client_address)


def _server_class(host: str):
    if ":" not in host:
        return _BoundedServer

    class V6(_BoundedServer):
        address_family = socket.AF_INET6

    return V6
