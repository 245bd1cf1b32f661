"""Whole-file reads and writes for the disk tier: aligned, direct where the filesystem allows.

Direct I/O (``O_DIRECT``) skips the page cache: an L1 object written to disk is not
kept a second time in the kernel's memory, which on a host whose RAM is mostly the L1
pool would only evict something else. It needs the buffer, the file offset and the
length aligned (``ALIGN_BYTES`` covers every logical block size in use). So buffers here
are anonymous mmaps (page aligned) padded to ``ALIGN_BYTES``, a write writes the padded
length and then truncates the file to the value's length, and a read asks for the
padded length and gets the file's (a direct read stops at the end of the file).

Not every filesystem takes ``O_DIRECT`` (tmpfs refuses it with ``EINVAL``, some network
filesystems ignore it). :func:`probe_direct` tries it once per directory; where it fails
every call is buffered, with the same bytes on disk. Nothing here is on the event loop:
the callers run these on threads (each syscall releases the GIL).

A write goes to a temporary name in the final directory and is renamed over the final
name only once complete: a reader sees the old file, no file, or the whole new one,
never part of one, whatever the writer's fate (kill -9 leaves a temporary file, which
the index rebuild removes). Several servers writing one key race harmlessly: each
rename installs a whole file.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import mmap
import os
import socket
import threading
from collections.abc import Callable

ALIGN_BYTES = 4096
#: Temporary files end with this; the index skips them and removes stale ones.
TMP_SUFFIX = ".tmp"
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_counter = itertools.count()
_HOST = socket.gethostname().replace("/", "_")[:32]
#: This host, as named in temporary files.
HOST = _HOST


def padded(nbytes: int) -> int:
    """``nbytes`` rounded up to ``ALIGN_BYTES`` (at least one block)."""
    return max(ALIGN_BYTES, -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES)


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """A page-aligned, zeroed, writable buffer of ``padded(nbytes)`` bytes."""
    return mmap.mmap(-1, padded(nbytes))


class BufferPool:
    """Aligned buffers kept for reuse, at most ``max_bytes`` of them idle.

    A fresh anonymous mapping costs a page fault and a zeroed page per 4 KiB on first
    touch, which on the 2-core CI VM took longer than the copy into it (0.27 s of
    0.36 s for 345 MB); a reused one costs neither. Thread-safe (the tier's threads
    take buffers, the event loop gives them back). A buffer is given back only once
    nothing reads or writes it any more: the caller's promise.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._free: dict[int, list[mmap.mmap]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> mmap.mmap:
        size = padded(nbytes)
        with self._lock:
            free = self._free.get(size)
            if free:
                self._idle_bytes -= size
                return free.pop()
        return mmap.mmap(-1, size)

    def give(self, buf: object) -> None:
        """Keep ``buf`` (a buffer from :meth:`take`) for reuse, if there is room."""
        if not isinstance(buf, mmap.mmap):
            return
        size = len(buf)
        with self._lock:
            free = self._free.setdefault(size, [])
            if any(b is buf for b in free):
                return  # given twice: kept once, or two takers would share it
            if self._idle_bytes + size <= self.max_bytes:
                free.append(buf)
                self._idle_bytes += size


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def is_aligned(view: memoryview) -> bool:
    """Whether ``view`` starts a buffer from :func:`aligned_buffer` (so its padded
    length can be written directly)."""
    obj = view.obj
    return (
        isinstance(obj, mmap.mmap)
        and not view.readonly
        and view.c_contiguous
        and len(obj) == padded(len(view))
        and _address(view) == _address(memoryview(obj))
    )


def probe_direct(directory: str) -> bool:
    """Whether ``directory``'s filesystem accepts direct writes and reads."""
    if not _O_DIRECT:
        return False
    path = os.path.join(directory, f".direct-probe.{_HOST}.{os.getpid()}{TMP_SUFFIX}")
    buf = aligned_buffer(ALIGN_BYTES)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | _O_DIRECT, 0o640)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return False
        raise
    try:
        os.pwrite(fd, buf, 0)
        os.close(fd)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | _O_DIRECT)
        os.preadv(fd, [buf], 0)
        return True
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return False
        raise
    finally:
        os.close(fd)
        os.unlink(path)


