"""What the disk tier knows is on disk: sizes in LRU order, capacity, and the rebuild.

The index is for capacity and eviction only; it never decides a hit. A read opens the
file its key names whether the index knows it or not, so a server started on a full
directory serves hits from its first lookup, and a file another server wrote into a
shared directory is found as soon as it exists. Every value read is checked (header,
checksum) by the tier before anything is served, so a stale index can cost a miss,
never a wrong byte.

The index rebuild walks the directory on a thread after start, in the background,
and hands each fan-out directory's files to the event loop (:meth:`DiskIndex.merge`),
oldest first (by mtime) at the cold end of the LRU order: everything this server wrote
or read since it started stays hotter. It removes the temporary files of writers that
are gone (killed mid-write): on this host, those of a process that no longer runs, at
once; another host's, once older than ``STALE_TMP_S`` (a live writer's are seconds
old).
Capacity is enforced on what the index knows: until the rebuild is done, files not yet
scanned are not counted; once every directory is scanned, the coldest files go until
the total fits, and then the rebuild is done.

Event-loop thread only, except :func:`scan`, which runs on a thread and touches nothing
shared.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from lmc_server.tiers.disk.direct_io import TMP_SUFFIX

#: A temporary file older than this was left by a dead writer.
STALE_TMP_S = 60.0


@dataclass(slots=True)
class RebuildProgress:
    """How far the index rebuild is (reported in ``stats`` and on /healthz)."""

    dirs_total: int = 0
    dirs_done: int = 0
    files: int = 0
    bytes: int = 0
    stale_tmp_removed: int = 0
    started_s: float = 0.0
    seconds: float = 0.0
    done: bool = False

    @property
    def fraction(self) -> float:
        if self.done:
            return 1.0
        return self.dirs_done / self.dirs_total if self.dirs_total else 0.0


@dataclass(slots=True)
class DiskIndex:
    """Known files (key -> bytes) in LRU order (first = coldest) and their total."""

    capacity_bytes: int
    entries: OrderedDict[bytes, int] = field(default_factory=OrderedDict)
    used_bytes: int = 0
    progress: RebuildProgress = field(default_factory=RebuildProgress)
    #: Keys evicted or forgotten while the rebuild runs: a scan may have listed their
    #: files before they went, and merging them then would count a file that is gone
    #: (seen under load: a test's index at 60,000 of 50,000 bytes). Emptied when done.
    gone: set[bytes] = field(default_factory=set)

    def touch(self, key: bytes, nbytes: int) -> None:
        """``key`` was written or read (``nbytes`` on disk): now the hottest."""
        old = self.entries.pop(key, None)
        if old is not None:
            self.used_bytes -= old
        self.entries[key] = nbytes
        self.used_bytes += nbytes

    def forget(self, key: bytes) -> None:
        old = self.entries.pop(key, None)
        if old is not None:
            self.used_bytes -= old
        if not self.progress.done:
            self.gone.add(key)

    def victims(self, incoming_bytes: int) -> list[bytes]:
        """Remove and return the coldest keys until ``incoming_bytes`` more would fit."""
        out: list[bytes] = []
        while self.entries and self.used_bytes + incoming_bytes > self.capacity_bytes:
            key, nbytes = self.entries.popitem(last=False)
            self.used_bytes -= nbytes
            out.append(key)
        if not self.progress.done:
            self.gone.update(out)
        return out

    def coldest(self, nbytes: int) -> list[bytes]:
        """Remove and return the coldest keys until they hold at least ``nbytes`` (the
        directory, shared with other servers, needs that much room; all of them when
        this index knows less)."""
        out: list[bytes] = []
        freed = 0
        while self.entries and freed < nbytes:
            key, size = self.entries.popitem(last=False)
            self.used_bytes -= size
            freed += size
            out.append(key)
        if not self.progress.done:
            self.gone.update(out)
        return out

    def rebuild_done(self) -> None:
        """The rebuild merged its last directory: nothing listed before can come back."""
        self.progress.done = True
        self.gone.clear()

    def merge(self, found: list[tuple[bytes, int, float]]) -> None:
        """Add scanned ``(key, bytes, mtime)`` not known yet, at the cold end, the
        oldest coldest."""
        for key, nbytes, _ in sorted(found, key=lambda f: f[2], reverse=True):
            if key in self.entries or key in self.gone:
                continue
            self.entries[key] = nbytes
            self.entries.move_to_end(key, last=False)
            self.used_bytes += nbytes
        self.progress.files += len(found)
        self.progress.bytes += sum(f[1] for f in found)


def stale_by_age(name: str, mtime_s: float, now_s: Callable[[], float] = time.time) -> bool:
    """A temporary file no live writer would still have open: older than
    ``STALE_TMP_S`` (the rule for another host's files; the tier knows more of its own
    host's, :meth:`~lmc_server.tiers.disk.rebuild.IndexRebuild.stale_temporary`)."""
    return now_s() - mtime_s > STALE_TMP_S


def scan(
    leaf_dirs: list[str],
    key_of: Callable[[str, str], bytes | None],
    stale: Callable[[str, float], bool] = stale_by_age,
    removed_bytes: Callable[[int], None] = lambda n: None,
) -> Iterator[tuple[list[tuple[bytes, int, float]], int]]:
    """Per directory of ``leaf_dirs``: its value files ``(key, bytes, mtime)`` and how
    many stale temporary files were removed (``stale(name, mtime)``; each removal's
    size is told to ``removed_bytes``). ``key_of(dir, name)`` maps a file name to its
    key (``None``: not a value file, left alone). Thread; only reads the filesystem
    and unlinks stale temporaries."""
    for d in leaf_dirs:
        found: list[tuple[bytes, int, float]] = []
        removed = 0
        try:
            entries = list(os.scandir(d))
        except OSError:
            yield found, removed
            continue
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue  # gone meanwhile (evicted, renamed over)
            if e.name.endswith(TMP_SUFFIX):
                if stale(e.name, st.st_mtime):
                    try:
                        os.unlink(e.path)
                    except OSError:
                        continue
                    removed += 1
                    removed_bytes(st.st_size)
                continue
            if not e.is_file(follow_symlinks=False):
                continue
            key = key_of(d, e.name)
            if key is not None:
                found.append((key, st.st_size, st.st_mtime))
        yield found, removed
