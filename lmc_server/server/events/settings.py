"""The KV-event publisher's settings: the server's (``--kv-events-*``), seen by name.

Apart from :mod:`.events` so that the publisher names what it reads in its own words
(``hwm``, ``endpoint``). Nothing is declared here: each value is read from the server's
:class:`~lmc_server.config.Config`, where the setting, its default and its range are
declared once; only the topic prefix is resolved (the host's name where none is set).
vLLM's bind-or-connect rule (:func:`binds`) lives in :mod:`lmc_server.net`, where the
server's exposure check reads it too.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from lmc_server.config import Config
from lmc_server.net import binds, endpoint_host, is_loopback

__all__ = ["KvEventSettings", "binds", "kv_event_settings", "needs_curve"]


@dataclass(frozen=True)
class KvEventSettings:
    """Where and how much: endpoints, the topic prefix, the bounds."""

    config: Config
    topic_prefix: str  # each model publishes on topic_prefix + model

    @property
    def endpoint(self) -> str:
        return self.config.kv_events_endpoint

    @property
    def replay_endpoint(self) -> str:
        return self.config.kv_events_replay_endpoint

    @property
    def hwm(self) -> int:
        """Batches queued per subscriber before sends are dropped."""
        return self.config.kv_events_hwm

    @property
    def replay_batches(self) -> int:
        """Batches kept for replay."""
        return self.config.kv_events_replay_batches

    @property
    def heartbeat_timeout_s(self) -> float:
        """A peer silent this long is disconnected (the server's heartbeat timeout)."""
        return self.config.heartbeat_timeout_s

    @property
    def curve_secret_key_file(self) -> str:
        """The server's CURVE secret key ("" without CURVE): an event socket bound on a
        non-loopback address is a CURVE server with it, admitting :attr:`curve_clients_dir`."""
        return self.config.curve_secret_key_file

    @property
    def curve_clients_dir(self) -> str:
        return self.config.curve_clients_dir


def needs_curve(endpoint: str) -> bool:
    """A socket bound at ``endpoint`` would be reachable from other machines."""
    host = endpoint_host(endpoint)
    return host is not None and not is_loopback(host)


def kv_event_settings(config: Config) -> KvEventSettings:
    """The publisher's settings from the server's (topic prefix defaulted)."""
    return KvEventSettings(config, config.kv_events_topic or f"kv@{socket.gethostname()}@")
