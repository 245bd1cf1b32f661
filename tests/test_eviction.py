"""One contract suite over every eviction policy, plus each policy's own order."""

from __future__ import annotations

import random

import pytest

from lmc_server.cache.eviction import POLICIES, EvictionPolicy, LRUPolicy, make_policy


@pytest.fixture(params=sorted(POLICIES))
def policy(request: pytest.FixtureRequest) -> EvictionPolicy:
    return make_policy(request.param, 16)


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
            present.discard(v)  # type: ignore[arg-type]
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
    with pytest.raises(ValueError, match="LRU, FIFO"):
        make_policy("random")


def test_touch_run_equals_touching_one_by_one(policy: EvictionPolicy) -> None:
    rng = random.Random(3)
    ref = make_policy(policy.name, 32)
    policy.grow(32)
    for s in range(32):
        policy.admit(s)
        ref.admit(s)
    for _ in range(300):
        start = rng.randrange(32)
        run = [(start + i) % 32 for i in range(rng.randint(1, 8))]
        if rng.random() < 0.5:
            run.reverse()
        policy.touch_run(run)
        for s in run:
            ref.touch(s)
        assert policy.first(32) == ref.first(32) or policy.name != "LRU"
    assert [policy.pop_victim() for _ in range(32)] == [ref.pop_victim() for _ in range(32)]
