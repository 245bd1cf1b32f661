"""An L1 index in process for the cache core's tests: a ready pool, views, block ids."""

from __future__ import annotations

import numpy as np

from lmc_server.cache.index import L1Index
from lmc_server.cache.layout import build_layout
from lmc_server.cache.view import CacheView
from lmc_server.testing.presets import dsv41_flash

MIB = 1 << 20


def make_index(pool_mib: int = 64, slab_mib: int = 16, policy: str = "LRU") -> L1Index:
    """An index over a pool whose every slab is ready."""
    index = L1Index(pool_mib * MIB, slab_mib * MIB, policy)
    for s in range(index.pool_usage().slabs):
        index.slab_ready(s)
    return index


def dsv_view(index: L1Index, separate: bool = True, ns: str = "ns", **kw: object) -> CacheView:
    """A view of the DeepSeek-V4.1-Flash preset (``kw``: its parameters) at 256-token chunks."""
    geo = dsv41_flash(**kw)  # type: ignore[arg-type]
    return index.view(ns, build_layout(geo.groups, 256, separate))


def ids_for(
    view: CacheView, n: int, missing: dict[int, list[int]] | None = None
) -> dict[int, np.ndarray]:
    """Consecutive block ids per cached group; ``missing`` sets chunks' blocks to -1."""
    out = {}
    for og in view.layout.object_groups:
        for sec in og.sections:
            bpc = sec.blocks_per_chunk
            a = np.arange(n * bpc, dtype=np.int64).reshape(n, bpc) % 64
            for c in (missing or {}).get(sec.group_index, []):
                a[c] = -1
            out[sec.group_index] = a
    return out


def store(
    index: L1Index, view: CacheView, keys: list[bytes], ids: dict[int, np.ndarray] | None = None
) -> list[np.ndarray]:
    """Reserve and commit ``keys`` (no bytes: the index alone); the statuses."""
    t = index.reserve_store(view, keys, ids if ids is not None else ids_for(view, len(keys)))
    index.commit_store(t)
    return t.statuses
