"""The L2 backend contract: a remote key-value store, batched, asyncio.

An adapter moves opaque bytes under opaque keys; it knows nothing of the cache
(headers, checksums and namespaces are :mod:`lmc_server.l2.codec`'s job). Every method
runs on the server's event loop and must not block it: network IO is asyncio, or runs
on the adapter's own thread. Failures raise :class:`L2Error`; ``unavailable`` says the
store cannot be reached (the tier goes degraded and reconnects), otherwise the store
answered but refused (full, read-only): counted, the tier stays up.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from lmc_server.l2 import codec

#: A value as an adapter returns or takes it: ``bytes`` (Redis) or a view of a buffer
#: the adapter allocated (the disk tier's aligned buffers).
Value = bytes | memoryview


@dataclass(frozen=True, slots=True)
class SlotObject:
    """One L1 object to be written straight from its slot (:meth:`L2Backend.put_slots`).

    ``payload`` is a view of the L1 slot: valid only until the call that received it
    returns (the writer keeps the slot pinned until then, so eviction cannot reuse it).
    """

    key: bytes  # the L2 key
    space: bytes
    chunk_key: bytes
    mask: int
    payload: memoryview

    @property
    def value_bytes(self) -> int:
        return codec.HEADER_BYTES + len(self.payload)


class L2Error(Exception):
    """A backend call failed; ``unavailable`` when the store could not be reached."""

    def __init__(
        self, message: str, unavailable: bool = True, written: list[bytes] | None = None
    ) -> None:
        super().__init__(message)
        self.unavailable = unavailable
        #: A write of several objects that failed for some: the keys that were written
        #: all the same (the writer counts and announces those; empty: none).
        self.written: list[bytes] = written or []


class L2Backend(ABC):
    """One remote store. ``connect`` may be called again after a failure (reconnect)."""

    name: str
    #: ``True``: the writer hands whole batches of pinned L1 slots to :meth:`put_slots`,
    #: which builds and writes each value itself (the disk tier: the copy of one object
    #: overlaps the writes of others, with no barrier between building a batch and
    #: writing it). ``False``: the writer builds values with :meth:`encode` first and
    #: unpins before :meth:`put_many` (a network store, whose send copies anyway).
    writes_from_slots = False

    @abstractmethod
    async def connect(self) -> None:
        """Open (or re-open) the connection and check the store answers."""

    @abstractmethod
    async def get_many(self, keys: Sequence[bytes]) -> list[Value | None]:
        """The value of each key, ``None`` where absent (one batched round trip)."""

    @abstractmethod
    async def put_many(self, items: Sequence[tuple[bytes, Value]]) -> None:
        """Write every ``(key, value)``; batched (pipelined). Overwrites."""

    async def put_slots(self, objects: Sequence[SlotObject]) -> None:
        """Build and write every object's value from its slot (only called when
        :attr:`writes_from_slots`); raises :class:`L2Error` as :meth:`put_many` does."""
        raise NotImplementedError(f"{self.name} does not write from slots")

    def encode(self, space: bytes, chunk_key: bytes, mask: int, payload: memoryview) -> Value:
        """The value of one object, in the buffer this store writes best from (called on
        the tier's threads; the payload is an L1 slot, pinned meanwhile)."""
        return codec.encode_value(space, chunk_key, mask, payload)

    async def discard(self, keys: Sequence[bytes]) -> None:
        """Values under ``keys`` were found damaged; a store that can delete them may
        (the default leaves them: the next write replaces them)."""
        return None

    def release(self, values: Sequence[Value | None]) -> None:
        """The tier is done with these values from :meth:`get_many` (nothing reads them
        any more): an adapter that reuses its buffers may take them back."""
        return None

    def status(self) -> str:
        """A phrase for /healthz about work in progress (empty: nothing to say)."""
        return ""

    @abstractmethod
    async def close(self) -> None:
        """Release connections (a later ``connect`` reopens them). Idempotent."""

    async def shutdown(self) -> None:
        """Close for good: connections and any threads of the adapter."""
        await self.close()
