"""The pinned L1 pool: one anonymous mapping, page-locked slab by slab in the background.

Each slab is page-locked on its own, either allocated with ``cudaHostAlloc`` or carved
from one anonymous mapping and registered with ``cudaHostRegister`` (both portable:
usable from every GPU's context; mapped: kernels may read and write it directly, at the
same address, since every supported GPU has unified addressing). Slabs need not be
contiguous: copy plans translate pool offsets through ``slab_ptrs``. Pinning takes about
0.4 s per GiB on the H200 host, so a 100 GiB pool is pinned over most of a minute while
the server already answers; ``on_ready(slab)`` hands each slab to the index as soon as it is pinned.

Invariant: a DMA or kernel touches a slab only after ``on_ready`` reported it (the
index hands out only ready slabs), and no copy ever spans two slabs (each slab is a
separate registration).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
import time
from collections.abc import Callable

import cupy
import numpy as np

from lmc_server.threadnames import name_os_thread
from lmc_server.transfer.base import HostPool, TransferError

log = logging.getLogger(__name__)

HOST_REGISTER_PORTABLE = 1
HOST_REGISTER_MAPPED = 2
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


PINNING = ("alloc", "register")


class CudaHostPool(HostPool):
    """``n_slabs`` slabs of ``slab_bytes`` pinned in order by a background thread.

    ``pinning="alloc"``: each slab is its own ``cudaHostAlloc`` (portable, mapped);
    ``"register"``: one anonymous mapping whose slabs are ``cudaHostRegister``-ed.
    ``slab_ptrs[s]`` is slab ``s``'s address once it is ready, 0 before.
    """

    def __init__(
        self, size_bytes: int, slab_bytes: int, device: int = 0, pinning: str = "alloc"
    ) -> None:
        super().__init__(size_bytes, slab_bytes)
        if self.n_slabs <= 0:
            raise TransferError(f"a pool of {size_bytes} bytes holds no {slab_bytes}-byte slab")
        if pinning not in PINNING:
            raise ValueError(f"pinning {pinning!r}: expected one of {PINNING}")
        self.device = device
        self.pinning = pinning
        self.slab_ptrs = np.zeros(self.n_slabs, dtype=np.int64)
        self._mm: mmap.mmap | None = None
        self._base = 0
        if pinning == "register":
            self._mm = mmap.mmap(-1, self.size_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            try:
                self._mm.madvise(MADV_HUGEPAGE)
            except OSError:
                log.debug("transparent huge pages not available for the pool")
            self._anchor: ctypes.c_char | None = ctypes.c_char.from_buffer(self._mm)
            self._base = ctypes.addressof(self._anchor)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.pinned_s = 0.0

    def start(self, on_ready: Callable[[int], None]) -> None:
        self._thread = threading.Thread(
            target=self._prepare, args=(on_ready,), name="lmc-pool-pin", daemon=True
        )
        self._thread.start()

    def _pin(self, slab: int, populate: bool) -> bool:
        """Pin one slab; returns whether MADV_POPULATE_WRITE is still worth trying."""
        flags = HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED  # == cudaHostAlloc's flags
        if self.pinning == "alloc":
            self.slab_ptrs[slab] = int(cupy.cuda.runtime.hostAlloc(self.slab_bytes, flags))
            return populate
        assert self._mm is not None
        lo = slab * self.slab_bytes
        if populate:
            try:
                self._mm.madvise(MADV_POPULATE_WRITE, lo, self.slab_bytes)
            except OSError:
                populate = False
        cupy.cuda.runtime.hostRegister(self._base + lo, self.slab_bytes, flags)
        self.slab_ptrs[slab] = self._base + lo
        return populate

    def _prepare(self, on_ready: Callable[[int], None]) -> None:
        name_os_thread()
        t0 = time.perf_counter()
        populate = True
        with cupy.cuda.Device(self.device):
            for slab in range(self.n_slabs):
                with self._lock:
                    if self._stop.is_set():
                        return
                    try:
                        populate = self._pin(slab, populate)
                    except cupy.cuda.runtime.CUDARuntimeError as e:
                        log.error(
                            "pinning slab %d failed (%s); %d of %d slabs usable",
                            slab,
                            e,
                            slab,
                            self.n_slabs,
                        )
                        return
                on_ready(slab)
        self.pinned_s = time.perf_counter() - t0
        log.info(
            "pinned %d slabs (%.1f GiB, %s) in %.2f s",
            self.n_slabs,
            self.size_bytes / (1 << 30),
            self.pinning,
            self.pinned_s,
        )

    def slab_view(self, slab: int) -> np.ndarray:
        """A numpy view of one ready slab (tests and diagnostics)."""
        ptr = int(self.slab_ptrs[slab])
        if not ptr:
            raise TransferError(f"slab {slab} is not ready")
        raw = (ctypes.c_uint8 * self.slab_bytes).from_address(ptr)
        return np.ctypeslib.as_array(raw)

    def read(self, offset: int, nbytes: int) -> bytes:
        out = bytearray()
        while nbytes > 0:
            slab, lo = divmod(offset, self.slab_bytes)
            n = min(nbytes, self.slab_bytes - lo)
            out += self.slab_view(slab)[lo : lo + n].tobytes()
            offset, nbytes = offset + n, nbytes - n
        return bytes(out)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock, cupy.cuda.Device(self.device):
            for slab, ptr in enumerate(self.slab_ptrs.tolist()):
                if not ptr:
                    continue
                try:
                    if self.pinning == "alloc":
                        cupy.cuda.runtime.freeHost(ptr)
                    else:
                        cupy.cuda.runtime.hostUnregister(ptr)
                except cupy.cuda.runtime.CUDARuntimeError as e:
                    log.warning("releasing slab %d failed: %s", slab, e)
            self.slab_ptrs[:] = 0
        if self._mm is not None and not self._mm.closed:
            self._anchor = None
            self._mm.close()
