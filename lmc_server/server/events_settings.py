"""The KV-event publisher's settings, from the server's (``--kv-events-*``).

Apart from :mod:`.events` so that the publisher takes only what it needs (not the whole
``Config``). vLLM's bind-or-connect rule (:func:`binds`) lives in :mod:`lmc_server.net`,
where the server's exposure check reads it too.
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

    endpoint: str
    replay_endpoint: str = ""
    topic_prefix: str = ""
    hwm: int = 100_000  # batches queued per subscriber before sends are dropped
    replay_batches: int = 10_000  # batches kept for replay
    heartbeat_timeout_s: float = 4.0  # a peer silent this long is disconnected
    #: The server's CURVE secret key file and admitted clients (both "" without CURVE):
    #: an event socket bound on a non-loopback address is a CURVE server with them.
    curve_secret_key_file: str = ""
    curve_clients_dir: str = ""


def needs_curve(endpoint: str) -> bool:
    """A socket bound at ``endpoint`` would be reachable from other machines."""
    host = endpoint_host(endpoint)
    return host is not None and not is_loopback(host)


def kv_event_settings(config: Config) -> KvEventSettings:
    """The publisher's settings from the server's (topic prefix defaulted)."""
    return KvEventSettings(
        endpoint=config.kv_events_endpoint,
        replay_endpoint=config.kv_events_replay_endpoint,
        topic_prefix=config.kv_events_topic or f"kv@{socket.gethostname()}@",
        hwm=config.kv_events_hwm,
        replay_batches=config.kv_events_replay_batches,
        heartbeat_timeout_s=config.heartbeat_timeout_s,
        curve_secret_key_file=config.curve_secret_key_file,
        curve_clients_dir=config.curve_clients_dir,
    )
