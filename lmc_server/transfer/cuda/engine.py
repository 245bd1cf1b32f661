"""The CUDA transfer engine: pages between workers' GPU buffers and the pinned pool.

Four copy modes (``--cuda-copy-mode``), chosen by measurement (docs/gpu.md): ``dma``
(the GPU's copy engines alone, 1-D rows in one ``cuMemcpyBatchAsync`` call where the
driver takes it, :mod:`~lmc_server.transfer.cuda.dma_plan`); ``staging`` (a short SM
gather of the pages into a GPU staging half, then one DMA per contiguous pool range, in
double-buffered pieces so the gather of piece k+1 runs while piece k is on the wire; the
reverse for a retrieve); ``mapped`` (one kernel reads the pages and writes the mapped
pinned pool over PCIe, or the reverse); and ``auto`` (default): ``dma`` while other
processes' kernels hold the GPU (:mod:`~lmc_server.transfer.cuda.gpu_activity`), because an
engine beside the server loses 8-20 % to the server's kernels and almost nothing to
copy-engine DMAs; on an idle GPU ``dma`` too where a request's copies are wide rows
(:func:`~lmc_server.transfer.cuda.dma_plan.wide_rows`: at the link there), else
``staging``.

A request is planned whole before anything is launched: every range is checked, and
the plan is one row per (layer run, chunk) plus the block ids
(:mod:`~lmc_server.transfer.cuda.units`); the kernels compute page addresses on the GPU,
so planning costs a fixed ~0.1 ms whatever the batch size, and the whole request is
enqueued at once. Each concurrent request takes a *lane* of its GPU (an SM stream, DMA streams,
staging halves, pinned and device unit buffers, events), so the per-request objects are
allocated once and reused. A lane's waiter thread waits for the GPU
(:mod:`~lmc_server.transfer.cuda.wait`), reports the copy and passes the lane on.
Ordering with the worker: a worker sends a store only once its writes to the pages are
complete (it waits for an event behind them off its engine thread,
``client.cuda.stream_done``), so a store's copy starts at once; the server never touches
the worker's streams. A retrieve is reported only after its last write completed, so
the reply itself tells the worker the pages are ready. (Passing an interprocess event
for the server's stream to wait on was tried and dropped: on the H200 the imported event
did not reliably order the copy after the worker's write; docs/gpu.md.)

This module is the engine's face, the :class:`~lmc_server.transfer.base.TransferEngine`
contract: its settings (checked here, before anything is allocated), the pinned pool and
the IPC mappings, a request's entry (``submit``: a lane taken, or the job queued for the
next free one, so the event loop never blocks on a lane) and the shutdown. What happens
to a job once it holds a lane is :mod:`~lmc_server.transfer.cuda.jobs`, the engine's
base class.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import cupy

from lmc_server.buffers import BufferSpec
from lmc_server.cache.layout import RunCopy
from lmc_server.transfer.base import (
    BufferMapping,
    DoneCallback,
    HostPool,
    TransferEngine,
    TransferError,
)
from lmc_server.transfer.cuda.batch import BatchCopier, batch_copier
from lmc_server.transfer.cuda.dma_plan import MIN_STREAM_BYTES
from lmc_server.transfer.cuda.ipc import CudaMapping, IpcTable
from lmc_server.transfer.cuda.jobs import CudaJobRunner
from lmc_server.transfer.cuda.lanes import CUDA_ERRORS, MIB, STAGING_HALF_BYTES, Job, Lanes
from lmc_server.transfer.cuda.pool import CudaHostPool
from lmc_server.transfer.cuda.wait import WAIT_MODES

COPY_MODES = ("auto", "staging", "mapped", "dma")
LANES_PER_DEVICE = 4
#: Thread blocks of the mapped-mode kernel: enough loads in flight to fill PCIe.
MAPPED_BLOCKS = 64
#: The first staging piece: a short gather, so the first DMA starts early.
FIRST_PIECE_BYTES = 8 * MIB
#: DMA streams per lane: copy mode ``dma`` spreads one request's copies over them, so
#: that several copy engines serve it (docs/gpu.md, "Every KV layout").
DMA_STREAMS = 4


class CudaEngine(CudaJobRunner, TransferEngine):
    """CUDA IPC mappings, a pinned pool, and the copy modes described above."""

    name = "cuda"

    def __init__(
        self,
        copy_mode: str = "staging",
        lanes_per_device: int = LANES_PER_DEVICE,
        mapped_blocks: int = MAPPED_BLOCKS,
        pinning: str = "alloc",
        wait: str = "hybrid",
        first_piece_bytes: int = FIRST_PIECE_BYTES,
        staging_half_bytes: int = STAGING_HALF_BYTES,
        kernel_pct: Callable[[int], Callable[[], int | None]] | None = None,
        batch_copies: bool = True,
        make_batch_copier: Callable[[int], BatchCopier | None] = batch_copier,
        dma_streams: int = DMA_STREAMS,
        dma_split_bytes: int = MIN_STREAM_BYTES,
    ) -> None:
        if copy_mode not in COPY_MODES:
            raise ValueError(f"copy mode {copy_mode!r}: expected one of {COPY_MODES}")
        if wait not in WAIT_MODES:
            raise ValueError(f"wait mode {wait!r}: expected one of {WAIT_MODES}")
        super().__init__(
            copy_mode,
            lanes_per_device,
            mapped_blocks,
            wait,
            first_piece_bytes,
            staging_half_bytes,
            kernel_pct,
            batch_copies,
            make_batch_copier,
            dma_streams,
            dma_split_bytes,
        )
        self.pinning = pinning
        self._queue_stopped = False
        self._ipc = IpcTable()
        if copy_mode == "mapped":
            for d in range(cupy.cuda.runtime.getDeviceCount()):
                # cudaDevAttrCanUseHostPointerForRegisteredMem: the pool's host address
                # is its device address, which the mapped kernels rely on.
                if not cupy.cuda.runtime.deviceGetAttribute(91, d):
                    raise TransferError(
                        f"device {d} cannot address registered host memory "
                        "directly; use --cuda-copy-mode staging"
                    )

    # -- resources ----------------------------------------------------------------------

    def create_pool(self, size_bytes: int, slab_bytes: int) -> HostPool:
        self._pool = CudaHostPool(size_bytes, slab_bytes, pinning=self.pinning)
        return self._pool

    def open(self, buffers: Sequence[BufferSpec]) -> BufferMapping:
        """Map a worker's buffers, and make its device's lanes now if they are new.

        A device's lanes (streams, staging buffers, the busy gate's NVML reader) and
        its batch copier's self-check (a few MB copied both ways and compared) are made
        once, here at registration, so the first request of a device does not pay
        them."""
        try:
            mapping = CudaMapping(self._ipc, list(buffers))
        except CUDA_ERRORS as e:
            raise TransferError(f"cannot map the buffers: {e}") from None
        if mapping.device_index >= 0:
            try:
                self._lanes_of(mapping.device_index)
            except CUDA_ERRORS as e:
                mapping.close()
                raise TransferError(f"cannot prepare device {mapping.device_index}: {e}") from None
        return mapping

    @property
    def open_handles(self) -> int:
        """IPC allocations currently mapped (tests and diagnostics)."""
        return len(self._ipc)

    # -- copies -------------------------------------------------------------------------

    def submit(
        self, mapping: BufferMapping, copies: Sequence[RunCopy], to_pool: bool, done: DoneCallback
    ) -> None:
        """Plan and launch on the calling thread, then hand the lane to its waiter.

        Planning and launching are Python work under the GIL wherever they run, so
        doing them here costs the event loop no more than a worker thread would, and
        saves the hop to that thread. The lane's waiter thread waits for the GPU
        (``WAIT_MODES``), calls ``done`` and gives the lane to the next queued job.
        """
        t_enter = time.perf_counter()
        if not isinstance(mapping, CudaMapping) or mapping.closed:
            raise TransferError("registration has no open CUDA mapping")
        # the list itself when every copy has chunks: identical requests share it
        live = (
            copies
            if all(c.block_ids.size for c in copies)
            else [c for c in copies if c.block_ids.size]
        )
        if not live:
            done("")
            return
        job = Job(mapping, live, to_pool, done, t_enter)
        lanes = self._lanes_of(mapping.device_index)
        lane = lanes.take_or_queue(job)
        if lane is None:
            if self._queue_stopped:
                self._fail_queued(lanes)
            return  # launched by the waiter that frees a lane
        try:
            launched = self._launch(lane, job)
        except TransferError:
            self._release(lanes, lane)
            raise
        if not launched:
            self._release(lanes, lane)

    def stop_queued(self) -> None:
        """Past the drain timeout: copies waiting for a lane fail now (their chunks are
        reported failed and never committed), and so does any later one that would
        have to wait; copies on a lane finish."""
        self._queue_stopped = True
        for lanes in list(self._lanes.values()):
            self._fail_queued(lanes)

    @staticmethod
    def _fail_queued(lanes: Lanes) -> None:
        for job in lanes.stop_queued():
            job.done("the server is shutting down: copy not started")

    def close(self) -> None:
        for gate in self._gates.values():
            gate.close()
        self._gates.clear()
        for lanes in list(self._lanes.values()):
            for lane in lanes.all:
                lane.jobs.put(None)
                if lane.waiter is not None:
                    lane.waiter.join()
                lane.sm.synchronize()
                for s in lane.dmas:
                    s.synchronize()
        self._lanes.clear()
        if self._pool is not None:
            self._pool.close()
