"""Copy-engine plans (copy mode ``dma``): a request as 1-D and 2-D DMA rows, no kernel.

Built from the same checked unit rows as the kernel plans (:mod:`.cuda_plan`:
``plan_units``, the page envelope and object-range checks), so a ``dma`` plan can name
no page or pool byte a kernel plan could not. Pure numpy, testable on a CPU host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lmc_server.cache.layout import RunCopy
from lmc_server.transfer.cuda_units import (
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
    what the rows move in all.
    """

    rows: np.ndarray  # (R, 6) int64
    nbytes: int

    @property
    def n_rows(self) -> int:
        return int(self.rows.shape[0])


DEV_ADDR, DEV_PITCH, POOL_ADDR, POOL_PITCH, WIDTH, HEIGHT = range(6)
_EMPTY_DMA = DmaPlan(np.zeros((0, 6), np.int64), 0)


def plan_dma(copies: Sequence[RunCopy], region: Region) -> DmaPlan:
    """2-D copy descriptors for the copy engines, checked like the kernels' plans.

    The page envelope and object ranges are checked by
    :func:`~lmc_server.transfer.cuda_plan.plan_units` (the same checks as the kernel
    paths) and every object range must lie in one pool slab. Pages of consecutive block
    ids whose block stride equals the page size are contiguous in the engine's buffer
    and in the object, so they merge into one row; a block id of -1 ("leave this page
    alone") ends a run and is skipped. A run's layers become the height of one 2-D copy
    when its layer stride is at least the row's width (layers that do not overlap, in
    increasing order); otherwise each layer is a row of its own.
    """
    u = plan_units(copies, region)
    if u is None:
        return _EMPTY_DMA
    t = u.table
    start = region.pool_addr(u.pool_off)
    slab_lo = region.slab_ptrs[u.pool_off // region.slab_bytes]
    check_objects(start, u.extent, slab_lo, slab_lo + region.slab_bytes)
    n_blocks = t[:, N_BLOCKS]
    unit = np.repeat(np.arange(t.shape[0], dtype=np.int64), n_blocks)
    ids = _unit_ids(t, u.ids)
    j = np.arange(ids.size, dtype=np.int64) - np.repeat(np.cumsum(n_blocks) - n_blocks, n_blocks)
    page = t[unit, PAGE_BYTES]
    contiguous = (t[unit, BLOCK_STRIDE] == page) & (t[unit, OBJ_BLOCK_STRIDE] == page)
    live = ids >= 0
    # a run continues where the id follows its predecessor in the same unit
    follows = np.zeros(ids.size, dtype=bool)
    follows[1:] = (j[1:] > 0) & live[:-1] & contiguous[1:] & (ids[1:] == ids[:-1] + 1)
    follows &= live
    first = np.flatnonzero(live & ~follows)
    # a run ends at the next id that does not follow (a begin or a dead id)
    breaks = np.append(np.flatnonzero(~follows), ids.size)
    stop = breaks[np.searchsorted(breaks, first, side="right")]
    length = stop - first
    ru = unit[first]
    width = length * page[first]
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
