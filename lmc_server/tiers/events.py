"""The hook point for "a lower tier now holds / no longer holds this object".

Whoever needs to know (KV events for a router, an audit log) subscribes callables; the
tier calls them on the event loop, after the fact, with the tier's kind (``"disk"`` or
``"l2"``) and the L2 keys (:func:`lmc_server.tiers.codec.l2_key`: space + chunk key) of the
objects. ``stored`` fires once a write is complete (the object can be read back);
``removed`` when the tier deletes an object (``reason``: ``"evicted"`` for capacity,
``"missing"`` when a read found it gone, ``"invalid"`` when a read found it damaged).
Redis evicts on its own, unseen, so only ``stored`` fires for it. A callback that
raises is logged and does not stop the others or the tier.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)

StoredCallback = Callable[[str, Sequence[bytes]], None]
RemovedCallback = Callable[[str, Sequence[bytes], str], None]


class TierListeners:
    """Callbacks of one tier (event-loop thread only)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._stored: list[StoredCallback] = []
        self._removed: list[RemovedCallback] = []

    def subscribe(
        self, stored: StoredCallback | None = None, removed: RemovedCallback | None = None
    ) -> None:
        if stored is not None:
            self._stored.append(stored)
        if removed is not None:
            self._removed.append(removed)

    def stored(self, keys: Sequence[bytes]) -> None:
        for cb in self._stored:
            try:
                cb(self.kind, keys)
            except Exception:
                log.exception("a %s tier 'stored' listener failed", self.kind)

    def removed(self, keys: Sequence[bytes], reason: str) -> None:
        if not keys:
            return
        for cb in self._removed:
            try:
                cb(self.kind, keys, reason)
            except Exception:
                log.exception("a %s tier 'removed' listener failed", self.kind)
