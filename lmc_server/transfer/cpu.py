"""The CPU transfer engine: POSIX shared memory in place of GPU pages, numpy copies.

Workers create their "KV buffers" as shared-memory segments and hand their descriptors
to the server (:mod:`.fd_inbox`; a segment may also be registered by its name under
``/dev/shm``); the server maps each segment (the mapping survives the worker dying)
and copies pages with ``numpy.copyto`` on strided views, which releases the GIL,
split over a small thread pool. It implements exactly the contract the CUDA engine
does, so the full server path (real processes, sockets and bytes) runs on any host.

The pool is one anonymous private mapping, paged in slab by slab on a background
thread so that the server answers at once and requests use slabs as they become ready.
"""

from __future__ import annotations

import fcntl
import gc
import logging
import mmap
import os
import re
import stat
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from lmc_server.buffers import BufferSpec, ShmBuffer, ShmFdBuffer
from lmc_server.cache.layout import RunCopy
from lmc_server.threadnames import name_os_thread
from lmc_server.transfer.base import (
    BufferMapping,
    DeviceInfo,
    DoneCallback,
    HostPool,
    TransferEngine,
    TransferError,
)
from lmc_server.transfer.fd_inbox import FdInbox, FdInboxError

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SHM_NAME = re.compile(r"^lmc-[A-Za-z0-9_.-]{1,200}$")
_PAGE = mmap.PAGESIZE
#: Linux madvise advice values (Python 3.11's mmap module lacks the second).
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
#: Copies up to this size run on the submitting (event loop) thread: measured here, a
#: hop to a copy thread and back cost ~0.3 ms, which copies about 1 MiB.
INLINE_BYTES = 1 << 20


class CpuHostPool(HostPool):
    """Anonymous memory paged in slab by slab in the background.

    Transparent huge pages are requested and each slab is populated with
    ``MADV_POPULATE_WRITE`` (about 50 ms per GiB measured here, against 1.4 s for
    touching 4 KiB pages one by one, which remains the fallback on older kernels).
    """

    def __init__(self, size_bytes: int, slab_bytes: int) -> None:
        super().__init__(size_bytes, slab_bytes)
        self._mm = mmap.mmap(-1, self.size_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            self._mm.madvise(MADV_HUGEPAGE)
        except OSError:
            log.debug("transparent huge pages not available for the pool")
        self._populate = True
        self.array = np.frombuffer(self._mm, dtype=np.uint8)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, on_ready: Callable[[int], None]) -> None:
        def prepare() -> None:
            name_os_thread()
            for slab in range(self.n_slabs):
                if self._stop.is_set():
                    return
                lo = slab * self.slab_bytes
                if self._populate:
                    try:
                        self._mm.madvise(MADV_POPULATE_WRITE, lo, self.slab_bytes)
                    except OSError:
                        self._populate = False
                if not self._populate:
                    self.array[lo : lo + self.slab_bytes : _PAGE] = 0
                on_ready(slab)

        self._thread = threading.Thread(target=prepare, name="lmc-pool-fill", daemon=True)
        self._thread.start()

    def read(self, offset: int, nbytes: int) -> bytes:
        return self.array[offset : offset + nbytes].tobytes()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if not self._mm.closed:
            del self.array
            try:
                self._mm.close()
            except BufferError:
                # a view of the pool is still referenced, typically from a reference
                # cycle (an exception's traceback holding the frame of a write from a
                # slot, after L2 failed): collect cycles and try once more; failing
                # that, the mapping goes with the process (nothing copies any more)
                gc.collect()
                try:
                    self._mm.close()
                except BufferError:
                    log.warning(
                        "the pool is still referenced at close; it is unmapped "
                        "when the process exits"
                    )


