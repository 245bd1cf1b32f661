"""The step's lookup answers settled as their round comes in (integration/answered.py):
a question answered from a settled entry gets exactly what the general path gives it,
and the load that follows reads exactly its own chunks, lease and blocks."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from lmc_server.cache.keys import DIGEST_BYTES
from lmc_server.integration.chunks import ChunkGeometry, EngineGroup
from lmc_server.integration.lookups import LookupRound
from lmc_server.integration.planning import SchedulerPlanner
from lmc_server.integration.plans import LookupAnswer, LookupBatch
from lmc_server.testing.connector_flow import block_hashes

CHUNK = 256
BLOCK = 16


class HandSetLookups:
    """Each round's answers in one batch the test sets part by part."""

    def __init__(self) -> None:
        self.batches: list[tuple[LookupBatch, list[bytes]]] = []
        self.released: list[int] = []

    def lookup_hashed(self, chunks: Sequence[int], digests: Callable[[int], bytes]) -> LookupBatch:
        batch = LookupBatch(len(chunks))
        self.batches.append((batch, [digests(i) for i in range(len(chunks))]))
        return batch

    def release(self, lease_id: int) -> None:
        self.released.append(lease_id)


def general_only(p: SchedulerPlanner) -> SchedulerPlanner:
    """``p`` never settles: every question takes the general path."""

    def settle(rnd: LookupRound) -> None:
        return None

    p.answered.settle = settle  # type: ignore[method-assign]
    return p


def planner(svc: HandSetLookups) -> SchedulerPlanner:
    return SchedulerPlanner(ChunkGeometry(CHUNK, BLOCK, [EngineGroup("full", BLOCK)]), svc)


def test_settled_questions_and_their_loads_match_the_general_path() -> None:
    """Forty arrivals of 1 to 4 chunks, hits from none to more than asked (misses with
    and without a lease), answered in three parts in random order, asked between the
    parts, some with tokens the engine holds: the planner that settles answers as
    they come returns for every question what the one that never settles returns,
    each load carries its own lease, digests and block ids (every request's blocks
    distinct), and the same leases are released."""
    rng = random.Random(3)
    svc, ref_svc = HandSetLookups(), HandSetLookups()
    p, ref = planner(svc), general_only(planner(ref_svc))
    reqs = []
    for i in range(40):
        tokens = [10_000 * i + t for t in range(rng.choice([300, 600, 700, 900, 1100]))]
        h = block_hashes(tokens, BLOCK)
        n = (len(tokens) - 1) // CHUNK
        hit = rng.randint(0, n + 1)
        lease = 100 + i if hit or rng.random() < 0.3 else 0
        computed = rng.choice([0, 0, 0, 0, BLOCK * 4, CHUNK])
        reqs.append((f"r{i}", tokens, h, LookupAnswer(hit, lease, 30.0), computed))
    for q in (p, ref):
        for rid, tokens, h, _, _ in reqs:
            q.request_arrived(rid, h, len(tokens), len(tokens))

    def ask(q: SchedulerPlanner, k: int) -> int | None:
        rid, tokens, h, _, computed = reqs[k]
        return q.matched_tokens(rid, h, len(tokens), len(tokens), computed)

    assert [ask(p, 0)] == [ask(ref, 0)] == [None]  # sent, nothing answered yet
    (batch, digests), (ref_batch, ref_digests) = svc.batches[0], ref_svc.batches[0]
    assert digests == ref_digests
    order = list(range(len(reqs)))
    rng.shuffle(order)
    parts = [order[:5], order[5:25], order[25:]]
    got: dict[int, int | None] = {}
    settled_used = 0
    for part in parts:
        for b in (batch, ref_batch):
            b.set([reqs[k][3] for k in part], at=part)
        for k in range(len(reqs)):
            if got.get(k) is not None:
                continue
            had = reqs[k][0] in p.answered.by_req
            a, b_ = ask(p, k), ask(ref, k)
            assert a == b_, reqs[k]
            settled_used += had and reqs[k][4] == 0
            got[k] = a
    assert settled_used >= 10, "the settled path was not taken"
    assert p.lookups_answered_at_once == ref.lookups_answered_at_once
    for k, (rid, tokens, _, answer, computed) in enumerate(reqs):
        n = (len(tokens) - 1) // CHUNK
        want = max(0, min(answer.hit_chunks, n) * CHUNK - computed)
        assert got[k] == want, (rid, answer, computed)
        external = got[k]
        if external:
            blocks = [[1000 * k + j + 1 for j in range(len(tokens) // BLOCK + 1)]]
            for q in (p, ref):
                q.after_alloc(rid, blocks, external)
    loads, ref_loads = p.build_step([]).loads, ref.build_step([]).loads
    assert len(loads) == len(ref_loads) == sum(1 for v in got.values() if v)
    for spec, ref_spec in zip(loads, ref_loads, strict=True):
        k = int(spec.req_id[1:])
        rid, tokens, h, answer, computed = reqs[k]
        n = (computed + got[k]) // CHUNK  # type: ignore[operator]
        assert (spec.req_id, spec.lease_id, spec.n_chunks) == (rid, answer.lease_id, n)
        assert spec.digests == ref_spec.digests == digests[k][: n * DIGEST_BYTES]
        ids = spec.block_ids["full"].tolist()
        held = computed // BLOCK  # blocks 1000 k + 1.. (0 is the engine's null block)
        expect = [-1 if j < held else 1000 * k + j + 1 for j in range(n * CHUNK // BLOCK)]
        assert ids == ref_spec.block_ids["full"].tolist() == expect, rid
    assert sorted(svc.released) == sorted(ref_svc.released)
    assert not p.answered.by_req, "entries live for one step"


def test_a_settled_entry_serves_only_the_question_it_was_settled_for() -> None:
    """Settled for a question with nothing held by the engine: a question with tokens
    held gets the general path's answer; one whose request now has fewer chunks
    looks up again (the longer lease released); an answer with chunks pending from L2
    is not settled; a question in a later step gets the same count again."""
    svc = HandSetLookups()
    p = planner(svc)
    h = block_hashes(list(range(1000)), BLOCK)
    for rid in ("held", "shorter", "l2", "later", "first"):
        p.request_arrived(rid, h, 1000, 1000)
    assert p.matched_tokens("first", h, 1000, 1000, 0) is None
    batch, _ = svc.batches[0]
    batch.set(
        [
            LookupAnswer(3, 11, 30.0),
            LookupAnswer(3, 12, 30.0),
            LookupAnswer(1, 13, 30.0, l2_pending_chunks=2),
            LookupAnswer(2, 14, 30.0),
            LookupAnswer(3, 15, 30.0),
        ]
    )
    assert p.matched_tokens("first", h, 1000, 1000, 0) == 768
    assert set(p.answered.by_req) == {"held", "shorter", "later"}
    assert p.matched_tokens("held", h, 1000, 1000, 512) == 256
    assert "held" not in p.answered.by_req
    short = h[: 600 // BLOCK]
    assert p.matched_tokens("shorter", short, 600, 600, 0) is None  # looked up again
    assert 12 in svc.released and len(svc.batches) == 2
    assert p.matched_tokens("l2", h, 1000, 1000, 0) is None  # set aside: L2 pending
    assert 13 in svc.released
    p.build_step([])
    assert not p.answered.by_req
    assert p.matched_tokens("later", h, 1000, 1000, 0) == 512
    assert 14 not in svc.released
