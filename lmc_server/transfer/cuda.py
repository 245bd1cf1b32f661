"""The CUDA transfer engine: pages between workers' GPU buffers and the pinned pool.

Two copy modes (``--cuda-copy-mode``), chosen by measurement (docs/gpu.md):

``staging`` (default)
    Store: a short SM gather of the request's pages into a GPU staging buffer, then one
    DMA per contiguous pool range (the copy engines, no SMs). Retrieve: DMA into staging,
    then an SM scatter into the pages. Requests are cut into pieces that fill one half
    of a double-buffered staging area, on two streams, so the gather of piece k+1 runs
    while piece k is on the wire. SM time is a few percent of the transfer.
``mapped``
    One kernel reads the pages and writes the mapped pinned pool directly over PCIe
    (or the reverse). No staging memory, but SMs are busy for the whole transfer.

A request is validated whole (every range, before anything is launched), then cut into
a few parts of growing size (one staging half, then three times the previous): part
``i + 1`` is planned on the CPU (numpy) while the GPU copies part ``i``, so only the
first, small part's planning adds to the latency. Each
concurrent request takes a *lane* of its GPU (two streams, staging halves,
descriptor buffers, events), so the per-request objects are allocated once and reused.
``store``/``retrieve`` block until the copy is complete, waiting on a blocking-sync
event (the thread sleeps; no core spins). Ordering with the worker: a store first makes
its own stream wait on the interprocess event the worker recorded after writing the
pages; the worker's stream is never made to wait on the server. A retrieve returns only
after its last write completed, so the reply itself tells the worker the pages are
ready.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Sequence

import cupy
import numpy as np

from lmc_server.cache.geometry import BufferSpec
from lmc_server.cache.layout import RunCopy
from lmc_server.transfer import cuda_kernels
from lmc_server.transfer.base import HostPool, Mapping, TransferEngine, TransferError
from lmc_server.transfer.cuda_ipc import CudaMapping, IpcTable
from lmc_server.transfer.cuda_plan import (
    Plan,
    Region,
    plan_mapped,
    plan_staging,
    split,
    validate,
)
from lmc_server.transfer.cuda_pool import CudaHostPool

log = logging.getLogger(__name__)

COPY_MODES = ("staging", "mapped")
MIB = 1 << 20
#: Staging half size floor; a half grows to the largest object run a request has.
STAGING_HALF_BYTES = 32 * MIB
LANES_PER_DEVICE = 4
GATHER_THREADS = 256
MAPPED_THREADS = 512
#: Thread blocks of the mapped-mode kernel: enough loads in flight to fill PCIe.
MAPPED_BLOCKS = 64
#: Interprocess events kept open per mapping (a worker reuses one per stream).
EVENT_CACHE = 64
_MEMCPY_DEFAULT = 4
_CUDA_ERRORS = (cupy.cuda.runtime.CUDARuntimeError, cupy.cuda.driver.CUDADriverError)


class _Lane:
    """What one in-flight request on one GPU needs, allocated once and reused."""

    def __init__(self, device: int) -> None:
        self.device = device
        with cupy.cuda.Device(device):
            self.sm = cupy.cuda.Stream(non_blocking=True)
            self.dma = cupy.cuda.Stream(non_blocking=True)
            self.filled = [cupy.cuda.Event(disable_timing=True) for _ in range(2)]
            self.freed = [cupy.cuda.Event(disable_timing=True) for _ in range(2)]
            self.done = cupy.cuda.Event(block=True, disable_timing=True)
        self.half_bytes = 0
        self.staging: cupy.cuda.memory.Memory | None = None
        self.desc_rows = 0
        self.desc_dev: cupy.cuda.memory.Memory | None = None
        self.desc_host: cupy.cuda.PinnedMemoryPointer | None = None
        self.desc_host_view = np.zeros((0, 3), dtype=np.uint64)

    def halves(self, need_bytes: int) -> tuple[int, int]:
        if need_bytes > self.half_bytes:
            size = max(STAGING_HALF_BYTES, -(-need_bytes // MIB) * MIB)
            self.staging = None
            with cupy.cuda.Device(self.device):
                self.staging = cupy.cuda.memory.Memory(2 * size)
            self.half_bytes = size
        assert self.staging is not None
        return int(self.staging.ptr), int(self.staging.ptr) + self.half_bytes

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` descriptors (host and device); grows, never shrinks."""
        if rows <= self.desc_rows:
            return
        rows = max(4096, 1 << (rows - 1).bit_length())
        self.desc_dev = self.desc_host = None
        with cupy.cuda.Device(self.device):
            self.desc_dev = cupy.cuda.memory.Memory(rows * cuda_kernels.DESC_BYTES)
        self.desc_host = cupy.cuda.alloc_pinned_memory(rows * cuda_kernels.DESC_BYTES)
        self.desc_host_view = np.frombuffer(self.desc_host, dtype=np.uint64,
                                            count=rows * 3).reshape(rows, 3)
        self.desc_rows = rows

    def upload(self, desc: np.ndarray, row: int, stream: cupy.cuda.Stream) -> int:
        """Enqueue the copy of ``desc`` to device rows ``row...`` on ``stream``.

        Rows of one request never overlap, so a part's host rows are not rewritten
        while an earlier part's upload may still be reading them. Returns the device
        address of row 0.
        """
        n = desc.shape[0]
        assert self.desc_dev is not None and row + n <= self.desc_rows
        self.desc_host_view[row:row + n] = desc
        nbytes = n * cuda_kernels.DESC_BYTES
        cupy.cuda.runtime.memcpyAsync(int(self.desc_dev.ptr) + row * cuda_kernels.DESC_BYTES,
                                      int(self.desc_host_view.ctypes.data)
                                      + row * cuda_kernels.DESC_BYTES,
                                      nbytes, _MEMCPY_DEFAULT, stream.ptr)
        return int(self.desc_dev.ptr)


