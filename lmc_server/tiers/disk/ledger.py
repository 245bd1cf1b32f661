"""The bytes every server sharing one disk directory has in it: one ledger, locked.

``--disk-size-gb`` bounds the directory, not one server's share of it: several servers
(one per host on a shared filesystem, or several on one host) write into one directory,
and each server's index knows only the files it wrote, read or found at start. So the
total lives in a file beside the objects, ``ROOT/lmc2/.ledger`` (16 bytes: a magic and
the bytes in use, little-endian), changed only under a POSIX record lock
(``fcntl.lockf``; NFS carries these through its lock manager) plus a mutex for this
process's threads (POSIX locks are per process).

Invariant: the ledger is never below the bytes of the tier's object files (values and
their temporary files) in the directory, so a write that the ledger admits never takes
the directory past the capacity:

- a write reserves its file's bytes (:meth:`DiskLedger.reserve`) before its temporary
  file exists, and gives them back (:meth:`DiskLedger.release`) only if it failed;
- an eviction gives back a file's bytes only after the unlink that removed it, and only
  the bytes of the file it removed (:func:`remove_counted` renames the file to a name of
  its own first, so what it measures is what it deletes; a file another server deleted
  first gives back nothing);
- a server never writes over a file it sees: the same value there is left as it is (not
  written again), another one is removed (counted) first; a write over a file that
  appeared meanwhile (two servers storing one key at once) gives nothing back: the
  ledger then counts more than is there, never less.

What can make it count more than is there: such races, and a server killed with writes
in flight (their reservations stay). :meth:`DiskLedger.recount_if_alone` sets it to
the bytes really there, at the end of a server's index rebuild, when no other server
uses the directory (each holds a shared lock on ``ROOT/lmc2/.servers`` from connect
to shutdown; the recount takes it exclusive without waiting, atomically converted, or
skips). A ledger that is missing (a directory written before it existed, or deleted) is
made by summing the directory once, under its lock.

Thread-safe; every method blocks on file locks, so the tier calls them on its I/O
threads, never on the event loop.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
import threading
from collections.abc import Callable, Iterator

LEDGER_NAME = ".ledger"
SERVERS_NAME = ".servers"
_MAGIC = b"LMCLEDG1"
_RECORD = struct.Struct("<8sQ")


def tier_file_bytes(
    base: str,
    skip: Callable[[str], bool] = lambda name: False,
    skip_paths: set[str] | frozenset[str] = frozenset(),
) -> int:
    """Bytes of the tier's files under ``base`` (values and temporaries in the fan-out
    directories, not the ledger files nor the direct-I/O probe), except names ``skip``
    says to leave out and the paths of ``skip_paths``."""
    total = 0
    for top, _dirs, files in os.walk(base):
        if top == base:
            continue
        for name in files:
            path = os.path.join(top, name)
            if skip(name) or path in skip_paths:
                continue
            total += _size(path)
    return total


def _size(path: str) -> int:
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0  # none, or gone meanwhile


class DiskLedger:
    """The directory-wide byte count (see the module docstring)."""

    def __init__(self, base: str, capacity_bytes: int) -> None:
        self.base = base
        self.capacity_bytes = capacity_bytes
        #: The ledger's value as last read or written by this process.
        self.used_bytes = 0
        self._shared: _Shared | None = None

    # -- lifecycle (I/O thread) ------------------------------------------------------

    def open(self) -> None:
        """Open (make) the ledger and join the servers of the directory. Idempotent."""
        if self._shared is None:
            self._shared = _Shared.join(self.base)
            self.used_bytes = self._shared.used()

    def close(self) -> None:
        shared, self._shared = self._shared, None
        if shared is not None:
            shared.leave()

    def _sh(self) -> _Shared:
        if self._shared is None:
            raise OSError(errno.EBADF, "the disk ledger is not open", self.base)
        return self._shared

    # -- counting (I/O thread) -------------------------------------------------------

    def reserve(self, files: list[tuple[str, int]]) -> int:
        """Reserve the leading ``(path, bytes)`` of ``files`` that fit under the
        capacity, in order; how many were reserved (the rest must not be written).
        Each reserved file is pending until :meth:`settled`."""
        sh = self._sh()
        with sh.locked():
            used = sh.read()
            n = 0
            for _, size in files:
                if used + size > self.capacity_bytes:
                    break
                used += size
                n += 1
            if n:
                sh.write(used)
                for path, size in files[:n]:
                    sh.pending.setdefault(path, []).append(size)
            self.used_bytes = used
            return n

    def shortfall(self, nbytes: int) -> int:
        """Bytes to free before ``nbytes`` more would fit (0: they fit now)."""
        sh = self._sh()
        with sh.locked():
            self.used_bytes = sh.read()
        return max(0, self.used_bytes + nbytes - self.capacity_bytes)

    def settled(self, files: list[tuple[str, int]]) -> None:
        """The writes of reserved ``files`` ended (each file in place, or released)."""
        sh = self._sh()
        with sh.mutex:
            for path, size in files:
                sizes = sh.pending[path]
                sizes.remove(size)
                if not sizes:
                    del sh.pending[path]

    def release(self, nbytes: int) -> None:
        """Files of ``nbytes`` this process removed (or never wrote) are gone."""
        if nbytes <= 0:
            return
        sh = self._sh()
        with sh.locked():
            self.used_bytes = max(0, sh.read() - nbytes)
            sh.write(self.used_bytes)

    def recount_if_alone(self, own_tmp: Callable[[str], bool]) -> int | None:
        """If no other server uses the directory: set the ledger to the bytes of the
        tier's files there, the new value (else None). Files this process is writing
        count as reserved, not as found: its own temporary files (``own_tmp(name)``)
        and the paths it is writing are left out of the walk, their reservations
        added. (The tier never writes over a file: one in the way is removed, counted,
        before the write is reserved, so a pending path holds nothing but the new file.)"""
        sh = self._sh()
        with sh.mutex:
            if sh.users > 1:
                return None  # another server in this process
            try:
                fcntl.lockf(sh.servers_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.EAGAIN, errno.EACCES):
                    return None  # another server: its writes in flight are not ours to see
                raise
            try:
                with sh.file_lock():  # no reservation of ours or theirs meanwhile
                    pending = {p: sum(sizes) for p, sizes in sh.pending.items()}
                    found = tier_file_bytes(self.base, own_tmp, set(pending))
                    self.used_bytes = found + sum(pending.values())
                    sh.write(self.used_bytes)
                    return self.used_bytes
            finally:
                fcntl.lockf(sh.servers_fd, fcntl.LOCK_SH)  # an atomic downgrade


class _Shared:
    """The open ledger of one directory, shared by every :class:`DiskLedger` of this
    process on it: POSIX record locks belong to the process, and closing any of its
    descriptors of a file drops all of them, so each file is opened once per process
    and its threads are ordered by one mutex."""

    _open: dict[str, _Shared] = {}
    _registry = threading.Lock()

    def __init__(self, base: str) -> None:
        os.makedirs(base, mode=0o750, exist_ok=True)
        self.base = base
        self.mutex = threading.Lock()
        self.users = 0
        #: Files this process reserved and is writing: final path -> reserved bytes
        #: (one entry per write in flight).
        self.pending: dict[str, list[int]] = {}
        self.servers_fd = os.open(os.path.join(base, SERVERS_NAME), os.O_RDWR | os.O_CREAT, 0o640)
        try:
            self.fd = os.open(os.path.join(base, LEDGER_NAME), os.O_RDWR | os.O_CREAT, 0o640)
        except BaseException:
            os.close(self.servers_fd)
            raise
        try:
            fcntl.lockf(self.servers_fd, fcntl.LOCK_SH)
            with self.file_lock():
                if self._read() is None:  # new, or not ours: sum what is there
                    self.write(tier_file_bytes(base))
        except BaseException:
            os.close(self.fd)
            os.close(self.servers_fd)
            raise

    @classmethod
    def join(cls, base: str) -> _Shared:
        with cls._registry:
            sh = cls._open.get(base)
            if sh is None:
                sh = cls._open[base] = _Shared(base)
            sh.users += 1
            return sh

    def leave(self) -> None:
        with _Shared._registry:
            self.users -= 1
            if self.users == 0:
                del _Shared._open[self.base]
                os.close(self.fd)  # drops this process's locks on the files
                os.close(self.servers_fd)

    @contextlib.contextmanager
    def file_lock(self) -> Iterator[None]:
        fcntl.lockf(self.fd, fcntl.LOCK_EX, _RECORD.size, 0)
        try:
            yield
        finally:
            fcntl.lockf(self.fd, fcntl.LOCK_UN, _RECORD.size, 0)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        with self.mutex, self.file_lock():
            yield

    def used(self) -> int:
        with self.locked():
            return self.read()

    def _read(self) -> int | None:
        raw = os.pread(self.fd, _RECORD.size, 0)
        if len(raw) != _RECORD.size:
            return None
        magic, used = _RECORD.unpack(raw)
        return int(used) if magic == _MAGIC else None

    def read(self) -> int:
        """The ledger's value (a damaged ledger reads as full: nothing more is
        written until a recount)."""
        v = self._read()
        return v if v is not None else 1 << 62

    def write(self, used: int) -> None:
        os.pwrite(self.fd, _RECORD.pack(_MAGIC, used), 0)


def remove_counted(path: str, aside: str) -> int:
    """Remove the file at ``path`` and return its size (0: there was none), exactly:
    it is renamed to ``aside`` (a name of this process's own) first, so the size
    measured is that of the file removed, whatever another server does to ``path``
    meanwhile."""
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return 0
    try:
        size = os.lstat(aside).st_size
    finally:
        os.unlink(aside)
    return size
