"""The disk index rebuilt from the directory after a start, while the tier serves.

A server that starts on a directory already holding files learns them here: at the
first connect :meth:`IndexRebuild.start` starts one task that walks the directory on a
thread of its own (:func:`lmc_server.tiers.disk.index.scan`), removing the temporary files
their writers left (:meth:`IndexRebuild.stale_temporary`), and merges each directory's
files into the index on the event loop as it goes; then it evicts what is over
capacity and, alone on the directory, sets the ledger to what is really there. Reads
need none of it (a read opens the path its key names), so the tier serves meanwhile.

Invariants: one rebuild per tier, however often it connects; the index says the rebuild
is done (stats, ``/healthz``) only once the directory holds no more than
``--disk-size-gb``; a temporary file is removed only once its writer is gone; the walk
only reads the filesystem and unlinks stale temporary files, the index is changed on the
loop alone; a rebuild that ends by a bug is logged once, with its traceback.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lmc_server.threadnames import name_os_thread
from lmc_server.tiers.disk import direct_io
from lmc_server.tiers.disk.files import DiskFiles
from lmc_server.tiers.disk.index import DiskIndex, scan, stale_by_age
from lmc_server.tiers.disk.ledger import DiskLedger

#: The disk tier's logger, not this module's: its lines name the tier's adapter
#: (:mod:`lmc_server.tiers.disk.backend`), as operators' filters expect.
log = logging.getLogger("lmc_server.tiers.disk.backend")


class IndexRebuild:
    """The rebuild of ``index`` from ``files`` under ``root``; ``evict`` is the tier's
    eviction (files removed, counted, told to its listeners) and ``run`` runs a call on
    the tier's I/O threads."""

    def __init__(
        self,
        root: str,
        files: DiskFiles,
        index: DiskIndex,
        ledger: DiskLedger,
        evict: Callable[[list[bytes]], Awaitable[None]],
        run: Callable[..., Awaitable[Any]],
    ) -> None:
        self._root = root
        self._files = files
        self._index = index
        self._ledger = ledger
        self._evict = evict
        self._run = run
        #: this process's own temporary files older than this are from before it started
        self._started_s = time.time()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the rebuild on the running loop, the first time only."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._rebuild_index(), name="disk-index"
            )
            self._task.add_done_callback(_report_failure)

    async def stop(self) -> None:
        """Cancel the rebuild (if started) and wait until it has ended."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _rebuild_index(self) -> None:
        """Walk the directory on a thread of its own; merge on the loop as it goes."""
        p = self._index.progress
        p.started_s = time.monotonic()
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(
            1, thread_name_prefix="lmc-disk-scan", initializer=name_os_thread
        ) as pool:
            dirs = await loop.run_in_executor(pool, self._files.leaf_dirs)
            p.dirs_total = len(dirs)
            it = scan(dirs, self._files.key_of, self.stale_temporary, self._ledger.release)
            while True:
                step = await loop.run_in_executor(pool, next, it, None)
                if step is None:
                    break
                found, removed = step
                self._index.merge(found)
                p.stale_tmp_removed += removed
                p.dirs_done += 1
                p.seconds = time.monotonic() - p.started_s
        # What is over capacity goes before the rebuild says it is done: once "done"
        # (stats, /healthz), the directory holds no more than --disk-size-gb.
        over = self._index.victims(0)
        await self._evict(over)
        # Alone on the directory, the ledger is set to what is really there (what a
        # server killed mid-write left reserved goes back).
        recount = await self._run(self._ledger.recount_if_alone, direct_io.is_own_temporary)
        self._index.rebuild_done()
        p.seconds = time.monotonic() - p.started_s
        log.info(
            "disk tier %s: index rebuilt in %.1f s (%d files, %.2f GiB; %d evicted "
            "to fit, %d stale temporary files removed); %s",
            self._root,
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
