"""Copy-engine plans (copy mode ``dma``): a request as 1-D and 2-D DMA rows, no kernel.

Built from the same checked unit rows as the kernel plans (:mod:`.plan`:
``plan_units``, the page envelope and object-range checks), so a ``dma`` plan can name
no page or pool byte a kernel plan could not. Pure numpy, testable on a CPU host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# np.unique (split_rows) imports numpy.ma at its first call: about 70 ms inside the launch
# of the server's first copy-engine request (py-spy on the H200 host), paid here, at
# import, instead.
import numpy.ma  # noqa: F401

from lmc_server.cache.layout import RunCopy
from lmc_server.transfer.cuda.units import (
    BLOCK_STRIDE,
    IDS_OFFSET,
    LAYER_STRIDE,
    N_BLOCKS,
    N_LAYERS,
    OBJ_BLOCK_STRIDE,
    OBJ_LAYER_STRIDE,
    PAGE_BASE,
    PAGE_BYTES,
    Region,
    check_objects,
    plan_units,
)


@dataclass(frozen=True, slots=True)
class DmaPlan:
    """Copy-engine descriptors of a request: no kernel, no staging.

    ``rows`` are ``(device address, device pitch, pool address, pool pitch, width,
    height)``: ``height`` rows of ``width`` bytes, the device-side rows ``device pitch``
    bytes apart (a run's layers) and the pool-side rows ``pool pitch`` apart (the
    object's layers). One row per (unit, run of consecutive block ids); ``nbytes`` is
    what the rows move in all. ``issues`` keeps how the rows were last handed to the
    driver (:func:`~lmc_server.transfer.cuda.launch.issue_dma`), so that a plan
    issued again is one driver call per stream.
    """

    rows: np.ndarray  # (R, 6) int64
    nbytes: int
    issues: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def n_rows(self) -> int:
        return int(self.rows.shape[0])


DEV_ADDR, DEV_PITCH, POOL_ADDR, POOL_PITCH, WIDTH, HEIGHT = range(6)
_EMPTY_DMA = DmaPlan(np.zeros((0, 6), np.int64), 0)


def plan_dma(copies: Sequence[RunCopy], region: Region) -> DmaPlan:
    """2-D copy descriptors for the copy engines, checked like the kernels' plans.

    The page envelope and object ranges are checked by
    :func:`~lmc_server.transfer.cuda.plan.plan_units` (the same checks as the kernel
    paths) and every object range must lie in one pool slab. Pages of consecutive block
    ids whose block stride equals the page size are contiguous in the engine's buffer
    and in the object, so they merge into one row; a block id of -1 ("leave this page
    alone") ends a run and is skipped. A run's layers become the height of one 2-D copy
    when its layer stride is at least the row's width (layers that do not overlap, in
    increasing order); otherwise each layer is a row of its own. A run of consecutive
    ids whose pages do not tile (block-major objects of layer-outermost pages) is
    copied whichever way takes fewer descriptors: a 2-D copy of the layers per block,
    or one of the blocks per layer (a Llama K plane: 16 pages of 32 KiB in one copy
    instead of 16).
    """
    u = plan_units(copies, region)
    if u is None:
        return _EMPTY_DMA
    t = u.table
    start = region.pool_addr(u.pool_off)
    slab_lo = region.slab_ptrs[u.pool_off // region.slab_bytes]
    check_objects(start, u.extent, slab_lo, slab_lo + region.slab_bytes)
    ids = _unit_ids(t, u.ids)
    if _side_by_side(t):
        return _side_by_side_plan(t, ids, start)
    return _general_plan(t, ids, start)


def _side_by_side(t: np.ndarray) -> bool:
    """Whether every unit's stored block is one contiguous range on both sides and the
    general plan would copy it as such: its layers side by side in the worker's buffer
    and in the object (a block-outermost worker, vLLM's layout of DeepSeek-V4), or a
    single layer whose consecutive blocks tile both sides. (A single layer whose blocks
    do not tile the object, a Llama K plane, is a 2-D copy of its blocks there.)"""
    page, layers = t[:, PAGE_BYTES], t[:, N_LAYERS]
    tiles = (t[:, BLOCK_STRIDE] == page) & (t[:, OBJ_BLOCK_STRIDE] == page)
    adjacent = (layers > 1) & (t[:, LAYER_STRIDE] == page) & (t[:, OBJ_LAYER_STRIDE] == page)
    return bool(((adjacent & ~tiles) | ((layers == 1) & tiles)).all())


def _side_by_side_plan(t: np.ndarray, ids: np.ndarray, start: np.ndarray) -> DmaPlan:
    """:func:`_general_plan` for units that are all :func:`_side_by_side`, in a third
    of its numpy operations (a store plans anew every time: a 64-chunk DSV4.1 request
    0.35 -> 0.13 ms on the 2-core VM; the driver's batch call is the rest): one 1-D
    row per live stored block, in unit and block order, then each row that continues
    the one before it in the same unit on both sides joined into it.
    The same rows in the same order as the general plan (``tests/gpu/test_cuda_plan.py``
    compares the two)."""
    n_blocks = t[:, N_BLOCKS]
    unit = np.repeat(np.arange(t.shape[0], dtype=np.int64), n_blocks)
    j = np.arange(ids.size, dtype=np.int64) - np.repeat(np.cumsum(n_blocks) - n_blocks, n_blocks)
    live = ids >= 0
    if not live.all():
        unit, j, ids = unit[live], j[live], ids[live]
    width = (t[:, N_LAYERS] * t[:, PAGE_BYTES])[unit]
    dev = t[unit, PAGE_BASE] + ids * t[unit, BLOCK_STRIDE]
    pool = start[unit] + j * t[unit, OBJ_BLOCK_STRIDE]
    joins = np.zeros(ids.size, dtype=bool)
    joins[1:] = (
        (unit[1:] == unit[:-1])
        & (dev[1:] == dev[:-1] + width[:-1])
        & (pool[1:] == pool[:-1] + width[:-1])
    )
    if joins.any():
        first = np.flatnonzero(~joins)
        dev, pool, width = dev[first], pool[first], np.add.reduceat(width, first)
    rows = np.empty((width.size, 6), dtype=np.int64)
    rows[:, DEV_ADDR], rows[:, POOL_ADDR] = dev, pool
    rows[:, DEV_PITCH] = rows[:, POOL_PITCH] = rows[:, WIDTH] = width
    rows[:, HEIGHT] = 1
    return DmaPlan(rows, int(width.sum()))


def _general_plan(t: np.ndarray, ids: np.ndarray, start: np.ndarray) -> DmaPlan:
    """The rows of checked units ``t`` (their block ids ``ids``, objects at ``start``)
    for any layout (:func:`plan_dma`)."""
    n_blocks = t[:, N_BLOCKS]
    unit = np.repeat(np.arange(t.shape[0], dtype=np.int64), n_blocks)
    j = np.arange(ids.size, dtype=np.int64) - np.repeat(np.cumsum(n_blocks) - n_blocks, n_blocks)
    live = ids >= 0
    # runs of consecutive block ids within a unit (a dead id ends a run and is skipped)
    follows = np.zeros(ids.size, dtype=bool)
    follows[1:] = (j[1:] > 0) & live[:-1] & (ids[1:] == ids[:-1] + 1)
    follows &= live
    first = np.flatnonzero(live & ~follows)
    breaks = np.append(np.flatnonzero(~follows), ids.size)
    length = breaks[np.searchsorted(breaks, first, side="right")] - first
    ru = unit[first]
    page_r = t[ru, PAGE_BYTES]
    contiguous = (t[ru, BLOCK_STRIDE] == page_r) & (t[ru, OBJ_BLOCK_STRIDE] == page_r)
    # A run of k blocks whose pages do not tile both sides is k rows of a block's L
    # layers, or L rows of a layer's k blocks (pitch: the block strides): the fewer.
    # (a block whose layers sit side by side on both sides is one 1-D copy anyway)
    layers_r = t[ru, N_LAYERS]
    adjacent = (
        (layers_r > 1) & (t[ru, LAYER_STRIDE] == page_r) & (t[ru, OBJ_LAYER_STRIDE] == page_r)
    )
    across = ~contiguous & ~adjacent & (length > layers_r)
    split = ~contiguous & ~across & (length > 1)
    if split.any():  # one run per block
        reps = np.where(split, length, 1)
        at = np.repeat(np.cumsum(reps) - reps, reps)
        step = np.arange(int(reps.sum()), dtype=np.int64) - at
        first = np.repeat(first, reps) + step
        length = np.where(np.repeat(split, reps), 1, np.repeat(length, reps))
        across = np.repeat(across, reps)
        ru = unit[first]
    across_rows = _across_rows(t, ids, j, start, first[across], length[across])
    first, length = first[~across], length[~across]
    ru = unit[first]
    page = t[ru, PAGE_BYTES]
    width = length * page
    layers = t[ru, N_LAYERS]
    lstride = t[ru, LAYER_STRIDE]
    obj_pitch = t[ru, OBJ_LAYER_STRIDE]
    dev = t[ru, PAGE_BASE] + ids[first] * t[ru, BLOCK_STRIDE]
    pool = start[ru] + j[first] * t[ru, OBJ_BLOCK_STRIDE]
    stacked = (layers == 1) | (lstride >= width)
    rows = np.empty((first.size, 6), dtype=np.int64)
    rows[:, DEV_ADDR], rows[:, DEV_PITCH] = dev, np.where(layers == 1, width, lstride)
    rows[:, POOL_ADDR], rows[:, POOL_PITCH] = pool, obj_pitch
    rows[:, WIDTH], rows[:, HEIGHT] = width, layers
    row_unit = ru
    if not stacked.all():  # one row per layer where layers cannot form a 2-D copy
        flat = rows[~stacked]
        reps = flat[:, HEIGHT]
        per = np.repeat(flat, reps, axis=0)
        li = np.arange(per.shape[0], dtype=np.int64) - np.repeat(np.cumsum(reps) - reps, reps)
        per[:, DEV_ADDR] += li * per[:, DEV_PITCH]
        per[:, POOL_ADDR] += li * per[:, POOL_PITCH]
        per[:, DEV_PITCH] = per[:, WIDTH]
        per[:, HEIGHT] = 1
        rows = np.concatenate([rows[stacked], per])
        row_unit = np.concatenate([ru[stacked], np.repeat(ru[~stacked], reps)])
    if across_rows.size:
        rows = np.concatenate([rows, across_rows])
        row_unit = np.concatenate([row_unit, np.full(across_rows.shape[0], -1, np.int64)])
    # rows whose layers are adjacent on both sides (block-major objects of a
    # block-outermost worker) are one contiguous range: a 1-D copy
    flat = (
        (rows[:, HEIGHT] > 1)
        & (rows[:, DEV_PITCH] == rows[:, WIDTH])
        & (rows[:, POOL_PITCH] == rows[:, WIDTH])
    )
    if flat.any():
        rows[flat, WIDTH] *= rows[flat, HEIGHT]
        rows[flat, HEIGHT] = 1
        rows[flat, DEV_PITCH] = rows[flat, WIDTH]
        rows[flat, POOL_PITCH] = rows[flat, WIDTH]
    return DmaPlan(_join_rows(rows, row_unit), int((rows[:, WIDTH] * rows[:, HEIGHT]).sum()))


#: Copy-engine rows at least this wide reach the link on an idle GPU too (block-outermost
#: pages: 337 KB rows at 0.99-1.0 of raw with two requests in flight, where 15-64 KB rows
#: reached 0.72-0.88; H200, docs/gpu.md), so mode ``auto`` takes ``dma`` for them there.
WIDE_ROW_BYTES = 128 << 10


def wide_rows(copies: Sequence[RunCopy]) -> bool:
    """Whether the request's stored blocks are, weighted by bytes, contiguous ranges of
    at least :data:`WIDE_ROW_BYTES` on both sides on average (a block's layers side by
    side in the worker's buffer and in the object; otherwise a row is a page), so that
    its ``dma`` rows are wide. Decided from the runs alone, before any plan."""
    total = weighted = 0
    for c in copies:
        r = c.run
        side_by_side = r.n_layers == 1 or (
            r.layer_stride == r.page_bytes and r.object_layer_stride == r.page_bytes
        )
        row = r.n_layers * r.page_bytes if side_by_side else r.page_bytes
        total += c.nbytes
        weighted += c.nbytes * row
    return total > 0 and weighted >= WIDE_ROW_BYTES * total


#: The least bytes a DMA stream of a lane is given: below this one request's copies stay
#: on fewer streams (joining a stream costs an event record and wait).
MIN_STREAM_BYTES = 4 << 20


def split_rows(rows: np.ndarray, parts: int, min_bytes: int = MIN_STREAM_BYTES) -> list[np.ndarray]:
    """``rows`` cut into at most ``parts`` consecutive slices of about equal bytes, each
    of at least ``min_bytes`` (one slice when the rows hold less): one per DMA stream.
    Every row is in exactly one slice, in order."""
    if rows.shape[0] == 0:
        return []
    nbytes = rows[:, WIDTH] * rows[:, HEIGHT]
    total = int(nbytes.sum())
    k = max(1, min(parts, rows.shape[0], total // max(1, min_bytes)))
    if k == 1:
        return [rows]
    cum = np.cumsum(nbytes)
    cuts = np.searchsorted(cum, total * np.arange(1, k, dtype=np.int64) // k, side="left") + 1
    bounds = np.unique(np.concatenate([[0], np.minimum(cuts, rows.shape[0]), [rows.shape[0]]]))
    return [rows[a:b] for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True)]


def _across_rows(
    t: np.ndarray,
    ids: np.ndarray,
    j: np.ndarray,
    start: np.ndarray,
    first: np.ndarray,
    length: np.ndarray,
) -> np.ndarray:
    """Rows of runs copied layer by layer: for each layer of the run's unit, one 2-D
    copy of ``length`` pages (the run's consecutive blocks), the device rows a block
    stride apart and the pool rows an object block stride apart. Both strides are at
    least a page (the registration's check and the block-major object), so the rows of
    one copy never overlap."""
    if not first.size:
        return np.zeros((0, 6), np.int64)
    ru = np.repeat(np.arange(t.shape[0], dtype=np.int64), t[:, N_BLOCKS])[first]
    layers = t[ru, N_LAYERS]
    at = np.repeat(np.cumsum(layers) - layers, layers)
    li = np.arange(int(layers.sum()), dtype=np.int64) - at
    r = np.repeat(np.arange(first.size), layers)
    u = ru[r]
    rows = np.empty((li.size, 6), dtype=np.int64)
    f = first[r]
    rows[:, DEV_ADDR] = t[u, PAGE_BASE] + li * t[u, LAYER_STRIDE] + ids[f] * t[u, BLOCK_STRIDE]
    rows[:, DEV_PITCH] = t[u, BLOCK_STRIDE]
    rows[:, POOL_ADDR] = start[u] + li * t[u, OBJ_LAYER_STRIDE] + j[f] * t[u, OBJ_BLOCK_STRIDE]
    rows[:, POOL_PITCH] = t[u, OBJ_BLOCK_STRIDE]
    rows[:, WIDTH] = t[u, PAGE_BYTES]
    rows[:, HEIGHT] = length[r]
    return rows


def _join_rows(rows: np.ndarray, row_unit: np.ndarray) -> np.ndarray:
    """Merge 1-D rows of one unit that continue each other on both sides (consecutive
    blocks whose slices tile both the worker's buffer and the object). Rows of one
    unit lie in one pool slab, so a merged row never crosses a slab."""
    one = rows[:, HEIGHT] == 1
    if one.sum() < 2:
        return rows
    r, u = rows[one], row_unit[one]
    order = np.lexsort((r[:, POOL_ADDR], u))
    r, u = r[order], u[order]
    joins = np.zeros(r.shape[0], dtype=bool)
    end_pool = r[:-1, POOL_ADDR] + r[:-1, WIDTH]
    end_dev = r[:-1, DEV_ADDR] + r[:-1, WIDTH]
    joins[1:] = (u[1:] == u[:-1]) & (r[1:, POOL_ADDR] == end_pool) & (r[1:, DEV_ADDR] == end_dev)
    if not joins.any():
        return rows
    first = np.flatnonzero(~joins)
    merged = r[first].copy()
    merged[:, WIDTH] = np.add.reduceat(r[:, WIDTH], first)
    merged[:, DEV_PITCH] = merged[:, WIDTH]
    merged[:, POOL_PITCH] = merged[:, WIDTH]
    return np.concatenate([rows[~one], merged])


def _unit_ids(t: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The block ids of every unit, concatenated in unit order.

    Built plans lay them end to end already; a plan whose all-skipped copies were
    dropped (:func:`_units_exact`) has gaps, and is gathered unit by unit.
    """
    offs, n = t[:, IDS_OFFSET], t[:, N_BLOCKS]
    ends = offs + n
    if int(offs[0]) == 0 and int(ends[-1]) == ids.size and bool((offs[1:] == ends[:-1]).all()):
        return ids
    return np.concatenate([ids[o : o + k] for o, k in zip(offs.tolist(), n.tolist(), strict=True)])
