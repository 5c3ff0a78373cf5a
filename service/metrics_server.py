"""FUSEDSERVE_METRICS_PORT: /metrics on a port of its own, served by the supervisor on a thread.

A port of its own so that a Kubernetes NetworkPolicy (or a firewall) can keep it inside the cluster while the
inference port is public; the front ends then answer 404 on their /metrics. The supervisor serves it: it lives as
long as the service, and in prometheus-client's multiprocess mode any process renders the whole deployment's
values (service/metrics.py). A thread per scrape (http.server's ThreadingHTTPServer), each connection closed after
SOCKET_TIMEOUT_S of silence, answering GET /metrics only (404 elsewhere); plain HTTP, and the `metrics` rule of
FUSEDSERVE_RESTRICTED_API (a header and its value) applies here too.
"""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger(__name__)

SOCKET_TIMEOUT_S = 10.0


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

        family_server = _server_class(host)
        self.httpd = family_server((host, port), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="metrics-port", daemon=True)
        self.thread.start()
        log.info("/metrics served on http://%s:%d/metrics (and 404 on the service's port)", host, port)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _server_class(host: str):
    if ":" not in host:
        return ThreadingHTTPServer
    import socket

    class V6(ThreadingHTTPServer):
        address_family = socket.AF_INET6

    return V6
