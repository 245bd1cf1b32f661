"""Lanes: what one in-flight copy on one GPU needs, allocated once and reused.

A lane is an SM stream (gather/scatter), one or more DMA streams (copy mode ``dma``
spreads a request's descriptors over them, so that several copy engines work on one
request), the double-buffered staging area, the
pinned and device buffers a plan's unit rows and block ids travel in, and the events
that order them; a waiter thread per lane reports each launched job's completion
(:class:`~lmc_server.transfer.cuda.engine.CudaEngine` runs it). :class:`Lanes` hands a GPU's
lanes to submissions, queueing a submission (FIFO) when every lane is busy, so the
event loop never blocks on a lane.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import cupy
import numpy as np

from lmc_server.cache.layout import RunCopy
from lmc_server.transfer.base import DoneCallback
from lmc_server.transfer.cuda.ipc import CudaMapping
from lmc_server.transfer.cuda.plan import Plan

log = logging.getLogger(__name__)

MIB = 1 << 20
#: Staging half size floor; a half grows to the largest object run a request has.
STAGING_HALF_BYTES = 32 * MIB
#: ``cudaMemcpyDefault``: the driver infers the direction from unified addresses.
MEMCPY_DEFAULT = 4
CUDA_ERRORS = (cupy.cuda.runtime.CUDARuntimeError, cupy.cuda.driver.CUDADriverError)


class Lane:
    """What one in-flight request on one GPU needs, allocated once and reused.

    The unit rows and block ids of a plan go to one pinned host buffer and from there
    to the device in one copy per request; a lane serves one request at a time and a
    request returns only after its GPU work is complete, so the host buffer is never
    rewritten while a copy may still read it.
    """

    def __init__(
        self, device: int, min_half_bytes: int = STAGING_HALF_BYTES, dma_streams: int = 1
    ) -> None:
        self.device = device
        self.min_half_bytes = min_half_bytes
        with cupy.cuda.Device(device):
            self.sm = cupy.cuda.Stream(non_blocking=True)
            #: ``dmas[0]`` is ``dma``, the stream every path ends on; the others are
            #: joined into it (``joined``) before ``done`` is recorded.
            self.dmas = [cupy.cuda.Stream(non_blocking=True) for _ in range(max(1, dma_streams))]
            self.dma = self.dmas[0]
            self.joined = [cupy.cuda.Event(disable_timing=True) for _ in self.dmas]
            self.filled = [cupy.cuda.Event(disable_timing=True) for _ in range(2)]
            self.freed = [cupy.cuda.Event(disable_timing=True) for _ in range(2)]
            self.done = cupy.cuda.Event(block=True, disable_timing=True)
            self.timing = (cupy.cuda.Event(), cupy.cuda.Event())
        self.half_bytes = 0
        self.staging: cupy.cuda.memory.Memory | None = None
        self.words = 0
        self.dev: cupy.cuda.memory.Memory | None = None
        self.host: cupy.cuda.PinnedMemoryPointer | None = None
        self.host_view = np.zeros(0, dtype=np.int64)
        #: The launched job this lane's waiter thread waits for (``None`` stops it).
        self.jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.waiter: threading.Thread | None = None

    def halves(self, need_bytes: int) -> tuple[int, int]:
        if need_bytes > self.half_bytes:
            size = max(self.min_half_bytes, -(-need_bytes // MIB) * MIB)
            self.staging = None
            with cupy.cuda.Device(self.device):
                self.staging = cupy.cuda.memory.Memory(2 * size)
            self.half_bytes = size
        assert self.staging is not None
        return int(self.staging.ptr), int(self.staging.ptr) + self.half_bytes

    def upload(self, plan: Plan, stream: cupy.cuda.Stream) -> tuple[int, int]:
        """Enqueue the copy of the plan's unit rows and block ids on ``stream``.

        Grows the buffers (never shrinks). Returns the device addresses of unit row 0
        and of block id 0.
        """
        unit_words, n_ids = plan.units.size, plan.ids.size
        words = unit_words + n_ids
        if words > self.words:
            size = max(1 << 16, 1 << (words - 1).bit_length())
            self.dev = self.host = None
            with cupy.cuda.Device(self.device):
                self.dev = cupy.cuda.memory.Memory(size * 8)
            self.host = cupy.cuda.alloc_pinned_memory(size * 8)
            self.host_view = np.frombuffer(self.host, dtype=np.int64, count=size)
            self.words = size
        assert self.dev is not None
        view = self.host_view
        view[:unit_words] = plan.units.reshape(-1)
        view[unit_words:words] = plan.ids
        dev = int(self.dev.ptr)
        cupy.cuda.runtime.memcpyAsync(
            dev, int(view.ctypes.data), words * 8, MEMCPY_DEFAULT, stream.ptr
        )
        return dev, dev + unit_words * 8

    def drain(self) -> None:
        """Wait for whatever this lane enqueued (after a failure part-way through)."""
        for s in (self.sm, *self.dmas):
            try:
                s.synchronize()
            except CUDA_ERRORS as e:
                log.warning("lane stream on device %d failed: %s", self.device, e)


@dataclass(slots=True, eq=False)
class Job:
    """One submitted copy; the timestamps feed ``CudaEngine.last_profile``."""

    mapping: CudaMapping
    copies: Sequence[RunCopy]
    to_pool: bool
    done: DoneCallback
    t_enter: float
    nbytes: int = 0
    t_planned: float = 0.0
    #: when the copy is expected done (``wait.LinkClock``)
    expected_end: float = 0.0
    t_launched: float = 0.0
    pieces: int = 0
    dmas: int = 0


class Lanes:
    """Up to ``limit`` lanes of one GPU, created on demand, each with a waiter thread.

    A submission takes a free lane or, when every lane is busy, waits in ``pending``
    (FIFO) until a waiter gives its lane back and launches it: the event loop never
    blocks on a lane. ``take_or_queue`` and ``give`` decide under one lock, so a job is
    never queued while a lane sits free.
    """

    def __init__(
        self, device: int, limit: int, half_bytes: int = STAGING_HALF_BYTES, dma_streams: int = 1
    ) -> None:
        self.device = device
        self.limit = limit
        self.half_bytes = half_bytes
        self.dma_streams = dma_streams
        self._free: list[Lane] = []
        self._pending: deque[Job] = deque()
        self._lock = threading.Lock()
        self.all: list[Lane] = []

    def take_or_queue(self, job: Job) -> Lane | None:
        with self._lock:
            if self._free:
                return self._free.pop()
            if len(self.all) >= self.limit:
                self._pending.append(job)
                return None
            lane = Lane(self.device, self.half_bytes, self.dma_streams)
            self.all.append(lane)
            return lane

    def give(self, lane: Lane) -> Job | None:
        """Return ``lane``, or keep it for the oldest queued job (returned)."""
        with self._lock:
            if self._pending:
                return self._pending.popleft()
            self._free.append(lane)
            return None

    @property
    def busy(self) -> int:
        """Lanes with a copy in flight (read without the lock: a hint, not a decision)."""
        return len(self.all) - len(self._free)

    def stop_queued(self) -> list[Job]:
        """Take every queued job out (the caller fails them); later ones queue again."""
        with self._lock:
            jobs = list(self._pending)
            self._pending.clear()
            return jobs
