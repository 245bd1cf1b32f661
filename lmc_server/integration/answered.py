"""The step's lookup answers, settled in one pass as they come, so that each question
is a dictionary hit.

vLLM asks about each waiting request in turn (``get_num_new_matched_tokens``); in the
step that takes 256 arrivals their answers land in a few parts of one
:class:`~lmc_server.integration.plans.LookupBatch`. When a question reads an answer,
:meth:`Answered.settle` takes every answer of that round set since it last looked
(the batch's ``order``, each index once) and does for each what reading it at its own
question would do: the request keeps the answer and its lease, adopts the digests the
link's thread hashed, and its matched tokens are noted by request id
(:attr:`Answered.by_req`). The planner's question then pops the entry and returns it
(:meth:`~lmc_server.integration.planning.SchedulerPlanner.matched_tokens`).

Invariants:

* an entry is exactly what the question would have computed from the same answer
  when the engine holds none of the prompt (``num_computed_tokens == 0``): whole
  chunks, at most the lookup's chunk count (never the last token); a question that
  finds the entry under other conditions (tokens held by the engine, another chunk
  count, KV events to attach) drops it and takes the general path, which reads the
  same answer kept on the request;
* only a request whose lookup is still that round's lookup at that index is settled
  (not one dropped or looked up again since), and only a plain answer: a failed lookup
  or one with chunks pending from L2 is left to its question;
* a settled miss has its lease (if any) released at once, as its question would;
* entries live for one engine step (:meth:`Answered.new_step`), so a lease's age is
  checked again by a question in a later step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from lmc_server.integration.lookups import LookupRound
from lmc_server.integration.plans import LookupAnswer
from lmc_server.integration.tracked import Tracked

__all__ = ["Answered"]

logger = logging.getLogger(__name__)

#: an entry packs the matched tokens above :data:`_CHUNK_BITS` and the lookup's chunk
#: count below (an int, not a tuple: no object per request)
_CHUNK_BITS = 32
_CHUNK_MASK = (1 << _CHUNK_BITS) - 1


class Answered:
    """The answers settled in this step, by request id; ``at_once`` counts those
    settled before their request was ever answered "ask again"."""

    def __init__(
        self, chunk_size: int, hashes_per_chunk: int, release: Callable[[int], None]
    ) -> None:
        self.chunk_size = chunk_size
        self.hashes_per_chunk = hashes_per_chunk
        self.release = release
        #: request id -> matched tokens << 32 | the lookup's chunk count
        self.by_req: dict[str, int] = {}
        self.at_once = 0

    def new_step(self) -> None:
        self.by_req.clear()

    def pop(
        self, req_id: str, num_tokens: int, num_hashes: int, num_computed_tokens: int
    ) -> int | None:
        """The matched tokens settled for ``req_id``, if any and the question is the
        one they were settled for (the engine holds none of the prompt, the same chunk
        count); None: ask the general way. The entry goes either way."""
        got = self.by_req.pop(req_id, None)
        if got is None or num_computed_tokens:
            return None
        n = min((num_tokens - 1) // self.chunk_size, num_hashes // self.hashes_per_chunk)
        return got >> _CHUNK_BITS if got & _CHUNK_MASK == n else None

    def take(self, r: Tracked, rnd: LookupRound, i: int, got: object) -> LookupAnswer:
        """``r`` reads its own lookup (``i`` of ``rnd``), answered ``got`` (an error
        reads as no hit): it adopts the digests hashed for it, its lookup is done, and
        the others of the round that are in are settled (:meth:`settle`)."""
        if not r.asked_again:
            self.at_once += 1
        r.asked_again = False
        d = rnd.done[i]  # Tracked.adopt_digests, inlined
        if d is not None and len(d) > len(r.digests):
            r.digests = d
        r.lookup = None
        self.settle(rnd)
        if isinstance(got, LookupAnswer):
            return got
        logger.warning("lookup for request %s failed: %s", r.req_id, got)
        return LookupAnswer(0, 0, 0.0)

    def settle(self, rnd: LookupRound) -> None:
        """Settle every answer of ``rnd`` set since the last call (see the module)."""
        answers = rnd.answers
        assert answers is not None, "settled once sent"
        order = answers.order
        at, end = rnd.settled, len(order)
        if at == end:
            return
        rnd.settled = end
        owners, slots, done = rnd.owners, answers.slots, rnd.done
        by_req, cs, at_once = self.by_req, self.chunk_size, 0
        for i in order[at:end]:
            r: Tracked = owners[i]  # type: ignore[assignment]
            got = slots[i]
            if (
                r.lookup is not rnd
                or r.lookup_index != i
                or got.__class__ is not LookupAnswer
                or r.local_tokens
            ):
                continue
            assert isinstance(got, LookupAnswer)
            if got.l2_pending_chunks:
                continue
            d = done[i]
            if d is not None and len(d) > len(r.digests):
                r.digests = d
            r.lookup = None
            r.l2_wait_from = None
            if not r.asked_again:
                at_once += 1
            r.asked_again = False
            r.answer = got
            hit, n = got.hit_chunks, r.lookup_chunks
            m = (hit if hit < n else n) * cs
            if m:
                r.lease_id = got.lease_id
            elif got.lease_id:
                self.release(got.lease_id)
                r.lease_id = 0
            by_req[r.req_id] = m << _CHUNK_BITS | n
        self.at_once += at_once
        if end >= len(owners):  # every slot set: the owners are not needed any more
            rnd.owners = []