class ShmMapping(BufferMapping):
    """The worker's segments mapped shared; ``arrays[i]`` views buffer ``i``.

    ``inbox`` holds the descriptors of :class:`ShmFdBuffer` buffers (none: only
    buffers by name are mapped). A segment passed by descriptor must be sealed
    against shrinking (``F_SEAL_SHRINK``, as :class:`~lmc_server.client.shm.ShmSegment`
    makes it): a segment cut short under the mapping would kill the server with
    SIGBUS at the next copy.
    """

    def __init__(self, buffers: Sequence[BufferSpec], inbox: FdInbox | None = None) -> None:
        self.device = DeviceInfo(arch=None, description="cpu (shared memory)")
        self._maps: list[mmap.mmap] = []
        self.arrays: list[np.ndarray] = []
        passed: dict[bytes, list[int]] = {}
        try:
            for b in buffers:
                if isinstance(b, ShmBuffer):
                    self._map_name(b)
                elif isinstance(b, ShmFdBuffer):
                    self._map_fd(b, self._passed(b, inbox, passed))
                else:
                    raise TransferError(
                        f"the cpu backend maps shared-memory buffers only (got {type(b).__name__})"
                    )
        except BaseException:
            self.close()
            raise
        finally:
            for fds in passed.values():
                for fd in fds:
                    os.close(fd)

    @staticmethod
    def _passed(b: ShmFdBuffer, inbox: FdInbox | None, passed: dict[bytes, list[int]]) -> int:
        if inbox is None:
            raise TransferError("this server takes no shared-memory descriptors")
        if b.token not in passed:
            try:
                passed[b.token] = inbox.take(b.token)
            except FdInboxError as e:
                raise TransferError(str(e)) from None
        fds = passed[b.token]
        if not 0 <= b.index < len(fds):
            raise TransferError(f"descriptor {b.index} not sent: {len(fds)} came with the token")
        return fds[b.index]

    def _map_name(self, b: ShmBuffer) -> None:
        if not SHM_NAME.match(b.name):
            raise TransferError(f"shared-memory name {b.name!r} must match {SHM_NAME.pattern}")
        path = os.path.join(SHM_DIR, b.name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as e:
            raise TransferError(f"cannot open shared memory {b.name!r}: {e.strerror}") from None
        try:
            self._map(fd, b.size_bytes, repr(b.name))
        finally:
            os.close(fd)

    def _map_fd(self, b: ShmFdBuffer, fd: int) -> None:
        what = f"passed segment {b.index}"
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0
        if not seals & fcntl.F_SEAL_SHRINK:
            raise TransferError(f"{what} is not sealed against shrinking (F_SEAL_SHRINK)")
        self._map(fd, b.size_bytes, what)

    def _map(self, fd: int, size_bytes: int, what: str) -> None:
        if size_bytes <= 0:
            raise TransferError(f"buffer {what}: size_bytes must be positive")
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TransferError(f"shared memory {what} is not a regular file")
        if st.st_size < size_bytes:
            raise TransferError(
                f"shared memory {what} has {st.st_size} bytes, registration says {size_bytes}"
            )
        try:
            mm = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED)
        except OSError as e:
            raise TransferError(f"cannot map shared memory {what}: {e.strerror}") from None
        self._maps.append(mm)
        self.arrays.append(np.frombuffer(mm, dtype=np.uint8))

    def close(self) -> None:
        self.arrays.clear()
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:  # a copy still holds a view; unmapped when it drops it
                log.warning("shared-memory mapping still in use at close")
        self._maps.clear()


def _layer_view(
    buf: np.ndarray,
    offset: int,
    n_layers: int,
    layer_stride: int,
    n_blocks: int,
    block_stride: int,
    page: int,
) -> np.ndarray:
    return np.ndarray(
        (n_layers, n_blocks, page),
        dtype=np.uint8,
        buffer=buf,
        offset=offset,
        strides=(layer_stride, block_stride, 1),
    )


def _consecutive(ids: np.ndarray) -> list[bool]:
    """Per chunk (row of ``ids``): its block ids ascend by one (one strided copy); below
    16 chunks looked at in Python (numpy's fixed cost dominates)."""
    nb = ids.shape[1]
    if nb == 1 or ids.shape[0] >= 16:
        return (np.diff(ids, axis=1) == 1).all(axis=1).tolist()
    return [row == list(range(row[0], row[0] + nb)) for row in ids.tolist()]


def _copy_run(c: RunCopy, buf: np.ndarray, pool: np.ndarray, to_pool: bool) -> None:
    """Copy one run for each of its chunks; consecutive block ids go in one call (one
    slice assignment where the pages lie back to back on both sides)."""
    r = c.run
    nb, page, nl = r.n_blocks, r.page_bytes, r.n_layers
    ols, obs = r.object_layer_stride, r.object_block_stride
    obj_strides = (ols, obs, 1)
    ids = c.block_ids
    consecutive = _consecutive(ids)
    # the run's pages of consecutive blocks are one contiguous span on both sides
    flat = (
        obs == page and r.block_stride == page and (nl == 1 or ols == r.layer_stride == nb * page)
    )
    span = nl * nb * page
    for ci, row_first in enumerate(ids[:, 0].tolist()):
        dst_base = int(c.object_offsets[ci])
        if consecutive[ci] and row_first >= 0:
            src = r.base_offset + row_first * r.block_stride
            if flat:
                eng, obj = buf[src : src + span], pool[dst_base : dst_base + span]
            else:
                eng = _layer_view(buf, src, nl, r.layer_stride, nb, r.block_stride, page)
                obj = np.ndarray((nl, nb, page), np.uint8, pool, dst_base, obj_strides)
            if to_pool:
                np.copyto(obj, eng)
            else:
                np.copyto(eng, obj)
            continue
        for j, b in enumerate(ids[ci].tolist()):
            if b < 0:
                continue
            eng = np.ndarray(
                (nl, page), np.uint8, buf, r.base_offset + b * r.block_stride, (r.layer_stride, 1)
            )
            obj = np.ndarray((nl, page), np.uint8, pool, dst_base + j * obs, (ols, 1))
            if to_pool:
                np.copyto(obj, eng)
            else:
                np.copyto(eng, obj)


