"""The metrics HTTP endpoint: ``/metrics`` and ``/healthz`` on one small threaded server.

It runs on its own thread (one more per connection, from ``ThreadingHTTPServer``) so a
slow scraper never blocks the event loop; what it reads is described in
:mod:`lmc_server.metrics.collector`. ``/healthz`` answers ``200`` with ``ok: <reason>``
while the server serves requests and ``503`` with the reason otherwise (starting,
draining, event loop stalled), one line, for load balancers and ``curl -f``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry

from lmc_server.net import address_family, bare_host
from lmc_server.threadnames import name_os_thread

log = logging.getLogger(__name__)

#: The listening thread's name; each scrape's thread is ``lmc-metrics-req``.
METRICS_THREAD = "lmc-metrics"
#: Seconds a client may take to send its request line before it is dropped.
REQUEST_TIMEOUT_S = 10.0


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        name_os_thread(f"{METRICS_THREAD}-req")
        super().process_request_thread(request, client_address)


class MetricsServer:
    """Serve ``registry`` at ``/metrics`` and ``health()`` at ``/healthz`` on host:port.

    :meth:`start` binds (raising ``OSError`` naming the address and ``--metrics-port``
    if the port is taken, so a bad setting fails startup rather than silently losing
    metrics) and returns once listening.
    """

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        health: Callable[[], tuple[bool, str]],
    ) -> None:
        self.host = bare_host(host)
        self.port = port
        self.registry = registry
        self.health = health
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        handler = _make_handler(self.registry, self.health)
        cls: type[_HTTPServer] = _HTTPServer
        family = address_family(self.host)
        if family != _HTTPServer.address_family:  # IPv6 literal, or a name only IPv6
            cls = type("_HTTPServer6", (_HTTPServer,), {"address_family": family})
        try:
            self._httpd = cls((self.host, self.port), handler)
        except OSError as e:
            raise OSError(
                f"cannot serve metrics on {self.address}: {e.strerror or e}; choose "
                f"another --metrics-port (0 turns the endpoint off)"
            ) from None
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(
            target=_serve, args=(self._httpd,), name=METRICS_THREAD, daemon=True
        )
        self._thread.start()
        log.info("metrics at %s/metrics, health at %s/healthz", self.address, self.address)

    def stop(self) -> None:
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join()
        self._httpd = None
        self._thread = None


def _serve(httpd: _HTTPServer) -> None:
    name_os_thread()
    httpd.serve_forever(poll_interval=0.2)


def _make_handler(
    registry: CollectorRegistry, health: Callable[[], tuple[bool, str]]
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "lmcache-metrics"
        timeout = REQUEST_TIMEOUT_S

        def do_GET(self) -> None:
            self._answer(send_body=True)

        def do_HEAD(self) -> None:
            self._answer(send_body=False)

        def _answer(self, send_body: bool) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
                try:
                    body = encoder(registry)
                except Exception:
                    log.exception("metrics collection failed")
                    self._reply(500, b"metrics collection failed (logged)\n", send_body)
                    return
                self._reply(200, body, send_body, content_type)
            elif path == "/healthz":
                serving, reason = health()
                line = (f"ok: {reason}" if serving else reason) + "\n"
                self._reply(200 if serving else 503, line.encode(), send_body)
            elif path == "/":
                self._reply(200, b"lmcache server: /metrics /healthz\n", send_body)
            else:
                self._reply(404, b"not found: try /metrics or /healthz\n", send_body)

        def _reply(
            self,
            code: int,
            body: bytes,
            send_body: bool,
            content_type: str = "text/plain; charset=utf-8",
        ) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            if send_body:
                self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("metrics http: %s", format % args)

    return Handler
