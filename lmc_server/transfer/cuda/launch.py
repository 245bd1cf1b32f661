"""Enqueueing one planned copy on a lane's streams: copy-engine rows, or staged pieces.

What :class:`~lmc_server.transfer.cuda.engine.CudaEngine` does once a request is planned: in
copy mode ``dma`` the plan's rows go to the copy engines (1-D rows in one
``cuMemcpyBatchAsync`` call where the driver passed its check, :mod:`.batch`;
2-D rows one ``cudaMemcpy2DAsync`` each); in mode ``staging`` each piece is gathered
into (or scattered from) one half of the lane's double-buffered staging area on the SM
stream, with one DMA per contiguous pool range on the DMA stream, the two streams
ordered by the lane's events. Nothing here waits for the GPU.
"""

from __future__ import annotations

import cupy
import numpy as np

from lmc_server.transfer.base import TransferError
from lmc_server.transfer.cuda import kernels
from lmc_server.transfer.cuda.batch import BatchCopier, Prepared2D, PreparedBatch
from lmc_server.transfer.cuda.dma_plan import (
    DEV_ADDR,
    DEV_PITCH,
    HEIGHT,
    MIN_STREAM_BYTES,
    POOL_ADDR,
    POOL_PITCH,
    WIDTH,
    DmaPlan,
    split_rows,
)
from lmc_server.transfer.cuda.lanes import MEMCPY_DEFAULT, Lane
from lmc_server.transfer.cuda.plan import Plan

#: Threads per block of the gather and scatter kernels.
GATHER_THREADS = 256


def issue_dma(
    lane: Lane,
    plan: DmaPlan,
    to_pool: bool,
    batch: BatchCopier | None,
    split_bytes: int = MIN_STREAM_BYTES,
) -> tuple[list[str], int]:
    """Issue the plan's copies on the lane's DMA streams (copy engines only); returns
    the driver's refusals of batch calls (empty: none) and the streams used.

    The rows are cut into one slice per DMA stream (:func:`split_rows`, by bytes), so
    that several copy engines work on one request; every stream but the first is joined
    into ``lane.dma`` by an event, so work recorded on ``lane.dma`` afterwards follows
    every copy. Per stream, 1-D rows go in one ``cuMemcpyBatchAsync`` call and 2-D rows
    in one ``cuMemcpy3DBatchAsync`` call where the driver passed those checks. A batch
    call the driver refuses is issued again as single copies: a copy writes the same
    bytes however often it runs, and the singles follow whatever part of the batch the
    driver did queue in stream order, so the result is the same.

    The slices and their calls' descriptors are worked out once per plan, direction,
    stream count and batch copier (:class:`StreamRows`, kept in ``plan.issues``): the
    tensor-parallel ranks' shared plans, and a prefix loaded again, cost the loop only
    the driver calls.
    """
    key = (to_pool, len(lane.dmas), split_bytes)
    known = plan.issues.get(key)
    if known is None or known[0] is not batch:
        parts = split_rows(plan.rows, len(lane.dmas), split_bytes)
        known = (batch, [StreamRows(rows, to_pool, batch) for rows in parts])
        plan.issues[key] = known  # one dict store: safe beside another lane's thread
    streams: list[StreamRows] = known[1]
    refused: list[str] = []
    for k, part in enumerate(streams):
        refused += part.issue(batch, lane.dmas[k].ptr)
    for k in range(1, len(streams)):
        lane.joined[k].record(lane.dmas[k])
        lane.dma.wait_event(lane.joined[k])
    return refused, len(streams)


