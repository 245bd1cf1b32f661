"""What the scheduler-side connector remembers of one engine request.

The planner (:mod:`lmc_server.integration.planning`) keeps one :class:`Tracked` per
request it has looked up, loaded or stored, from its first question to the workers'
last report; the store planning (:mod:`lmc_server.integration.stores`) reads and
updates the store fields. A plain record with no behaviour beyond its digest cache, so
either module can be read without the other's internals.

Invariants:

* ``digests`` is a prefix of the request's chunk digests: the engine's block hashes of
  a chunk never change once the block is full, so a digest computed once is never
  recomputed (:meth:`Tracked.digests_for`); those the link's thread hashed for a
  lookup are adopted when its answer is read (:meth:`Tracked.adopt_digests`);
* ``block_hashes`` and ``token_ids`` are the engine's live lists, read, never written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lmc_server.cache.keys import DIGEST_BYTES
from lmc_server.integration.chunks import ChunkGeometry
from lmc_server.integration.lookups import LookupRound
from lmc_server.integration.plans import LookupAnswer


@dataclass(slots=True, eq=False)
class StoreInFlight:
    """A store in flight as the scheduler sees it: per window engine group, the
    lowest block index (in the request's table) it reads."""

    store_id: int
    first_window_block: dict[int, int]


@dataclass(slots=True, eq=False)
class Tracked:
    req_id: str
    block_hashes: Sequence[bytes]
    num_prompt_tokens: int
    #: the request's tokens (the engine's live list) when its stores carry KV-event
    #: fields, else None
    token_ids: Sequence[int] | None = None
    #: the round its lookup is queued in (``lookup.answers`` None) or was sent with,
    #: and which of its lookups (two fields, not an object per request); None: no
    #: lookup queued or in flight
    lookup: LookupRound | None = None
    lookup_index: int = 0
    lookup_chunks: int = 0
    lookup_at_s: float = 0.0
    #: chunk digests computed so far (a prefix of the request's; they never change)
    digests: bytes = b""
    #: the lookup in flight was answered "ask again" at least once
    asked_again: bool = False
    answer: LookupAnswer | None = None
    lease_id: int = 0
    #: when the first answer with L2 chunks pending came (None: not waiting for L2)
    l2_wait_from: float | None = None
    loading: bool = False
    stored_chunks: int = 0
    has_store: bool = False
    ended: bool = False
    local_tokens: int = 0
    computed_tokens: int = 0
    #: the engine's block table per group (empty until allocated) and the stores in
    #: flight: ``()`` until there are some, so that an arrival allocates one object
    #: (allocations drive the cyclic collector, whose collections run in whichever
    #: hook allocates; in vLLM's heap one costs about 0.7 ms)
    blocks: Sequence[list[int]] = ()
    stores: Sequence[StoreInFlight] = ()

    @property
    def lookup_unanswered(self) -> bool:
        """A lookup is queued or in flight and not answered yet."""
        rnd = self.lookup
        return rnd is not None and (
            rnd.answers is None or rnd.answers.get(self.lookup_index) is None
        )

    def adopt_digests(self) -> None:
        """Take the digests the lookup service hashed for this request's lookup, if it
        has and they go further than those known (they are the same bytes:
        :meth:`ChunkGeometry.digests` of the same hashes)."""
        rnd = self.lookup
        if rnd is None or rnd.answers is None:
            return
        done = rnd.done[self.lookup_index]
        if done is not None and len(done) > len(self.digests):
            self.digests = done

    def digests_for(self, geometry: ChunkGeometry, n_chunks: int) -> bytes:
        """The first ``n_chunks`` chunk digests, each hashed once per request."""
        self.digests = geometry.digests(self.block_hashes, n_chunks, self.digests)
        return self.digests[: n_chunks * DIGEST_BYTES]
