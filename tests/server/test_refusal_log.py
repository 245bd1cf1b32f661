"""A client that repeats a refused request cannot flood the server's log.

Each refusal is still answered and counted; the log gets the first
:data:`~lmc_server.server.refusal_log.REFUSALS_LOGGED` lines of each client per
interval and then a summary by code, and the server goes on serving everyone else.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from lmc_server.client import Client, Registration, ServerError, chunk_digests
from lmc_server.server.refusal_log import REFUSAL_LOG_INTERVAL_S, REFUSALS_LOGGED
from lmc_server.testing.inprocess import FakeClock, run_server
from lmc_server.testing.kv import ShmKV, assert_same_pages, block_ids_for
from lmc_server.testing.presets import simple_model
from lmc_server.testing.process import ServerProcess

FLOOD = 200


def refuse(c: Client, reg: Registration, n: int) -> list[str]:
    """``n`` stores with an out-of-range block id; the codes of the replies."""
    ids = {g.name: np.full(reg.blocks_per_chunk(g), 10**6) for g in reg.groups if g.cached}
    codes = []
    for i in range(n):
        with pytest.raises(ServerError) as e:
            c.store(reg, chunk_digests(np.arange(256) + i, 256), ids)
        codes.append(e.value.code)
    return codes


def byte_exact_round_trip(c: Client, kv: ShmKV, reg: Registration, seed: int) -> None:
    """Store two chunks and retrieve them into other blocks of the same (randomly
    filled) cache: a retrieve that copied nothing leaves other bytes there."""
    digests = chunk_digests(np.arange(512) + seed, 256)
    src = block_ids_for(reg, 2)
    assert c.store(reg, digests, src).ok.all()
    lease = c.lookup(reg, digests)
    assert lease.hit_chunks == 2
    dst = block_ids_for(reg, 2, first_block=32)
    assert c.retrieve(reg, digests, dst).ok.all()
    c.release(lease.lease_id)
    assert_same_pages(reg, kv, src, kv, dst, 2)


def test_a_refusal_flood_is_answered_counted_and_logged_a_few_lines() -> None:
    with (
        ServerProcess(["--chunk-size", "256"]) as srv,
        Client(srv.endpoint, client_name="looping-worker") as bad,
        Client(srv.endpoint, client_name="bystander") as good,
        ShmKV(simple_model(num_blocks=64)) as kv_bad,
        ShmKV(simple_model(num_blocks=64)) as kv_good,
    ):
        kv_bad.fill_random(1)
        kv_good.fill_random(2)
        reg_bad = bad.register(**kv_bad.register_kwargs())
        reg_good = good.register(**kv_good.register_kwargs())
        byte_exact_round_trip(good, kv_good, reg_good, seed=1)
        assert refuse(bad, reg_bad, FLOOD) == ["bounds"] * FLOOD
        assert good.stats().counters.requests.get("store:bounds") == FLOOD
        byte_exact_round_trip(good, kv_good, reg_good, seed=2)  # the others are served
        log = srv.log()
    lines = [line for line in log.splitlines() if "refused store from looping-worker" in line]
    assert len(lines) == REFUSALS_LOGGED, log[-2000:]
    assert "looping-worker: 10 requests refused within 60 s; further refusals" in log
    assert "bystander" not in "".join(lines)


def test_the_rest_is_summarized_after_the_interval_and_logging_starts_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    caplog.set_level(logging.INFO, logger="lmc_server.server.refusal_log")
    with (
        run_server(clock=clock, chunk_size=256) as ts,
        Client(ts.endpoint, client_name="looping-worker") as c,
        ShmKV(simple_model(num_blocks=64)) as kv,
    ):
        reg = c.register(**kv.register_kwargs())
        refuse(c, reg, REFUSALS_LOGGED + 7)

        def summaries() -> list[str]:
            return [
                r.getMessage()
                for r in caplog.records
                if "more requests refused in" in r.getMessage()
            ]

        assert summaries() == []  # the interval is not over
        clock.advance(REFUSAL_LOG_INTERVAL_S)
        ts.wait_housekeeping()  # one whole tick after the interval ended
        assert summaries() == [
            "looping-worker: 7 more requests refused in 60 s, not logged one by one (bounds 7)"
        ]
        caplog.clear()
        refuse(c, reg, 1)  # a new interval: logged again
        assert [r.getMessage() for r in caplog.records if "refused store" in r.getMessage()]
