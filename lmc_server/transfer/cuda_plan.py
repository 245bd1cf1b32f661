"""Copy plans for the CUDA engine: run descriptors expanded into page descriptors.

Pure numpy (no CuPy), so every address computation and range check is testable on a
CPU-only host. A plan has three parts:

* ``desc``: one row ``(page address, object address, bytes)`` per page, ``uint64``,
  uploaded to the GPU in one copy; the kernels in ``kernels/copy_pages.cu`` read it.
* ``pieces``: consecutive descriptor ranges. In copy mode ``staging`` each piece fills
  one half of a lane's double-buffered staging area; in mode ``mapped`` the object
  addresses point straight into the pinned pool and there is one piece.
* ``segments``: per piece, the DMA copies between staging and pool
  ``(staging address, pool address, bytes)``; an object run is one contiguous pool
  range, and runs that are contiguous in the pool (sections of one object, neighbour
  slots of one slab) are merged into one DMA. A DMA never crosses a slab, because slabs
  are page-locked one by one.

Invariants: every page range lies inside the registered buffer it belongs to, every
object range inside the pool (one slab) or inside the staging half of its piece, and no
unit (one run of one chunk) straddles two pieces. :func:`_expand` checks the first (the
exact envelope of each run's pages: lowest and highest block of its first and last
layer) and :func:`check_objects` the second, per unit, before anything is launched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lmc_server.cache.layout import RunCopy
from lmc_server.transfer.base import TransferError


@dataclass(frozen=True, slots=True)
class Region:
    """Address ranges a plan may touch: the mapping's buffers and the pool."""

    buffer_ptrs: np.ndarray  # int64 device address of each registered buffer
    buffer_sizes: np.ndarray  # int64 bytes
    slab_ptrs: np.ndarray  # int64 address of each pool slab (0: not ready)
    pool_bytes: int
    slab_bytes: int

    def pool_addr(self, offsets: np.ndarray) -> np.ndarray:
        """Addresses of pool byte offsets (no offset range spans two slabs)."""
        slab = offsets // self.slab_bytes
        base = self.slab_ptrs[slab]
        if not base.all():
            raise TransferError("an object lies in a pool slab that is not ready")
        return base + offsets % self.slab_bytes


@dataclass(frozen=True, slots=True)
class Piece:
    """Descriptors ``[first, first + count)``; ``segments`` rows are DMAs of this piece."""

    first: int
    count: int
    half: int
    segments: np.ndarray  # (k, 3) int64: staging address, pool address, bytes


@dataclass(frozen=True, slots=True)
class Plan:
    desc: np.ndarray  # (n, 3) uint64
    pieces: tuple[Piece, ...]
    nbytes: int

    @property
    def n_desc(self) -> int:
        return int(self.desc.shape[0])


@dataclass(frozen=True, slots=True)
class _Units:
    """Units (one run of one chunk) and their pages, flat, in unit-major order.

    Unit ``u`` owns page rows ``[row_start[u], row_start[u] + n_pages[u])``; a row's
    ``rel`` is its offset inside the unit's object range.
    """

    pool_off: np.ndarray  # (U,) int64
    size: np.ndarray  # (U,) int64
    n_pages: np.ndarray  # (U,) int64
    row_start: np.ndarray  # (U,) int64
    page_ptr: np.ndarray  # (R,) int64
    rel: np.ndarray  # (R,) int64
    nbytes: np.ndarray  # (R,) int64
    keep: np.ndarray | None  # (R,) bool, None when no block is -1


