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


class L2Error(Exception):
    """A backend call failed; ``unavailable`` when the store could not be reached."""

    def __init__(self, message: str, unavailable: bool = True) -> None:
        super().__init__(message)
        self.unavailable = unavailable


class L2Backend(ABC):
    """One remote store. ``connect`` may be called again after a failure (reconnect)."""

    name: str

    @abstractmethod
    async def connect(self) -> None:
        """Open (or re-open) the connection and check the store answers."""

    @abstractmethod
    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The value of each key, ``None`` where absent (one batched round trip)."""

    @abstractmethod
    async def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        """Write every ``(key, value)``; batched (pipelined). Overwrites."""

    @abstractmethod
    async def close(self) -> None:
        """Release connections (a later ``connect`` reopens them). Idempotent."""

    async def shutdown(self) -> None:
        """Close for good: connections and any threads of the adapter."""
        await self.close()
