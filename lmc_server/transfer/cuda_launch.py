"""Enqueueing one planned copy on a lane's streams: copy-engine rows, or staged pieces.

What :class:`~lmc_server.transfer.cuda.CudaEngine` does once a request is planned: in
copy mode ``dma`` the plan's rows go to the copy engines (1-D rows in one
``cuMemcpyBatchAsync`` call where the driver passed its check, :mod:`.cuda_batch`;
2-D rows one ``cudaMemcpy2DAsync`` each); in mode ``staging`` each piece is gathered
into (or scattered from) one half of the lane's double-buffered staging area on the SM
stream, with one DMA per contiguous pool range on the DMA stream, the two streams
ordered by the lane's events. Nothing here waits for the GPU.
"""

from __future__ import annotations

import cupy

from lmc_server.transfer import cuda_kernels
from lmc_server.transfer.base import TransferError
from lmc_server.transfer.cuda_batch import BatchCopier
from lmc_server.transfer.cuda_dma_plan import DEV_ADDR, HEIGHT, POOL_ADDR, WIDTH, DmaPlan
from lmc_server.transfer.cuda_lanes import MEMCPY_DEFAULT, Lane
from lmc_server.transfer.cuda_plan import Plan

#: Threads per block of the gather and scatter kernels.
GATHER_THREADS = 256


def issue_dma(lane: Lane, plan: DmaPlan, to_pool: bool, batch: BatchCopier | None) -> str:
    """Issue the plan's copies on the lane's DMA stream (copy engines only); returns
    the driver's refusal of the batch call, ``""`` when there was none.

    A batch call the driver refuses is issued again as single copies: a copy writes the
    same bytes however often it runs, and the singles follow whatever part of the batch
    the driver did queue in stream order, so the result is the same.
    """
    stream = lane.dma.ptr
    rows = plan.rows
    refused = ""
    if batch is not None:
        one = rows[:, HEIGHT] == 1
        if one.any():
            r = rows[one]
            dev, pool, width = r[:, DEV_ADDR], r[:, POOL_ADDR], r[:, WIDTH]
            try:
                if to_pool:
                    batch.copy(pool, dev, width, stream)
                else:
                    batch.copy(dev, pool, width, stream)
                rows = rows[~one]
            except TransferError as e:
                refused = str(e)
    copy2d, copy1d = cupy.cuda.runtime.memcpy2DAsync, cupy.cuda.runtime.memcpyAsync
    for dev, dpitch, pool, ppitch, width, height in rows.tolist():
        dst, dst_pitch, src, src_pitch = (
            (pool, ppitch, dev, dpitch) if to_pool else (dev, dpitch, pool, ppitch)
        )
        if height == 1:
            copy1d(dst, src, width, MEMCPY_DEFAULT, stream)
        else:
            copy2d(dst, dst_pitch, src, src_pitch, width, height, MEMCPY_DEFAULT, stream)
    return refused


def _blocks(pages: int, sm_count: int) -> int:
    return max(1, min(pages, 4 * sm_count))


def store_pieces(lane: Lane, plan: Plan, units: int, ids: int, sm_count: int) -> None:
    """Gather each piece into a staging half (SMs), then DMA it out (copy engine).

    Piece ``k`` uses half ``k % 2``; its gather waits until the DMA of piece ``k - 2``
    has drained that half.
    """
    sm, dma, memcpy = lane.sm, lane.dma, cupy.cuda.runtime.memcpyAsync
    launch, device, n = cuda_kernels.launch, lane.device, plan.n_units
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
    launch, device, n = cuda_kernels.launch, lane.device, plan.n_units
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
