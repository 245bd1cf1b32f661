"""The throughput baseline: a plain copy of the same number of bytes, same memory kinds.

CPU: one ``numpy.copyto`` between a POSIX shared-memory segment (what a CPU worker's
KV buffers are) and an anonymous mapping populated the way the server's pool is
(``MADV_POPULATE_WRITE``): ``d2h`` is segment to pool memory (a store), ``h2d`` the
reverse (a retrieve), ``both`` runs the two at once on two threads (a store and a
retrieve in flight together); :meth:`CpuRawCopy.seconds` times one copy. GPU:
``lmc_server.testing.cuda_kv.raw_copy_gbps`` (pinned ``cudaMemcpy``), imported only
for ``--backend cuda``.
"""

from __future__ import annotations

import mmap
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from lmc_server.client.shm import ShmSegment
from lmc_server.transfer.cpu import MADV_POPULATE_WRITE

DIRECTIONS = ("d2h", "h2d", "both")


class CpuRawCopy:
    """Buffers for raw copies of up to ``max_bytes`` (two of each kind, for ``both``)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max(max_bytes, 1)
        self._segs = [ShmSegment(self.max_bytes), ShmSegment(self.max_bytes)]
        self._maps = [
            mmap.mmap(-1, self.max_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            for _ in range(2)
        ]
        self._anon = []
        for mm in self._maps:
            try:
                mm.madvise(MADV_POPULATE_WRITE)
            except OSError:
                pass
            a = np.frombuffer(mm, dtype=np.uint8)
            a[:: mmap.PAGESIZE] = 0
            self._anon.append(a)
        for s in self._segs:
            s.array[:] = 1
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="lmc-bench-raw")

    def _copy(self, direction: str, nbytes: int, i: int) -> None:
        shm, anon = self._segs[i].array[:nbytes], self._anon[i][:nbytes]
        if direction == "d2h":
            np.copyto(anon, shm)
        else:
            np.copyto(shm, anon)

    def _once(self, direction: str, nbytes: int, nbytes2: int) -> None:
        if direction != "both":
            self._copy(direction, nbytes, 0)
            return
        f1 = self._pool.submit(self._copy, "d2h", nbytes, 0)
        f2 = self._pool.submit(self._copy, "h2d", nbytes2, 1)
        f1.result()
        f2.result()

    def seconds(self, direction: str, nbytes: int, nbytes2: int = 0) -> float:
        """Seconds of one copy of ``nbytes`` (and ``nbytes2`` the other way, for
        ``both``)."""
        assert direction in DIRECTIONS
        assert nbytes <= self.max_bytes and nbytes2 <= self.max_bytes
        t0 = time.perf_counter()
        self._once(direction, nbytes, nbytes2)
        return time.perf_counter() - t0

    def close(self) -> None:
        self._pool.shutdown()
        self._anon.clear()
        for mm in self._maps:
            mm.close()
        for s in self._segs:
            s.close()
