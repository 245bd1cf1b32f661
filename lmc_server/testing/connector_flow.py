"""The vLLM connector's machinery driven over a fixture's KV cache, without vLLM.

:class:`ConnectorFlow` wires what ``LMCacheMPConnector`` wires (see
``lmc_server/integration/vllm/connector.py``), from the same vLLM-free parts:

* scheduler: a lookup-only :class:`~lmc_server.integration.link.link.ServerLink` registered
  with :func:`~lmc_server.integration.kvlayout.derive_registration` of the fixture's
  descriptors, and a :class:`~lmc_server.integration.planning.SchedulerPlanner`;
* worker: a second link registered with the derivation over the backing's tensors
  (exported as shared memory or CUDA IPC), a
  :class:`~lmc_server.integration.worker.WorkerTransfers` and its tracker; each store
  is sent once ``backing.ready()`` returned (``stream_done`` on CUDA), as the
  connector sends its stores once the forward pass's writes are done.

Block ids come from one pool shared by every engine group, as vLLM's block pool hands
them out (groups overlay one allocation, so a block id belongs to one group at a time);
block 0 is vLLM's null block and never used.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any, Self

import numpy as np

from lmc_server.integration.chunks import ChunkGeometry
from lmc_server.integration.exporters import TensorExporter
from lmc_server.integration.kvlayout import RegistrationPlan, derive_registration
from lmc_server.integration.link.batches import LOAD_PART_CHUNKS
from lmc_server.integration.link.link import ServerLink
from lmc_server.integration.planning import SchedulerPlanner
from lmc_server.integration.plans import LoadSpec, ScheduledRequest, StepPlan
from lmc_server.integration.worker import (
    Report,
    TransferTracker,
    WorkerTransfers,
    failures_by_block_ids,
)
from lmc_server.testing.kvfixture import (
    Backing,
    KVFixture,
    PageCopy,
    describe_byte,
    expected_copies,
)


def block_hashes(tokens: list[int], per: int) -> list[bytes]:
    """Chained hashes of every ``per`` tokens, standing in for vLLM's block hashes."""
    out, prev = [], b""
    for i in range(len(tokens) // per):
        prev = hashlib.sha256(
            prev + np.asarray(tokens[i * per : (i + 1) * per], dtype="<i4").tobytes()
        ).digest()
        out.append(prev)
    return out


def _merge(into: Report, rep: Report) -> None:
    into.finished_sending |= rep.finished_sending
    into.finished_recving |= rep.finished_recving
    into.failed_recving |= rep.failed_recving
    into.invalid_block_ids |= rep.invalid_block_ids


class ConnectorFlow:
    """One scheduler and one worker of the connector over ``backing``'s tensors."""

    def __init__(
        self,
        fx: KVFixture,
        backing: Backing,
        endpoint: str,
        arch: str,
        *,
        exporter: TensorExporter | None = None,
        rank: int = 0,
        world_size: int = 1,
        timeout_s: float = 30.0,
        kv_events: bool = False,
    ) -> None:
        self.fx = fx
        #: stores carry KV-event fields, as with ``lmcache.mp.kv_events``
        self.kv_events = kv_events
        self.backing = backing
        self.timeout_s = timeout_s
        self.tensors = backing.views(fx)
        self.plan: RegistrationPlan = derive_registration(fx.layout, self.tensors, exporter)
        self.lookup_plan = derive_registration(fx.layout)
        kw: dict[str, Any] = dict(
            model=fx.model,
            kv_dtype=self.plan.kv_dtype,
            arch=arch,
            world_size=world_size,
            rank=rank,
            replicated=self.plan.replicated,
        )
        self.sched = ServerLink(endpoint, timeout_s=timeout_s, client_name="flow-scheduler")
        try:
            self.work = ServerLink(endpoint, timeout_s=timeout_s, client_name="flow-worker")
        except BaseException:
            self.sched.close()
            raise
        try:
            self.sched.register(groups=self.lookup_plan.groups, **kw)
            self.work.register(groups=self.plan.groups, buffers=self.plan.buffers, **kw)
        except BaseException:
            self.close()
            raise
        cached = [g for g in self.plan.engine_groups if g.cached]
        self.hash_block = min(g.tokens_per_block for g in cached)
        self.geometry = ChunkGeometry(
            self.work.reg.chunk_size, self.hash_block, self.plan.engine_groups
        )
        self.planner = SchedulerPlanner(self.geometry, self.sched)
        self.tracker = TransferTracker(by_block_ids=failures_by_block_ids(self.plan.engine_groups))
        self.transfers = WorkerTransfers(self.work, self.tracker)
        self._next_block = 1

    @property
    def chunk_size(self) -> int:
        return self.geometry.chunk_size

    def tables(self, num_tokens: int) -> list[list[int]]:
        """A request's block table per engine group, fresh ids from the shared pool
        (a scratch group holds one block per request)."""
        out = []
        for g in self.plan.engine_groups:
            n = -(-num_tokens // g.tokens_per_block) if g.cached else 1
            if self._next_block + n > self.fx.layout.num_blocks:
                raise ValueError(
                    f"{self.fx.name}: {self.fx.layout.num_blocks} blocks are too few for this test"
                )
            out.append(list(range(self._next_block, self._next_block + n)))
            self._next_block += n
        return out

    def _matched(self, req_id: str, tokens: list[int]) -> int:
        hashes = block_hashes(tokens, self.hash_block)
        deadline = time.monotonic() + self.timeout_s
        events = tokens if self.kv_events else None
        while (
            n := self.planner.matched_tokens(req_id, hashes, len(tokens), len(tokens), 0, events)
        ) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"lookup for {req_id} never answered")
            time.sleep(0.002)
        return n

    def _poll(self, finished: set[str], want: str) -> Report:
        rep = Report()
        deadline = time.monotonic() + self.timeout_s
        while not getattr(rep, want):
            _merge(rep, self.tracker.poll(finished))
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {want} reported")
            time.sleep(0.002)
        _merge(rep, self.tracker.poll(set()))
        return rep

    def prefill(
        self, req_id: str, tokens: list[int], tables: list[list[int]]
    ) -> tuple[StepPlan, Report]:
        """A miss, then one step computing the whole prompt: its whole chunks are
        stored once the engine's writes are done; returns the step and the report."""
        if self._matched(req_id, tokens):
            raise RuntimeError(f"{req_id}: a hit where the test expects a miss")
        self.planner.after_alloc(req_id, tables, 0)
        plan = self.planner.build_step([ScheduledRequest(req_id, 0, len(tokens), tables, True)])
        self.transfers.begin_step(plan)
        self.transfers.start_stores(plan.stores, self.backing.ready())
        self.transfers.fence(s.store_id for s in plan.stores)
        held = self.planner.request_finished(req_id)
        rep = self._poll({req_id}, "finished_sending") if held else Report()
        self.planner.transfers_finished([], rep.finished_sending)
        return plan, rep

    def load_hit(
        self, req_id: str, tokens: list[int], tables: list[list[int]]
    ) -> tuple[int, LoadSpec | None, Report]:
        """Look up ``tokens``; on a hit, load it into ``tables`` and wait for the report."""
        n = self._matched(req_id, tokens)
        self.planner.after_alloc(req_id, tables, n)
        plan = self.planner.build_step([])
        if not plan.loads:
            return n, None, Report()
        (spec,) = plan.loads
        rep = self.load(spec)
        self.planner.transfers_finished(rep.finished_recving, [])
        self.planner.request_finished(req_id)
        return n, spec, rep

    def load(self, spec: LoadSpec) -> Report:
        """Run one load and wait for the worker's report of it."""
        self.transfers.start_loads([spec])
        return self._poll(set(), "finished_recving")

    def unstored_load(self, req_id: str, tokens: list[int], tables: list[list[int]]) -> LoadSpec:
        """A load of chunks the server never stored (no lookup, no lease)."""
        n = len(tokens) // self.chunk_size
        digests = self.geometry.digests(block_hashes(tokens, self.hash_block), n)
        return LoadSpec(req_id, digests, self.geometry.block_ids(tables, 0, n), 0)

    def copies(self, spec: LoadSpec, src_tables: list[list[int]]) -> list[PageCopy]:
        """The pages ``spec`` must write: those stored from ``src_tables``."""
        src = self.geometry.block_ids(src_tables, 0, spec.n_chunks)
        return expected_copies(
            self.plan.groups, self.chunk_size, spec.n_chunks, src, spec.block_ids
        )

    # -- scenarios shared by the CPU and GPU tests ------------------------------------

    def check_store_then_load(self, seed: int, tokens: list[int]) -> None:
        """Prefill request ``A`` (a miss, two whole chunks stored), then load the hit into
        request ``B``'s other blocks. Checks: the stores leave the engine's memory alone;
        the load writes exactly the stored pages of every cached group and layer and no
        other byte (scratch groups, which overlay the same allocation, keep theirs); no
        block ids are ever sent for a scratch group. Raises ``AssertionError``."""
        fx, mem = self.fx, self.backing
        mem.fill_random(seed)
        a, b = self.tables(len(tokens)), self.tables(len(tokens))
        before = mem.snapshot()
        step, rep = self.prefill("A", tokens, a)
        assert [s.n_chunks for s in step.stores] == [2]
        assert rep.finished_sending == {"A"} and self.tracker.failed_store_chunks == 0
        scratch = {g.name for g in fx.scratch_groups}
        assert not scratch & set(step.stores[0].block_ids)
        assert mem.first_difference(mem.snapshot(), before) is None

        n, load, rep = self.load_hit("B", tokens, b)
        assert n == 2 * self.chunk_size and load is not None
        assert rep.finished_recving == {"B"}
        assert not rep.failed_recving and not rep.invalid_block_ids
        assert not scratch & set(load.block_ids)
        copies = self.copies(load, a)
        cached = {(g.name, layer.name) for g in fx.groups if g.cached for layer in g.layers}
        assert {(c.group, c.layer) for c in copies} == cached
        expected = mem.apply(before, copies)
        assert mem.first_difference(expected, before) is not None
        bad = mem.first_difference(mem.snapshot(), expected)
        assert bad is None, f"byte {bad} differs: {describe_byte(fx.groups, bad)}"

    def check_failed_load(self, seed: int, tokens: list[int]) -> None:
        """A load of chunks never stored finishes as failed, never as success: block
        ids with one engine group, the request with several (as vLLM 0.33 requires);
        no byte changes. Raises ``AssertionError``."""
        mem = self.backing
        mem.fill_random(seed)
        tables = self.tables(len(tokens))
        before = mem.snapshot()
        spec = self.unstored_load("C", tokens, tables)
        rep = self.load(spec)
        assert rep.finished_recving == {"C"}
        sent = {int(b) for ids in spec.block_ids.values() for b in ids if b >= 0}
        if len(self.plan.engine_groups) == 1:
            assert rep.invalid_block_ids == sent and not rep.failed_recving
        else:
            assert rep.failed_recving == {"C"}
        assert mem.first_difference(mem.snapshot(), before) is None

    def check_survives_restart(
        self, seed: int, tokens: list[int], restart: Callable[[], None]
    ) -> None:
        """Turn 1 prefills request ``A`` (stored); ``restart()`` restarts the server (or
        kills it and has it started again while turn 2 arrives); turn 2 finds the new,
        empty server: a miss, the prompt prefilled into ``B``'s blocks and stored with
        no failed chunk; turn 3 loads the hit into request ``C``, given ``A``'s
        blocks (free again), and exactly the pages stored in turn 2 land there. Both
        links connected and registered again. Raises ``AssertionError``."""
        mem = self.backing
        mem.fill_random(seed)
        a = self.tables(len(tokens))
        _, rep = self.prefill("A", tokens, a)
        assert rep.finished_sending == {"A"} and self.tracker.failed_store_chunks == 0
        restart()
        b = self.tables(len(tokens))
        step, rep = self.prefill("B", tokens, b)  # a miss: the new server holds nothing
        assert [s.n_chunks for s in step.stores] == [2]
        assert rep.finished_sending == {"B"}
        assert self.tracker.failed_store_chunks == 0, "a store failed after the restart"
        before = mem.snapshot()
        n, load, rep = self.load_hit("C", tokens, a)  # A's blocks, free again
        assert n == 2 * self.chunk_size and load is not None, f"turn 3 hit {n} tokens"
        assert rep.finished_recving == {"C"}
        assert not rep.failed_recving and not rep.invalid_block_ids
        expected = mem.apply(before, self.copies(load, b))
        bad = mem.first_difference(mem.snapshot(), expected)
        assert bad is None, f"byte {bad} differs: {describe_byte(self.fx.groups, bad)}"
        assert self.sched.reconnects >= 1 and self.work.reconnects >= 1

    def close(self) -> None:
        self.work.close()
        self.sched.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_batched_step(
    endpoint: str,
    kv: Any,
    n_requests: int,
    ready: Callable[[], None] | None = None,
    timeout_s: float = 60.0,
) -> None:
    """``n_requests`` requests store in one step, then ``n_requests`` others hit in one
    step: one batched store, and batched retrieves of at most
    :data:`~lmc_server.integration.link.batches.LOAD_PART_CHUNKS` chunks each, on the worker's
    connection (the server counts them); every load succeeds and writes exactly the
    stored pages.

    ``kv`` is a :class:`~lmc_server.testing.kv.ShmKV` or
    :class:`~lmc_server.testing.cuda_kv.CudaKV` of a full-attention geometry with 16
    tokens per block and at least ``34 * n_requests + 1`` blocks; ``ready`` is what the
    stores wait for (``stream_done`` on CUDA). Raises ``AssertionError``.
    """
    from lmc_server.client import Client
    from lmc_server.integration.chunks import EngineGroup

    (g,) = kv.geometry.groups
    assert g.tokens_per_block == 16 and g.num_blocks > 34 * n_requests
    sched = ServerLink(endpoint, timeout_s=timeout_s, client_name="batch-scheduler")
    work = ServerLink(endpoint, timeout_s=timeout_s, client_name="batch-worker")
    with Client(endpoint) as c:
        before = dict(c.stats().counters.requests)
    try:
        sched.register(**kv.register_kwargs(buffers=[], replicated=True))
        work.register(**kv.register_kwargs(replicated=True))
        geometry = ChunkGeometry(work.reg.chunk_size, 16, [EngineGroup(g.name, 16)])
        planner = SchedulerPlanner(geometry, sched)
        tracker = TransferTracker(by_block_ids=True)
        wt = WorkerTransfers(work, tracker)
        n_tok = geometry.chunk_size + 1
        per = -(-n_tok // 16)

        def matched(rid: str, toks: list[int]) -> int:
            h = block_hashes(toks, 16)
            deadline = time.monotonic() + timeout_s
            while (m := planner.matched_tokens(rid, h, len(toks), len(toks), 0)) is None:
                assert time.monotonic() < deadline, "lookup never answered"
                time.sleep(0.002)
            return m

        def poll(finished: set[str], want: str) -> Report:
            rep = Report()
            deadline = time.monotonic() + timeout_s
            while len(getattr(rep, want)) < n_requests:
                _merge(rep, tracker.poll(finished))
                assert time.monotonic() < deadline, f"{want}: not every request reported"
                time.sleep(0.002)
            return rep

        prompts = {
            f"r{i}": [i + 1] * 3 + list(range(1000 * i, 1000 * i + n_tok - 3))
            for i in range(n_requests)
        }
        src = {rid: [list(range(1 + per * i, 1 + per * (i + 1)))] for i, rid in enumerate(prompts)}
        dst = {
            rid: [list(range(1 + per * (n_requests + i), 1 + per * (n_requests + i + 1)))]
            for i, rid in enumerate(prompts)
        }
        for rid, toks in prompts.items():
            assert matched(rid, toks) == 0
            planner.after_alloc(rid, src[rid], 0)
        plan = planner.build_step([ScheduledRequest(r, 0, n_tok, src[r], True) for r in prompts])
        wt.begin_step(plan)
        wt.start_stores(plan.stores, ready)
        for rid in prompts:
            assert planner.request_finished(rid) is True
        rep = poll(set(prompts), "finished_sending")
        assert tracker.failed_store_chunks == 0
        planner.transfers_finished([], rep.finished_sending)
        for rid, toks in prompts.items():
            assert matched("h" + rid, toks + [0]) == geometry.chunk_size
            planner.after_alloc("h" + rid, dst[rid], geometry.chunk_size)
        plan = planner.build_step([])
        assert len(plan.loads) == n_requests
        wt.begin_step(plan)
        rep = poll(set(), "finished_recving")
        assert not rep.failed_recving and not rep.invalid_block_ids
        bpc = geometry.blocks_per_chunk(geometry.groups[0])
        for rid in prompts:
            assert kv.pages(g.name, dst[rid][0][:bpc]) == kv.pages(g.name, src[rid][0][:bpc])
    finally:
        sched.close()
        work.close()
    with Client(endpoint) as c:
        after = dict(c.stats().counters.requests)
    parts = -(-n_requests // LOAD_PART_CHUNKS)  # loads of one chunk each
    for op, want in (("store", 1), ("retrieve", parts)):
        sent = after.get(f"{op}:ok", 0) - before.get(f"{op}:ok", 0)
        assert sent == want, f"{n_requests} requests took {sent} {op} requests, not {want}"
    assert not any(k.endswith(":busy") for k in after), after
