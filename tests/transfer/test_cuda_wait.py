"""The copy waiters' expected end: copies of one direction of one GPU queue behind each
other (they share its copy engines), other directions and GPUs do not; and how a waiter
waits: polling only for a copy alone on its GPU."""

from __future__ import annotations

import pytest

from lmc_server.transfer.cuda.wait import EXPECTED_BPS, WAIT_MODES, LinkClock, wait_mode

MB = 1_000_000


def test_copies_in_one_direction_end_one_after_the_other() -> None:
    clock = LinkClock()
    one = 55 * MB / EXPECTED_BPS
    assert clock.expect(0, False, 55 * MB, 10.0) == pytest.approx(10.0 + one)
    assert clock.expect(0, False, 55 * MB, 10.0) == pytest.approx(10.0 + 2 * one)
    assert clock.expect(0, True, 55 * MB, 10.0) == pytest.approx(10.0 + one)  # other way
    assert clock.expect(1, False, 55 * MB, 10.0) == pytest.approx(10.0 + one)  # other GPU


def test_an_idle_link_starts_a_copy_at_its_launch() -> None:
    clock = LinkClock()
    clock.expect(0, False, 55 * MB, 10.0)
    later = clock.expect(0, False, 55 * MB, 20.0)
    assert later == pytest.approx(20.0 + 55 * MB / EXPECTED_BPS)


def test_hybrid_polls_only_for_a_lone_copy_and_block_always_blocks() -> None:
    assert wait_mode("hybrid", 1) == "hybrid"
    assert wait_mode("hybrid", 2) == "block"
    assert wait_mode("hybrid", 8) == "block"
    assert wait_mode("block", 1) == "block"
    assert {wait_mode(m, n) for m in WAIT_MODES for n in (1, 2)} <= set(WAIT_MODES)
