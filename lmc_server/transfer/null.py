"""The null transfer engine: full server bookkeeping, no bytes moved (benchmarks only).

Trace replays measure hit ratios of the index and eviction policies at L1 sizes of
hundreds of GiB; copying the bytes would only slow them down. With ``--backend null``
the pool is address space that is never touched, registrations map nothing, and copies
return at once: every lookup, lease, store, eviction and counter behaves as on a real
engine, but retrieved blocks hold whatever they held before. Never use it to serve an
engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lmc_server.buffers import BufferSpec
from lmc_server.cache.layout import RunCopy
from lmc_server.transfer.base import (
    BufferMapping,
    DeviceInfo,
    DoneCallback,
    HostPool,
    TransferEngine,
)


class NullHostPool(HostPool):
    """No memory at all; every slab is ready at once."""

    def start(self, on_ready: Callable[[int], None]) -> None:
        for slab in range(self.n_slabs):
            on_ready(slab)

    def read(self, offset: int, nbytes: int) -> bytes:
        return bytes(nbytes)

    def close(self) -> None:
        pass


class NullMapping(BufferMapping):
    def __init__(self) -> None:
        self.device = DeviceInfo(arch=None, description="null (no memory)")

    def close(self) -> None:
        pass


class NullEngine(TransferEngine):
    name = "null"

    def create_pool(self, size_bytes: int, slab_bytes: int) -> HostPool:
        return NullHostPool(size_bytes, slab_bytes)

    def open(self, buffers: Sequence[BufferSpec]) -> BufferMapping:
        return NullMapping()

    def submit(
        self, mapping: BufferMapping, copies: Sequence[RunCopy], to_pool: bool, done: DoneCallback
    ) -> None:
        done("")

    def close(self) -> None:
        pass
