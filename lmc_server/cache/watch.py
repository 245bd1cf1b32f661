"""What the index tells a watcher of a partition's objects (the KV-event publisher)."""

from __future__ import annotations

from typing import Protocol


class SlotWatcher(Protocol):
    """Told when an object of a watched partition becomes visible and when it goes.

    Called on the thread that drives the index (the event loop), inside the index
    operation, with the object's index key: it must not call back into the index.
    Watch a partition with :meth:`~lmc_server.cache.index.L1Index.watch`.
    """

    def visible(self, key: bytes) -> None: ...

    def gone(self, key: bytes) -> None: ...