def temporary_path(path: str) -> str:
    """A new name beside ``path`` for a temporary file of this process
    (``.NAME.HOST.PID.N.tmp``: :func:`temporary_owner` reads who made it)."""
    directory, name = os.path.split(path)
    return os.path.join(directory, f".{name}.{_HOST}.{os.getpid()}.{next(_counter)}{TMP_SUFFIX}")


def temporary_owner(name: str) -> tuple[str, int] | None:
    """(host, pid) of the process that made the temporary file ``name``, or None when
    ``name`` is not one of :func:`temporary_path`'s."""
    if not name.startswith(".") or not name.endswith(TMP_SUFFIX):
        return None
    parts = name[1 : -len(TMP_SUFFIX)].split(".")
    if len(parts) < 4 or not parts[-1].isdigit() or not parts[-2].isdigit():
        return None
    return ".".join(parts[1:-2]), int(parts[-2])


def is_own_temporary(name: str) -> bool:
    """Whether ``name`` is a temporary file of this process."""
    return temporary_owner(name) == (_HOST, os.getpid())


def _install(path: str, direct: bool, body: Callable[[int], None]) -> None:
    """Run ``body(fd)`` on a new temporary file beside ``path``, then rename it over
    ``path``; on any failure the temporary file is removed and the error raised."""
    tmp = temporary_path(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    fd = os.open(tmp, flags | (_O_DIRECT if direct else 0), 0o640)
    try:
        body(fd)
        os.close(fd)
        fd = -1
        os.rename(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_file(path: str, value: memoryview, direct: bool) -> None:
    """Write ``value`` as the whole file ``path`` (temporary name, then rename).

    With ``direct`` the value must come from :func:`aligned_buffer` (else it is copied
    into one). Raises ``OSError``; a failed write leaves no temporary file behind.
    """
    n = len(value)
    if direct and not is_aligned(value):
        buf = aligned_buffer(n)
        buf[:n] = value
        value = memoryview(buf)[:n]
    out = memoryview(value.obj)[: padded(n)] if direct else value

    def body(fd: int) -> None:
        done = 0
        while done < len(out):
            done += os.pwrite(fd, out[done:], done)
        if len(out) != n:
            os.ftruncate(fd, n)

    _install(path, direct, body)


def write_parts(path: str, parts: list[memoryview], nbytes: int) -> None:
    """Write ``parts`` back to back as the file ``path``, then cut it to ``nbytes``
    (temporary name, then rename, as :func:`write_file`), with direct I/O.

    Every part must start at an ``ALIGN_BYTES``-aligned address and be a multiple of
    ``ALIGN_BYTES`` long (the disk layout's header block, a payload straight from its
    L1 slot, a padded tail block): one ``pwritev``, no copy. Raises ``OSError``; a
    failed write leaves no temporary file behind."""
    total = sum(len(p) for p in parts)

    def body(fd: int) -> None:
        done = os.pwritev(fd, parts, 0)
        while done < total:  # a short write (rare on a regular file): the rest
            rest, skip = [], done
            for p in parts:
                if skip >= len(p):
                    skip -= len(p)
                    continue
                rest.append(p[skip:])
                skip = 0
            n = os.pwritev(fd, rest, done)
            if n <= 0:
                raise OSError(errno.EIO, "short write", path)
            done += n
        if total != nbytes:
            os.ftruncate(fd, nbytes)

    _install(path, True, body)


def read_file(
    path: str, direct: bool, max_bytes: int, take: Callable[[int], mmap.mmap] = aligned_buffer
) -> memoryview | None:
    """The whole file ``path``, ``None`` if absent, in a buffer from ``take``. A file
    longer than ``max_bytes`` is returned cut to ``max_bytes`` (its header then fails
    the length checks: a miss)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (_O_DIRECT if direct else 0))
    except FileNotFoundError:
        return None
    try:
        size = min(os.fstat(fd).st_size, max_bytes)
        buf = take(size)
        view = memoryview(buf)
        want = padded(size) if direct else size
        done = 0
        while done < size:
            got = os.preadv(fd, [view[done:want]], done)
            if got == 0:
                break  # the file shrank under us: what was read is checked, and fails
            done += got
        return view[: min(done, size)]
    finally:
        os.close(fd)
