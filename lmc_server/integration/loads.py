"""The loads of one engine step: queued as the engine allocates, planned together.

Its own module for the same reason as :mod:`lmc_server.integration.stores`: which
blocks a load writes is where a mistake would put one prefix's KV into another
request's blocks. The planner (:mod:`lmc_server.integration.planning`) queues a load
when the engine allocated blocks for a hit (:meth:`LoadPlanner.queue`) and takes the
step's loads when it builds the step (:meth:`LoadPlanner.take`).

Invariants:

* a load reads only chunks its own lease covers (the lease of the lookup answer the hit
  came from) and writes only chunks ``0..n`` of its request's block tables, as they
  were when the engine allocated them: the planner keeps a request's tables unchanged
  between :meth:`~LoadPlanner.queue` and :meth:`~LoadPlanner.take` (only the step that
  takes the loads extends them, after);
* blocks the engine's own prefix cache holds (``keep_tokens``), vLLM's null block and
  blocks past a table's end are sent as ``-1`` (never written), exactly as
  :meth:`~lmc_server.integration.chunks.ChunkGeometry.block_ids` has them: the step's
  loads share one array per group (:meth:`~ChunkGeometry.load_block_ids`), each load's
  ids a view of its own slice, so a step that takes 256 hits pays for a few numpy calls,
  not hundreds.
"""

from __future__ import annotations

from lmc_server.cache.keys import DIGEST_BYTES
from lmc_server.integration.chunks import ChunkGeometry
from lmc_server.integration.plans import LoadSpec
from lmc_server.integration.tracked import Tracked

__all__ = ["LoadPlanner"]


class LoadPlanner:
    """The loads queued since the last step."""

    def __init__(self, geometry: ChunkGeometry) -> None:
        self.geometry = geometry
        #: (request, chunks, tokens the engine holds, lease) per queued load
        self._queued: list[tuple[Tracked, int, int, int]] = []

    def queue(self, r: Tracked, n_chunks: int, keep_tokens: int) -> None:
        """Load chunks ``0..n_chunks`` of ``r`` into its blocks (``r.blocks``) under its
        lease, except the blocks below ``keep_tokens``, with the next step."""
        self._queued.append((r, n_chunks, keep_tokens, r.lease_id))

    def take(self) -> list[LoadSpec]:
        """Every queued load, planned: each request's digests (hashed once, usually by
        its lookup already) and block ids (one array per group for all of them)."""
        queued, self._queued = self._queued, []
        if not queued:
            return []
        g = self.geometry
        ids = g.load_block_ids([(r.blocks, n, keep) for r, n, keep, _ in queued])
        out = []
        for (r, n, _, lease_id), block_ids in zip(queued, ids, strict=True):
            digests = r.digests
            if len(digests) != n * DIGEST_BYTES:  # else exactly the load's, as usual
                digests = r.digests_for(g, n)
            out.append(LoadSpec(r.req_id, digests, block_ids, lease_id))
        return out
