"""Copy plans of the kernel paths: a request's checked unit rows
(:mod:`~lmc_server.transfer.cuda.units`) laid out for copy mode ``staging`` or
``mapped``.

A plan has:

* ``units``: ``(U, UNIT_WORDS)`` rows, in launch order; ``ids``: the block ids the rows
  point into.
* ``pieces``: consecutive unit ranges. In copy mode ``staging`` each piece fills one
  half of a lane's double-buffered staging area (the first piece may be smaller, so the
  first DMA starts sooner); in mode ``mapped`` object addresses point straight into the
  pinned pool and there is one piece.
* ``segments``: per piece, the DMA copies between staging and pool
  ``(staging address, pool address, bytes)``; a unit's object bytes are one contiguous
  pool range, and units that are contiguous in the pool (sections of one object,
  neighbour slots of one slab) merge into one DMA. A DMA never crosses a slab, because
  slabs are page-locked one by one.

Every object address a plan writes is checked against its slab or staging half
(:func:`~lmc_server.transfer.cuda.units.check_objects`) before anything is launched.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lmc_server.cache.layout import RunCopy
from lmc_server.transfer.base import TransferError
from lmc_server.transfer.cuda.units import (
    N_BLOCKS,
    N_LAYERS,
    OBJECT,
    UNIT_WORDS,
    Region,
    Units,
    check_objects,
    plan_units,
)


@dataclass(frozen=True, slots=True)
class Piece:
    """Unit rows ``[first, first + count)``; ``segments`` rows are DMAs of this piece."""

    first: int
    count: int
    half: int
    segments: np.ndarray  # (k, 3) int64: staging address, pool address, bytes


@dataclass(frozen=True, slots=True)
class Plan:
    units: np.ndarray  # (U, UNIT_WORDS) int64
    ids: np.ndarray  # (N,) int64 block ids the rows' IDS_OFFSET point into
    pieces: tuple[Piece, ...]
    nbytes: int
    max_layers: int
    max_blocks: int

    @property
    def n_units(self) -> int:
        return int(self.units.shape[0])

    def box_pages(self, count: int) -> int:
        """Page slots the kernels walk for ``count`` units (the launch's work items)."""
        return count * self.max_layers * self.max_blocks


_EMPTY = Plan(np.zeros((0, UNIT_WORDS), np.int64), np.zeros(0, np.int64), (), 0, 0, 0)


def _finish(u: Units, table: np.ndarray, pieces: tuple[Piece, ...]) -> Plan:
    return Plan(
        table,
        u.ids,
        pieces,
        int(u.size.sum()),
        int(table[:, N_LAYERS].max()),
        int(table[:, N_BLOCKS].max()),
    )


def plan_mapped(copies: Sequence[RunCopy], region: Region) -> Plan:
    """One piece whose object addresses point straight into the (mapped) pool."""
    u = plan_units(copies, region)
    if u is None:
        return _EMPTY
    start = region.pool_addr(u.pool_off)
    slab_lo = region.slab_ptrs[u.pool_off // region.slab_bytes]
    check_objects(start, u.extent, slab_lo, slab_lo + region.slab_bytes)
    table = u.table
    table[:, OBJECT] = start
    return _finish(u, table, (Piece(0, table.shape[0], 0, np.zeros((0, 3), np.int64)),))


def plan_staging(
    copies: Sequence[RunCopy],
    region: Region,
    halves: Sequence[int],
    half_bytes: int,
    first_piece_bytes: int = 0,
) -> Plan:
    """Units in pool order, packed into staging halves; one piece per half-fill.

    Units whose object extents overlap (the runs of one block-major section, whose
    pages interleave) form a *cluster*, which staging mirrors byte for byte: a unit's
    staging address is its cluster's place in the half plus its offset in the cluster,
    so the kernels write staging with the same strides as the pool, and one DMA moves a
    cluster (neighbouring clusters merge). ``halves`` are the device addresses of the
    lane's staging halves (used alternately: piece ``k`` uses half ``k % len(halves)``).
    The first piece holds about ``first_piece_bytes`` (``0``: a whole half, at least one
    cluster), so the first DMA waits only for a short gather. A cluster larger than a
    half is refused (the engine sizes halves to the largest section of the request).
    """
    u = plan_units(copies, region)
    if u is None:
        return _EMPTY
    n_units = u.table.shape[0]
    order = np.argsort(u.pool_off, kind="stable")
    table = u.table[order]
    s_lo = u.pool_off[order]
    s_hi = s_lo + u.extent[order]
    starts_cluster = np.ones(n_units, dtype=bool)
    starts_cluster[1:] = s_lo[1:] >= np.maximum.accumulate(s_hi)[:-1]
    cl_first = np.flatnonzero(starts_cluster)
    n_cl = cl_first.size
    cl_lo = s_lo[cl_first]
    cl_size = np.maximum.reduceat(s_hi, cl_first) - cl_lo
    unit_cl = np.repeat(np.arange(n_cl, dtype=np.int64), np.diff(np.append(cl_first, n_units)))
    if int(cl_size.max()) > half_bytes:
        raise TransferError(
            f"one object section is {int(cl_size.max())} bytes, more than "
            f"the {half_bytes}-byte staging half"
        )
    cum_end = np.cumsum(cl_size)
    cum_start = cum_end - cl_size
    # Greedy packing at cluster boundaries: one bisection per piece, not per cluster.
    ends = cum_end.tolist()
    firsts_c = [0]
    cap = min(first_piece_bytes, half_bytes) if first_piece_bytes > 0 else half_bytes
    while True:
        f = firsts_c[-1]
        k = max(bisect.bisect_right(ends, ends[f] - int(cl_size[f]) + cap), f + 1)
        if k >= n_cl:
            break
        firsts_c.append(k)
        cap = half_bytes
    n_pieces = len(firsts_c)
    first_arr = np.asarray(firsts_c + [n_cl], dtype=np.int64)
    cl_piece = np.repeat(np.arange(n_pieces, dtype=np.int64), np.diff(first_arr))
    half_addr = np.asarray([int(halves[p % len(halves)]) for p in range(n_pieces)], dtype=np.int64)
    cl_half = half_addr[cl_piece]
    cl_stage = cl_half + cum_start - cum_start[first_arr[:-1]][cl_piece]
    unit_stage = cl_stage[unit_cl] + (s_lo - cl_lo[unit_cl])
    check_objects(unit_stage, s_hi - s_lo, cl_half[unit_cl], cl_half[unit_cl] + half_bytes)
    # DMA segments: clusters neighbouring in pool and staging, same piece and slab, merge.
    slab = cl_lo // region.slab_bytes
    joins = np.zeros(n_cl, dtype=bool)
    joins[1:] = (
        (cl_lo[1:] == cl_lo[:-1] + cl_size[:-1])
        & (cl_piece[1:] == cl_piece[:-1])
        & (slab[1:] == slab[:-1])
    )
    seg_first = np.flatnonzero(~joins)
    segments = np.empty((len(seg_first), 3), dtype=np.int64)
    segments[:, 0] = cl_stage[seg_first]
    segments[:, 1] = region.pool_addr(cl_lo[seg_first])
    segments[:, 2] = np.add.reduceat(cl_size, seg_first)
    seg_bounds = np.searchsorted(cl_piece[seg_first], np.arange(n_pieces + 1)).tolist()
    table[:, OBJECT] = unit_stage
    unit_firsts = np.append(cl_first, n_units)[first_arr].tolist()
    pieces = tuple(
        Piece(
            unit_firsts[p],
            unit_firsts[p + 1] - unit_firsts[p],
            p % len(halves),
            segments[seg_bounds[p] : seg_bounds[p + 1]],
        )
        for p in range(n_pieces)
    )
    return _finish(u, table, pieces)
