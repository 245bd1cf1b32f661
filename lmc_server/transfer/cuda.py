"""The CUDA transfer engine: pages between workers' GPU buffers and the pinned pool.

Four copy modes (``--cuda-copy-mode``), chosen by measurement (docs/gpu.md): ``dma``
(the GPU's copy engines alone, 1-D rows in one ``cuMemcpyBatchAsync`` call where the
driver takes it, :mod:`~lmc_server.transfer.cuda_dma_plan`); ``staging`` (a short SM
gather of the pages into a GPU staging half, then one DMA per contiguous pool range, in
double-buffered pieces so the gather of piece k+1 runs while piece k is on the wire; the
reverse for a retrieve); ``mapped`` (one kernel reads the pages and writes the mapped
pinned pool over PCIe, or the reverse); and ``auto`` (default): ``dma`` while other
processes' kernels hold the GPU (:mod:`~lmc_server.transfer.gpu_activity`), because an
engine beside the server loses 8-20 % to the server's kernels and almost nothing to
copy-engine DMAs; on an idle GPU ``dma`` too where a request's copies are wide rows
(:func:`~lmc_server.transfer.cuda_dma_plan.wide_rows`: at the link there), else
``staging``.

A request is planned whole before anything is launched: every range is checked, and
the plan is one row per (layer run, chunk) plus the block ids
(:mod:`~lmc_server.transfer.cuda_units`); the kernels compute page addresses on the GPU,
so planning costs a fixed ~0.1 ms whatever the batch size, and the whole request is
enqueued at once. Each concurrent request takes a *lane* of its GPU (an SM stream, DMA streams,
staging halves, pinned and device unit buffers, events), so the per-request objects are
allocated once and reused. A lane's waiter thread waits for the GPU
(:mod:`~lmc_server.transfer.cuda_wait`), reports the copy and passes the lane on.
Ordering with the worker: a worker sends a store only once its writes to the pages are
complete (it waits for an event behind them off its engine thread,
``client.cuda.stream_done``), so a store's copy starts at once; the server never touches
the worker's streams. A retrieve is reported only after its last write completed, so
the reply itself tells the worker the pages are ready. (Passing an interprocess event
for the server's stream to wait on was tried and dropped: on the H200 the imported event
did not reliably order the copy after the worker's write; docs/gpu.md.)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import cupy

from lmc_server.buffers import BufferSpec
from lmc_server.cache.layout import RunCopy
from lmc_server.threadnames import name_os_thread
from lmc_server.transfer import cuda_kernels
from lmc_server.transfer.base import (
    BufferMapping,
    DoneCallback,
    HostPool,
    TransferEngine,
    TransferError,
)
from lmc_server.transfer.cuda_batch import BatchCopier, batch_copier
from lmc_server.transfer.cuda_dma_plan import MIN_STREAM_BYTES, DmaPlan, wide_rows
from lmc_server.transfer.cuda_dma_reuse import DmaPlans
from lmc_server.transfer.cuda_ipc import CudaMapping, IpcTable
from lmc_server.transfer.cuda_lanes import (
    CUDA_ERRORS,
    MIB,
    STAGING_HALF_BYTES,
    Job,
    Lane,
    Lanes,
)
from lmc_server.transfer.cuda_launch import issue_dma, retrieve_pieces, store_pieces
from lmc_server.transfer.cuda_plan import Plan, plan_mapped, plan_staging
from lmc_server.transfer.cuda_pool import CudaHostPool
from lmc_server.transfer.cuda_units import Region
from lmc_server.transfer.cuda_wait import WAIT_MODES, LinkClock, wait_for_lane
from lmc_server.transfer.gpu_activity import BusyGate, NvmlUtilization, SampledGate

log = logging.getLogger(__name__)

COPY_MODES = ("auto", "staging", "mapped", "dma")
LANES_PER_DEVICE = 4
MAPPED_THREADS = 512
#: Thread blocks of the mapped-mode kernel: enough loads in flight to fill PCIe.
MAPPED_BLOCKS = 64
#: The first staging piece: a short gather, so the first DMA starts early.
FIRST_PIECE_BYTES = 8 * MIB
#: DMA streams per lane: copy mode ``dma`` spreads one request's copies over them, so
#: that several copy engines serve it (docs/gpu.md, "Every KV layout").
DMA_STREAMS = 4


def _nvml_reader(device: int) -> Callable[[], int | None]:
    return NvmlUtilization(str(cupy.cuda.Device(device).pci_bus_id)).read


class CudaEngine(TransferEngine):
    """CUDA IPC mappings, a pinned pool, and the two copy modes described above."""

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
        self.copy_mode = copy_mode
        self.mapped_blocks = mapped_blocks
        self.pinning = pinning
        self.wait = wait
        self.first_piece_bytes = first_piece_bytes
        self.staging_half_bytes = staging_half_bytes
        #: device -> a reader of its kernel-time percent (mode ``auto``; NVML default)
        self._kernel_pct = kernel_pct or _nvml_reader
        self._gates: dict[int, SampledGate] = {}
        #: Issue dma rows in cuMemcpyBatchAsync calls where the driver passes the check
        #: (``make_batch_copier``: device -> copier or ``None``). On the H200 it took
        #: stores beside a GEMM engine from 48.9 to 54.2 GB/s (docs/gpu.md).
        self.batch_copies = batch_copies
        self._make_batch_copier = make_batch_copier
        self._queue_stopped = False
        #: device -> the checked batch copier of mode dma (``None``: single copies)
        self._batch: dict[int, BatchCopier | None] = {}
        #: batch calls the driver refused, whose rows went out as single copies
        self.batch_fallbacks = 0
        #: Copies launched per path (``dma``, ``staging``, ``mapped``), for tests and
        #: diagnostics: what mode ``auto`` chose.
        self.copies_by_path: dict[str, int] = {"dma": 0, "staging": 0, "mapped": 0}
        #: When set, each copy records CUDA timing events and fills :attr:`last_profile`
        #: (benchmarks only: it adds two event records and one stream wait per copy).
        self.profile = False
        self.last_profile: dict[str, float] = {}
        self._lanes_per_device = lanes_per_device
        #: DMA plans of recent copy lists, moved to the next worker with the same
        #: request (:mod:`~lmc_server.transfer.cuda_dma_reuse`); launched from one thread
        #: at a time (the loop, or a waiter launching a queued job, under ``_plan_lock``)
        self._dma_plans = DmaPlans()
        self._plan_lock = threading.Lock()
        #: when each GPU's copies in flight are expected done (waiters sleep until then)
        self._link = LinkClock()
        self.dma_streams = dma_streams
        #: the least bytes a request puts on one of its DMA streams
        self.dma_split_bytes = dma_split_bytes
        #: the most DMA streams one request used so far (diagnostics and tests)
        self.dma_streams_used = 0
        self._lanes: dict[int, Lanes] = {}
        self._lanes_lock = threading.Lock()
        self._ipc = IpcTable()
        self._pool: CudaHostPool | None = None
        self._sm_count: dict[int, int] = {}
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
        try:
            return CudaMapping(self._ipc, list(buffers))
        except CUDA_ERRORS as e:
            raise TransferError(f"cannot map the buffers: {e}") from None

    @property
    def open_handles(self) -> int:
        """IPC allocations currently mapped (tests and diagnostics)."""
        return len(self._ipc)

    def _lanes_of(self, device: int) -> Lanes:
        lanes = self._lanes.get(device)
        if lanes is None:
            with self._lanes_lock:
                lanes = self._lanes.get(device)
                if lanes is None:
                    lanes = Lanes(
                        device, self._lanes_per_device, self.staging_half_bytes, self.dma_streams
                    )
                    self._sm_count[device] = int(
                        cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"]
                    )
                    if self.copy_mode == "auto":
                        self._gates[device] = SampledGate(
                            BusyGate(self._kernel_pct(device), name=f"GPU {device}")
                        )
                    if self.copy_mode in ("auto", "dma") and self.batch_copies:
                        self._batch[device] = self._make_batch_copier(device)
                    self._lanes[device] = lanes  # last: readers take the lanes unlocked
        return lanes

    def _region(self, mapping: CudaMapping) -> Region:
        pool = self._pool
        assert pool is not None, "create_pool first"
        return Region(mapping.ptrs, mapping.sizes, pool.slab_ptrs, pool.size_bytes, pool.slab_bytes)

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

    def _launch(self, lane: Lane, job: Job) -> bool:
        """Plan ``job`` and enqueue its GPU work on ``lane``; ``False``: nothing to copy
        (``done`` was called). Raises :class:`TransferError` with the lane drained."""
        device, to_pool = lane.device, job.to_pool
        if job.mapping.closed:
            raise TransferError("registration closed before its copy started")
        launched = False
        try:
            with cupy.cuda.Device(device):
                region = self._region(job.mapping)
                mode = self.copy_mode
                if mode == "auto":
                    busy = self._gates[device].busy()
                    mode = "dma" if busy or wide_rows(job.copies) else "staging"
                plan: Plan | DmaPlan
                if mode == "dma":
                    with self._plan_lock:
                        plan = self._dma_plans.plan(job.copies, region)
                    if not plan.n_rows:
                        job.done("")
                        return False
                elif mode == "staging":
                    # the largest cluster a plan stages: a section of one object
                    halves = lane.halves(
                        max(
                            max(c.run.nbytes, c.run.n_blocks * c.run.object_block_stride)
                            for c in job.copies
                        )
                    )
                    plan = plan_staging(
                        job.copies, region, halves, lane.half_bytes, self.first_piece_bytes
                    )
                else:
                    plan = plan_mapped(job.copies, region)
                if isinstance(plan, Plan) and not plan.pieces:
                    job.done("")
                    return False
                job.t_planned = time.perf_counter()
                launched = True
                self.copies_by_path[mode] += 1
                if self.profile:
                    lane.timing[0].record(lane.sm)
                    for s in lane.dmas:
                        s.wait_event(lane.timing[0])
                if isinstance(plan, DmaPlan):
                    # one request alone on its GPU spreads over the lane's DMA streams;
                    # with other lanes busy the copy engines are shared already, and
                    # each extra stream would only cost the loop an event and a call
                    alone = self._lanes[device].busy <= 1
                    refused, used = issue_dma(
                        lane,
                        plan,
                        to_pool,
                        self._batch.get(device),
                        self.dma_split_bytes if alone else plan.nbytes + 1,
                    )
                    self.dma_streams_used = max(self.dma_streams_used, used)
                    for why in refused:
                        self._batch_refused(plan, why)
                    last = lane.dma
                else:
                    units, ids = lane.upload(plan, lane.sm)
                    if mode == "mapped":
                        cuda_kernels.launch(
                            device,
                            "gather_units" if to_pool else "scatter_units",
                            units,
                            ids,
                            plan.n_units,
                            0,
                            plan.n_units,
                            plan.max_layers,
                            plan.max_blocks,
                            self.mapped_blocks,
                            MAPPED_THREADS,
                            lane.sm,
                        )
                        last = lane.sm
                    elif to_pool:
                        store_pieces(lane, plan, units, ids, self._sm_count[device])
                        last = lane.dma
                    else:
                        retrieve_pieces(lane, plan, units, ids, self._sm_count[device])
                        last = lane.sm
                if self.profile:
                    lane.timing[1].record(last)
                lane.done.record(last)
        except CUDA_ERRORS as e:
            if launched:
                lane.drain()
            raise TransferError(f"CUDA copy failed: {e}") from None
        except TransferError:
            if launched:
                lane.drain()
            raise
        job.nbytes = plan.nbytes
        with self._plan_lock:
            job.expected_end = self._link.expect(device, to_pool, plan.nbytes, job.t_planned)
        if isinstance(plan, DmaPlan):
            job.pieces, job.dmas = 1, plan.n_rows
        else:
            job.pieces = len(plan.pieces)
            job.dmas = sum(len(p.segments) for p in plan.pieces)
        job.t_launched = time.perf_counter()
        if lane.waiter is None:
            lane.waiter = threading.Thread(
                target=self._waiter, args=(lane,), name=f"lmc-cuda{device}-wait", daemon=True
            )
            lane.waiter.start()
        lane.jobs.put(job)
        return True

    def _waiter(self, lane: Lane) -> None:
        """Wait for each launched job of ``lane``, report it, pass the lane on."""
        name_os_thread()
        lanes = self._lanes_of(lane.device)
        while (job := lane.jobs.get()) is not None:
            err = ""
            try:
                wait_for_lane(lane, job.expected_end, self.wait)
            except CUDA_ERRORS as e:
                lane.drain()
                err = f"CUDA copy failed: {e}"
            if self.profile and not err:
                t_done = time.perf_counter()
                self.last_profile = {
                    "wall_ms": 1e3 * (t_done - job.t_enter),
                    "plan_ms": 1e3 * (job.t_planned - job.t_enter),
                    "launch_ms": 1e3 * (job.t_launched - job.t_planned),
                    "gpu_ms": float(cupy.cuda.get_elapsed_time(*lane.timing)),
                    "pieces": float(job.pieces),
                    "dmas": float(job.dmas),
                }
            job.done(err)
            self._release(lanes, lane)

    def _release(self, lanes: Lanes, lane: Lane) -> None:
        """Give ``lane`` back, or launch the oldest queued job on it (a queued job
        whose launch fails is answered here, and the lane goes to the next one)."""
        while (job := lanes.give(lane)) is not None:
            try:
                if self._launch(lane, job):
                    return
            except TransferError as e:
                job.done(str(e))

    def _batch_refused(self, plan: DmaPlan, why: str) -> None:
        """Count (and now and then log) a batch call the driver refused."""
        self.batch_fallbacks += 1
        if self.batch_fallbacks == 1 or self.batch_fallbacks % 1000 == 0:
            log.warning(
                "%s; the plan's %d rows went out as single copies (%d batch calls refused so far)",
                why,
                plan.n_rows,
                self.batch_fallbacks,
            )

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
