"""The KV-event publisher's settings, from the server's (``--kv-events-*``).

Apart from :mod:`.events` so that the publisher takes only what it needs (not the whole
``Config``) and so that vLLM's bind-or-connect rule is read in one place.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from lmc_server.config import Config


@dataclass(frozen=True)
class KvEventSettings:
    """Where and how much: endpoints, the topic prefix, the bounds."""

    endpoint: str
    replay_endpoint: str = ""
    topic_prefix: str = ""
    hwm: int = 100_000  # batches queued per subscriber before sends are dropped
    replay_batches: int = 10_000  # batches kept for replay
    heartbeat_timeout_s: float = 4.0  # a peer silent this long is disconnected


def binds(endpoint: str) -> bool:
    """vLLM's rule for its PUB endpoint, kept so a vLLM ``--kv-events-config`` endpoint
    means the same here: bind a wildcard (``*``, ``::``) or ipc endpoint, connect to any
    other (a router that binds its SUB socket, as llm-d's indexer does centrally)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def kv_event_settings(config: Config) -> KvEventSettings:
    """The publisher's settings from the server's (topic prefix defaulted)."""
    return KvEventSettings(
        endpoint=config.kv_events_endpoint,
        replay_endpoint=config.kv_events_replay_endpoint,
        topic_prefix=config.kv_events_topic or f"kv@{socket.gethostname()}@",
        hwm=config.kv_events_hwm,
        replay_batches=config.kv_events_replay_batches,
        heartbeat_timeout_s=config.heartbeat_timeout_s,
    )
