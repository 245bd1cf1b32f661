"""The requests that arrived since the planner last acted, admitted in one loop.

vLLM's scheduler announces every new request (``request_arrived``) before it asks how
much of any is cached. Noting an arrival is one list append; the arrivals are admitted
(tracked, their lookups queued to go out together,
:class:`~lmc_server.integration.lookups.StepLookups`) when the planner next acts, on the
same thread and before anything reads them. A step that takes 256 arrivals pays for
256 appends and one clock read instead of the bookkeeping's calls per request.

A lookup covers whole, hashed chunks and never the request's last token (the engine
must compute at least one token); a request that has a lookup queued, in flight or
answered gets none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lmc_server.integration.chunks import ChunkGeometry
from lmc_server.integration.lookups import StepLookups
from lmc_server.integration.tracked import Tracked


class Arrivals:
    """Arrivals noted (:meth:`note`), admitted into the planner's requests by
    :meth:`admit`."""

    def __init__(
        self, geometry: ChunkGeometry, lookups: StepLookups, clock: Callable[[], float]
    ) -> None:
        self.geometry = geometry
        self.lookups = lookups
        self.clock = clock
        #: (req_id, block hashes, tokens, prompt tokens) of each arrival not admitted yet
        #: (the planner reads it to skip a call when empty)
        self.noted: list[tuple[str, Sequence[bytes], int, int]] = []

    def note(
        self, req_id: str, block_hashes: Sequence[bytes], num_tokens: int, num_prompt_tokens: int
    ) -> None:
        self.noted.append((req_id, block_hashes, num_tokens, num_prompt_tokens))

    def admit(self, reqs: dict[str, Tracked]) -> None:
        """Track every arrival noted in ``reqs`` (req_id -> its state) and queue its
        lookup: one loop that makes each arrival's record and adds its lookup straight
        to the lists the service is handed (:class:`~.lookups.LookupRound`)."""
        if not self.noted:
            return
        arrived, self.noted = self.noted, []
        now = self.clock()
        cs, per = self.geometry.chunk_size, self.geometry.hashes_per_chunk
        rnd = self.lookups.next_round()  # StepLookups.queue, inlined: 256 calls fewer
        owners, hashes, chunks, known = rnd.owners, rnd.hashes, rnd.chunks, rnd.known
        for req_id, block_hashes, num_tokens, num_prompt_tokens in arrived:
            n = min(max(0, num_tokens - 1) // cs, len(block_hashes) // per)
            if n <= 0:
                continue
            r = reqs.get(req_id)
            if r is None:
                r = reqs[req_id] = Tracked(
                    req_id, block_hashes, num_prompt_tokens, None, rnd, len(chunks), n, now
                )
                hashes.append(block_hashes)
                known.append(b"")
            elif r.lookup is not None or r.answer is not None:
                continue
            else:
                r.lookup, r.lookup_index, r.lookup_chunks, r.lookup_at_s = rnd, len(chunks), n, now
                hashes.append(r.block_hashes)
                known.append(r.digests)
            owners.append(r)
            chunks.append(n)
