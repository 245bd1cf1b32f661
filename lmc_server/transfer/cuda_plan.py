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
unit (one run of one chunk) straddles two pieces. :func:`check_descriptors` verifies the
first two on the final descriptors before any launch.
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
    pool_ptr: int
    pool_bytes: int
    slab_bytes: int


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
    """One unit per (run copy, chunk): its pool offset and size, and its pages."""

    pool_off: np.ndarray  # int64 (u,)
    size: np.ndarray  # int64 (u,)
    page_ptr: list[np.ndarray]  # per copy: (chunks, layers * blocks) int64
    page_rel: list[np.ndarray]  # per copy: (layers * blocks,) offset inside the unit
    page_bytes: list[int]
    keep: list[np.ndarray]  # per copy: (chunks, layers * blocks) bool
    buffer: list[int]


def _expand(copies: Sequence[RunCopy], region: Region) -> _Units:
    """Page addresses per copy (vectorized) after checking every range."""
    pool_off, size = [], []
    page_ptr, page_rel, page_bytes, keep, buffer = [], [], [], [], []
    n_buffers = len(region.buffer_ptrs)
    for ci, c in enumerate(copies):
        r = c.run
        ids = np.asarray(c.block_ids, dtype=np.int64)
        offs = np.asarray(c.object_offsets, dtype=np.int64)
        if ids.ndim != 2 or ids.shape[1] != r.n_blocks or offs.shape != (ids.shape[0],):
            raise TransferError(f"copy {ci}: block ids {ids.shape} / object offsets "
                                f"{offs.shape} do not match {r.n_blocks} blocks per chunk")
        if not 0 <= r.buffer < n_buffers:
            raise TransferError(f"copy {ci}: buffer {r.buffer} is not registered")
        if r.page_bytes <= 0 or r.n_layers <= 0 or r.n_blocks <= 0:
            raise TransferError(f"copy {ci}: empty run")
        if ids.size and int(ids.min()) < -1:
            raise TransferError(f"copy {ci}: negative block id {int(ids.min())}")
        mask = ids >= 0
        layer_off = np.arange(r.n_layers, dtype=np.int64) * r.layer_stride
        if mask.any():
            valid = ids[mask]
            lo = r.base_offset + int(layer_off.min()) + int(valid.min()) * r.block_stride
            hi = (r.base_offset + int(layer_off.max()) + int(valid.max()) * r.block_stride
                  + r.page_bytes)
            if r.block_stride < 0:
                lo = r.base_offset + int(layer_off.min()) + int(valid.max()) * r.block_stride
                hi = (r.base_offset + int(layer_off.max()) + int(valid.min()) * r.block_stride
                      + r.page_bytes)
            if lo < 0 or hi > int(region.buffer_sizes[r.buffer]):
                raise TransferError(
                    f"copy {ci}: pages span bytes [{lo}, {hi}) of buffer {r.buffer}, which "
                    f"has {int(region.buffer_sizes[r.buffer])} bytes (block ids "
                    f"{int(valid.min())}..{int(valid.max())})")
        if offs.size:
            end = offs + r.nbytes
            same_slab = (offs // region.slab_bytes) == ((end - 1) // region.slab_bytes)
            if int(offs.min()) < 0 or int(end.max()) > region.pool_bytes or not same_slab.all():
                raise TransferError(f"copy {ci}: object range outside the pool or across a "
                                    "slab boundary")
        base = int(region.buffer_ptrs[r.buffer]) + r.base_offset
        # (chunks, layers, blocks) page addresses; -1 blocks get a dummy address (masked).
        ptr = base + layer_off[None, :, None] + np.maximum(ids, 0)[:, None, :] * r.block_stride
        rel = (np.arange(r.n_layers * r.n_blocks, dtype=np.int64) * r.page_bytes)
        pool_off.append(offs)
        size.append(np.full(offs.shape, r.nbytes, dtype=np.int64))
        page_ptr.append(ptr.reshape(ids.shape[0], -1))
        page_rel.append(rel)
        page_bytes.append(r.page_bytes)
        keep.append(np.broadcast_to(mask[:, None, :], ptr.shape).reshape(ids.shape[0], -1))
        buffer.append(r.buffer)
    cat = np.concatenate
    return _Units(cat(pool_off) if pool_off else np.zeros(0, np.int64),
                  cat(size) if size else np.zeros(0, np.int64),
                  page_ptr, page_rel, page_bytes, keep, buffer)


def _descriptors(u: _Units, unit_obj: np.ndarray, unit_piece: np.ndarray | None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows (page, object, bytes), each row's buffer index, each row's piece."""
    rows, bufs, pieces = [], [], []
    start = 0
    for i, ptr in enumerate(u.page_ptr):
        m = ptr.shape[0]
        obj = unit_obj[start:start + m, None] + u.page_rel[i][None, :]
        keep = u.keep[i]
        d = np.empty((int(keep.sum()), 3), dtype=np.int64)
        d[:, 0] = ptr[keep]
        d[:, 1] = obj[keep]
        d[:, 2] = u.page_bytes[i]
        rows.append(d)
        bufs.append(np.full(d.shape[0], u.buffer[i], dtype=np.int32))
        if unit_piece is not None:
            pieces.append(np.broadcast_to(unit_piece[start:start + m, None], keep.shape)[keep])
        start += m
    if not rows:
        return (np.zeros((0, 3), np.int64), np.zeros(0, np.int32), np.zeros(0, np.int32))
    return (np.concatenate(rows), np.concatenate(bufs),
            np.concatenate(pieces) if pieces else np.zeros(0, np.int32))


def check_descriptors(desc: np.ndarray, buffers: np.ndarray, region: Region,
                      obj_lo: np.ndarray, obj_hi: np.ndarray) -> None:
    """Every page inside its buffer and every object range inside ``[obj_lo, obj_hi)``.

    ``obj_lo``/``obj_hi`` are per row (the staging half or the pool). Raises
    :class:`TransferError` naming the first bad row; nothing has been launched yet.
    """
    if desc.size == 0:
        return
    page, obj, n = desc[:, 0], desc[:, 1], desc[:, 2]
    blo = region.buffer_ptrs[buffers]
    bhi = blo + region.buffer_sizes[buffers]
    bad = (n <= 0) | (page < blo) | (page + n > bhi) | (obj < obj_lo) | (obj + n > obj_hi)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise TransferError(f"descriptor {i} out of range: page {int(page[i]):#x} object "
                            f"{int(obj[i]):#x} bytes {int(n[i])}")


def plan_mapped(copies: Sequence[RunCopy], region: Region) -> Plan:
    """One piece whose object addresses point straight into the (mapped) pool."""
    u = _expand(copies, region)
    desc, bufs, _ = _descriptors(u, region.pool_ptr + u.pool_off, None)
    lo = np.full(desc.shape[0], region.pool_ptr, dtype=np.int64)
    check_descriptors(desc, bufs, region, lo, lo + region.pool_bytes)
    pieces = (Piece(0, desc.shape[0], 0, np.zeros((0, 3), np.int64)),) if len(desc) else ()
    return Plan(desc.view(np.uint64), pieces, int(u.size.sum()))


def plan_staging(copies: Sequence[RunCopy], region: Region, halves: Sequence[int],
                 half_bytes: int) -> Plan:
    """Units in pool order, packed into staging halves; one piece per half-fill.

    ``halves`` are the device addresses of the lane's staging halves (used
    alternately: piece ``k`` uses half ``k % len(halves)``). A unit larger than a half
    is refused (the engine sizes halves to at least one slab).
    """
    u = _expand(copies, region)
    n_units = len(u.pool_off)
    if n_units and int(u.size.max()) > half_bytes:
        raise TransferError(f"one object run is {int(u.size.max())} bytes, more than the "
                            f"{half_bytes}-byte staging half")
    order = np.argsort(u.pool_off, kind="stable")
    sizes = u.size[order].tolist()
    offs = u.pool_off[order].tolist()
    unit_piece_sorted = np.empty(n_units, dtype=np.int32)
    unit_stage_sorted = np.empty(n_units, dtype=np.int64)
    segs: list[list[tuple[int, int, int]]] = []
    piece, fill = 0, 0
    seg_list: list[tuple[int, int, int]] = []
    slab = region.slab_bytes
    for k in range(n_units):
        sz, off = sizes[k], offs[k]
        if fill + sz > half_bytes:
            segs.append(seg_list)
            seg_list, piece, fill = [], piece + 1, 0
        stage = int(halves[piece % len(halves)]) + fill
        unit_piece_sorted[k] = piece
        unit_stage_sorted[k] = stage
        pool_addr = region.pool_ptr + off
        if seg_list:
            s_stage, s_pool, s_n = seg_list[-1]
            if (s_pool + s_n == pool_addr and s_stage + s_n == stage
                    and (s_pool - region.pool_ptr) // slab == off // slab):
                seg_list[-1] = (s_stage, s_pool, s_n + sz)
                fill += sz
                continue
        seg_list.append((stage, pool_addr, sz))
        fill += sz
    if seg_list:
        segs.append(seg_list)
    unit_piece = np.empty(n_units, dtype=np.int32)
    unit_stage = np.empty(n_units, dtype=np.int64)
    unit_piece[order] = unit_piece_sorted
    unit_stage[order] = unit_stage_sorted
    desc, bufs, row_piece = _descriptors(u, unit_stage, unit_piece)
    by_piece = np.argsort(row_piece, kind="stable")
    desc = desc[by_piece]
    bufs = bufs[by_piece]
    row_piece = row_piece[by_piece]
    half_lo = np.asarray([int(halves[p % len(halves)]) for p in range(len(segs))],
                         dtype=np.int64)
    check_descriptors(desc, bufs, region, half_lo[row_piece], half_lo[row_piece] + half_bytes)
    counts = np.bincount(row_piece, minlength=len(segs)) if len(segs) else np.zeros(0, int)
    firsts = np.concatenate([[0], np.cumsum(counts)[:-1]]) if len(segs) else counts
    pieces = tuple(Piece(int(firsts[p]), int(counts[p]), p % len(halves),
                         np.asarray(segs[p], dtype=np.int64).reshape(-1, 3))
                   for p in range(len(segs)))
    return Plan(desc.view(np.uint64), pieces, int(u.size.sum()))
