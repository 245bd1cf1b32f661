"""The registry a metrics endpoint serves: the server's collector and the process and
platform collectors of prometheus_client."""

from __future__ import annotations

from prometheus_client import PlatformCollector, ProcessCollector
from prometheus_client.registry import CollectorRegistry

from lmc_server.metrics.collector import ServerCollector


def make_registry(collector: ServerCollector) -> CollectorRegistry:
    """A registry with the server collector and the process/platform collectors
    (``process_*``: CPU seconds, resident memory, open fds; ``python_info``)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry
