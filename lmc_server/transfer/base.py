"""The transfer-engine contract shared by the CPU and CUDA engines.

Threading: ``store``/``retrieve`` block until the copy is complete and are called from
worker threads, several at once; ``open``/``close`` of mappings come from the event
loop thread. An engine never touches the index: the caller commits objects only after
``store`` returned, so a failed or interrupted copy never becomes visible.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lmc_server.cache.geometry import BufferSpec
from lmc_server.cache.layout import RunCopy


class TransferError(RuntimeError):
    """A mapping or a copy failed; the message is safe to send to the client."""


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """What the engine knows about the device a registration's buffers live on."""

    arch: str | None
    description: str


class HostPool(ABC):
    """The L1 pool memory: ``n_slabs`` slabs of ``slab_bytes``, prepared in background.

    ``start`` prepares slabs (page-in, pinning) in order on a background thread and
    calls ``on_ready(slab)`` from that thread after each one; it must return at once.
    """

    def __init__(self, size_bytes: int, slab_bytes: int) -> None:
        self.slab_bytes = slab_bytes
        self.n_slabs = size_bytes // slab_bytes
        self.size_bytes = self.n_slabs * slab_bytes

    @abstractmethod
    def start(self, on_ready: Callable[[int], None]) -> None: ...

    @abstractmethod
    def read(self, offset: int, nbytes: int) -> bytes:
        """A copy of pool bytes (tests and diagnostics only)."""

    @abstractmethod
    def close(self) -> None:
        """Stop preparing slabs and release the memory. Idempotent."""


class Mapping(ABC):
    """One registration's buffers, mapped into the server for its lifetime."""

    device: DeviceInfo

    @abstractmethod
    def close(self) -> None:
        """Unmap everything. Idempotent."""


class TransferEngine(ABC):
    """Copies pages between mapped buffers and the pool."""

    name: str

    @abstractmethod
    def create_pool(self, size_bytes: int, slab_bytes: int) -> HostPool: ...

    @abstractmethod
    def open(self, buffers: Sequence[BufferSpec]) -> Mapping:
        """Map a registration's buffers; raise :class:`TransferError` if impossible."""

    @abstractmethod
    def store(self, mapping: Mapping, copies: Sequence[RunCopy]) -> None:
        """Copy pages into the pool; returns once every byte has landed.

        The worker sends a store only after its writes to the pages are complete
        (protocol: ``Store``), so the copy starts at once.
        """

    @abstractmethod
    def retrieve(self, mapping: Mapping, copies: Sequence[RunCopy]) -> None:
        """Copy pages from the pool; returns once every byte is visible to the worker.

        Blocks whose id is ``-1`` are left untouched.
        """

    @abstractmethod
    def close(self) -> None: ...
