"""The requests that arrived since the planner last acted, admitted in one loop.

vLLM's scheduler announces every new request (``request_arrived``) before it asks how
much of any is cached. Noting an arrival is one list append; the arrivals are admitted
(tracked, their lookups queued to go out together,
:class:`~lmc_server.integration.lookups.StepLookups`) when the planner next acts, on the
same thread and before anything reads them. A step that takes 256 arrivals pays for
256 appends, one clock read and a few C-level passes over them (the chunk counts, the
records, the lookup lists), not a loop's bytecode per request.

A lookup covers whole, hashed chunks and never the request's last token (the engine
must compute at least one token); a request that has a lookup queued, in flight or
answered gets none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import repeat
from operator import floordiv, sub

from lmc_server.integration.chunks import ChunkGeometry
from lmc_server.integration.lookups import StepLookups
from lmc_server.integration.tracked import Tracked


class Arrivals:
    """Arrivals noted (the planner appends to :attr:`noted`), admitted into the
    planner's requests by :meth:`admit`."""

    def __init__(
        self, geometry: ChunkGeometry, lookups: StepLookups, clock: Callable[[], float]
    ) -> None:
        self.geometry = geometry
        self.lookups = lookups
        self.clock = clock
        #: (req_id, block hashes, tokens, prompt tokens) of each arrival not admitted yet
        #: (the planner appends to it, and reads it to skip a call when empty)
        self.noted: list[tuple[str, Sequence[bytes], int, int]] = []

    def admit(self, reqs: dict[str, Tracked]) -> None:
        """Track every arrival noted in ``reqs`` (req_id -> its state) and queue its
        lookup, adding it straight to the lists the service is handed
        (:class:`~.lookups.LookupRound`): in one pass of C-level calls over the step's
        arrivals when each is new, distinct and has a chunk to look up (the usual
        case), else one loop that skips those that are not."""
        if not self.noted:
            return
        arrived, self.noted = self.noted, []
        now = self.clock()
        cs, per = self.geometry.chunk_size, self.geometry.hashes_per_chunk
        rnd = self.lookups.next_round()  # StepLookups.queue, inlined: 256 calls fewer
        owners, hashes, chunks, known = rnd.owners, rnd.hashes, rnd.chunks, rnd.known
        ids, their_hashes, tokens, prompts = zip(*arrived, strict=True)
        # a lookup covers whole, hashed chunks and never the last token
        ns = list(
            map(
                min,
                map(floordiv, map(sub, tokens, repeat(1)), repeat(cs)),
                map(floordiv, map(len, their_hashes), repeat(per)),
            )
        )
        if min(ns) > 0 and len(set(ids)) == len(ids) and reqs.keys().isdisjoint(ids):
            at = len(chunks)
            fresh = list(
                map(
                    Tracked,
                    ids,
                    their_hashes,
                    prompts,
                    repeat(None),
                    repeat(rnd),
                    range(at, at + len(ids)),
                    ns,
                    repeat(now),
                )
            )
            reqs.update(zip(ids, fresh, strict=True))
            owners += fresh
            hashes += their_hashes
            chunks += ns
            known += repeat(b"", len(ids))
            return
        for req_id, block_hashes, n, num_prompt_tokens in zip(
            ids, their_hashes, ns, prompts, strict=True
        ):
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
