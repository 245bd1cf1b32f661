"""The disk tier's adapter: one file per object under a directory (local NVMe, NFS, ...).

Layout::

    ROOT/lmc2/<space, 32 hex>/<first chunk-key byte, 2 hex>/<chunk key, 64 hex>

one file per L2 key (:func:`lmc_server.l2.codec.l2_key`), holding the L2 value as is
(header with namespace hash, chunk key, length and XXH3 checksum, then the payload), so
the tier checks a file exactly as it checks a Redis value: a damaged, truncated or
foreign file is a miss and a counter, never served. The fan-out keeps directories
small (256 per namespace and layout).

Writes are whole files, renamed into place (:mod:`lmc_server.l2.direct_io`), built
from the L1 slot on the I/O thread that writes them (``writes_from_slots``): one
object's copy and checksum overlap the other threads' writes, where building a whole
batch first and then writing it left the disk idle during the build (measured on the
2-core CI VM: 0.62-0.75 of plain writes before, 0.84-0.96 after). Reads open
the path the key names (the index decides nothing about hits, see
:mod:`lmc_server.l2.disk_index`). I/O runs on ``IO_THREADS`` threads of the adapter (a
batch's files in parallel, to keep an NVMe's queue busy), never on the event loop;
the index is updated on the loop when each call returns.

Errors: a full filesystem (``ENOSPC``, ``EDQUOT``) is a refusal (counted, the tier stays
up); any other error (directory gone, read-only, I/O error) makes the tier degraded,
and it reconnects (re-checks the directory) with backoff like any L2.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from lmc_server.l2 import codec, direct_io, disk_layout
from lmc_server.l2.backend import L2Backend, L2Error, SlotObject, Value
from lmc_server.l2.disk_index import DiskIndex, scan
from lmc_server.l2.events import TierListeners
from lmc_server.threadnames import name_os_thread

log = logging.getLogger(__name__)

IO_THREADS = 4
#: A file longer than this is not read whole (no object is near it; a miss).
MAX_VALUE_BYTES = 1 << 30
#: Idle aligned buffers kept for reuse (reads and writes; see direct_io.BufferPool).
BUFFER_POOL_BYTES = 256 << 20
LAYOUT_DIR = "lmc2"
_REFUSALS = (errno.ENOSPC, errno.EDQUOT)
T = TypeVar("T")


class FileBackend(L2Backend):
    """Objects as files under ``root``, at most ``capacity_bytes`` of them known."""

    name = "file"
    writes_from_slots = True

    def __init__(
        self,
        root: str,
        capacity_bytes: int,
        direct: bool | None = None,
        io_threads: int = IO_THREADS,
    ) -> None:
        self.root = os.path.abspath(root)
        self.base = os.path.join(self.root, LAYOUT_DIR)
        self.index = DiskIndex(capacity_bytes)
        self.listeners = TierListeners("disk")
        #: ``None``: probe the filesystem at connect; else forced (tests).
        self._want_direct = direct
        self.direct = False
        self.evicted_objects = 0
        self._io = ThreadPoolExecutor(
            io_threads, thread_name_prefix="lmc-disk", initializer=name_os_thread
        )
        self._buffers = direct_io.BufferPool(BUFFER_POOL_BYTES)
        self._made: set[str] = set()
        self._connected = False
        self._rebuild: asyncio.Task[None] | None = None

    # -- paths -----------------------------------------------------------------------

    def path_of(self, key: bytes) -> str:
        if len(key) != len(
            codec.KEY_PREFIX
        ) + codec.SPACE_BYTES + codec.CHUNK_KEY_BYTES or not key.startswith(codec.KEY_PREFIX):
            raise ValueError("not an L2 key")
        rest = key[len(codec.KEY_PREFIX) :]
        space, chunk = rest[: codec.SPACE_BYTES].hex(), rest[codec.SPACE_BYTES :].hex()
        return os.path.join(self.base, space, chunk[:2], chunk)

    def _key_of(self, directory: str, name: str) -> bytes | None:
        space = os.path.basename(os.path.dirname(directory))
        if len(name) != 2 * codec.CHUNK_KEY_BYTES or len(space) != 2 * codec.SPACE_BYTES:
            return None
        try:
            return codec.KEY_PREFIX + bytes.fromhex(space) + bytes.fromhex(name)
        except ValueError:
            return None

    # -- calls -----------------------------------------------------------------------

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    def _check_dir(self) -> bool:
        os.makedirs(self.base, mode=0o750, exist_ok=True)
        if not os.access(self.base, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "not writable", self.base)
        direct = direct_io.probe_direct(self.base)
        return direct if self._want_direct is None else (self._want_direct and direct)

    async def connect(self) -> None:
        try:
            self.direct = await self._run(self._check_dir)
        except OSError as e:
            raise L2Error(f"disk {self.root}: {e.strerror or e}") from None
        if not self._connected:
            log.info(
                "disk tier %s: %s I/O, capacity %.1f GiB",
                self.root,
                "direct" if self.direct else "buffered (no O_DIRECT here)",
                self.index.capacity_bytes / (1 << 30),
            )
        self._connected = True
        if self._rebuild is None:
            self._rebuild = asyncio.get_running_loop().create_task(
                self._rebuild_index(), name="disk-index"
            )

    def _read(self, key: bytes) -> tuple[memoryview, int] | None:
        """The value in ``key``'s file (either layout) and the file's size."""
        data = direct_io.read_file(
            self.path_of(key), self.direct, MAX_VALUE_BYTES, self._buffers.take
        )
        if data is None:
            return None
        return disk_layout.value_of_file(data), len(data)

    async def get_many(self, keys: Sequence[bytes]) -> list[Value | None]:
        if not self._connected:
            raise L2Error("disk: not ready")
        results = await asyncio.gather(
            *(self._run(self._read, k) for k in keys), return_exceptions=True
        )
        out: list[Value | None] = []
        missing: list[bytes] = []
        for key, r in zip(keys, results, strict=True):
            if isinstance(r, BaseException):
                if not isinstance(r, OSError):
                    raise r
                raise L2Error(f"disk read {self.root}: {r.strerror or r}") from None
            if r is None:
                if key in self.index.entries:
                    missing.append(key)
                    self.index.forget(key)
                out.append(None)
            else:
                value, file_bytes = r
                self.index.touch(key, file_bytes)
                out.append(value)
        self.listeners.removed(missing, "missing")
        return out

    def release(self, values: Sequence[Value | None]) -> None:
        for v in values:
            if isinstance(v, memoryview):
                self._buffers.give(v.obj)

    def encode(self, space: bytes, chunk_key: bytes, mask: int, payload: memoryview) -> memoryview:
        """Header and payload in one aligned buffer (one copy), written as is."""
        buf = self._buffers.take(codec.HEADER_BYTES + len(payload))
        n = codec.encode_into(memoryview(buf), space, chunk_key, mask, payload)
        return memoryview(buf)[:n]

    def _write(self, key: bytes, value: Value) -> None:
        view = memoryview(value)
        self._to_path(key, lambda path: direct_io.write_file(path, view, self.direct))

    def _to_path(self, key: bytes, write: Callable[[str], None]) -> None:
        """``write(path)`` for ``key``'s file, its directory made on first use."""
        path = self.path_of(key)
        directory = os.path.dirname(path)
        if directory not in self._made:
            os.makedirs(directory, mode=0o750, exist_ok=True)
            self._made.add(directory)
        try:
            write(path)
        except FileNotFoundError:  # the directory went (an operator cleaning up): once more
            os.makedirs(directory, mode=0o750, exist_ok=True)
            write(path)

    def _write_slot(self, obj: SlotObject, aligned: bool) -> None:
        """Write one object from its (pinned) slot, on one I/O thread: in the aligned
        layout straight from the slot (:mod:`lmc_server.l2.disk_layout`), else copied
        with its header into an aligned buffer first (while this thread copies, the
        others' writes are in flight)."""
        if aligned:
            write = functools.partial(
                disk_layout.write_aligned,
                space=obj.space,
                chunk_key=obj.chunk_key,
                mask=obj.mask,
                payload=obj.payload,
                buffers=self._buffers,
            )
            self._to_path(obj.key, write)
            return
        value = self.encode(obj.space, obj.chunk_key, obj.mask, obj.payload)
        try:
            self._write(obj.key, value)
        finally:
            self._buffers.give(value.obj)

    def _unlink(self, key: bytes) -> None:
        try:
            os.unlink(self.path_of(key))
        except FileNotFoundError:
            pass

    async def put_many(self, items: Sequence[tuple[bytes, Value]]) -> None:
        try:
            await self._put(
                [(k, len(v)) for k, v in items],
                [functools.partial(self._write, k, v) for k, v in items],
            )
        finally:
            # Written or failed, no one reads these buffers again (the writer keeps
            # only their lengths): back to the pool.
            self.release([v for _, v in items])

    async def put_slots(self, objects: Sequence[SlotObject]) -> None:
        aligned = [disk_layout.aligned_ok(o.payload, self.direct) for o in objects]
        await self._put(
            [
                (o.key, disk_layout.file_bytes(len(o.payload), a))
                for o, a in zip(objects, aligned, strict=True)
            ],
            [
                functools.partial(self._write_slot, o, a)
                for o, a in zip(objects, aligned, strict=True)
            ],
        )

    async def _put(self, sizes: list[tuple[bytes, int]], writes: list[Callable[[], None]]) -> None:
        """Make room for ``sizes`` (evicting by LRU), run ``writes`` on the I/O threads,
        and index what was written; the first failure raised as :class:`L2Error`.

        Never past the capacity: objects of a batch beyond what the whole capacity holds
        (a batch, or one object, larger than ``--disk-size-gb``) are not written, a
        refusal (the tier stays up)."""
        if not self._connected:
            raise L2Error("disk: not ready")
        known = {k: self.index.entries[k] for k, _ in sizes if k in self.index.entries}
        for k in known:  # a rewrite replaces its file: never its own victim
            self.index.forget(k)
        fit, total = 0, 0  # the objects that fit in the whole capacity, in order
        while fit < len(sizes) and total + sizes[fit][1] <= self.index.capacity_bytes:
            total += sizes[fit][1]
            fit += 1
        refused = len(sizes) - fit
        for key, _ in sizes[fit:]:
            if key in known:  # not rewritten: its old file stays
                self.index.touch(key, known.pop(key))
        sizes, writes = sizes[:fit], writes[:fit]
        victims = self.index.victims(total)
        jobs = [self._run(self._unlink, k) for k in victims]
        jobs += [self._run(w) for w in writes]
        results = await asyncio.gather(*jobs, return_exceptions=True)
        self.evicted_objects += len(victims)
        self.listeners.removed(victims, "evicted")
        failure: OSError | None = None
        written: list[bytes] = []
        for (key, nbytes), r in zip(sizes, results[len(victims) :], strict=True):
            if isinstance(r, BaseException):
                if not isinstance(r, OSError):
                    raise r
                failure = failure or r
                if key in known:  # the old file is still there
                    self.index.touch(key, known[key])
            else:
                self.index.touch(key, nbytes)
                written.append(key)
        if failure is not None:
            raise L2Error(
                f"disk write {self.root}: {failure.strerror or failure}",
                unavailable=failure.errno not in _REFUSALS,
                written=written,
            )
        if refused:
            raise L2Error(
                f"disk {self.root}: {refused} objects do not fit in "
                f"--disk-size-gb ({self.index.capacity_bytes} bytes) with the "
                f"rest of their batch",
                unavailable=False,
                written=written,
            )

    async def discard(self, keys: Sequence[bytes]) -> None:
        """Delete files the tier found damaged (a later write replaces them anyway)."""
        for k in keys:
            self.index.forget(k)
        await asyncio.gather(*(self._run(self._unlink, k) for k in keys), return_exceptions=True)
        self.listeners.removed(keys, "invalid")

    # -- the index rebuild -----------------------------------------------------------

    def _leaf_dirs(self) -> list[str]:
        out: list[str] = []
        try:
            spaces = [e.path for e in os.scandir(self.base) if e.is_dir(follow_symlinks=False)]
        except OSError:
            return out
        for sp in spaces:
            try:
                out.extend(e.path for e in os.scandir(sp) if e.is_dir(follow_symlinks=False))
            except OSError:
                continue
        return out

    async def _rebuild_index(self) -> None:
        """Walk the directory on a thread of its own; merge on the loop as it goes."""
        p = self.index.progress
        p.started_s = time.monotonic()
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(
            1, thread_name_prefix="lmc-disk-scan", initializer=name_os_thread
        ) as pool:
            dirs = await loop.run_in_executor(pool, self._leaf_dirs)
            p.dirs_total = len(dirs)
            it = scan(dirs, self._key_of)
            while True:
                step = await loop.run_in_executor(pool, next, it, None)
                if step is None:
                    break
                found, removed = step
                self.index.merge(found)
                p.stale_tmp_removed += removed
                p.dirs_done += 1
                p.seconds = time.monotonic() - p.started_s
        # What is over capacity goes before the rebuild says it is done: once "done"
        # (stats, /healthz), the directory holds no more than --disk-size-gb.
        over = self.index.victims(0)
        if over:
            await asyncio.gather(
                *(self._run(self._unlink, k) for k in over), return_exceptions=True
            )
            self.evicted_objects += len(over)
            self.listeners.removed(over, "evicted")
        self.index.rebuild_done()
        p.seconds = time.monotonic() - p.started_s
        log.info(
            "disk tier %s: index rebuilt in %.1f s (%d files, %.2f GiB; %d evicted "
            "to fit, %d stale temporary files removed)",
            self.root,
            p.seconds,
            p.files,
            p.bytes / (1 << 30),
            len(over),
            p.stale_tmp_removed,
        )

    def status(self) -> str:
        p = self.index.progress
        if p.done:
            return ""
        return f"index rebuild {p.fraction:.0%} ({p.files} files found, serving meanwhile)"

    async def close(self) -> None:
        """Nothing to close between calls (files are opened per call)."""

    async def shutdown(self) -> None:
        if self._rebuild is not None:
            self._rebuild.cancel()
            await asyncio.gather(self._rebuild, return_exceptions=True)
        self._io.shutdown(wait=True)