class _Lanes:
    """Up to ``LANES_PER_DEVICE`` lanes per GPU, created on demand."""

    def __init__(self, device: int, limit: int) -> None:
        self.device = device
        self.limit = limit
        self._free: queue.LifoQueue[_Lane] = queue.LifoQueue()
        self._lock = threading.Lock()
        self.all: list[_Lane] = []

    def take(self) -> _Lane:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if len(self.all) < self.limit:
                lane = _Lane(self.device)
                self.all.append(lane)
                return lane
        return self._free.get()

    def give(self, lane: _Lane) -> None:
        self._free.put(lane)


class _EventCache:
    """A mapping's opened interprocess events by handle (closed with the mapping)."""

    def __init__(self, device: int) -> None:
        self.device = device
        self._lock = threading.Lock()
        self._events: OrderedDict[bytes, int] = OrderedDict()

    def wait(self, handle: bytes, stream: cupy.cuda.Stream) -> None:
        """Make ``stream`` wait for the event's last record (enqueued, not blocking)."""
        if len(handle) != 64:
            raise TransferError(f"wait_event must be a 64-byte CUDA IPC event handle, "
                                f"got {len(handle)} bytes")
        with self._lock:
            ev = self._events.get(handle)
            if ev is None:
                try:
                    ev = int(cupy.cuda.runtime.ipcOpenEventHandle(handle))
                except _CUDA_ERRORS as e:
                    raise TransferError(f"cannot open the wait event: {e}") from None
                self._events[handle] = ev
                if len(self._events) > EVENT_CACHE:
                    _, old = self._events.popitem(last=False)
                    cupy.cuda.runtime.eventDestroy(old)
            else:
                self._events.move_to_end(handle)
            cupy.cuda.runtime.streamWaitEvent(stream.ptr, ev, 0)

    def close(self) -> None:
        with self._lock:
            with cupy.cuda.Device(self.device):
                for ev in self._events.values():
                    try:
                        cupy.cuda.runtime.eventDestroy(ev)
                    except _CUDA_ERRORS as e:
                        log.debug("destroying an imported event failed: %s", e)
            self._events.clear()


class _EngineMapping(CudaMapping):
    def __init__(self, table: IpcTable, buffers: list[BufferSpec]) -> None:
        super().__init__(table, buffers)
        self.events = _EventCache(self.device_index)

    def close(self) -> None:
        events = getattr(self, "events", None)
        if events is not None:
            events.close()
        super().close()


