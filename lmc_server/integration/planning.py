"""Scheduler-side connector planning: what to look up, load and store, given engine state.

This module knows nothing about vLLM's classes; the adapter
(:mod:`lmc_server.integration.vllm.connector`) maps vLLM's requests, block tables and
scheduler outputs onto these calls, so the logic is tested in CI without vLLM.

Invariants:

* a lookup blocks the caller at most ``lookup_wait_s`` per engine step in all
  (:class:`~lmc_server.integration.lookups.StepLookups`):
  :meth:`SchedulerPlanner.matched_tokens` returns ``None`` ("ask again") while the
  server's answer is in flight past that;
* an answer whose hit stops short while the server is still bringing the continuation
  in from its L2 tier (``l2_pending_chunks > 0``) is set aside, its lease released at
  once, and ``None`` returned: the next call looks up again. Waiting ends when an
  answer has nothing pending, or ``l2_wait_s`` after the first such answer, and the
  hit of that answer is used with that answer's lease: a load only ever reads chunks
  its own lease covers;
* matched tokens are whole chunks and never include the request's last token (the
  engine must compute at least one token to sample the next);
* a load never rewrites blocks the engine's own prefix cache already holds: their ids
  are sent as ``-1``;
* every lease is released exactly once: when every worker reported the load finished,
  when the request ends first (as the answer comes, if it was still in flight), or
  when the hit turned out useless; an unused lease older than half its TTL is
  refreshed by a new lookup;
* a request that had a store planned is held (blocks not freed) until the workers
  report its stores finished;
* a store completes before any block it reads can be written again
  (:mod:`lmc_server.integration.stores`, which plans stores and their fences);
* what the server lacks is stored, per the lookup: chunks the engine holds in its own
  prefix cache are stored again when the server did not report them (evicted, server
  restarted); without a lookup answer every whole chunk is offered (the server answers
  ``exists`` for those it has, without copying).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from lmc_server.integration.answered import Answered
from lmc_server.integration.arrivals import Arrivals
from lmc_server.integration.chunks import ChunkGeometry
from lmc_server.integration.loads import LoadPlanner
from lmc_server.integration.lookups import L2Waits, LookupRound, StepLookups
from lmc_server.integration.plans import (
    LookupService,
    ScheduledRequest,
    StepPlan,
    StoreSpec,
)
from lmc_server.integration.stores import StorePlanner
from lmc_server.integration.tracked import Tracked

logger = logging.getLogger(__name__)

__all__ = ["SchedulerPlanner"]


class SchedulerPlanner:
    """Per-request lookup, load and store state of the scheduler-side connector.

    ``store_generated``: also store whole chunks of generated tokens (a conversation's
    next turn holds them in its prompt); otherwise prompt chunks only.

    ``l2_wait_s``: how long a request may wait (answering "ask again") for chunks the
    server reports coming from its L2 tier, from the first answer that reported them;
    0: never wait, use the L1 hit at once (:attr:`l2`, an :class:`L2Waits`, counts
    the answers set aside and the waits that ended at the bound).

    ``lookup_wait_s``: how long the scheduler thread may wait for lookup answers in
    one engine step, over all its requests (0: never; the first call then answers "ask
    again"); the step's arrivals' lookups go out together (:class:`StepLookups`).
    ``lookup_wait_used_s`` sums the time waited, ``lookups_answered_at_once`` counts
    answers in within the budget at a request's first call.
    """

    def __init__(
        self,
        geometry: ChunkGeometry,
        service: LookupService,
        clock: Callable[[], float] = time.monotonic,
        store: bool = True,
        load: bool = True,
        store_generated: bool = True,
        l2_wait_s: float = 0.05,
        lookup_wait_s: float = 0.0,
    ) -> None:
        self.l2 = L2Waits(geometry.chunk_size, l2_wait_s)
        self.lookups = StepLookups(service, lookup_wait_s, geometry)
        self.answered = Answered(geometry.chunk_size, geometry.hashes_per_chunk, service.release)
        self.geometry = geometry
        self._cs, self._per = geometry.chunk_size, geometry.hashes_per_chunk
        self.service = service
        self.clock = clock
        self.store_enabled = store
        self.load_enabled = load
        self.store_generated = store_generated
        self._reqs: dict[str, Tracked] = {}
        self._arrivals = Arrivals(geometry, self.lookups, clock)
        self._loads = LoadPlanner(geometry)
        self._pending_stores: list[StoreSpec] = []
        self._stores = StorePlanner(geometry)

    def _release(self, r: Tracked) -> None:
        if r.lease_id:
            self.service.release(r.lease_id)
            r.lease_id = 0

    @property
    def lookup_wait_used_s(self) -> float:
        return self.lookups.waited_s

    @property
    def lookups_answered_at_once(self) -> int:
        return self.answered.at_once

    @property
    def tracked(self) -> int:
        self._admit()
        return len(self._reqs)

    @property
    def lookups_in_flight(self) -> int:
        """Lookups sent or queued to go out, not answered yet."""
        self._admit()
        return sum(1 for r in self._reqs.values() if r.lookup_unanswered)

    def _storable_chunks(self, r: Tracked, tokens: int) -> int:
        """Whole chunks of ``r``'s first ``tokens`` tokens it may store (of its prompt
        only, unless ``store_generated``)."""
        limit = tokens if self.store_generated else min(tokens, r.num_prompt_tokens)
        return limit // self.geometry.chunk_size

    def _drop_lookup(self, r: Tracked) -> None:
        """Forget ``r``'s queued or unanswered lookup; its lease goes back on answer."""
        r.asked_again = False
        if r.lookup is not None:
            self.lookups.drop(r)

    # -- scheduler hooks ----------------------------------------------------------------

    def request_arrived(
        self, req_id: str, block_hashes: Sequence[bytes], num_tokens: int, num_prompt_tokens: int
    ) -> None:
        """A new request: queue its lookup to go out with the others of this step
        (noted now, admitted when the planner next acts: :mod:`.arrivals`)."""
        if self.load_enabled:  # Arrivals.note, inlined: one call fewer per arrival
            self._arrivals.noted.append((req_id, block_hashes, num_tokens, num_prompt_tokens))

    def _admit(self) -> None:
        self._arrivals.admit(self._reqs)

    def matched_tokens(
        self,
        req_id: str,
        block_hashes: Sequence[bytes],
        num_tokens: int,
        num_prompt_tokens: int,
        num_computed_tokens: int,
        token_ids: Sequence[int] | None = None,
    ) -> int | None:
        """Tokens beyond ``num_computed_tokens`` the server can supply; ``None``: ask again.

        Idempotent while the answer stands: calling it again returns the same count.
        Waits for the answer within the step's budget (``lookup_wait_s``); reading one
        answer settles the others of its round that are in (:mod:`.answered`), so
        their questions are one dictionary pop. ``token_ids`` (the request's tokens, a
        live list): its stores carry KV-event fields (``StoreSpec.events``); None:
        they do not.
        """
        if self.answered.by_req:  # settled: one pop (else popped, the general path)
            m = self.answered.pop(req_id, num_tokens, len(block_hashes), num_computed_tokens)
            if m is not None and token_ids is None:
                return m
        if self._arrivals.noted:  # the step's first question: admit and send the arrivals
            self._arrivals.admit(self._reqs)
        lookups = self.lookups
        if lookups.round is not None:
            lookups.flush()
        r = self._reqs.get(req_id)
        if r is None:
            r = self._reqs[req_id] = Tracked(req_id, block_hashes, num_prompt_tokens, token_ids)
        elif r.token_ids is None and token_ids is not None:  # admitted from an arrival
            r.token_ids = token_ids
        r.local_tokens = num_computed_tokens
        if not self.load_enabled or r.loading:
            return 0
        cs = self._cs  # n = geometry.max_chunks(...), inlined (n < 0: no token to load)
        n, hashed = (num_tokens - 1) // cs, len(block_hashes) // self._per
        if hashed < n:
            n = hashed
        if n * cs <= num_computed_tokens:
            self._drop_lookup(r)
            return 0
        rnd = r.lookup
        if rnd is None or r.lookup_chunks != n or r.answer is not None:
            # not the common case (an arrival's lookup in flight or answered): a lookup
            # to send, a stale one to drop, an answer to keep or refresh
            rnd = self._lookup_for(r, n)
        if rnd is not None:
            answers, i = rnd.answers, r.lookup_index
            assert answers is not None, "sent above"
            got = answers.slots[i]  # LookupBatch.get, inlined: the usual case, answered
            if got is None:
                got = answers.get(i)  # or failed as a whole
            if got is None:
                lookups.wait(answers, i)
                got = answers.get(i)
                if got is None:
                    r.asked_again = True
                    return None
            answer = self.answered.take(r, rnd, i, got)  # and settles the others in
            if answer.l2_pending_chunks and self.l2.set_aside(
                r, answer, n, num_computed_tokens, self.clock()
            ):
                if answer.lease_id:
                    self.service.release(answer.lease_id)
                return None
            r.l2_wait_from = None
            r.answer = answer
            r.lease_id = answer.lease_id
        else:
            assert r.answer is not None
            answer = r.answer
        hit = answer.hit_chunks
        matched = (hit if hit < n else n) * cs
        if matched <= num_computed_tokens:
            self._release(r)
            return 0
        return matched - num_computed_tokens

    def _lookup_for(self, r: Tracked, n: int) -> LookupRound | None:
        """The lookup whose answer :meth:`matched_tokens` reads for ``n`` chunks of
        ``r``: the one in flight for ``n``, or none (``r.answer`` stands), or one sent
        now. An answer older than half its lease's TTL, or for another chunk count, has
        its lease released and is looked up again; a lookup in flight for another count
        is dropped (its lease goes back when it is answered)."""
        now = self.clock()
        if (
            r.answer is not None
            and r.lease_id
            and (now - r.lookup_at_s > r.answer.lease_ttl_s / 2 or r.lookup_chunks != n)
        ):
            self._release(r)
            r.answer = None
        if r.lookup is not None and r.lookup_chunks != n:
            self._drop_lookup(r)
        if r.answer is None and r.lookup is None:
            r.lookup_chunks = n
            r.lookup_at_s = now
            self.lookups.send(r)
            assert r.lookup is not None
        return r.lookup

    def after_alloc(
        self,
        req_id: str,
        blocks: Sequence[Sequence[Any]],
        num_external_tokens: int,
        num_local_tokens: int | None = None,
        ids_of: Callable[[Sequence[Any]], list[int]] | None = None,
    ) -> None:
        """The engine allocated ``blocks`` (every group's table) for the request.

        With ``num_external_tokens > 0`` a load of the hit is queued for the next step;
        ``num_local_tokens`` (default: as given to the last :meth:`matched_tokens`) are
        held by the engine's prefix cache and not reloaded. A hit the engine did not
        take (0 external tokens: a partial block tail, ``skip_reading_prefix_cache``, a
        replay) has its lease released at once. Chunks the lookup did not report are
        stored later even when the engine holds them.

        ``blocks``: block ids, copied as the request's tables (the caller may reuse its
        lists); or, with ``ids_of`` (reads a table part's ids), the engine's block
        objects, read for the load only: the engine then sends a request's whole tables
        when it schedules it (vLLM does)."""
        if self._arrivals.noted:
            self._admit()
        r = self._reqs.get(req_id)
        if r is None:
            return
        if num_local_tokens is None:
            num_local_tokens = r.local_tokens
        if ids_of is None:
            r.blocks = [list(b) for b in blocks]
            blocks = r.blocks
        answer = r.answer
        if answer is not None and answer.hit_chunks > r.stored_chunks:
            r.stored_chunks = answer.hit_chunks
        if num_external_tokens <= 0:
            self._release(r)
            r.answer = None
            return
        matched = num_local_tokens + num_external_tokens
        cs = self._cs
        assert matched % cs == 0, "a load ends on a chunk boundary"
        assert answer is not None, "after_alloc with external tokens but no lookup"
        n = matched // cs
        self._loads.queue(r, n, num_local_tokens, blocks, ids_of)  # planned by build_step
        r.loading = True
        if n > r.stored_chunks:
            r.stored_chunks = n

    def build_step(
        self, scheduled: Iterable[ScheduledRequest], preempted_req_ids: Iterable[str] = ()
    ) -> StepPlan:
        """The loads queued since the last step, the stores this step completes, and
        the earlier stores this step's scheduling may have freed blocks of."""
        self._admit()
        self.lookups.new_step()
        self.answered.new_step()
        plan = StepPlan(loads=self._loads.take(), stores=self._pending_stores)
        self._pending_stores = []
        for pid in preempted_req_ids:
            r = self._reqs.get(pid)
            if r is not None:
                self._stores.fence_freed(r, None)
                r.blocks, r.answer, r.computed_tokens = (), None, 0
                self._release(r)
        for s in scheduled:
            plan.scheduled_tokens += s.num_scheduled_tokens
            r = self._reqs.get(s.req_id)
            if r is None:
                continue
            if s.new_block_ids is not None:
                if s.replace_blocks or not r.blocks:
                    r.blocks = [list(b) for b in s.new_block_ids]
                else:
                    for mine, new in zip(r.blocks, s.new_block_ids, strict=True):
                        mine.extend(new)
            self._stores.fence_freed(r, s.num_computed_tokens)
            end = s.num_computed_tokens + s.num_scheduled_tokens
            r.computed_tokens = end
            if not self.store_enabled:
                continue
            spec = self._stores.plan(r, self._storable_chunks(r, end), s.num_computed_tokens)
            if spec is not None:
                plan.stores.append(spec)
        plan.fence_store_ids = self._stores.take_fences()
        return plan

    def transfers_finished(
        self,
        finished_recving: Iterable[str],
        finished_sending: Iterable[str],
        failed_recving: Iterable[str] = (),
    ) -> None:
        """Every worker reported these loads / held stores finished; the loads of
        ``failed_recving`` failed (the engine computes those requests afresh, and the
        chunks the server did not deliver are stored again once computed)."""
        self._admit()
        for req_id in failed_recving:
            r = self._reqs.get(req_id)
            if r is not None:
                r.stored_chunks = 0
        for req_id in finished_recving:
            r = self._reqs.get(req_id)
            if r is None:
                continue
            self._release(r)
            r.loading = False
            r.answer = None
            if r.ended and not r.has_store:
                del self._reqs[req_id]
        for req_id in finished_sending:
            self._reqs.pop(req_id, None)

    def request_finished(self, req_id: str) -> bool:
        """The request ended (or was aborted); True: hold its blocks until reported.

        Blocks are held while a load into them may still be running (released by the
        workers' ``finished_recving``) or when a store was planned (``finished_sending``).
        Whole chunks computed but not yet stored get a final store in the next step.
        The engine frees sliding-window blocks that left the window as the request
        ends, held or not: stores reading them are fenced in the next step.
        """
        self._admit()
        r = self._reqs.get(req_id)
        if r is None:
            return False
        r.ended = True
        self._drop_lookup(r)
        hold_for_load = r.loading
        if not r.loading:
            self._release(r)
        if self.store_enabled and not r.loading and r.computed_tokens:
            done = r.computed_tokens
            spec = self._stores.plan(r, self._storable_chunks(r, done), done)
            if spec is not None:
                self._pending_stores.append(spec)
        self._stores.fence_freed(r, r.computed_tokens)
        if r.has_store:
            return True
        if not hold_for_load:
            del self._reqs[req_id]
        return hold_for_load
