"""One contract suite over every eviction policy, plus each policy's own order."""

from __future__ import annotations

import random

import numpy as np
import pytest

from lmc_server.cache.eviction.arc import ARCPolicy
from lmc_server.cache.eviction.base import EvictionPolicy, FrequencySketch, GhostTags
from lmc_server.cache.eviction.lru import LRUPolicy
from lmc_server.cache.eviction.names import SUMMARIES
from lmc_server.cache.eviction.registry import POLICIES, make_policy
from lmc_server.cache.eviction.s3fifo import S3FIFOPolicy
from lmc_server.cache.eviction.sarc import SARCPolicy


def keyed(name: str, capacity: int) -> tuple[EvictionPolicy, list[bytes | None]]:
    """A policy bound to a slot-to-key table, as a partition binds it."""
    keys: list[bytes | None] = [None] * capacity
    p = make_policy(name, capacity)
    p.bind_keys(keys)
    return p, keys


@pytest.fixture(params=sorted(POLICIES))
def policy(request: pytest.FixtureRequest) -> EvictionPolicy:
    p, keys = keyed(request.param, 64)
    keys[:] = [b"key%d" % i for i in range(64)]
    return p


def test_empty(policy: EvictionPolicy) -> None:
    assert len(policy) == 0
    assert policy.pop_victim() is None
    assert policy.peek() is None


def test_pops_every_added_slot_exactly_once(policy: EvictionPolicy) -> None:
    for s in (3, 1, 7, 0):
        policy.admit(s)
    assert len(policy) == 4
    popped = []
    while (v := policy.peek()) is not None:
        assert policy.pop_victim() == v
        popped.append(v)
    assert sorted(popped) == [0, 1, 3, 7]
    assert len(policy) == 0


def test_pinned_slot_never_popped(policy: EvictionPolicy) -> None:
    for s in range(5):
        policy.admit(s)
    policy.pin(2)
    assert 2 not in policy
    out = [policy.pop_victim() for _ in range(4)]
    assert 2 not in out and policy.pop_victim() is None


def test_grow_extends_capacity(policy: EvictionPolicy) -> None:
    policy.grow(100)
    policy.admit(99)
    assert 99 in policy and policy.pop_victim() == 99


def test_double_add_is_a_broken_contract(policy: EvictionPolicy) -> None:
    policy.admit(1)
    with pytest.raises(AssertionError):
        policy.admit(1)


def test_random_operations_keep_membership(policy: EvictionPolicy) -> None:
    rng = random.Random(7)
    policy.grow(64)
    present: set[int] = set()
    for _ in range(5000):
        s = rng.randrange(64)
        op = rng.random()
        if s in present and op < 0.15:
            policy.forget(s)
            present.discard(s)
        elif s in present and op < 0.3:
            policy.pin(s)
            policy.unpin(s)
        elif s in present and op < 0.6:
            policy.touch(s)
        elif s not in present:
            policy.admit(s)
            present.add(s)
        elif op < 0.7:
            v = policy.pop_victim()
            assert v in present
            present.discard(v)
        assert len(policy) == len(present)
    assert {s for s in range(64) if s in policy} == present


def test_lru_order_follows_touches() -> None:
    p = LRUPolicy(8)
    for s in range(4):
        p.admit(s)
    p.touch(0)
    p.touch(2)
    assert p.order() == [1, 3, 0, 2]
    assert [p.pop_victim() for _ in range(4)] == [1, 3, 0, 2]


def test_lru_counts_an_unpin_as_a_use() -> None:
    p = LRUPolicy(8)
    for s in range(3):
        p.admit(s)
    p.pin(0)
    p.unpin(0)
    assert p.order() == [1, 2, 0]


def test_fifo_ignores_touches_and_pins() -> None:
    p = make_policy("fifo", 8)
    for s in range(4):
        p.admit(s)
    p.touch(0)
    p.pin(1)
    p.unpin(1)
    p.pin(0)
    assert p.peek() == 1
    p.unpin(0)
    assert [p.pop_victim() for _ in range(4)] == [0, 1, 2, 3]


def test_fifo_readmitted_slot_goes_to_the_back() -> None:
    p = make_policy("fifo", 8)
    for s in range(3):
        p.admit(s)
    assert p.pop_victim() == 0
    p.admit(0)
    assert [p.pop_victim() for _ in range(3)] == [1, 2, 0]


