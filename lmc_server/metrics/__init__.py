"""Prometheus metrics and health over HTTP.

:mod:`.collector` turns the server's plain counters into metric families at scrape
time; :mod:`.endpoint` serves them (and ``/healthz``) from a thread. The server wires
them in :func:`make_registry` so that tests and tools can scrape the same registry.
"""

from __future__ import annotations

from prometheus_client import PlatformCollector, ProcessCollector
from prometheus_client.registry import CollectorRegistry

from lmc_server.metrics.collector import (
    CounterCollector,
    LiveState,
    ServerCollector,
    ServerInfo,
)
from lmc_server.metrics.endpoint import MetricsServer


def make_registry(collector: ServerCollector) -> CollectorRegistry:
    """A registry with the server collector and the process/platform collectors
    (``process_*``: CPU seconds, resident memory, open fds; ``python_info``)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


__all__ = [
    "CounterCollector",
    "LiveState",
    "MetricsServer",
    "ServerCollector",
    "ServerInfo",
    "make_registry",
]
