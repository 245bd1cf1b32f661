"""Scheduler-side connector planning: what to look up, load and store, given engine state.

This module knows nothing about vLLM's classes; the adapter
(:mod:`lmc_server.integration.vllm.connector`) maps vLLM's requests, block tables and
scheduler outputs onto these calls, so the logic is tested in CI without vLLM.

Chunks and digests. A chunk is ``chunk_size`` tokens. The engine hashes every
``hash_block_size`` tokens (vLLM's block hashes, already chained and salted with the
request's cache salt, LoRA and multimodal inputs); the digest of chunk ``k`` chains the
concatenated hashes of its blocks onto the digest of chunk ``k - 1``
(:func:`lmc_server.client.digests.hash_chain`), so equal digests mean equal prefixes.

Invariants:

* a lookup never blocks the caller: :meth:`SchedulerPlanner.matched_tokens` returns
  ``None`` ("ask again") while the server's answer is in flight;
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
  when the request ends first, or when the hit turned out useless; an unused lease
  older than half its TTL is refreshed by a new lookup;
* a request that had a store planned is held (blocks not freed) until the workers
  report its stores finished;
* a store completes before any block it reads can be written again, whatever the step
  boundaries. The planner derives this from the blocks vLLM may free while the request
  runs: sliding-window blocks that leave the window (:meth:`ChunkGeometry.freed_blocks`,
  vLLM's ``SlidingWindowManager`` rule) and every block of a preempted request. A store
  reading such a block is fenced (:attr:`StepPlan.fence_store_ids`) in the first step
  whose scheduling may free it, so the workers wait for it before that step's loads and
  forward pass; a store never reads a block that was already freed (sent as ``-1``);
* what the server lacks is stored, per the lookup: chunks the engine holds in its own
  prefix cache are stored again when the server did not report them (evicted, server
  restarted); without a lookup answer every whole chunk is offered (the server answers
  ``exists`` for those it has, without copying).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from lmc_server.cache.geometry import blocks_per_chunk
from lmc_server.client.digests import DIGEST_BYTES, hash_chain

logger = logging.getLogger(__name__)

NULL_BLOCK_ID = 0
"""vLLM's null block (block 0 of its pool): a placeholder, never real KV."""


@dataclass(frozen=True, slots=True)
class EngineGroup:
    """One engine KV cache group as the planner needs it.

    ``cached`` is False for scratch groups (never stored, never sent block ids).
    ``window_tokens`` > 0 marks a sliding-window group. ``server_groups`` names the
    server groups this block table drives when there are several (layers with
    different records under one block table, :mod:`lmc_server.integration.kvlayout`);
    empty means one server group named ``name``.
    """

    name: str
    tokens_per_block: int
    cached: bool = True
    window_tokens: int = 0
    server_groups: tuple[str, ...] = ()

    @property
    def block_id_keys(self) -> tuple[str, ...]:
        """The server groups that receive this group's block ids."""
        return self.server_groups or (self.name,)


