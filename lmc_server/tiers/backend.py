"""The L2 backend contract: a remote key-value store, batched, asyncio.

An adapter moves opaque bytes under opaque keys; it knows nothing of the cache
(headers, checksums and namespaces are :mod:`lmc_server.tiers.codec`'s job). Every method
runs on the server's event loop and must not block it: network IO is asyncio, or runs
on the adapter's own thread. Failures raise :class:`L2Error`; ``unavailable`` says the
store cannot be reached (the tier goes degraded and reconnects), otherwise the store
answered but refused (full, read-only): counted, the tier stays up.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from lmc_server.errors import LmcError
from lmc_server.tiers import codec

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


@dataclass(frozen=True, slots=True)
class SlotRead:
    """One value to be received straight into its reserved L1 slot
    (:meth:`L2Backend.get_into`).

    ``dest`` is a view of the slot (``object_bytes`` long), reserved WRITING by the
    prefetch, invisible, until the call that received it returned; ``mask`` is the
    section mask the reservation was made for (from the value's header, read ahead).
    """

    key: bytes  # the L2 key
    space: bytes
    chunk_key: bytes
    mask: int
    dest: memoryview

    @property
    def value_bytes(self) -> int:
        return codec.HEADER_BYTES + len(self.dest)


#: What :meth:`L2Backend.get_into` says of one value: ``True``, received into its slot
#: and verified (header, mask, checksum); ``None``, absent (or replaced by a value of
#: other sections since its header was read); an :class:`~lmc_server.tiers.codec.Invalid`,
#: refused for that reason. Only ``True`` may be committed.
ReadResult = bool | codec.Invalid | None
#: The start of a value, as :meth:`L2Backend.heads` returns it: its first bytes (at
#: most ``HEADER_BYTES``) and its length.
Head = tuple[bytes, int]


class L2Error(LmcError):
    """A backend call failed; ``unavailable`` when the store could not be reached."""

    def __init__(
        self,
        message: str,
        unavailable: bool = True,
        written: list[bytes] | None = None,
        dropped: str = "error",
    ) -> None:
        super().__init__(message)
        self.unavailable = unavailable
        #: A write of several objects that failed for some: the keys that were written
        #: all the same (the writer counts and announces those; empty: none).
        self.written: list[bytes] = written or []
        #: Why the objects not written were dropped (``dropped_writes{reason}``):
        #: ``error`` (also counted in ``errors{write}``) or ``full`` (the store holds
        #: its capacity and had nothing of this server's to evict: not an error).
        self.dropped = dropped


class L2Backend(ABC):
    """One remote store. ``connect`` may be called again after a failure (reconnect)."""

    name: str
    #: ``True``: the writer hands whole batches of pinned L1 slots to :meth:`put_slots`,
    #: which builds and writes each value itself (the disk tier: the copy of one object
    #: overlaps the writes of others, with no barrier between building a batch and
    #: writing it). ``False``: the writer builds values with :meth:`encode` first and
    #: unpins before :meth:`put_many` (a network store, whose send copies anyway).
    writes_from_slots = False

    @property
    def write_shards(self) -> int:
        """Stores of its own that this backend writes to side by side (a cluster's
        primaries): the writer keeps ``SLOT_BATCHES_IN_FLIGHT`` batches in flight per
        shard. A batch spread over the shards by key ends with its most loaded shard;
        with one store's batches in flight, the other shards wait for it at each one."""
        return 1

    @abstractmethod
    async def connect(self) -> None:
        """Open (or re-open) the connection and check the store answers."""

    #: ``True``: prefetches read headers first (:meth:`heads`), reserve L1 slots for
    #: the values worth reading, and have the adapter receive each value into its slot
    #: (:meth:`get_into`) instead of :meth:`get_many` (no copy of its own).
    reads_into_slots = False

    async def heads(self, keys: Sequence[bytes]) -> list[Head | None]:
        """The first bytes and length of each key's value, ``None`` where absent (only
        called when :attr:`reads_into_slots`)."""
        raise NotImplementedError(f"{self.name} does not read into slots")

    async def get_into(self, reads: Sequence[SlotRead]) -> list[ReadResult]:
        """Receive each value into its slot and verify it (see :data:`ReadResult`).
        Returns, or raises :class:`L2Error`, only once nothing writes to any ``dest``
        any more (also when cancelled: it waits for its threads, then re-raises)."""
        raise NotImplementedError(f"{self.name} does not read into slots")

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
