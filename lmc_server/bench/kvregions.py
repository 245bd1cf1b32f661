"""Block regions of a benchmark KV cache, bytes moved per request, and byte checks.

The throughput benchmark stores from two source regions (``A1``, ``A2``: different
random contents) and retrieves into a third (``B``). A retrieve writes, per the hit
rule, every stored block of full-prefix sections but only the window's blocks of the
last chunks for sliding-window sections; :class:`Regions` knows exactly which blocks
those are, so both the byte count of a transfer and its verification follow the
server's own layout (:func:`lmc_server.cache.layout.build_layout`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lmc_server.cache.geometry import GroupSpec, blocks_per_chunk
from lmc_server.cache.layout import RegistrationLayout, SectionLayout, build_layout
from lmc_server.testing.kv import ShmKV
from lmc_server.testing.presets import KVGeometry

A1, A2, B = 0, 1, 2


def max_blocks_per_chunk(geometry: KVGeometry, chunk_size: int) -> int:
    return max(blocks_per_chunk(g, chunk_size) for g in geometry.groups if g.cached)


@dataclass(frozen=True)
class Regions:
    """Block ids of the three regions for every cached group of ``geometry``."""

    geometry: KVGeometry
    chunk_size: int
    max_batch: int
    layout: RegistrationLayout
    #: ``consecutive``: a region's blocks in order, as a fresh engine hands them out;
    #: ``random``: a fixed random permutation of each region's blocks, as an engine's
    #: block pool hands them out after much churn (no two pages of a chunk adjacent).
    block_order: str = "consecutive"
    #: (group, region) -> block order, made once (the timing loops ask per request)
    _orders: dict[tuple[str, int], np.ndarray] = field(
        default_factory=dict, compare=False, repr=False
    )

    @classmethod
    def build(
        cls,
        geometry: KVGeometry,
        chunk_size: int,
        max_batch: int,
        separate: bool,
        block_order: str = "consecutive",
    ) -> Regions:
        if block_order not in ("consecutive", "random"):
            raise ValueError(f"block order {block_order!r}: expected consecutive or random")
        return cls(
            geometry,
            chunk_size,
            max_batch,
            build_layout(geometry.groups, chunk_size, separate),
            block_order,
        )

    def _order(self, g: GroupSpec, region: int) -> np.ndarray:
        """Block ids of ``region`` in the order chunks use them."""
        order = self._orders.get((g.name, region))
        if order is None:
            n = self.max_batch * self.bpc(g)
            first = region * n
            if self.block_order == "consecutive":
                order = np.arange(first, first + n, dtype=np.int32)
            else:
                seed = sum(ord(ch) for ch in g.name) * 7 + region
                order = (first + np.random.default_rng(seed).permutation(n)).astype(np.int32)
            order.flags.writeable = False  # callers get slices of it
            self._orders[(g.name, region)] = order
        return order

    def _group(self, name: str) -> GroupSpec:
        for g in self.geometry.groups:
            if g.name == name:
                return g
        raise KeyError(name)

    def bpc(self, g: GroupSpec) -> int:
        return blocks_per_chunk(g, self.chunk_size)

    def ids(self, region: int, n_chunks: int) -> dict[str, np.ndarray]:
        """Consecutive block ids of ``n_chunks`` chunks in ``region``, per cached group."""
        assert n_chunks <= self.max_batch, "batch larger than the regions"
        out = {}
        for g in self.geometry.groups:
            if g.cached:
                out[g.name] = self._order(g, region)[: n_chunks * self.bpc(g)]
        return out

    def sections(self) -> list[SectionLayout]:
        return [s for og in self.layout.object_groups for s in og.sections]

    def store_bytes(self, n_chunks: int) -> int:
        return n_chunks * self.layout.chunk_bytes

    def retrieved_chunks(self, sec: SectionLayout, n_chunks: int) -> range:
        """Chunk indices whose ``sec`` blocks a retrieve of ``n_chunks`` writes."""
        if not sec.is_window:
            return range(n_chunks)
        return range(max(0, n_chunks - self.layout.windows[sec.window_tokens]), n_chunks)

    def retrieve_bytes(self, n_chunks: int) -> int:
        return sum(s.nbytes * len(self.retrieved_chunks(s, n_chunks)) for s in self.sections())

    def written_blocks(self, sec: SectionLayout, region: int, n_chunks: int) -> list[int]:
        """Block ids in ``region`` that a retrieve of ``n_chunks`` writes for ``sec``."""
        order = self._order(self._group(sec.group_name), region).tolist()
        return [
            order[c * sec.blocks_per_chunk + sec.first_block + j]
            for c in self.retrieved_chunks(sec, n_chunks)
            for j in range(sec.n_blocks)
        ]

    def mismatched_bytes(self, kv: Any, src: int, dst: int, n_chunks: int) -> int:
        """Bytes of region ``dst`` that differ from region ``src`` where a retrieve of
        ``n_chunks`` stored from ``src`` must have written ``dst``."""
        bad = 0
        for sec in self.sections():
            a = self.written_blocks(sec, src, n_chunks)
            b = self.written_blocks(sec, dst, n_chunks)
            if isinstance(kv, ShmKV):
                bad += _shm_mismatch(kv, self._group(sec.group_name), a, b)
            else:
                pa = np.frombuffer(kv.pages(sec.group_name, a), dtype=np.uint8)
                pb = np.frombuffer(kv.pages(sec.group_name, b), dtype=np.uint8)
                bad += int(np.count_nonzero(pa != pb)) + abs(pa.size - pb.size)
        return bad


def _runs(blocks: list[int]) -> list[tuple[int, int]]:
    """``(first, count)`` of consecutive runs in ``blocks``."""
    out: list[tuple[int, int]] = []
    for b in blocks:
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out


def _shm_mismatch(kv: ShmKV, g: GroupSpec, a: list[int], b: list[int]) -> int:
    """Compare pages in place through strided views (no copies of the pages)."""
    bad = 0
    for spec in g.layers:
        arr = kv.segments[spec.buffer].array
        for (fa, na), (fb, nb) in zip(_runs(a), _runs(b), strict=True):
            assert na == nb, "regions are laid out alike"
            va = np.ndarray(
                (na, spec.page_bytes),
                np.uint8,
                arr,
                spec.offset + fa * spec.block_stride,
                (spec.block_stride, 1),
            )
            vb = np.ndarray(
                (nb, spec.page_bytes),
                np.uint8,
                arr,
                spec.offset + fb * spec.block_stride,
                (spec.block_stride, 1),
            )
            bad += int(np.count_nonzero(va != vb))
    return bad