class CudaEngine(TransferEngine):
    """CUDA IPC mappings, a pinned pool, and the two copy modes described above."""

    name = "cuda"

    def __init__(self, copy_mode: str = "staging", lanes_per_device: int = LANES_PER_DEVICE,
                 mapped_blocks: int = MAPPED_BLOCKS, pinning: str = "alloc") -> None:
        if copy_mode not in COPY_MODES:
            raise ValueError(f"copy mode {copy_mode!r}: expected one of {COPY_MODES}")
        self.copy_mode = copy_mode
        self.mapped_blocks = mapped_blocks
        self.part_bytes = STAGING_HALF_BYTES
        self.pinning = pinning
        self._lanes_per_device = lanes_per_device
        self._lanes: dict[int, _Lanes] = {}
        self._lanes_lock = threading.Lock()
        self._ipc = IpcTable()
        self._pool: CudaHostPool | None = None
        self._sm_count: dict[int, int] = {}
        if copy_mode == "mapped":
            for d in range(cupy.cuda.runtime.getDeviceCount()):
                # cudaDevAttrCanUseHostPointerForRegisteredMem: the pool's host address
                # is its device address, which the mapped kernels rely on.
                if not cupy.cuda.runtime.deviceGetAttribute(91, d):
                    raise TransferError(f"device {d} cannot address registered host memory "
                                        "directly; use --cuda-copy-mode staging")

    # -- resources ----------------------------------------------------------------------

    def create_pool(self, size_bytes: int, slab_bytes: int) -> HostPool:
        self._pool = CudaHostPool(size_bytes, slab_bytes, pinning=self.pinning)
        return self._pool

    def open(self, buffers: Sequence[BufferSpec]) -> Mapping:
        try:
            return _EngineMapping(self._ipc, list(buffers))
        except _CUDA_ERRORS as e:
            raise TransferError(f"cannot map the buffers: {e}") from None

    @property
    def open_handles(self) -> int:
        """IPC allocations currently mapped (tests and diagnostics)."""
        return len(self._ipc)

    def _lanes_of(self, device: int) -> _Lanes:
        lanes = self._lanes.get(device)
        if lanes is None:
            with self._lanes_lock:
                lanes = self._lanes.get(device)
                if lanes is None:
                    lanes = _Lanes(device, self._lanes_per_device)
                    self._lanes[device] = lanes
                    self._sm_count[device] = int(cupy.cuda.runtime.getDeviceProperties(
                        device)["multiProcessorCount"])
        return lanes

    def _region(self, mapping: CudaMapping) -> Region:
        pool = self._pool
        assert pool is not None, "create_pool first"
        return Region(mapping.ptrs, mapping.sizes, pool.slab_ptrs, pool.size_bytes,
                      pool.slab_bytes)

    # -- copies -------------------------------------------------------------------------

    def store(self, mapping: Mapping, copies: Sequence[RunCopy],
              wait_event: bytes = b"") -> None:
        self._copy(mapping, copies, to_pool=True, wait_event=wait_event)

    def retrieve(self, mapping: Mapping, copies: Sequence[RunCopy]) -> None:
        self._copy(mapping, copies, to_pool=False, wait_event=b"")

    def _copy(self, mapping: Mapping, copies: Sequence[RunCopy], to_pool: bool,
              wait_event: bytes) -> None:
        if not isinstance(mapping, _EngineMapping) or mapping.closed:
            raise TransferError("registration has no open CUDA mapping")
        copies = [c for c in copies if c.block_ids.size]
        if not copies:
            return
        device = mapping.device_index
        lanes = self._lanes_of(device)
        lane = lanes.take()
        try:
            with cupy.cuda.Device(device):
                if self.copy_mode == "staging":
                    self._staging(lane, mapping, copies, to_pool, wait_event)
                else:
                    self._mapped(lane, mapping, copies, to_pool, wait_event)
        except _CUDA_ERRORS as e:
            raise TransferError(f"CUDA copy failed: {e}") from None
        finally:
            lanes.give(lane)

    def _mapped(self, lane: _Lane, mapping: _EngineMapping, copies: list[RunCopy],
                to_pool: bool, wait_event: bytes) -> None:
        region = self._region(mapping)
        validate(copies, region)
        lane.reserve(sum(c.block_ids.size * c.run.n_layers for c in copies))
        if wait_event:
            mapping.events.wait(wait_event, lane.sm)
        kernel = "gather_pages" if to_pool else "scatter_pages"
        row = 0
        for part in split(copies, self.part_bytes):
            plan = plan_mapped(part, region, checked=True)
            if not plan.n_desc:
                continue
            desc = lane.upload(plan.desc, row, lane.sm)
            cuda_kernels.launch(lane.device, kernel, desc, lane.desc_rows, row, plan.n_desc,
                                self.mapped_blocks, MAPPED_THREADS, lane.sm)
            row += plan.n_desc
        lane.done.record(lane.sm)
        lane.done.synchronize()

    def _staging(self, lane: _Lane, mapping: _EngineMapping, copies: list[RunCopy],
                 to_pool: bool, wait_event: bytes) -> None:
        region = self._region(mapping)
        validate(copies, region)
        halves = lane.halves(max(c.run.nbytes for c in copies))
        lane.reserve(sum(c.block_ids.size * c.run.n_layers for c in copies))
        if wait_event:
            mapping.events.wait(wait_event, lane.sm)
        row, k = 0, 0
        for part in split(copies, lane.half_bytes):
            order = halves if k % 2 == 0 else halves[::-1]
            plan = plan_staging(part, region, order, lane.half_bytes, checked=True)
            if not plan.pieces:
                continue
            desc = lane.upload(plan.desc, row, lane.sm)
            if to_pool:
                self._store_pieces(lane, plan, desc, row, k)
            else:
                self._retrieve_pieces(lane, plan, desc, row, k)
            row += plan.n_desc
            k += len(plan.pieces)
        lane.done.record(lane.dma if to_pool else lane.sm)
        lane.done.synchronize()

    def _blocks(self, device: int, count: int) -> int:
        return max(1, min(count, 4 * self._sm_count[device]))

    def _store_pieces(self, lane: _Lane, plan: Plan, desc: int, row: int, k0: int) -> None:
        """Gather piece into a staging half (SMs), then DMA it out (copy engine).

        Piece ``k`` (counted over the whole request) uses half ``k % 2``; its gather
        waits until the DMA of piece ``k - 2`` has drained that half.
        """
        sm, dma, memcpy = lane.sm, lane.dma, cupy.cuda.runtime.memcpyAsync
        for i, p in enumerate(plan.pieces):
            k = k0 + i
            h = k % 2
            if k >= 2:
                sm.wait_event(lane.freed[h])
            cuda_kernels.launch(lane.device, "gather_pages", desc, lane.desc_rows,
                                row + p.first, p.count, self._blocks(lane.device, p.count),
                                GATHER_THREADS, sm)
            lane.filled[h].record(sm)
            dma.wait_event(lane.filled[h])
            for stage, pool, n in p.segments.tolist():
                memcpy(pool, stage, n, _MEMCPY_DEFAULT, dma.ptr)
            lane.freed[h].record(dma)

    def _retrieve_pieces(self, lane: _Lane, plan: Plan, desc: int, row: int, k0: int) -> None:
        """DMA a piece into a staging half, then scatter it into the pages (SMs)."""
        sm, dma, memcpy = lane.sm, lane.dma, cupy.cuda.runtime.memcpyAsync
        for i, p in enumerate(plan.pieces):
            k = k0 + i
            h = k % 2
            if k >= 2:
                dma.wait_event(lane.freed[h])
            for stage, pool, n in p.segments.tolist():
                memcpy(stage, pool, n, _MEMCPY_DEFAULT, dma.ptr)
            lane.filled[h].record(dma)
            sm.wait_event(lane.filled[h])
            cuda_kernels.launch(lane.device, "scatter_pages", desc, lane.desc_rows,
                                row + p.first, p.count, self._blocks(lane.device, p.count),
                                GATHER_THREADS, sm)
            lane.freed[h].record(sm)

    def close(self) -> None:
        for lanes in list(self._lanes.values()):
            for lane in lanes.all:
                lane.sm.synchronize()
                lane.dma.synchronize()
        self._lanes.clear()
        if self._pool is not None:
            self._pool.close()

