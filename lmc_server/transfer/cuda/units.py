"""A request as *unit* rows the CUDA kernels expand on the GPU, every range checked.

Pure numpy (no CuPy), so every address computation and range check is testable on a
CPU-only host. A *unit* is one layer run of one chunk. The host never expands a request
into per-page descriptors: it uploads one row of ``UNIT_WORDS`` ``int64`` words per unit
(layout in ``kernels/copy_pages.cu``) plus the chunks' block ids, and the kernels compute
each page's address from them. Planning therefore costs a fixed number of numpy
operations per request (one per copy for the checks, a few dozen in all), independent of
the number of pages: about 0.1 ms for a 64-chunk DeepSeek-V4.1 batch, small enough to
plan a whole request before launching it.

Invariants, checked before anything is launched and on the very arrays that are
uploaded: every page a unit names lies inside its registered buffer (the exact envelope
of each copy's pages: lowest and highest block of its first and last layer), and every
unit's object range lies inside one pool slab and, in mode ``staging``, inside the
staging half of its piece (:func:`check_objects`, called by the plans of
:mod:`~lmc_server.transfer.cuda.plan` and :mod:`~lmc_server.transfer.cuda.dma_plan`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lmc_server.cache.layout import LayerRun, RunCopy
from lmc_server.transfer.base import TransferError

#: int64 words per unit row; column meanings match ``kernels/copy_pages.cu``.
UNIT_WORDS = 10
(
    PAGE_BASE,
    LAYER_STRIDE,
    BLOCK_STRIDE,
    PAGE_BYTES,
    OBJECT,
    IDS_OFFSET,
    N_LAYERS,
    N_BLOCKS,
    OBJ_LAYER_STRIDE,
    OBJ_BLOCK_STRIDE,
) = range(UNIT_WORDS)


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


def _check_shape(ci: int, c: RunCopy, n_buffers: int) -> None:
    r = c.run
    ids, offs = c.block_ids, c.object_offsets
    if ids.ndim != 2 or ids.shape[1] != r.n_blocks or offs.shape != (ids.shape[0],):
        raise TransferError(
            f"copy {ci}: block ids {ids.shape} / object offsets "
            f"{offs.shape} do not match {r.n_blocks} blocks per chunk"
        )
    if ids.dtype.kind not in "iu" or offs.dtype.kind not in "iu":
        raise TransferError(f"copy {ci}: block ids and object offsets must be integers")
    if not 0 <= r.buffer < n_buffers:
        raise TransferError(f"copy {ci}: buffer {r.buffer} is not registered")
    if r.page_bytes <= 0 or r.n_layers <= 0 or r.n_blocks <= 0:
        raise TransferError(f"copy {ci}: empty run")


def _check_ranges(ci: int, c: RunCopy, ids: np.ndarray, offs: np.ndarray, region: Region) -> bool:
    """Check one copy's page envelope and object ranges; ``False``: nothing to copy
    (every block id is -1)."""
    r = c.run
    lo_id, hi_id = int(ids.min()), int(ids.max())
    if lo_id < -1:
        raise TransferError(f"copy {ci}: negative block id {lo_id}")
    if lo_id == -1:
        if hi_id < 0:
            return False
        lo_id = int(ids[ids >= 0].min())
    last_layer = (r.n_layers - 1) * r.layer_stride
    lo_b, hi_b = sorted((lo_id * r.block_stride, hi_id * r.block_stride))
    lo = r.base_offset + min(0, last_layer) + lo_b
    hi = r.base_offset + max(0, last_layer) + hi_b + r.page_bytes
    if lo < 0 or hi > int(region.buffer_sizes[r.buffer]):
        raise TransferError(
            f"copy {ci}: pages span bytes [{lo}, {hi}) of buffer {r.buffer}, which has "
            f"{int(region.buffer_sizes[r.buffer])} bytes (block ids {lo_id}..{hi_id})"
        )
    ext = r.object_extent
    lo_off, hi_off = int(offs.min()), int(offs.max()) + ext
    same_slab = (offs // region.slab_bytes) == ((offs + ext - 1) // region.slab_bytes)
    if lo_off < 0 or hi_off > region.pool_bytes or not same_slab.all():
        raise TransferError(f"copy {ci}: object range outside the pool or across a slab boundary")
    return True


@dataclass(frozen=True, slots=True)
class Units:
    table: np.ndarray  # (U, UNIT_WORDS) int64, OBJECT column not filled yet
    ids: np.ndarray  # (N,) int64
    pool_off: np.ndarray  # (U,) int64
    size: np.ndarray  # (U,) int64 object bytes per unit (what it moves)
    extent: np.ndarray  # (U,) int64 bytes from its first to past its last object byte


@dataclass(frozen=True, slots=True)
class _Template:
    """What depends only on a request's shape (runs, chunks per copy) and the mapping's
    buffers: unit rows with everything but OBJECT, and per-copy constants for the
    vectorized range checks. Built once per shape, reused by every later request."""

    table: np.ndarray  # (U, UNIT_WORDS) int64, OBJECT 0
    size: np.ndarray  # (U,) int64
    extent: np.ndarray  # (U,) int64
    id_starts: np.ndarray  # (C,) first id of each copy in the concatenated ids
    off_starts: np.ndarray  # (C,) first unit of each copy
    block_stride: np.ndarray  # (C,) int64
    lo_extent: np.ndarray  # (C,) base_offset + lowest layer offset
    hi_extent: np.ndarray  # (C,) base_offset + highest layer offset + page_bytes
    buffer_bytes: np.ndarray  # (C,) int64
    run_extent: np.ndarray  # (C,) int64


_TEMPLATES: dict[tuple[object, ...], _Template] = {}
_TEMPLATES_MAX = 256
#: Block ids and strides below this keep every envelope product inside int64.
_SAFE = 1 << 31


def _row(region: Region, r: LayerRun, id_at: int) -> tuple[int, ...]:
    """A run's unit row (columns as above), its block ids from ``id_at`` of the
    flattened id array; ``OBJECT`` stays 0 until the plan fills it per unit."""
    return (
        int(region.buffer_ptrs[r.buffer]) + r.base_offset,
        r.layer_stride,
        r.block_stride,
        r.page_bytes,
        0,
        id_at,
        r.n_layers,
        r.n_blocks,
        r.object_layer_stride,
        r.object_block_stride,
    )


def _template(live: list[RunCopy], region: Region) -> _Template:
    key = (
        tuple((c.run, int(c.block_ids.shape[0])) for c in live),
        region.buffer_ptrs.tobytes(),
        region.buffer_sizes.tobytes(),
    )
    t = _TEMPLATES.get(key)
    if t is not None:
        return t
    rows, counts, id_starts, off_starts, consts = [], [], [], [], []
    id_at = off_at = 0
    for c in live:
        r = c.run
        m = int(c.block_ids.shape[0])
        rows.append(_row(region, r, id_at))
        counts.append(m)
        id_starts.append(id_at)
        off_starts.append(off_at)
        last_layer = (r.n_layers - 1) * r.layer_stride
        consts.append(
            (
                r.block_stride,
                r.base_offset + min(0, last_layer),
                r.base_offset + max(0, last_layer) + r.page_bytes,
                int(region.buffer_sizes[r.buffer]),
                r.object_extent,
            )
        )
        id_at += m * r.n_blocks
        off_at += m
    n = np.asarray(counts, dtype=np.int64)
    table = np.repeat(np.asarray(rows, dtype=np.int64), n, axis=0)
    local = np.arange(table.shape[0], dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
    table[:, IDS_OFFSET] += local * table[:, N_BLOCKS]
    size = table[:, PAGE_BYTES] * table[:, N_LAYERS] * table[:, N_BLOCKS]
    k = np.asarray(consts, dtype=np.int64)
    t = _Template(
        table,
        size,
        _extent(table),
        np.asarray(id_starts, np.int64),
        np.asarray(off_starts, np.int64),
        k[:, 0],
        k[:, 1],
        k[:, 2],
        k[:, 3],
        k[:, 4],
    )
    if len(_TEMPLATES) >= _TEMPLATES_MAX:
        _TEMPLATES.pop(next(iter(_TEMPLATES)))
    _TEMPLATES[key] = t
    return t


def plan_units(copies: Sequence[RunCopy], region: Region) -> Units | None:
    """Unit rows of every copy, checked; ``None`` when there is nothing to copy.

    The block ids and object offsets are concatenated first and checked from the
    concatenated arrays, which are the ones the rows point into and that get uploaded.
    The common case is checked for all copies at once against a cached per-shape
    template (a few dozen numpy operations whatever the batch); a copy whose block ids
    are all -1, or values large enough that int64 products could overflow, take the
    exact per-copy path (:func:`_units_exact`).
    """
    n_buffers = len(region.buffer_ptrs)
    live = []
    for ci, c in enumerate(copies):
        _check_shape(ci, c, n_buffers)
        if c.block_ids.shape[0]:
            live.append(c)
    if not live:
        return None
    ids = np.concatenate([c.block_ids.reshape(-1) for c in live]).astype(np.int64, copy=False)
    offs = np.concatenate([c.object_offsets for c in live]).astype(np.int64, copy=False)
    t = _template(live, region)
    lo_id = np.minimum.reduceat(ids, t.id_starts)
    hi_id = np.maximum.reduceat(ids, t.id_starts)
    if (
        int(lo_id.min()) < -1
        or int(hi_id.min()) < 0
        or int(hi_id.max()) >= _SAFE
        or int(np.abs(t.block_stride).max()) >= _SAFE
    ):
        return _units_exact(copies, live, ids, offs, region)
    if int(lo_id.min()) == -1:
        lo_id = np.minimum.reduceat(np.where(ids < 0, hi_id.max(), ids), t.id_starts)
    a, b = lo_id * t.block_stride, hi_id * t.block_stride
    bad = (t.lo_extent + np.minimum(a, b) < 0) | (t.hi_extent + np.maximum(a, b) > t.buffer_bytes)
    lo_off = np.minimum.reduceat(offs, t.off_starts)
    hi_off = np.maximum.reduceat(offs, t.off_starts) + t.run_extent
    bad |= (lo_off < 0) | (hi_off > region.pool_bytes)
    slab = region.slab_bytes
    if bad.any() or not ((offs // slab) == ((offs + t.extent - 1) // slab)).all():
        return _units_exact(copies, live, ids, offs, region)  # raises with the details
    return Units(t.table.copy(), ids, offs, t.size, t.extent)


def _units_exact(
    copies: Sequence[RunCopy],
    live: list[RunCopy],
    ids: np.ndarray,
    offs: np.ndarray,
    region: Region,
) -> Units | None:
    """Per-copy checks in Python integers (exact, with the offending copy named)."""
    index = {id(c): ci for ci, c in enumerate(copies)}
    rows: list[tuple[int, ...]] = []
    counts: list[int] = []
    keep_offs: list[np.ndarray] = []
    id_at = off_at = 0
    for c in live:
        r = c.run
        m = int(c.block_ids.shape[0])
        c_ids = ids[id_at : id_at + m * r.n_blocks].reshape(m, r.n_blocks)
        c_offs = offs[off_at : off_at + m]
        if _check_ranges(index[id(c)], c, c_ids, c_offs, region):
            rows.append(_row(region, r, id_at))
            counts.append(m)
            keep_offs.append(c_offs)
        id_at += m * r.n_blocks
        off_at += m
    if not rows:
        return None
    n = np.asarray(counts, dtype=np.int64)
    table = np.repeat(np.asarray(rows, dtype=np.int64), n, axis=0)
    local = np.arange(table.shape[0], dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
    table[:, IDS_OFFSET] += local * table[:, N_BLOCKS]
    size = table[:, PAGE_BYTES] * table[:, N_LAYERS] * table[:, N_BLOCKS]
    pool_off = keep_offs[0] if len(keep_offs) == 1 else np.concatenate(keep_offs)
    return Units(table, ids, pool_off, size, _extent(table))


def _extent(table: np.ndarray) -> np.ndarray:
    """Per unit row: bytes from its first object byte to past its last."""
    return (
        (table[:, N_LAYERS] - 1) * table[:, OBJ_LAYER_STRIDE]
        + (table[:, N_BLOCKS] - 1) * table[:, OBJ_BLOCK_STRIDE]
        + table[:, PAGE_BYTES]
    )


def check_objects(start: np.ndarray, size: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
    """Every unit's object range ``[start, start + size)`` lies inside ``[lo, hi)``.

    With the per-copy page envelope checked in :func:`_units`, this bounds every
    address a kernel or DMA can name; it runs before anything is launched.
    """
    bad = (start < lo) | (start + size > hi)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise TransferError(
            f"object range {i} [{int(start[i]):#x}, +{int(size[i])}) is "
            "outside its pool or staging area"
        )