def _check_copy(ci: int, c: RunCopy, region: Region) -> tuple[np.ndarray, bool] | None:
    """Check one copy's ranges; its ``block ids >= 0`` mask and whether any is -1.

    ``None`` when the copy has nothing to do (no chunks, or every block -1).
    """
    r = c.run
    ids, offs = c.block_ids, c.object_offsets
    if ids.ndim != 2 or ids.shape[1] != r.n_blocks or offs.shape != (ids.shape[0],):
        raise TransferError(f"copy {ci}: block ids {ids.shape} / object offsets "
                            f"{offs.shape} do not match {r.n_blocks} blocks per chunk")
    if not 0 <= r.buffer < len(region.buffer_ptrs):
        raise TransferError(f"copy {ci}: buffer {r.buffer} is not registered")
    if r.page_bytes <= 0 or r.n_layers <= 0 or r.n_blocks <= 0:
        raise TransferError(f"copy {ci}: empty run")
    if ids.shape[0] == 0:
        return None
    lo_id, hi_id = int(ids.min()), int(ids.max())
    if lo_id < -1:
        raise TransferError(f"copy {ci}: negative block id {lo_id}")
    mask = ids >= 0
    holes = lo_id == -1
    if holes:
        if hi_id < 0:
            return None
        lo_id = int(ids[mask].min())
    last_layer = (r.n_layers - 1) * r.layer_stride
    lo_b, hi_b = sorted((lo_id * r.block_stride, hi_id * r.block_stride))
    lo = r.base_offset + min(0, last_layer) + lo_b
    hi = r.base_offset + max(0, last_layer) + hi_b + r.page_bytes
    if lo < 0 or hi > int(region.buffer_sizes[r.buffer]):
        raise TransferError(
            f"copy {ci}: pages span bytes [{lo}, {hi}) of buffer {r.buffer}, which has "
            f"{int(region.buffer_sizes[r.buffer])} bytes (block ids {lo_id}..{hi_id})")
    lo_off, hi_off = int(offs.min()), int(offs.max()) + r.nbytes
    same_slab = (offs // region.slab_bytes) == ((offs + r.nbytes - 1) // region.slab_bytes)
    if lo_off < 0 or hi_off > region.pool_bytes or not same_slab.all():
        raise TransferError(f"copy {ci}: object range outside the pool or across a slab "
                            "boundary")
    return mask, holes


def validate(copies: Sequence[RunCopy], region: Region) -> None:
    """Check every range of a whole request (before any part of it is launched)."""
    for ci, c in enumerate(copies):
        _check_copy(ci, c, region)


def _expand(copies: Sequence[RunCopy], region: Region, checked: bool) -> _Units:
    """Page addresses of every copy (vectorized); ranges checked unless ``checked``
    says :func:`validate` already passed on a request holding these copies."""
    pool_off, size, n_pages = [], [], []
    page_ptr, rel, nbytes, keep = [], [], [], []
    any_holes = False
    for ci, c in enumerate(copies):
        if checked:
            if c.block_ids.shape[0] == 0:
                continue
            mask = c.block_ids >= 0
            holes = not mask.all()
        else:
            ok = _check_copy(ci, c, region)
            if ok is None:
                continue
            mask, holes = ok
        r = c.run
        m = c.block_ids.shape[0]
        layer_off = np.arange(r.n_layers, dtype=np.int64) * r.layer_stride
        base = int(region.buffer_ptrs[r.buffer]) + r.base_offset
        per = r.n_layers * r.n_blocks
        # (chunks, layers, blocks) page addresses; -1 blocks get a dummy address (masked).
        ids = np.maximum(c.block_ids, 0).astype(np.int64, copy=False)
        ptr = base + layer_off[None, :, None] + ids[:, None, :] * r.block_stride
        pool_off.append(c.object_offsets.astype(np.int64, copy=False))
        size.append(np.full(m, r.nbytes, dtype=np.int64))
        n_pages.append(np.full(m, per, dtype=np.int64))
        page_ptr.append(ptr.ravel())
        rel.append(np.tile(np.arange(per, dtype=np.int64) * r.page_bytes, m))
        nbytes.append(np.full(m * per, r.page_bytes, dtype=np.int64))
        keep.append(np.broadcast_to(mask[:, None, :], ptr.shape).ravel())
        any_holes |= holes
    if not pool_off:
        z = np.zeros(0, np.int64)
        return _Units(z, z, z, z, z, z, z, None)
    cat = np.concatenate
    counts = cat(n_pages)
    return _Units(cat(pool_off), cat(size), counts, np.cumsum(counts) - counts, cat(page_ptr),
                  cat(rel), cat(nbytes), cat(keep) if any_holes else None)


def split(copies: Sequence[RunCopy], first_bytes: int, growth: int = 3
          ) -> list[list[RunCopy]]:
    """Cut a request by chunk rows into parts of about ``first_bytes``, then ``growth``
    times the previous part (the last takes the rest), every copy alike.

    The engine plans part ``i + 1`` on the CPU while the GPU copies part ``i``: a small
    first part starts the GPU early, and each part's copy lasts long enough to hide the
    planning of the next, larger one; few parts keep numpy's per-call overhead low.
    """
    total = sum(c.nbytes for c in copies)
    bounds = [0.0]
    size = float(first_bytes)
    while total and bounds[-1] + size < total:
        bounds.append(bounds[-1] + size)
        size *= growth
    if len(bounds) == 1:
        return [list(copies)]
    fractions = [b / total for b in bounds] + [1.0]
    parts: list[list[RunCopy]] = []
    for i in range(len(fractions) - 1):
        part = []
        for c in copies:
            m = c.block_ids.shape[0]
            lo, hi = round(fractions[i] * m), round(fractions[i + 1] * m)
            if hi > lo:
                part.append(RunCopy(c.run, c.block_ids[lo:hi], c.object_offsets[lo:hi]))
        if part:
            parts.append(part)
    return parts


def check_objects(start: np.ndarray, size: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
    """Every unit's object range ``[start, start + size)`` lies inside ``[lo, hi)``.

    With the per-run page envelope checked in :func:`_expand`, this bounds every
    address a descriptor or DMA can name; it runs before anything is launched.
    """
    bad = (start < lo) | (start + size > hi)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise TransferError(f"object range {i} [{int(start[i]):#x}, +{int(size[i])}) is "
                            "outside its pool or staging area")


def _rows(page: np.ndarray, obj: np.ndarray, n: np.ndarray) -> np.ndarray:
    d = np.empty((page.shape[0], 3), dtype=np.int64)
    d[:, 0] = page
    d[:, 1] = obj
    d[:, 2] = n
    return d


def plan_mapped(copies: Sequence[RunCopy], region: Region, checked: bool = False) -> Plan:
    """One piece whose object addresses point straight into the (mapped) pool."""
    u = _expand(copies, region, checked)
    start = region.pool_addr(u.pool_off)
    slab_lo = region.slab_ptrs[u.pool_off // region.slab_bytes]
    check_objects(start, u.size, slab_lo, slab_lo + region.slab_bytes)
    obj = np.repeat(start, u.n_pages) + u.rel
    page, n = u.page_ptr, u.nbytes
    if u.keep is not None:
        page, obj, n = page[u.keep], obj[u.keep], n[u.keep]
    desc = _rows(page, obj, n)
    pieces = (Piece(0, desc.shape[0], 0, np.zeros((0, 3), np.int64)),) if len(desc) else ()
    return Plan(desc.view(np.uint64), pieces, int(u.size.sum()))


def plan_staging(copies: Sequence[RunCopy], region: Region, halves: Sequence[int],
                 half_bytes: int, checked: bool = False) -> Plan:
    """Units in pool order, packed into staging halves; one piece per half-fill.

    ``halves`` are the device addresses of the lane's staging halves (used
    alternately: piece ``k`` uses half ``k % len(halves)``). A unit larger than a half
    is refused (the engine sizes halves to the largest run of the request).
    """
    u = _expand(copies, region, checked)
    n_units = len(u.pool_off)
    if n_units == 0:
        return Plan(np.zeros((0, 3), np.uint64), (), 0)
    if int(u.size.max()) > half_bytes:
        raise TransferError(f"one object run is {int(u.size.max())} bytes, more than the "
                            f"{half_bytes}-byte staging half")
    order = np.argsort(u.pool_off, kind="stable")
    s_off, s_size = u.pool_off[order], u.size[order]
    cum_end = np.cumsum(s_size)
    cum_start = cum_end - s_size
    # Greedy packing at unit boundaries: one search per piece, not per unit.
    firsts_u = [0]
    while True:
        k = int(np.searchsorted(cum_end, cum_start[firsts_u[-1]] + half_bytes, side="right"))
        if k >= n_units:
            break
        firsts_u.append(k)
    n_pieces = len(firsts_u)
    units_per_piece = np.diff(np.asarray(firsts_u + [n_units], dtype=np.int64)).astype(np.int64)
    unit_piece = np.repeat(np.arange(n_pieces, dtype=np.int64), units_per_piece)
    half_addr = np.asarray([int(halves[p % len(halves)]) for p in range(n_pieces)],
                           dtype=np.int64)
    unit_stage = half_addr[unit_piece] + cum_start - cum_start[firsts_u][unit_piece]
    check_objects(unit_stage, s_size, half_addr[unit_piece], half_addr[unit_piece] + half_bytes)
    # DMA segments: neighbours in pool and staging, same piece, same slab, merge.
    slab = s_off // region.slab_bytes
    joins = np.zeros(n_units, dtype=bool)
    joins[1:] = ((s_off[1:] == s_off[:-1] + s_size[:-1]) & (unit_piece[1:] == unit_piece[:-1])
                 & (slab[1:] == slab[:-1]))
    seg_first = np.flatnonzero(~joins)
    segments = np.empty((len(seg_first), 3), dtype=np.int64)
    segments[:, 0] = unit_stage[seg_first]
    segments[:, 1] = region.pool_addr(s_off[seg_first])
    segments[:, 2] = np.add.reduceat(s_size, seg_first)
    seg_bounds = np.searchsorted(unit_piece[seg_first], np.arange(n_pieces + 1))
    # Page rows in sorted-unit order (so rows of one piece are consecutive).
    lens = u.n_pages[order]
    idx = np.repeat(u.row_start[order] - (np.cumsum(lens) - lens), lens)
    idx += np.arange(idx.shape[0], dtype=np.int64)
    obj = np.repeat(unit_stage, lens) + u.rel[idx]
    row_piece = np.repeat(unit_piece, lens)
    page, n = u.page_ptr[idx], u.nbytes[idx]
    if u.keep is not None:
        k = u.keep[idx]
        page, obj, n, row_piece = page[k], obj[k], n[k], row_piece[k]
    desc = _rows(page, obj, n)
    counts = np.bincount(row_piece, minlength=n_pieces)
    row_first = np.cumsum(counts) - counts
    pieces = tuple(Piece(int(row_first[p]), int(counts[p]), p % len(halves),
                         segments[seg_bounds[p]:seg_bounds[p + 1]])
                   for p in range(n_pieces))
    return Plan(desc.view(np.uint64), pieces, int(u.size.sum()))
