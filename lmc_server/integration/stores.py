"""Which chunks of a request to store, and which stores to fence before a step.

Its own module because the store rule is the one place where a mistake serves wrong
bytes later: a store that reads a block after the engine rewrote it puts another
request's KV under this prefix's key. The planner
(:mod:`lmc_server.integration.planning`) calls :class:`StorePlanner` as steps are
scheduled and requests end.

Invariants:

* a store reads only whole chunks that are hashed and computed, and only blocks the
  engine holds at the step's computed tokens (blocks it may have freed are sent as
  ``-1``, :meth:`ChunkGeometry.block_ids`);
* a store completes before any block it reads can be written again, whatever the step
  boundaries. This is derived from the blocks vLLM may free while the request runs:
  sliding-window blocks that leave the window (:meth:`ChunkGeometry.freed_blocks`,
  vLLM's ``SlidingWindowManager`` rule) and every block of a preempted request. A store
  reading such a block is fenced (:attr:`StepPlan.fence_store_ids`) in the first step
  whose scheduling may free it, so the workers wait for it before that step's loads and
  forward pass;
* store ids are unique per planner and increase.
"""

from __future__ import annotations

from lmc_server.cache.keys import DIGEST_BYTES
from lmc_server.integration.chunks import ChunkGeometry
from lmc_server.integration.plans import StoreSpec
from lmc_server.integration.tracked import StoreInFlight, Tracked


class StorePlanner:
    """Store specs and fences for the requests of one scheduler."""

    def __init__(self, geometry: ChunkGeometry) -> None:
        self.geometry = geometry
        self._fences: set[int] = set()
        self._next_store_id = 1

    def take_fences(self) -> set[int]:
        """The stores to fence in the step being built; forgotten here."""
        fences, self._fences = self._fences, set()
        return fences

    def fence_freed(self, r: Tracked, computed_tokens: int | None) -> None:
        """Fence ``r``'s stores that read blocks the engine may free at
        ``computed_tokens`` (``None``: every block, a preemption)."""
        if not r.stores:
            return
        g = self.geometry
        keep = []
        for st in r.stores:
            hit = computed_tokens is None or any(
                g.freed_blocks(g.groups[gi], computed_tokens) > first
                for gi, first in st.first_window_block.items()
            )
            if hit:
                self._fences.add(st.store_id)
            else:
                keep.append(st)
        r.stores = keep

    def plan(self, r: Tracked, done: int, computed_tokens: int) -> StoreSpec | None:
        """A store of ``r``'s chunks ``stored_chunks..done`` (whole, hashed, computed),
        reading only blocks the engine holds at ``computed_tokens``."""
        g = self.geometry
        done = min(done, len(r.block_hashes) // g.hashes_per_chunk)
        if done <= r.stored_chunks or not r.blocks:
            return None
        first = r.stored_chunks
        ids = g.block_ids(r.blocks, first, done - first, computed_tokens=computed_tokens)
        events = (
            None
            if r.token_ids is None
            else g.store_events(r.block_hashes, r.token_ids, first, done - first)
        )
        spec = StoreSpec(
            req_id=r.req_id,
            first_chunk=first,
            digests=r.digests_for(g, done)[first * DIGEST_BYTES :],
            block_ids=ids,
            store_id=self._next_store_id,
            events=events,
        )
        self._next_store_id += 1
        r.stores = [
            *r.stores,
            StoreInFlight(spec.store_id, g.first_window_blocks(ids, first, done - first)),
        ]
        r.stored_chunks = done
        r.has_store = True
        return spec
