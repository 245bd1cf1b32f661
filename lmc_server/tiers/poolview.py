"""Zero-copy numpy views of L1 pool objects, for the L2 tier to read and fill.

The transfer engine owns the pool memory; the CPU pool is one mapping (``array``), the
CUDA pool pinned slabs (``slab_view``). An object never spans two slabs (a partition
carves whole slabs), so one view per object always exists. The null engine keeps no
bytes: the L2 tier refuses to start on it (:class:`PoolViewError`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from lmc_server.errors import LmcError
from lmc_server.transfer.base import HostPool


class PoolViewError(LmcError, RuntimeError):
    """The pool has no bytes to read or write (the null engine)."""


class PoolView:
    """``view(offset, nbytes)``: a writable uint8 view of pool bytes (no copy).

    Holds a reference to the pool's memory: :meth:`release` it before the pool is
    closed (an mmap with live views cannot be closed).
    """

    def __init__(self, pool: HostPool, backend: str) -> None:
        self._array: np.ndarray | None = None
        self._slab_view: Callable[[int], np.ndarray] | None = None
        self.slab_bytes = pool.slab_bytes
        array = getattr(pool, "array", None)
        slab_view = getattr(pool, "slab_view", None)
        if isinstance(array, np.ndarray):
            self._array = array
        elif callable(slab_view):
            self._slab_view = slab_view
        else:
            raise PoolViewError(
                f"--l2 needs pool memory to read objects from, and the "
                f"{backend} backend keeps none; run with --backend cpu or "
                f"cuda"
            )

    def __call__(self, offset: int, nbytes: int) -> np.ndarray:
        if self._array is not None:
            return self._array[offset : offset + nbytes]
        if self._slab_view is None:
            raise PoolViewError("the pool view was released (server shutting down)")
        slab, lo = divmod(offset, self.slab_bytes)
        assert lo + nbytes <= self.slab_bytes, "an object spans two slabs"
        return self._slab_view(slab)[lo : lo + nbytes]

    def release(self) -> None:
        self._array = None
        self._slab_view = None
