"""The disk tier's adapter: the L2 contract over a directory (local NVMe, NFS, ...).

One file per object (:mod:`lmc_server.tiers.disk.files`: the layout, the reads and
writes, removal). Writes are whole files, renamed into place
(:mod:`lmc_server.tiers.disk.direct_io`), built from the L1 slot on the I/O thread that writes
them (``writes_from_slots``): one object's copy and checksum overlap the other threads'
writes, where building a whole batch first and then writing it left the disk idle
during the build (measured on the 2-core CI VM: 0.62-0.75 of plain writes before,
0.84-0.96 after). Reads open the path the key names (the index decides nothing about
hits, see :mod:`lmc_server.tiers.disk.index`). I/O runs on ``IO_THREADS`` threads of the
adapter (a batch's files in parallel, to keep an NVMe's queue busy), never on the event
loop; the index is updated on the loop when each call returns. After a start the index
is rebuilt from the directory while the tier serves (:mod:`lmc_server.tiers.disk.rebuild`).

What this module decides is a batch's admission: which of a batch's objects are
written, within the capacity of the whole directory (every file's bytes reserved in
the byte ledger before it is written, :mod:`lmc_server.tiers.disk.ledger`; this server's
coldest files evicted to make room), and what the tier is told when some are not.

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
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from lmc_server.threadnames import name_os_thread
from lmc_server.tiers import codec
from lmc_server.tiers.backend import L2Backend, L2Error, SlotObject, Value
from lmc_server.tiers.disk import direct_io
from lmc_server.tiers.disk import layout as disk_layout
from lmc_server.tiers.disk.config import disk_error
from lmc_server.tiers.disk.files import DiskFiles, holds
from lmc_server.tiers.disk.index import DiskIndex
from lmc_server.tiers.disk.ledger import DiskLedger
from lmc_server.tiers.disk.rebuild import IndexRebuild
from lmc_server.tiers.events import TierListeners

log = logging.getLogger(__name__)

IO_THREADS = 4
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
        #: The objects' files: names, reads, writes, removals (I/O threads).
        self.files = DiskFiles(self.base, self.ledger)
        #: The index's rebuild from the directory, started at the first connect.
        self._rebuild = IndexRebuild(
            self.root, self.files, self.index, self.ledger, self._evict, self._run
        )
        self.listeners = TierListeners("disk")
        #: ``None``: probe the filesystem at connect; else forced (tests).
        self._want_direct = direct
        self.evicted_objects = 0
        self._io = ThreadPoolExecutor(
            io_threads, thread_name_prefix="lmc-disk", initializer=name_os_thread
        )
        self._connected = False

    @property
    def direct(self) -> bool:
        """Whether the files are read and written with ``O_DIRECT`` (probed at connect)."""
        return self.files.direct

    def path_of(self, key: bytes) -> str:
        """``key``'s file (:meth:`~lmc_server.tiers.disk.files.DiskFiles.path_of`)."""
        return self.files.path_of(key)

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
            self.files.direct = await self._run(self._check_dir)
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
        self._rebuild.start()

    async def get_many(self, keys: Sequence[bytes]) -> list[Value | None]:
        if not self._connected:
            raise L2Error("disk: not ready")
        results = await asyncio.gather(
            *(self._run(self.files.read, k) for k in keys), return_exceptions=True
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
        self.files.release(values)

    def encode(self, space: bytes, chunk_key: bytes, mask: int, payload: memoryview) -> memoryview:
        """Header and payload in one aligned buffer (one copy), written as is."""
        return self.files.encode(space, chunk_key, mask, payload)

    async def _evict(self, victims: list[bytes]) -> None:
        if not victims:
            return
        await asyncio.gather(
            *(self._run(self.files.remove, k) for k in victims), return_exceptions=True
        )
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
                [functools.partial(self.files.write, k, v) for k, v in items],
            )
        finally:
            # Written or failed, no one reads these buffers again (the writer keeps
            # only their lengths): back to the pool.
            self.release([v for _, v in items])

    async def put_slots(self, objects: Sequence[SlotObject]) -> None:
        aligned = [disk_layout.aligned_ok(o.payload, self.files.direct) for o in objects]
        await self._put(
            [
                (o.key, disk_layout.file_bytes(len(o.payload), a))
                for o, a in zip(objects, aligned, strict=True)
            ],
            [codec.header_prefix(o.space, o.chunk_key, o.mask, len(o.payload)) for o in objects],
            [
                functools.partial(self.files.write_slot, o, a)
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

        Never past the capacity, of the whole directory (:mod:`lmc_server.tiers.disk.ledger`):
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
                self._run(holds, self.path_of(k), n, pre)
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
        await asyncio.gather(
            *(self._run(self.files.remove, k) for k in keys), return_exceptions=True
        )
        self.listeners.removed(keys, "invalid")

    def status(self) -> str:
        p = self.index.progress
        if p.done:
            return ""
        return f"index rebuild {p.fraction:.0%} ({p.files} files found, serving meanwhile)"

    async def close(self) -> None:
        """Nothing to close between calls (files are opened per call)."""

    async def shutdown(self) -> None:
        await self._rebuild.stop()
        self._io.shutdown(wait=True)
        self.ledger.close()
