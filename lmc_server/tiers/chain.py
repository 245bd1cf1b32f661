"""The tiers below L1, in order: the local disk tier, then the shared L2 store.

Each tier is optional; with both, the order is L1 -> disk -> L2 (Redis/Valkey or
Mooncake). The server holds one :class:`TierChain` and calls it at the same two points
it called the L2 tier: after a commit and after a lookup that hit less than it asked.

- **Writes**: at commit, every tier queues the committed objects (its own bounded
  queue: a slow L2 never makes the disk drop writes, nor the other way round).
- **Lookups**: the first tier (from the top) that takes the continuation prefetches
  it, and the lookup reports its pending chunks. Where that tier runs out (a miss, a
  damaged value), the next tier is asked at once for the rest (``fallthrough``), so a
  prefix half on disk and half in L2 costs one poll more than one wholly on disk, not
  one per tier per poll.
- **Promotion**: objects a lower tier brought into L1 are queued for the tiers above it
  (an L2 hit is written to the disk tier), so the next miss of L1 finds them on the
  local disk; they are never written back to the tier they came from.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from lmc_server.cache.index import Reservation, StoreTicket
from lmc_server.cache.view import CacheView
from lmc_server.tiers.tier import L2Tier


class TierChain:
    """The ordered lower tiers (see the module docstring). Event-loop thread only."""

    def __init__(self, tiers: list[L2Tier]) -> None:
        assert tiers, "a chain has at least one tier"
        self.tiers = tiers
        for upper, lower in zip(tiers, tiers[1:], strict=False):
            upper.prefetcher.fallthrough = lower.prefetcher.start
        for i, tier in enumerate(tiers):
            if i:
                tier.prefetcher.on_filled = self._promoter(tiers[:i])

    @staticmethod
    def _promoter(above: list[L2Tier]) -> Callable[[str, Reservation], None]:
        def promote(namespace: str, objects: Reservation) -> None:
            for tier in above:
                tier.writer.enqueue_objects(namespace, objects)

        return promote

    def tier(self, kind: str) -> L2Tier | None:
        return next((t for t in self.tiers if t.kind == kind), None)

    # -- hooks (event loop) ----------------------------------------------------------

    def on_commit(self, namespace: str, ticket: StoreTicket) -> None:
        for tier in self.tiers:
            tier.on_commit(namespace, ticket)

    def on_lookup(self, view: CacheView, namespace: str, keys: list[bytes], hit: int) -> int:
        """Chunks now being fetched by the first tier that takes the continuation."""
        for tier in self.tiers:
            pending = tier.on_lookup(view, namespace, keys, hit)
            if pending:
                return pending
        return 0

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        for tier in self.tiers:
            tier.start()

    async def stop(self, drain_s: float = 0.0) -> None:
        """Write out every tier's queue, side by side, for at most ``drain_s``; then
        stop the tiers top down: a prefetch of an upper tier may still start one below
        it (which then waits for it), never the other way round."""
        if drain_s > 0:
            await asyncio.gather(*(t.drain(drain_s) for t in self.tiers))
        for tier in self.tiers:
            await tier.stop()

    def health(self) -> str:
        return ", ".join(t.health() for t in self.tiers)
