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
from lmc_server.l2.disk_config import disk_error
from lmc_server.l2.disk_index import DiskIndex, scan, stale_by_age
from lmc_server.l2.disk_ledger import DiskLedger, remove_counted
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
#: Rounds of "evict this server's coldest files, reserve again" before the rest of a
#: batch is dropped as ``full`` (other servers may take the room freed meanwhile).
RESERVE_ROUNDS = 3
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
        #: The bytes in the directory, of every server sharing it (the capacity's bound).
        self.ledger = DiskLedger(self.base, capacity_bytes)
        self._started_s = time.time()
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
        self.ledger.open()
        direct = direct_io.probe_direct(self.base)
        return direct if self._want_direct is None else (self._want_direct and direct)

    async def connect(self) -> None:
        try:
            self.direct = await self._run(self._check_dir)
        except OSError as e:
            raise L2Error(disk_error(self.root, "use it", e)) from None
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
            self._rebuild.add_done_callback(_report_failure)

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

    def _write(self, key: bytes, value: Value) -> bool:
        view = memoryview(value)
        return self._to_path(
            key,
            lambda path: direct_io.write_file(path, view, self.direct),
            len(view),
            bytes(view[: codec.HEADER_PREFIX_BYTES]),
        )

    def _to_path(
        self, key: bytes, write: Callable[[str], None], file_bytes: int, prefix: bytes
    ) -> bool:
        """``write(path)`` for ``key``'s file, its directory made on first use; False
        (nothing written) when the file is there already with this value's size and
        header (another server sharing the directory, or this one earlier, wrote it)."""
        path = self.path_of(key)
        there = _holds(path, file_bytes, prefix)
        if there:
            return False
        if there is None:  # another value under this key: never written over
            self._remove(key)
        directory = os.path.dirname(path)
        if directory not in self._made:
            os.makedirs(directory, mode=0o750, exist_ok=True)
            self._made.add(directory)
        try:
            write(path)
        except FileNotFoundError:  # the directory went (an operator cleaning up): once more
            os.makedirs(directory, mode=0o750, exist_ok=True)
            write(path)
        return True

    def _write_slot(self, obj: SlotObject, aligned: bool) -> bool:
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
            prefix = codec.header_prefix(obj.space, obj.chunk_key, obj.mask, len(obj.payload))
            size = disk_layout.file_bytes(len(obj.payload), aligned=True)
            return self._to_path(obj.key, write, size, prefix)
        prefix = codec.header_prefix(obj.space, obj.chunk_key, obj.mask, len(obj.payload))
        if _holds(self.path_of(obj.key), obj.value_bytes, prefix):
            return False  # (the copy is not made for nothing)
        value = self.encode(obj.space, obj.chunk_key, obj.mask, obj.payload)
        try:
            return self._write(obj.key, value)
        finally:
            self._buffers.give(value.obj)

    def _remove(self, key: bytes) -> int:
        """Delete ``key``'s file (I/O thread); its bytes leave the ledger (0: none)."""
        path = self.path_of(key)
        size = remove_counted(path, direct_io.temporary_path(path))
        self.ledger.release(size)
        return size

    async def _evict(self, victims: list[bytes]) -> None:
        if not victims:
            return
        await asyncio.gather(*(self._run(self._remove, k) for k in victims), return_exceptions=True)
        self.evicted_objects += len(victims)
        self.listeners.removed(victims, "evicted")

    async def _reserve(self, files: list[tuple[str, int]]) -> int:
        """Reserve room in the directory for the leading ``(path, bytes)`` of ``files``
        (evicting this server's coldest files while it is full); how many got room."""
        done = 0
        for _ in range(RESERVE_ROUNDS):
            done += await self._run(self.ledger.reserve, files[done:])
            if done == len(files):
                break
            short = await self._run(self.ledger.shortfall, sum(n for _, n in files[done:]))
            victims = self.index.coldest(short)
            if not victims:
                break
            await self._evict(victims)
        return done

    def _settle(self, reserved: list[tuple[str, int]], unused: int) -> None:
        """The writes of ``reserved`` files ended; ``unused`` of their bytes were not
        written (I/O thread)."""
        self.ledger.settled(reserved)
        self.ledger.release(unused)

    async def put_many(self, items: Sequence[tuple[bytes, Value]]) -> None:
        try:
            await self._put(
                [(k, len(v)) for k, v in items],
                [bytes(memoryview(v)[: codec.HEADER_PREFIX_BYTES]) for _, v in items],
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
            [codec.header_prefix(o.space, o.chunk_key, o.mask, len(o.payload)) for o in objects],
            [
                functools.partial(self._write_slot, o, a)
                for o, a in zip(objects, aligned, strict=True)
            ],
        )

    async def _put(
        self,
        sizes: list[tuple[bytes, int]],
        prefixes: list[bytes],
        writes: list[Callable[[], bool]],
    ) -> None:
        """Make room for ``sizes`` (evicting by LRU), run ``writes`` on the I/O threads,
        and index what was written; the first failure raised as :class:`L2Error`.

        Never past the capacity, of the whole directory (:mod:`lmc_server.l2.disk_ledger`):
        every file's bytes are reserved in the ledger before it is written. A file
        already there with the same value (``prefixes``: each header's bytes before the
        checksum, and the size) is not written again. Objects of a batch beyond what
        the whole capacity holds (a batch, or one object, larger than
        ``--disk-size-gb``) are not written, a refusal (the tier stays up); objects that
        find the directory full of other servers' files, with none of this server's
        left to evict, are dropped as ``full``."""
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
        present = await asyncio.gather(
            *(
                self._run(_holds, self.path_of(k), n, pre)
                for (k, n), pre in zip(sizes[:fit], prefixes, strict=False)
            )
        )
        written: list[bytes] = []
        todo: list[int] = []
        for i, there in enumerate(present):
            if there is True:  # written before, by this server or another
                key, nbytes = sizes[i]
                known.pop(key, None)
                self.index.touch(key, nbytes)
                written.append(key)
            else:
                todo.append(i)
        left = [i for i in range(fit, len(sizes))]  # not written: old files stay
        want = [sizes[i] for i in todo]
        await self._evict(self.index.victims(sum(n for _, n in want)))  # own share first
        files = [(self.path_of(k), n) for k, n in want]
        room = await self._reserve(files)
        full = len(want) - room
        left += todo[room:]
        for i in left:
            key = sizes[i][0]
            if key in known:
                self.index.touch(key, known.pop(key))
        todo, files = todo[:room], files[:room]
        results: list[Any] = []
        try:
            results = await asyncio.gather(
                *(self._run(writes[i]) for i in todo), return_exceptions=True
            )
        finally:
            unused = (
                sum(  # failed, or the same file there meanwhile: not written by us
                    n for (_, n), r in zip(files, results, strict=False) if r is not True
                )
                + sum(n for _, n in files[len(results) :])
            )
            await self._run(self._settle, files, unused)
        failure: OSError | None = None
        for i, r in zip(todo, results, strict=True):
            key, nbytes = sizes[i]
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
        if full:
            raise L2Error(
                f"disk {self.root}: the directory holds its --disk-size-gb "
                f"({self.index.capacity_bytes} bytes, {self.ledger.used_bytes} in use by "
                f"the servers sharing it) and this server knows no file of its own to "
                f"evict: {full} objects not written",
                unavailable=False,
                written=written,
                dropped="full",
            )

    async def discard(self, keys: Sequence[bytes]) -> None:
        """Delete files the tier found damaged (a later write replaces them anyway)."""
        for k in keys:
            self.index.forget(k)
        await asyncio.gather(*(self._run(self._remove, k) for k in keys), return_exceptions=True)
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
            it = scan(dirs, self._key_of, self.stale_temporary, self.ledger.release)
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
        await self._evict(over)
        # Alone on the directory, the ledger is set to what is really there (what a
        # server killed mid-write left reserved goes back).
        recount = await self._run(self.ledger.recount_if_alone, direct_io.is_own_temporary)
        self.index.rebuild_done()
        p.seconds = time.monotonic() - p.started_s
        log.info(
            "disk tier %s: index rebuilt in %.1f s (%d files, %.2f GiB; %d evicted "
            "to fit, %d stale temporary files removed); %s",
            self.root,
            p.seconds,
            p.files,
            p.bytes / (1 << 30),
            len(over),
            p.stale_tmp_removed,
            "the directory holds %.2f GiB" % (recount / (1 << 30))
            if recount is not None
            else "directory shared with other running servers",
        )

    def stale_temporary(self, name: str, mtime_s: float) -> bool:
        """Whether the temporary file ``name`` was left by a writer that is gone: one of
        this host's processes that no longer runs (or this process's pid, from before
        it started: a container restarted as pid 1), found at start; another host's
        once older than ``STALE_TMP_S``. Scan thread."""
        owner = direct_io.temporary_owner(name)
        if owner is None or owner[0] != direct_io.HOST:
            return stale_by_age(name, mtime_s)
        pid = owner[1]
        if pid == os.getpid():
            return mtime_s < self._started_s
        return not _alive(pid)

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
        self.ledger.close()


def _holds(path: str, file_bytes: int, prefix: bytes) -> bool | None:
    """Whether ``path`` is a file of ``file_bytes`` whose header starts with ``prefix``
    (the value to be written is there already): True; False when there is no file;
    None when there is another one (I/O thread)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    try:
        if st.st_size != file_bytes:
            return None
        with open(path, "rb", buffering=0) as f:
            return True if f.read(len(prefix)) == prefix else None
    except OSError:
        return None


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _report_failure(task: asyncio.Task[None]) -> None:
    """Log a background task of the tier that ended by a bug (its exception consumed
    here, once, with the traceback a bug deserves)."""
    if not task.cancelled() and (e := task.exception()) is not None:
        log.error("disk tier: %s failed", task.get_name(), exc_info=e)
