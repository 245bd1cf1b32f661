"""The pinned L1 pool: one anonymous mapping, page-locked slab by slab in the background.

The pool is reserved at once (address space only) and each slab is then populated and
registered with ``cudaHostRegister`` (portable: usable from every GPU's context;
mapped: kernels may read and write it directly, at the same address, since every
supported GPU has unified addressing). Registration takes about 0.45 s per GiB on the
H200 host, so a 100 GiB pool is pinned over most of a minute while the server already
answers; ``on_ready(slab)`` hands each slab to the index as soon as it is pinned.

Invariant: a DMA or kernel touches a slab only after ``on_ready`` reported it (the
index hands out only ready slabs), and no copy ever spans two slabs (each slab is a
separate registration).
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
from collections.abc import Callable

import cupy
import numpy as np

from lmc_server.transfer.base import HostPool, TransferError

log = logging.getLogger(__name__)

HOST_REGISTER_PORTABLE = 1
HOST_REGISTER_MAPPED = 2
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


class CudaHostPool(HostPool):
    """``n_slabs`` slabs of ``slab_bytes`` pinned in order by a background thread."""

    def __init__(self, size_bytes: int, slab_bytes: int, device: int = 0) -> None:
        super().__init__(size_bytes, slab_bytes)
        if self.n_slabs <= 0:
            raise TransferError(f"a pool of {size_bytes} bytes holds no {slab_bytes}-byte slab")
        self.device = device
        self._mm = mmap.mmap(-1, self.size_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            self._mm.madvise(MADV_HUGEPAGE)
        except OSError:
            log.debug("transparent huge pages not available for the pool")
        self.array = np.frombuffer(self._mm, dtype=np.uint8)
        self.ptr = int(self.array.ctypes.data)
        self._registered: list[int] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.pinned_s = 0.0

    def start(self, on_ready: Callable[[int], None]) -> None:
        self._thread = threading.Thread(target=self._prepare, args=(on_ready,),
                                        name="lmc-pool-pin", daemon=True)
        self._thread.start()

    def _prepare(self, on_ready: Callable[[int], None]) -> None:
        t0 = time.perf_counter()
        populate = True
        flags = HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED
        with cupy.cuda.Device(self.device):
            for slab in range(self.n_slabs):
                if self._stop.is_set():
                    return
                lo = slab * self.slab_bytes
                if populate:
                    try:
                        self._mm.madvise(MADV_POPULATE_WRITE, lo, self.slab_bytes)
                    except OSError:
                        populate = False
                with self._lock:
                    if self._stop.is_set():
                        return
                    try:
                        cupy.cuda.runtime.hostRegister(self.ptr + lo, self.slab_bytes, flags)
                    except cupy.cuda.runtime.CUDARuntimeError as e:
                        log.error("pinning slab %d failed (%s); %d of %d slabs usable", slab, e,
                                  slab, self.n_slabs)
                        return
                    self._registered.append(slab)
                on_ready(slab)
        self.pinned_s = time.perf_counter() - t0
        log.info("pinned %d slabs (%.1f GiB) in %.2f s", self.n_slabs,
                 self.size_bytes / (1 << 30), self.pinned_s)

    @property
    def pinned_slabs(self) -> int:
        return len(self._registered)

    def read(self, offset: int, nbytes: int) -> bytes:
        return self.array[offset:offset + nbytes].tobytes()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            with cupy.cuda.Device(self.device):
                for slab in self._registered:
                    try:
                        cupy.cuda.runtime.hostUnregister(self.ptr + slab * self.slab_bytes)
                    except cupy.cuda.runtime.CUDARuntimeError as e:
                        log.warning("unpinning slab %d failed: %s", slab, e)
            self._registered.clear()
        if not self._mm.closed:
            del self.array
            self._mm.close()
