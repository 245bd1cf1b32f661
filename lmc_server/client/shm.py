"""POSIX shared-memory KV buffers for the CPU engine (tests, CPU-only hosts).

The worker creates a segment under ``/dev/shm`` (mode 0600, random ``lmc-`` name),
registers it by name, and may unlink it at any time: the server's mapping stays
valid until it unmaps. Closing the owner unmaps and unlinks.
"""

from __future__ import annotations

import mmap
import os
import secrets

import numpy as np

from lmc_server.buffers import ShmBuffer

SHM_DIR = "/dev/shm"


class ShmSegment:
    """One segment this process created; ``array`` is a writable uint8 view."""

    def __init__(self, size_bytes: int, name: str | None = None) -> None:
        self.name = name or f"lmc-{os.getpid()}-{secrets.token_hex(8)}"
        self.size_bytes = size_bytes
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

    @property
    def spec(self) -> ShmBuffer:
        return ShmBuffer(name=self.name, size_bytes=self.size_bytes)

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
