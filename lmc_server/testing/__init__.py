"""Helpers for tests and benchmarks: model presets and shared-memory KV caches.

Importable from an installed package, so users' own tests and ``lmcache bench`` use the
same DeepSeek-V4.1-Flash geometry as ours.
"""

from lmc_server.testing.kv import ShmKV
from lmc_server.testing.presets import KVGeometry, dsv41_flash, simple_model

__all__ = ["KVGeometry", "ShmKV", "dsv41_flash", "simple_model"]