def test_pin_unpin_churn_keeps_fifo_heap_bounded() -> None:
    p = make_policy("fifo", 4)
    for s in range(4):
        p.admit(s)
    for _ in range(10_000):
        p.pin(3)
        p.unpin(3)
    assert len(p._heap) < 200  # type: ignore[attr-defined]
    assert [p.pop_victim() for _ in range(4)] == [0, 1, 2, 3]


def test_unknown_policy_names_choices() -> None:
    with pytest.raises(ValueError, match="LRU, FIFO, ARC, S3FIFO, SARC"):
        make_policy("random")


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_names_are_case_insensitive_and_documented(name: str) -> None:
    assert make_policy(name.lower()).name == name
    assert POLICIES[name].summary and "\n" not in POLICIES[name].summary


def test_the_policies_are_the_names_the_configuration_offers() -> None:
    """``--eviction-policy`` takes its choices and help from ``eviction.names`` (no
    numpy); the registry of classes must name exactly those, in the same order."""
    assert list(POLICIES) == list(SUMMARIES)
    assert all(cls.summary == SUMMARIES[name] for name, cls in POLICIES.items())


def test_peek_is_what_pop_returns_under_churn(policy: EvictionPolicy) -> None:
    """Every policy's ``peek`` must name the slot ``pop_victim`` removes: the index peeks,
    then evicts that slot through ``forget``."""
    rng = random.Random(11)
    present: set[int] = set()
    for _ in range(3000):
        s = rng.randrange(64)
        if s not in present:
            policy.admit(s)
            present.add(s)
        elif rng.random() < 0.5:
            policy.touch(s)
        else:
            v = policy.peek()
            assert v in present
            if rng.random() < 0.5:
                assert policy.pop_victim() == v
            else:
                policy.forget(v)
            present.discard(v)
    assert len(policy) == len(present)


def test_pinned_slots_survive_any_eviction_sequence(policy: EvictionPolicy) -> None:
    for s in range(64):
        policy.admit(s)
    pinned = set(range(0, 64, 5))
    for s in pinned:
        policy.touch(s)
        policy.pin(s)
    out = []
    while (v := policy.pop_victim()) is not None:
        out.append(v)
    assert sorted(out) == sorted(set(range(64)) - pinned)
    for s in pinned:
        policy.unpin(s)
    assert len(policy) == len(pinned)


def test_ghost_tags_remember_and_forget() -> None:
    g = GhostTags()
    g.add(b"a")  # no table yet: ignored
    assert not g.pop(b"a")
    g.grow(100)
    keys = [b"k%d" % i for i in range(50)]
    for k in keys:
        g.add(k)
    remembered = [k for k in keys if g.pop(k)]
    # a key is remembered unless a later key took its cell (the hash is salted per
    # process, so which ones differs from run to run; the rule does not)
    cells = [g._split(k)[0] & g._mask for k in keys]
    kept = [k for i, k in enumerate(keys) if cells[i] not in cells[i + 1 :]]
    assert remembered == kept and len(kept) >= 25
    assert not any(g.pop(k) for k in remembered)  # popped means forgotten
    assert g.size == 0 or g.size <= 50
    assert not g.pop(b"never added")


def test_frequency_sketch_counts_and_halves() -> None:
    f = FrequencySketch()
    assert f.add(b"x") == 0 and f.estimate(b"x") == 0  # no table yet
    f.grow(1024)
    for _ in range(5):
        f.add(b"hot")
    assert f.estimate(b"hot") == 5
    assert f.estimate(b"cold") == 0
    hot = set(f._cells_of(b"hot"))
    added, i = 0, 0
    while added < 1024:  # one table of traffic on other cells: every count halves once
        key = b"other%d" % i
        i += 1
        if hot.isdisjoint(f._cells_of(key)):  # (the hash is salted per process)
            f.add(key)
            added += 1
    assert f.estimate(b"hot") == 2


