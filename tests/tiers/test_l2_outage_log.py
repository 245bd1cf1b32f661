"""A store that dies mid-run is one WARNING line per outage, never a traceback.

Real redis-server, real server processes, writes and prefetches in flight over several
connections when the store is killed (SIGKILL) or frozen (SIGSTOP): the server's log
has exactly one ``degraded`` WARNING for the outage and one ``connected`` line for the
recovery, no traceback, and no future or task whose exception nobody retrieved
(asyncio's ``... exception was never retrieved``); after the recovery, stores and L2
reads are byte-exact again. And the adapter alone: the reconnect that follows one failed
batch leaves the connections of the batches still sending to their threads.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal

import numpy as np
import pytest

from lmc_server.client import chunk_digests
from lmc_server.testing.redis_process import RedisProcess, redis_server_path
from lmc_server.testing.tierworker import (
    CHUNK,
    Worker,
    l2_server,
    l2_stats,
    retrieve_exact,
    tokens,
    wait_for,
    wait_l2_written,
)
from lmc_server.tiers import codec
from lmc_server.tiers.backend import SlotObject, SlotRead
from lmc_server.tiers.redis.backend import RedisBackend

if redis_server_path() is None:
    if os.environ.get("CI") == "true":
        pytest.fail(
            "CI=true but redis-server is not installed (.ci/install-redis.sh)", pytrace=False
        )
    pytestmark = pytest.mark.skip(
        reason="redis-server is not installed (apt-get install redis-server)"
    )

#: What must never be in the log of an outage: a traceback, a future or task whose
#: exception nobody retrieved.
NEVER = ("Traceback", "never retrieved", "ERROR")


def _outage_lines(log: str) -> tuple[list[str], list[str]]:
    lines = log.splitlines()
    degraded = [ln for ln in lines if "degraded (serving from L1 only)" in ln]
    connected = [ln for ln in lines if ln.rstrip().endswith(": connected")]
    return degraded, connected


def _assert_clean(log: str) -> None:
    for word in NEVER:
        assert word not in log, f"{word!r} in the server's log:\n{log}"


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_store_dying_mid_writes_is_one_warning_no_traceback(how: str) -> None:
    # A timeout well above what a write takes on a loaded 2-core machine: the one
    # outage is the one the test makes.
    with RedisProcess() as r, l2_server(r.url, "--l2-connections", "8", l2_timeout_s=2.0) as a:
        w, reader = Worker(a.endpoint, seed=5), Worker(a.endpoint, seed=0)
        try:
            wait_for(lambda: l2_stats(w.client).state == "up", "connected")
            d0 = chunk_digests(tokens(100, 4), CHUNK)
            w.store(d0, block_seed=1)
            wait_l2_written(w.client, 8)
            # Writes in flight on every connection when the store goes: 8 objects per
            # store, each batch split over 8 connections.
            for i in range(6):
                w.store(chunk_digests(tokens(200 + i, 4), CHUNK), block_seed=10 + i)
            assert r.proc is not None
            if how == "kill":
                r.kill()
            else:
                os.kill(r.proc.pid, signal.SIGSTOP)
            for i in range(6):  # stores and L1 go on, writes fail or are dropped
                w.store(chunk_digests(tokens(300 + i, 4), CHUNK), block_seed=20 + i)
            wait_for(lambda: l2_stats(w.client).state == "degraded", "degraded", 20)
            # A prefetch attempted while down, and L1 hits meanwhile.
            reader.client.clear()
            assert w.client.lookup(w.reg, d0, lease=False).hit_chunks in (0, 4)
            if how == "kill":
                r.start()
            else:
                os.kill(r.proc.pid, signal.SIGCONT)
            wait_for(lambda: l2_stats(w.client).state == "up", "L2 back up", 30)
            d1 = chunk_digests(tokens(400, 4), CHUNK)
            ids = w.store(d1, block_seed=33)
            written = l2_stats(w.client).objects_written
            wait_for(lambda: l2_stats(w.client).objects_written >= written, "writes after")
            wait_l2_written(w.client, written)
            # Byte-exact from L2 on a second server after the recovery.
            with l2_server(r.url) as b:
                other = Worker(b.endpoint, seed=0)
                try:
                    wait_for(lambda: l2_stats(other.client).state == "up", "B connected")
                    retrieve_exact(other, w, ids, d1, 4)
                    assert not l2_stats(other.client).invalid
                finally:
                    other.close()
            gc.collect()
        finally:
            w.close()
            reader.close()
        a.terminate()
        log = a.log()
    _assert_clean(log)
    degraded, connected = _outage_lines(log)
    assert len(degraded) == 1, log
    assert len(connected) == 2, "\n".join(connected) or log  # at start, after the outage


def test_a_reconnect_leaves_the_writes_in_flight_their_connections() -> None:
    """Writes blocked mid-send on a frozen store while the tier reconnects: closing
    the old client's connections under their threads made redis-py's next send raise
    ``AttributeError`` (its socket gone), a traceback in the log. The reconnect closes
    only idle connections: once the store thaws, the writes in flight finish on their
    own connections, and every value reads back byte for byte."""
    space = bytes(range(16))
    size = 8 << 20  # 2 x 16 MiB per connection: more than loopback buffers take
    data = np.random.default_rng(11).integers(0, 256, 4 * size, dtype=np.uint8)
    cks = [i.to_bytes(32, "big") for i in range(4)]
    objs = [
        SlotObject(codec.l2_key(space, ck), space, ck, 1, data[i * size : (i + 1) * size].data)
        for i, ck in enumerate(cks)
    ]

    async def go(r: RedisProcess) -> None:
        assert r.proc is not None
        b = RedisBackend(r.url, timeout_s=10.0, connections=2)
        await b.connect()
        os.kill(r.proc.pid, signal.SIGSTOP)
        try:
            put = asyncio.ensure_future(b.put_slots(objs))
            await asyncio.sleep(0.3)  # both write threads blocked in sendall
            assert not put.done()
            reconnect = asyncio.ensure_future(b.connect())
            await asyncio.sleep(0.3)
        finally:
            os.kill(r.proc.pid, signal.SIGCONT)
        await reconnect
        await put  # raised L2Error or AttributeError when its connections were closed
        back = np.zeros(4 * size, dtype=np.uint8)
        reads = [
            SlotRead(codec.l2_key(space, ck), space, ck, 1, back[i * size : (i + 1) * size].data)
            for i, ck in enumerate(cks)
        ]
        assert await b.get_into(reads) == [True] * 4
        assert np.array_equal(back, data)
        await b.shutdown()

    with RedisProcess() as r:
        asyncio.run(go(r))
