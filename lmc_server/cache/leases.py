"""Leases: time-limited read pins that a lookup takes on the chunks it reported.

A lease id is a random 64-bit capability: whoever holds it (the scheduler that looked
up, or a worker it handed the id to) may release it. The table pins each object once
per lease and unpins exactly once, whichever comes first: explicit release, expiry, or
the death of the session that took it. Expiry uses a heap of ``(deadline, id)`` with
lazy deletion, so taking and releasing a lease is O(log n) and expiring is amortized.
"""

from __future__ import annotations

import heapq
import secrets
from array import array
from dataclasses import dataclass, field

from lmc_server.cache.pool import Partition


@dataclass(slots=True)
class Lease:
    """Pins held by one lookup. ``pins`` lists ``(partition, slots)`` pairs."""

    lease_id: int
    owner: int
    deadline_s: float
    chunks: int
    pins: list[tuple[Partition, array]] = field(default_factory=list)


class LeaseTable:
    """All live leases; the only code that pins on behalf of a lookup."""

    def __init__(self) -> None:
        self._leases: dict[int, Lease] = {}
        self._deadlines: list[tuple[float, int]] = []
        self._by_owner: dict[int, set[int]] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, lease_id: int) -> bool:
        return lease_id in self._leases

    def get(self, lease_id: int) -> Lease | None:
        return self._leases.get(lease_id)

    def take(
        self, owner: int, deadline_s: float, chunks: int, pins: list[tuple[Partition, array]]
    ) -> Lease:
        """Pin every listed slot and record the lease under a fresh random id."""
        lease_id = secrets.randbits(63) or 1
        while lease_id in self._leases:
            lease_id = secrets.randbits(63) or 1
        for part, slots in pins:
            part.pin_many(slots)
        lease = Lease(lease_id, owner, deadline_s, chunks, pins)
        self._leases[lease_id] = lease
        heapq.heappush(self._deadlines, (deadline_s, lease_id))
        self._by_owner.setdefault(owner, set()).add(lease_id)
        return lease

    def release(self, lease_id: int) -> Lease | None:
        """Unpin and forget a lease; ``None`` if it does not exist (any more)."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return None
        for part, slots in lease.pins:
            part.unpin_many(slots)  # last to first: chunk 0 ends most recent
        owned = self._by_owner.get(lease.owner)
        if owned is not None:
            owned.discard(lease_id)
            if not owned:
                del self._by_owner[lease.owner]
        return lease

    def expire(self, now_s: float) -> list[Lease]:
        """Release every lease whose deadline passed; returns them."""
        out: list[Lease] = []
        while self._deadlines and self._deadlines[0][0] <= now_s:
            _, lease_id = heapq.heappop(self._deadlines)
            lease = self._leases.get(lease_id)
            if lease is not None and lease.deadline_s <= now_s:
                released = self.release(lease_id)
                assert released is not None
                out.append(released)
        if len(self._deadlines) > 4 * len(self._leases) + 64:
            self._deadlines = [(lease.deadline_s, i) for i, lease in self._leases.items()]
            heapq.heapify(self._deadlines)
        return out

    def release_owner(self, owner: int) -> int:
        """Release every lease taken by ``owner`` (a session that went away)."""
        ids = list(self._by_owner.get(owner, ()))
        for lease_id in ids:
            self.release(lease_id)
        return len(ids)
