"""POSIX shared-memory KV buffers for the server's cpu backend (CPU-only hosts, tests).

A worker whose KV cache lives in host memory allocates it here (:class:`ShmSegment`),
uses ``segment.array`` as that memory and registers ``segment.spec``: the server maps
the same pages, so stores and retrieves copy straight between them and its pool.

The worker creates a segment under ``/dev/shm`` (mode 0600, random ``lmc-<pid>-``
name) and registers it by name; the server opens the name once, at registration, and
its mapping stays valid until it unmaps, whatever happens to the name. So the name is
needed only until the server has acknowledged the registration, and it is removed then
(:func:`registered`, called by the client for every ``Registered`` reply): a worker
killed with SIGKILL afterwards leaves nothing in ``/dev/shm``.

The price: a segment is registered once. The server opens segments only by name (a
socket cannot pass it a file descriptor) and Linux cannot give an unlinked file a name
again, so a second registration of the same segment, another client's or the same
client's after a server restart, would find no name: the client refuses it before
sending (:func:`check_registrable`). A segment that must be registered again is
created with ``keep_name=True``; its name then lives until :meth:`ShmSegment.close`
(or :meth:`ShmSegment.unlink`), and a kill -9 leaves it behind.
"""

from __future__ import annotations

import mmap
import os
import secrets
import weakref
from collections.abc import Sequence

import numpy as np

from lmc_server.buffers import BufferSpec, ShmBuffer

SHM_DIR = "/dev/shm"
#: This process's segments by name (weak: a segment dropped or closed leaves).
_LIVE: weakref.WeakValueDictionary[str, ShmSegment] = weakref.WeakValueDictionary()


def check_registrable(buffers: Sequence[BufferSpec]) -> None:
    """Raise ``ValueError`` if a segment of this process among ``buffers`` has lost its
    name (registered already): the server could not open it."""
    for b in buffers:
        seg = _LIVE.get(b.name) if isinstance(b, ShmBuffer) else None
        if seg is not None and seg.unlinked:
            raise ValueError(
                f"shared-memory segment {seg.name} was registered already and its name "
                f"removed (nothing is left behind if this process is killed); create it "
                f"with ShmSegment(..., keep_name=True) to register it more than once"
            )


def registered(buffers: Sequence[BufferSpec]) -> None:
    """The server acknowledged a registration of ``buffers``: remove the name of each
    segment of this process among them, unless it keeps its name."""
    for b in buffers:
        seg = _LIVE.get(b.name) if isinstance(b, ShmBuffer) else None
        if seg is not None and not seg.keep_name:
            seg.unlink()


class ShmSegment:
    """A zero-filled shared-memory segment of ``size_bytes`` this process created;
    ``array`` is a writable uint8 view of all of it (reshape or ``.view()`` it to the
    engine's layout), ``spec`` what a registration's ``buffers`` take. Close it (or use
    ``with``) once the registration is gone.

    ``keep_name``: keep the name after a registration (see the module docstring).
    """

    def __init__(self, size_bytes: int, name: str | None = None, keep_name: bool = False) -> None:
        self.name = name or f"lmc-{os.getpid()}-{secrets.token_hex(8)}"
        self.size_bytes = size_bytes
        self.keep_name = keep_name
        self.path = os.path.join(SHM_DIR, self.name)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size_bytes)
            self._mm = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._mm, dtype=np.uint8)
        self._unlinked = False
        _LIVE[self.name] = self

    @property
    def spec(self) -> ShmBuffer:
        return ShmBuffer(name=self.name, size_bytes=self.size_bytes)

    @property
    def unlinked(self) -> bool:
        """The name is gone: the memory lives on in every mapping of it."""
        return self._unlinked

    def unlink(self) -> None:
        if not self._unlinked:
            self._unlinked = True
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Unlink, and unmap unless views of ``array`` are still alive elsewhere (the
        mapping then goes away with the last view)."""
        self.unlink()
        if not self._mm.closed:
            self.array = np.empty(0, dtype=np.uint8)
            try:
                self._mm.close()
            except BufferError:
                pass

    def __enter__(self) -> ShmSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
