"""The transfer-engine contract shared by the CPU and CUDA engines.

The server drives copies with :meth:`TransferEngine.submit`: it is called on the event
loop thread, starts the copy (plans and launches it, or hands it to the engine's own
threads) and returns at once; the engine later calls ``done(error)`` exactly once, from
whatever thread saw the copy finish, with ``""`` when every byte has landed. So a
request costs the event loop its planning and launch and one wake-up at completion,
with no thread-pool hop in between (the earlier contract ran a blocking call on a
server thread: two hops, each waiting for the GIL behind the loop). ``store`` and
``retrieve`` stay as blocking conveniences for tests and benchmarks.

``open``/``close`` of mappings come from the event loop thread. An engine never
touches the index: the caller commits objects only after ``done("")``, so a failed or
interrupted copy never becomes visible.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lmc_server.buffers import BufferSpec
from lmc_server.cache.layout import RunCopy
from lmc_server.errors import LmcError


class TransferError(LmcError, RuntimeError):
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


class BufferMapping(ABC):
    """One registration's buffers, mapped into the server for its lifetime."""

    device: DeviceInfo

    @abstractmethod
    def close(self) -> None:
        """Unmap everything. Idempotent."""


#: ``done(error)``: ``""`` when the copy completed, else why it failed (safe to send to
#: the client). Called exactly once per :meth:`TransferEngine.submit`.
DoneCallback = Callable[[str], None]


class TransferEngine(ABC):
    """Copies pages between mapped buffers and the pool."""

    name: str

    @property
    def fd_socket(self) -> str:
        """The abstract unix socket that takes shared-memory descriptors, named in the
        ``welcome`` ("": this engine takes none; see :mod:`.fd_inbox`)."""
        return ""

    @abstractmethod
    def create_pool(self, size_bytes: int, slab_bytes: int) -> HostPool: ...

    @abstractmethod
    def open(self, buffers: Sequence[BufferSpec]) -> BufferMapping:
        """Map a registration's buffers; raise :class:`TransferError` if impossible."""

    @abstractmethod
    def submit(
        self, mapping: BufferMapping, copies: Sequence[RunCopy], to_pool: bool, done: DoneCallback
    ) -> None:
        """Start copying pages into the pool (``to_pool``) or out of it; never blocks.

        Called on the event loop thread. Raises :class:`TransferError` only when
        nothing was started (then ``done`` is never called); otherwise ``done`` is
        called exactly once, from any thread, after every byte has landed (a store's
        objects may be committed; a retrieve's pages are visible to the worker) or
        with the reason the copy failed. A worker sends a store only after its writes
        to the pages are complete (protocol: ``Store``), so the copy starts at once.
        Blocks whose id is ``-1`` are left untouched.
        """

    def store(self, mapping: BufferMapping, copies: Sequence[RunCopy]) -> None:
        """Blocking store (tests, benchmarks): returns once every byte has landed."""
        self._blocking(mapping, copies, True)

    def retrieve(self, mapping: BufferMapping, copies: Sequence[RunCopy]) -> None:
        """Blocking retrieve (tests, benchmarks): returns once the pages are written."""
        self._blocking(mapping, copies, False)

    def _blocking(self, mapping: BufferMapping, copies: Sequence[RunCopy], to_pool: bool) -> None:
        finished = threading.Event()
        errors: list[str] = []

        def done(err: str) -> None:
            errors.append(err)
            finished.set()

        self.submit(mapping, copies, to_pool, done)
        finished.wait()
        if errors[0]:
            raise TransferError(errors[0])

    def stop_queued(self) -> None:
        """Shutdown, past the drain timeout: copies waiting for a copy thread or lane are
        not started (each reports an error through its ``done``); running copies finish.
        Irreversible. The default has nothing queued to stop."""
        return None

    @abstractmethod
    def close(self) -> None: ...
