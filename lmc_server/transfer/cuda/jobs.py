"""A submitted copy's life on a lane of its GPU: path, plan, launch, wait, report.

What the engine (:class:`~lmc_server.transfer.cuda.engine.CudaEngine`, a
:class:`CudaJobRunner`) does with a job once the job holds a lane
(:mod:`~lmc_server.transfer.cuda.lanes`): ``_launch`` picks the copy path (mode
``auto``: the GPU's busy gate, then the rows' width), plans the whole job, enqueues its
GPU work (:mod:`~lmc_server.transfer.cuda.launch`) and hands it to the lane's waiter
thread, started at the lane's first launch; ``_waiter`` waits for the GPU
(:mod:`~lmc_server.transfer.cuda.wait`), reports the job and, through ``_release``,
gives the lane back or launches the oldest queued job on it. The counters the tests and
benchmarks read (``copies_by_path``, ``batch_fallbacks``, ``dma_streams_used``,
``last_profile``) are kept here, where the jobs pass.

Invariants: a lane carries one job at a time, from its launch until its waiter reported
it, and is then released exactly once; a job launched by a waiter is answered exactly
once (``done("")`` or its error), one launched by the submitter either is or raises
:class:`~lmc_server.transfer.base.TransferError` to it, its lane drained of whatever
was enqueued and released; a GPU's lanes are published (``_lanes``) only once its SM
count, busy gate and batch copier are in place, so readers take them unlocked; the DMA
plan cache and the link clock, shared by the loop and the waiters that launch queued
jobs, are touched only under ``_plan_lock``. A base class of the engine rather than an
object it holds, so that the request path calls exactly the methods it called when they
were the engine's: no call is added per submit, launch or wait.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import cupy

from lmc_server.threadnames import name_os_thread
from lmc_server.transfer.base import TransferError
from lmc_server.transfer.cuda import kernels
from lmc_server.transfer.cuda.batch import BatchCopier
from lmc_server.transfer.cuda.dma_plan import DmaPlan, plan_dma, wide_rows
from lmc_server.transfer.cuda.dma_reuse import DmaPlans
from lmc_server.transfer.cuda.gpu_activity import BusyGate, NvmlUtilization, SampledGate
from lmc_server.transfer.cuda.ipc import CudaMapping
from lmc_server.transfer.cuda.lanes import CUDA_ERRORS, Job, Lane, Lanes
from lmc_server.transfer.cuda.launch import issue_dma, retrieve_pieces, store_pieces
from lmc_server.transfer.cuda.plan import Plan, plan_mapped, plan_staging
from lmc_server.transfer.cuda.pool import CudaHostPool
from lmc_server.transfer.cuda.units import Region
from lmc_server.transfer.cuda.wait import LinkClock, wait_for_lane, wait_mode

#: The engine's logger (its package), not this module's: its lines name the engine, as operators'
#: filters expect, whichever of its modules writes them.
log = logging.getLogger("lmc_server.transfer.cuda")

MAPPED_THREADS = 512


def _nvml_reader(device: int) -> Callable[[], int | None]:
    return NvmlUtilization(str(cupy.cuda.Device(device).pci_bus_id)).read


class CudaJobRunner:
    """The lanes of each GPU and the jobs on them; the settings are the engine's
    (:class:`~lmc_server.transfer.cuda.engine.CudaEngine` checks and documents them)."""

    def __init__(
        self,
        copy_mode: str,
        lanes_per_device: int,
        mapped_blocks: int,
        wait: str,
        first_piece_bytes: int,
        staging_half_bytes: int,
        kernel_pct: Callable[[int], Callable[[], int | None]] | None,
        batch_copies: bool,
        make_batch_copier: Callable[[int], BatchCopier | None],
        dma_streams: int,
        dma_split_bytes: int,
    ) -> None:
        self.copy_mode = copy_mode
        self.mapped_blocks = mapped_blocks
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
        #: DMA plans of recent retrieves' copy lists, moved to the next worker with the
        #: same request (:mod:`~lmc_server.transfer.cuda.dma_reuse`; a store's copies
        #: name slots reserved for it alone, so its plan is never kept, and stores do not
        #: push the ranks' retrieve plans out of the cache); launched from one thread
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
        #: the pinned pool the copies go to and from (``create_pool`` sets it)
        self._pool: CudaHostPool | None = None
        self._sm_count: dict[int, int] = {}

    @property
    def dma_plans_made(self) -> int:
        """Retrieve DMA plans made and kept for reuse so far (tests, diagnostics)."""
        return self._dma_plans.planned

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
                    if to_pool:  # a store's list is new every time (fresh slots): no reuse
                        plan = plan_dma(job.copies, region)
                    else:
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
                        kernels.launch(
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
                wait_for_lane(lane, job.expected_end, wait_mode(self.wait, lanes.busy))
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
