"""Socket options and CURVE for the event sockets (the PUB socket and the replay ROUTER).

Both sockets follow one rule set: no linger, dual-stack, ZMTP heartbeats so a
subscriber that is gone or stopped is disconnected and its queue freed; and a socket
bound where other machines reach it is a CURVE server admitting the server's clients
when the server has CURVE (the configuration refuses such an endpoint without CURVE
unless ``--kv-events-allow-remote``). One authenticator serves both, started by the
first socket that needs it.
"""

from __future__ import annotations

from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from lmc_server.server.events.settings import KvEventSettings, needs_curve
from lmc_server.server.security import curve_server, start_authenticator


def heartbeat(sock: zmq.Socket[Any], timeout_s: float) -> None:
    """No linger; ZMTP heartbeats of ``timeout_s``, so a subscriber that is gone or
    stopped (its zmq thread no longer answers) is disconnected and its queue freed."""
    hb_ms = int(timeout_s * 1000)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IPV6, 1)  # dual-stack: tcp://[::1]:PORT binds
    sock.setsockopt(zmq.HEARTBEAT_IVL, max(100, hb_ms // 4))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, hb_ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, hb_ms)


class Curve:
    """The CURVE authenticator of one publisher's context, started on first use and
    stopped by :meth:`stop` (before the context is terminated)."""

    def __init__(self, ctx: zmq.Context[Any], settings: KvEventSettings) -> None:
        self._ctx = ctx
        self._settings = settings
        self._auth: ThreadAuthenticator | None = None

    @property
    def started(self) -> bool:
        return self._auth is not None

    def secure(self, sock: zmq.Socket[Any], endpoint: str) -> None:
        """Make ``sock``, about to be bound on ``endpoint``, a CURVE server when the
        server has CURVE and other machines reach ``endpoint``; else leave it as is."""
        s = self._settings
        if not s.curve_secret_key_file or not needs_curve(endpoint):
            return
        if self._auth is None:
            self._auth = start_authenticator(self._ctx, s.curve_clients_dir)
        curve_server(sock, s.curve_secret_key_file)

    def stop(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
