"""Helpers for tests and benchmarks: model presets and shared-memory KV caches.

Importable from an installed package, so users' own tests and ``lmcache bench`` use the
same DeepSeek-V4.1-Flash geometry as ours.

The presets are plain data; :class:`ShmKV` (which needs the client, and with it zmq) is
imported on first use, so ``import lmc_server.testing.presets`` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmc_server.testing.presets import KVGeometry, dsv41_flash, llama3_8b, simple_model

if TYPE_CHECKING:
    from lmc_server.testing.kv import ShmKV


def __getattr__(name: str) -> Any:
    if name == "ShmKV":
        from lmc_server.testing.kv import ShmKV

        return ShmKV
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["KVGeometry", "ShmKV", "dsv41_flash", "llama3_8b", "simple_model"]