class ChunkGeometry:
    """Chunk arithmetic over an engine's groups and block hashes."""

    def __init__(self, chunk_size: int, hash_block_size: int,
                 groups: Sequence[EngineGroup]) -> None:
        if chunk_size <= 0 or hash_block_size <= 0 or chunk_size % hash_block_size:
            raise ValueError(f"chunk size {chunk_size} must be a positive multiple of the "
                             f"engine's hash block size {hash_block_size}")
        for g in groups:
            if g.cached and chunk_size % g.tokens_per_block:
                raise ValueError(f"chunk size {chunk_size} is not a multiple of group "
                                 f"{g.name!r}'s {g.tokens_per_block} tokens per block")
        self.chunk_size = chunk_size
        self.hash_block_size = hash_block_size
        self.groups = tuple(groups)
        self.hashes_per_chunk = chunk_size // hash_block_size

    @property
    def has_window(self) -> bool:
        return any(g.cached and g.window_tokens for g in self.groups)

    def blocks_per_chunk(self, group: EngineGroup) -> int:
        return blocks_per_chunk(group, self.chunk_size)

    @staticmethod
    def freed_blocks(group: EngineGroup, num_computed_tokens: int) -> int:
        """Leading blocks of ``group`` the engine may have freed at this many computed
        tokens: 0 for full groups; for a window of W tokens, the blocks wholly below
        ``num_computed_tokens - W + 1`` (vLLM 0.33 ``SlidingWindowManager``: the
        skipped tokens no later token attends to, freed by ``remove_skipped_blocks``
        when the request is next scheduled)."""
        if not group.cached or not group.window_tokens:
            return 0
        return max(0, num_computed_tokens - group.window_tokens + 1) // group.tokens_per_block

    def max_chunks(self, num_tokens: int, num_hashes: int) -> int:
        """Chunks a hit may cover: whole chunks, never the last token, hashed."""
        return min(max(0, num_tokens - 1) // self.chunk_size,
                   num_hashes // self.hashes_per_chunk)

    def digests(self, block_hashes: Sequence[bytes], n_chunks: int) -> bytes:
        """Prefix-chained digests of the first ``n_chunks`` chunks."""
        per = self.hashes_per_chunk
        if len(block_hashes) < n_chunks * per:
            raise ValueError(f"{len(block_hashes)} block hashes cannot cover {n_chunks} "
                             f"chunks of {per} hashes")
        return hash_chain(b"".join(bytes(h) for h in block_hashes[k * per:(k + 1) * per])
                          for k in range(n_chunks))

    def block_ids(self, group_blocks: Sequence[Sequence[int]], first_chunk: int,
                  n_chunks: int, keep_tokens: int = 0,
                  computed_tokens: int = 0) -> dict[str, np.ndarray]:
        """Per cached server group, the block ids of chunks ``first_chunk..+n_chunks``.

        ``group_blocks[i]`` is the request's block table of engine group ``i``; every
        server group of an engine group gets the same ids. Blocks whose tokens all lie
        below ``keep_tokens`` (the engine already holds them), blocks the engine may
        have freed at ``computed_tokens`` (:meth:`freed_blocks`), the null block and
        blocks past the table's end become ``-1``.
        """
        out: dict[str, np.ndarray] = {}
        for gi, g in enumerate(self.groups):
            if not g.cached:
                continue
            bpc = self.blocks_per_chunk(g)
            lo = first_chunk * bpc
            ids = np.full(n_chunks * bpc, -1, dtype=np.int32)
            have = np.asarray(group_blocks[gi][lo:lo + n_chunks * bpc], dtype=np.int64)
            ids[:have.size] = have
            ids[ids == NULL_BLOCK_ID] = -1
            keep_blocks = max(keep_tokens // g.tokens_per_block,
                              self.freed_blocks(g, computed_tokens)) - lo
            if keep_blocks > 0:
                ids[:keep_blocks] = -1
            for key in g.block_id_keys:
                out[key] = ids
        return out


@dataclass(frozen=True, slots=True)
class LookupAnswer:
    hit_chunks: int
    lease_id: int
    lease_ttl_s: float
    #: chunks after the hit the server is fetching from its L2 tier (0 without one)
    l2_pending_chunks: int = 0


class LookupService(Protocol):
    """The scheduler's link to the server (a lookup-only registration)."""

    def lookup(self, digests: bytes) -> Future[LookupAnswer]: ...

    def release(self, lease_id: int) -> None: ...


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Retrieve chunks ``0..n`` of a request into its blocks (``-1``: leave alone)."""

    req_id: str
    digests: bytes
    block_ids: dict[str, np.ndarray]
    lease_id: int

    @property
    def n_chunks(self) -> int:
        return len(self.digests) // DIGEST_BYTES


@dataclass(frozen=True, slots=True)
class StoreSpec:
    """Store chunks ``first_chunk..`` of a request from its blocks (``-1``: not read).

    ``store_id`` names the store for fences (:attr:`StepPlan.fence_store_ids`).
    """

    req_id: str
    first_chunk: int
    digests: bytes
    block_ids: dict[str, np.ndarray]
    store_id: int = 0

    @property
    def n_chunks(self) -> int:
        return len(self.digests) // DIGEST_BYTES


@dataclass(slots=True)
class StepPlan:
    """What the workers do in one engine step.

    ``fence_store_ids``: stores (of earlier steps) that read blocks this step's
    scheduling may have freed; the workers wait for them before this step's loads
    and forward pass write any block.
    """

    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)
    fence_store_ids: set[int] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request of a scheduler step, as the adapter reads it from the engine.

    ``new_block_ids`` appends to the request's block tables, or replaces them when
    ``resumed`` (a preempted request that starts over) or when it is a new request.
    """

    req_id: str
    num_computed_tokens: int
    num_scheduled_tokens: int
    new_block_ids: Sequence[Sequence[int]] | None
    replace_blocks: bool = False


@dataclass(slots=True, eq=False)
class _Store:
    """A store in flight as the scheduler sees it: per window engine group, the
    lowest block index (in the request's table) it reads."""

    store_id: int
    first_window_block: dict[int, int]


@dataclass(slots=True, eq=False)
class _Request:
    req_id: str
    block_hashes: Sequence[bytes]
    num_prompt_tokens: int
    lookup: Future[LookupAnswer] | None = None
    lookup_chunks: int = 0
    lookup_at_s: float = 0.0
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
    blocks: list[list[int]] = field(default_factory=list)
    stores: list[_Store] = field(default_factory=list)


class SchedulerPlanner:
    """Per-request lookup, load and store state of the scheduler-side connector.

    ``store_generated``: also store whole chunks of generated tokens (the next turn
    of a conversation holds them in its prompt); otherwise prompt chunks only.

    ``l2_wait_s``: how long a request may wait (answering "ask again") for chunks the
    server reports coming from its L2 tier, from the first answer that reported them;
    0: never wait, use the L1 hit at once. ``l2_waits`` counts answers set aside to
    wait, ``l2_wait_expired`` the waits that ended at the bound with chunks still
    pending.
    """

    def __init__(self, geometry: ChunkGeometry, service: LookupService,
                 clock: Callable[[], float] = time.monotonic, store: bool = True,
                 load: bool = True, store_generated: bool = True,
                 l2_wait_s: float = 0.05) -> None:
        if not 0.0 <= l2_wait_s < float("inf"):
            raise ValueError(f"l2_wait_s {l2_wait_s} must be finite and >= 0")
        self.geometry = geometry
        self.l2_wait_s = l2_wait_s
        self.l2_waits = 0
        self.l2_wait_expired = 0
        self.service = service
        self.clock = clock
        self.store_enabled = store
        self.load_enabled = load
        self.store_generated = store_generated
        self._reqs: dict[str, _Request] = {}
        self._pending_loads: list[LoadSpec] = []
        self._pending_stores: list[StoreSpec] = []
        self._pending_fences: set[int] = set()
        self._orphans: list[Future[LookupAnswer]] = []
        self._next_store_id = 1

    # -- helpers ------------------------------------------------------------------------

    def _req(self, req_id: str, block_hashes: Sequence[bytes],
             num_prompt_tokens: int) -> _Request:
        r = self._reqs.get(req_id)
        if r is None:
            r = self._reqs[req_id] = _Request(req_id, block_hashes, num_prompt_tokens)
        return r

    def _release(self, r: _Request) -> None:
        if r.lease_id:
            self.service.release(r.lease_id)
            r.lease_id = 0

    def _drain_orphans(self) -> None:
        """Release leases of lookups whose request ended before the answer came."""
        keep = []
        for fut in self._orphans:
            if not fut.done():
                keep.append(fut)
            elif fut.exception() is None and fut.result().lease_id:
                self.service.release(fut.result().lease_id)
        self._orphans = keep

    @property
    def tracked(self) -> int:
        return len(self._reqs)

    @property
    def lookups_in_flight(self) -> int:
        return sum(1 for r in self._reqs.values()
                   if r.lookup is not None and not r.lookup.done())

    def _fence_freed(self, r: _Request, computed_tokens: int | None) -> None:
        """Fence ``r``'s stores that read blocks the engine may free at
        ``computed_tokens`` (``None``: every block, a preemption)."""
        keep = []
        for st in r.stores:
            hit = computed_tokens is None or any(
                self.geometry.freed_blocks(self.geometry.groups[gi], computed_tokens) > first
                for gi, first in st.first_window_block.items())
            if hit:
                self._pending_fences.add(st.store_id)
            else:
                keep.append(st)
        r.stores = keep

    def _plan_store(self, r: _Request, done: int, computed_tokens: int) -> StoreSpec | None:
        """A store of ``r``'s chunks ``stored_chunks..done`` (whole, hashed, computed),
        reading only blocks the engine holds at ``computed_tokens``."""
        g = self.geometry
        done = min(done, len(r.block_hashes) // g.hashes_per_chunk)
        if done <= r.stored_chunks or not r.blocks:
            return None
        first = r.stored_chunks
        ids = g.block_ids(r.blocks, first, done - first, computed_tokens=computed_tokens)
        spec = StoreSpec(req_id=r.req_id, first_chunk=first,
                         digests=g.digests(r.block_hashes, done)[first * DIGEST_BYTES:],
                         block_ids=ids, store_id=self._next_store_id)
        self._next_store_id += 1
        windows: dict[int, int] = {}
        for gi, eg in enumerate(g.groups):
            if not (eg.cached and eg.window_tokens):
                continue
            bpc = g.blocks_per_chunk(eg)
            nwin = min(bpc, -(-eg.window_tokens // eg.tokens_per_block))
            read = ids[eg.block_id_keys[0]].reshape(done - first, bpc)[:, bpc - nwin:]
            rows, cols = np.nonzero(read >= 0)
            if rows.size:
                windows[gi] = int((first + rows[0]) * bpc + bpc - nwin + cols[0])
        r.stores.append(_Store(spec.store_id, windows))
        r.stored_chunks = done
        r.has_store = True
        return spec

    # -- scheduler hooks ----------------------------------------------------------------

    def matched_tokens(self, req_id: str, block_hashes: Sequence[bytes], num_tokens: int,
                       num_prompt_tokens: int, num_computed_tokens: int) -> int | None:
        """Tokens beyond ``num_computed_tokens`` the server can supply; ``None``: ask again.

        Idempotent while the answer stands: calling it again returns the same count.
        """
        self._drain_orphans()
        g = self.geometry
        r = self._req(req_id, block_hashes, num_prompt_tokens)
        r.local_tokens = num_computed_tokens
        if not self.load_enabled:
            return 0
        if r.loading:
            return 0
        n = g.max_chunks(num_tokens, len(block_hashes))
        if n * g.chunk_size <= num_computed_tokens:
            return 0
        now = self.clock()
        if r.answer is not None and r.lease_id and (
                now - r.lookup_at_s > r.answer.lease_ttl_s / 2 or r.lookup_chunks != n):
            self._release(r)
            r.answer = None
        if r.answer is None and r.lookup is None:
            r.lookup = self.service.lookup(g.digests(block_hashes, n))
            r.lookup_chunks = n
            r.lookup_at_s = now
        if r.lookup is not None:
            if not r.lookup.done():
                return None
            fut, r.lookup = r.lookup, None
            exc = fut.exception()
            if exc is not None:
                logger.warning("lookup for request %s failed: %s", req_id, exc)
                r.answer = LookupAnswer(0, 0, 0.0)
                r.l2_wait_from = None
            else:
                answer = fut.result()
                if self._wait_for_l2(r, answer, n, num_computed_tokens, now):
                    if answer.lease_id:
                        self.service.release(answer.lease_id)
                    return None
                r.l2_wait_from = None
                r.answer = answer
                r.lease_id = answer.lease_id
        assert r.answer is not None
        matched = min(r.answer.hit_chunks, n) * g.chunk_size
        if matched <= num_computed_tokens:
            self._release(r)
            return 0
        return matched - num_computed_tokens

    def _wait_for_l2(self, r: _Request, answer: LookupAnswer, n: int,
                     num_computed_tokens: int, now: float) -> bool:
        """True: set ``answer`` aside and ask again later, since the server is bringing
        chunks in from L2 that would load more than the answer's hit does now."""
        if answer.l2_pending_chunks <= 0 or answer.hit_chunks >= n or self.l2_wait_s <= 0:
            return False
        coming = min(n, answer.hit_chunks + answer.l2_pending_chunks)
        if coming * self.geometry.chunk_size <= num_computed_tokens:
            return False  # the engine's own prefix cache already holds all of it
        if r.l2_wait_from is None:
            r.l2_wait_from = now
        elif now - r.l2_wait_from >= self.l2_wait_s:
            self.l2_wait_expired += 1
            return False
        self.l2_waits += 1
        return True

    def after_alloc(self, req_id: str, blocks: Sequence[Sequence[int]],
                    num_external_tokens: int, num_local_tokens: int | None = None) -> None:
        """The engine allocated ``blocks`` (every group's table) for the request.

        With ``num_external_tokens > 0`` a load of the hit is queued for the next step;
        ``num_local_tokens`` (default: as given to the last :meth:`matched_tokens`) are
        held by the engine's prefix cache and not reloaded. A hit the engine did not
        take (0 external tokens: a partial block tail, ``skip_reading_prefix_cache``, a
        replay) has its lease released at once. Chunks the lookup did not report are
        stored later even when the engine holds them.
        """
        r = self._reqs.get(req_id)
        if r is None:
            return
        if num_local_tokens is None:
            num_local_tokens = r.local_tokens
        r.blocks = [list(b) for b in blocks]
        g = self.geometry
        server_chunks = r.answer.hit_chunks if r.answer is not None else 0
        r.stored_chunks = max(r.stored_chunks, server_chunks)
        if num_external_tokens <= 0:
            self._release(r)
            r.answer = None
            return
        matched = num_local_tokens + num_external_tokens
        assert matched % g.chunk_size == 0, "a load ends on a chunk boundary"
        assert r.answer is not None, "after_alloc with external tokens but no lookup"
        n = matched // g.chunk_size
        self._pending_loads.append(LoadSpec(
            req_id=req_id, digests=g.digests(r.block_hashes, n),
            block_ids=g.block_ids(r.blocks, 0, n, keep_tokens=num_local_tokens),
            lease_id=r.lease_id))
        r.loading = True
        r.stored_chunks = max(r.stored_chunks, n)

    def build_step(self, scheduled: Iterable[ScheduledRequest],
                   preempted_req_ids: Iterable[str] = ()) -> StepPlan:
        """The loads queued since the last step, the stores this step completes, and
        the earlier stores this step's scheduling may have freed blocks of."""
        self._drain_orphans()
        g = self.geometry
        plan = StepPlan(loads=self._pending_loads, stores=self._pending_stores)
        self._pending_loads, self._pending_stores = [], []
        for pid in preempted_req_ids:
            r = self._reqs.get(pid)
            if r is not None:
                self._fence_freed(r, None)
                r.blocks = []
                r.answer = None
                r.computed_tokens = 0
                self._release(r)
        for s in scheduled:
            r = self._reqs.get(s.req_id)
            if r is None:
                continue
            if s.new_block_ids is not None:
                if s.replace_blocks or not r.blocks:
                    r.blocks = [list(b) for b in s.new_block_ids]
                else:
                    for mine, new in zip(r.blocks, s.new_block_ids, strict=True):
                        mine.extend(new)
            self._fence_freed(r, s.num_computed_tokens)
            end = s.num_computed_tokens + s.num_scheduled_tokens
            r.computed_tokens = end
            if not self.store_enabled:
                continue
            limit = end if self.store_generated else min(end, r.num_prompt_tokens)
            spec = self._plan_store(r, limit // g.chunk_size, s.num_computed_tokens)
            if spec is not None:
                plan.stores.append(spec)
        plan.fence_store_ids, self._pending_fences = self._pending_fences, set()
        return plan

    def transfers_finished(self, finished_recving: Iterable[str],
                           finished_sending: Iterable[str]) -> None:
        """Every worker reported these loads / held stores finished."""
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
        r = self._reqs.get(req_id)
        if r is None:
            return False
        r.ended = True
        if r.lookup is not None:
            self._orphans.append(r.lookup)
            r.lookup = None
        hold_for_load = r.loading
        if not r.loading:
            self._release(r)
        if self.store_enabled and not r.loading and r.computed_tokens:
            g = self.geometry
            limit = (r.computed_tokens if self.store_generated
                     else min(r.computed_tokens, r.num_prompt_tokens))
            spec = self._plan_store(r, limit // g.chunk_size, r.computed_tokens)
            if spec is not None:
                self._pending_stores.append(spec)
        self._fence_freed(r, r.computed_tokens)
        if r.has_store:
            return True
        if not hold_for_load:
            del self._reqs[req_id]
        return hold_for_load