#: What a piece stopped at shutdown reports (:meth:`CpuEngine.stop_queued`).
STOPPED = "copy not started: the server is shutting down"


class _Latch:
    """Counts the pieces of one copy down; the last to finish calls ``done`` once,
    with the first failure if any piece failed. A piece that reaches a copy thread
    after ``stopped`` is set is not copied and fails the copy."""

    def __init__(self, pieces: int, done: DoneCallback, stopped: threading.Event) -> None:
        self._left = pieces
        self._error = ""
        self._lock = threading.Lock()
        self._done = done
        self._stopped = stopped

    def run(self, fn: Callable[..., None], *args: object) -> None:
        err = ""
        try:
            if self._stopped.is_set():
                err = STOPPED
            else:
                fn(*args)
        except Exception as e:  # reported to the request, never lost in the pool
            err = f"copy failed: {e}"
        with self._lock:
            if err and not self._error:
                self._error = err
            self._left -= 1
            last = self._left == 0
        if last:
            self._done(self._error)


class CpuEngine(TransferEngine):
    """Shared-memory buffers, numpy copies over ``copy_threads`` threads."""

    name = "cpu"

    def __init__(self, copy_threads: int = 0) -> None:
        self.copy_threads = copy_threads or min(4, os.cpu_count() or 1)
        self._pool: CpuHostPool | None = None
        self._executor = ThreadPoolExecutor(
            self.copy_threads, thread_name_prefix="lmc-copy", initializer=name_os_thread
        )
        self._stopped = threading.Event()
        self._inbox: FdInbox | None = None

    @property
    def fd_socket(self) -> str:
        return "" if self._inbox is None else self._inbox.name

    def create_pool(self, size_bytes: int, slab_bytes: int) -> HostPool:
        """The pool, and the descriptor socket: the engine serves from now on."""
        self._pool = CpuHostPool(size_bytes, slab_bytes)
        if self._inbox is None:
            self._inbox = FdInbox()
        return self._pool

    def open(self, buffers: Sequence[BufferSpec]) -> BufferMapping:
        return ShmMapping(buffers, self._inbox)

    def submit(
        self, mapping: BufferMapping, copies: Sequence[RunCopy], to_pool: bool, done: DoneCallback
    ) -> None:
        """Copies of at most ``INLINE_BYTES`` run right here (a thread hop costs more
        than the copy); larger ones are split over the copy threads and the last
        piece to finish calls ``done``."""
        if not isinstance(mapping, ShmMapping) or not mapping.arrays:
            raise TransferError("registration has no mapped buffers (lookup-only or closed)")
        assert self._pool is not None, "create_pool first"
        pool = self._pool.array
        arrays = mapping.arrays
        live = [c for c in copies if c.block_ids.size]
        if sum(c.nbytes for c in live) <= INLINE_BYTES:
            try:
                for c in live:
                    _copy_run(c, arrays[c.run.buffer], pool, to_pool)
            except (ValueError, TypeError, IndexError) as e:
                done(f"copy failed: {e}")
                return
            done("")
            return
        work = self._split(live)
        latch = _Latch(len(work), done, self._stopped)
        for c in work:
            self._executor.submit(latch.run, _copy_run, c, arrays[c.run.buffer], pool, to_pool)

    def _split(self, copies: list[RunCopy]) -> list[RunCopy]:
        """Cut large runs into per-thread pieces so every thread gets work."""
        if len(copies) >= self.copy_threads or self.copy_threads == 1:
            return copies
        out: list[RunCopy] = []
        for c in copies:
            n = c.block_ids.shape[0]
            parts = min(self.copy_threads, n)
            bounds = np.linspace(0, n, parts + 1).astype(int)
            for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
                if hi > lo:
                    out.append(RunCopy(c.run, c.block_ids[lo:hi], c.object_offsets[lo:hi]))
        return out

    def stop_queued(self) -> None:
        """Pieces still waiting for a copy thread are not copied (see the base class);
        a piece being copied finishes, so the wait is one piece at most per thread."""
        self._stopped.set()

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        if self._inbox is not None:
            self._inbox.close()
            self._inbox = None
        if self._pool is not None:
            self._pool.close()