def test_arc_moves_reused_objects_to_t2_and_evicts_t1_first() -> None:
    p, keys = keyed("ARC", 8)
    for s in range(4):
        keys[s] = b"k%d" % s
        p.admit(s)
    p.touch(0)
    p.touch(1)
    assert [p.pop_victim() for _ in range(2)] == [2, 3]  # T1 before T2 (p = 0)
    assert [p.pop_victim() for _ in range(2)] == [0, 1]


def test_arc_ghost_hit_in_b1_grows_t1_target() -> None:
    p, keys = keyed("ARC", 8)
    assert isinstance(p, ARCPolicy)
    for s in range(3):
        keys[s] = b"k%d" % s
        p.admit(s)
    assert p.pop_victim() == 0  # k0 -> B1
    p.admit(0)  # k0 stored again: it was evicted too early
    assert p._p >= 1
    assert p.peek() != 0  # it came back into T2, behind T1's objects


def test_s3fifo_one_time_objects_leave_from_the_small_queue() -> None:
    p, keys = keyed("S3FIFO", 32)
    assert isinstance(p, S3FIFOPolicy)
    for s in range(20):
        keys[s] = b"k%d" % s
        p.admit(s)
        if s < 10:
            p.touch(s)  # used: goes to M instead of being evicted
    out = [p.pop_victim() for _ in range(8)]  # S keeps ~10% of what is left
    assert out == list(range(10, 18))
    assert all(s in p for s in range(10))


def test_s3fifo_ghost_sends_a_returning_key_to_main() -> None:
    p, keys = keyed("S3FIFO", 32)
    for s in range(12):
        keys[s] = b"k%d" % s
        p.admit(s)
    assert p.pop_victim() == 0  # unused: evicted from S, remembered
    p.admit(0)  # same key k0 again -> main queue
    for s in range(12, 20):
        keys[s] = b"k%d" % s
        p.admit(s)
    out = [p.pop_victim() for _ in range(17)]  # S: 18 of 19 objects, down to ~10%
    assert 0 not in out and 0 in p


def test_sarc_first_time_keys_are_cold_returning_keys_warm() -> None:
    p, keys = keyed("SARC", 32)
    assert isinstance(p, SARCPolicy)
    keys[0] = b"prefix"
    p.admit(0)
    assert not p.in_warm(0)
    p.forget(0)
    keys[1] = b"prefix"  # the same key, stored again in another slot
    p.admit(1)
    assert p.in_warm(1)
    keys[2] = b"other"
    p.admit(2)
    p.touch(2)
    assert p.in_warm(2)


def test_sarc_cold_ages_faster_and_the_weight_adapts() -> None:
    p, keys = keyed("SARC", 32)
    assert isinstance(p, SARCPolicy)
    keys[0] = b"warm"
    p.admit(0)
    p.touch(0)  # WARM, used at clock 2
    keys[1] = b"cold"
    p.admit(1)  # COLD, clock 3: younger, but ages 4x faster
    for s in range(2, 5):
        keys[s] = b"w%d" % s
        p.admit(s)
        p.touch(s)
    assert p.peek() == 1
    w = p.cold_weight
    p.forget(1)
    keys[1] = b"cold"
    p.admit(1)  # evicted from COLD and back: COLD should age slower
    assert p.cold_weight < w


def test_touch_run_equals_touching_one_by_one(policy: EvictionPolicy) -> None:
    """Short runs and runs long enough for the LRU's numpy pass, contiguous in its order
    or not, given as a list alone or with the same slots as an int32 array."""
    rng = random.Random(3)
    ref = make_policy(policy.name, 32)
    policy.grow(32)
    for s in range(32):
        policy.admit(s)
        ref.admit(s)
    for _ in range(600):
        start = rng.randrange(32)
        length = rng.randint(1, 8) if rng.random() < 0.5 else rng.randint(16, 30)
        run = [(start + i) % 32 for i in range(length)]
        if rng.random() < 0.5:
            run.reverse()
        if rng.random() < 0.5:
            # a reversed view, as the partition passes it: negative strides
            policy.touch_run(run, np.asarray(run[::-1], dtype=np.int32)[::-1])
        else:
            policy.touch_run(run)
        for s in run:
            ref.touch(s)
        assert policy.first(32) == ref.first(32) or policy.name != "LRU"
    assert [policy.pop_victim() for _ in range(32)] == [ref.pop_victim() for _ in range(32)]