class StreamRows:
    """One DMA stream's rows of a plan, in one direction, as the driver is given them:
    the 1-D rows as one prepared ``cuMemcpyBatchAsync`` call, the 2-D rows as one
    ``cuMemcpy3DBatchAsync`` call (each where ``batch`` has it), the rest as single
    copies. Read-only once made (lanes issue from several threads)."""

    __slots__ = ("rows", "to_pool", "batched", "one", "two", "singles")

    def __init__(self, rows: np.ndarray, to_pool: bool, batch: BatchCopier | None) -> None:
        self.rows, self.to_pool = rows, to_pool
        self.one: PreparedBatch | None = None
        self.two: Prepared2D | None = None
        #: which rows a batch call takes (the others are singles)
        self.batched = np.zeros(rows.shape[0], dtype=bool)
        if batch is not None:
            one = rows[:, HEIGHT] == 1
            if one.any():
                r = rows[one]
                dev, pool, width = r[:, DEV_ADDR], r[:, POOL_ADDR], r[:, WIDTH]
                self.one = (
                    batch.prepare(pool, dev, width) if to_pool else batch.prepare(dev, pool, width)
                )
                self.batched |= one
            two = rows[:, HEIGHT] > 1
            if batch.has_2d and two.any():
                r = rows[two]
                dev, dp, pool, pp = (
                    r[:, DEV_ADDR],
                    r[:, DEV_PITCH],
                    r[:, POOL_ADDR],
                    r[:, POOL_PITCH],
                )
                w, h = r[:, WIDTH], r[:, HEIGHT]
                self.two = (
                    batch.prepare2d(pool, pp, dev, dp, w, h)
                    if to_pool
                    else batch.prepare2d(dev, dp, pool, pp, w, h)
                )
                self.batched |= two
        self.batched.flags.writeable = False
        self.singles: list[list[int]] = rows[~self.batched].tolist()

    def issue(self, batch: BatchCopier | None, stream: int) -> list[str]:
        """Enqueue the rows on ``stream``; the refusals of batch calls (their rows then
        go out as single copies, in row order, after the calls the driver took)."""
        refused: list[str] = []
        singles = self.singles
        if self.one is not None or self.two is not None:
            assert batch is not None
            took = self.batched
            if self.one is not None:
                try:
                    batch.copy_prepared(self.one, stream)
                except TransferError as e:
                    refused.append(str(e))
                    took = took & ~(self.rows[:, HEIGHT] == 1)
            if self.two is not None:
                try:
                    batch.copy2d_prepared(self.two, stream)
                except TransferError as e:
                    refused.append(str(e))
                    took = took & ~(self.rows[:, HEIGHT] > 1)
            if refused:
                singles = self.rows[~took].tolist()
        _issue_singles(singles, self.to_pool, stream)
        return refused


def _issue_singles(rows: list[list[int]], to_pool: bool, stream: int) -> None:
    copy2d, copy1d = cupy.cuda.runtime.memcpy2DAsync, cupy.cuda.runtime.memcpyAsync
    for dev, dpitch, pool, ppitch, width, height in rows:
        dst, dst_pitch, src, src_pitch = (
            (pool, ppitch, dev, dpitch) if to_pool else (dev, dpitch, pool, ppitch)
        )
        if height == 1:
            copy1d(dst, src, width, MEMCPY_DEFAULT, stream)
        else:
            copy2d(dst, dst_pitch, src, src_pitch, width, height, MEMCPY_DEFAULT, stream)


def _blocks(pages: int, sm_count: int) -> int:
    return max(1, min(pages, 4 * sm_count))


def store_pieces(lane: Lane, plan: Plan, units: int, ids: int, sm_count: int) -> None:
    """Gather each piece into a staging half (SMs), then DMA it out (copy engine).

    Piece ``k`` uses half ``k % 2``; its gather waits until the DMA of piece ``k - 2``
    has drained that half.
    """
    sm, dma, memcpy = lane.sm, lane.dma, cupy.cuda.runtime.memcpyAsync
    launch, device, n = kernels.launch, lane.device, plan.n_units
    for k, p in enumerate(plan.pieces):
        h = k % 2
        if k >= 2:
            sm.wait_event(lane.freed[h])
        launch(
            device,
            "gather_units",
            units,
            ids,
            n,
            p.first,
            p.count,
            plan.max_layers,
            plan.max_blocks,
            _blocks(plan.box_pages(p.count), sm_count),
            GATHER_THREADS,
            sm,
        )
        lane.filled[h].record(sm)
        dma.wait_event(lane.filled[h])
        for stage, pool, nbytes in p.segments.tolist():
            memcpy(pool, stage, nbytes, MEMCPY_DEFAULT, dma.ptr)
        lane.freed[h].record(dma)


def retrieve_pieces(lane: Lane, plan: Plan, units: int, ids: int, sm_count: int) -> None:
    """DMA each piece into a staging half, then scatter it into the pages (SMs)."""
    sm, dma, memcpy = lane.sm, lane.dma, cupy.cuda.runtime.memcpyAsync
    launch, device, n = kernels.launch, lane.device, plan.n_units
    for k, p in enumerate(plan.pieces):
        h = k % 2
        if k >= 2:
            dma.wait_event(lane.freed[h])
        for stage, pool, nbytes in p.segments.tolist():
            memcpy(stage, pool, nbytes, MEMCPY_DEFAULT, dma.ptr)
        lane.filled[h].record(dma)
        sm.wait_event(lane.filled[h])
        launch(
            device,
            "scatter_units",
            units,
            ids,
            n,
            p.first,
            p.count,
            plan.max_layers,
            plan.max_blocks,
            _blocks(plan.box_pages(p.count), sm_count),
            GATHER_THREADS,
            sm,
        )
        lane.freed[h].record(sm)
