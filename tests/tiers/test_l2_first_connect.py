"""What is stored while a tier's first connect is under way still reaches the tier.

A real server started on a real redis-server that is frozen (SIGSTOP) before the
server starts: the first connect hangs, a burst is stored meanwhile, then Redis thaws.
Every object of the burst is written once the connect completes (none dropped as
``l2_down``) and a second server reads it back byte for byte. Dropped at once, the
first stores after a start never reached a tier whose connect (a disk directory's
check on a loaded machine, a Redis across the network) took longer than the pool's
preparation. A store that cannot be reached at all at start still drops what waited:
the second case.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from lmc_server.client import chunk_digests
from lmc_server.testing.process import ServerProcess
from lmc_server.testing.redis_process import RedisProcess
from lmc_server.testing.tierworker import (
    BASE_ARGS,
    CHUNK,
    Worker,
    l2_server,
    l2_stats,
    retrieve_exact,
    tokens,
    wait_for,
    wait_l2_written,
)

pytestmark = pytest.mark.needs_tool(
    "redis-server", "Debian: redis-server; CI: .ci/install-redis.sh"
)
CHUNKS = 6
#: Objects per chunk of the preset the tier worker registers (full and window groups).
OBJECTS_PER_CHUNK = 2


@contextmanager
def _frozen_before_start() -> Iterator[RedisProcess]:
    """A real redis-server, frozen (SIGSTOP) until the block ends."""
    with RedisProcess() as r:
        assert r.proc is not None
        os.kill(r.proc.pid, signal.SIGSTOP)
        try:
            yield r
        finally:
            _thaw(r)


def _thaw(r: RedisProcess) -> None:
    assert r.proc is not None
    os.kill(r.proc.pid, signal.SIGCONT)


def _pool_ready(w: Worker) -> None:
    wait_for(lambda: w.client.stats().l1.ready_slabs > 0, "the first slab")


def test_stores_during_the_first_connect_are_written_once_it_connects() -> None:
    with _frozen_before_start() as r:
        args = [*BASE_ARGS, "--l2", r.url, "--l2-timeout-s", "30"]
        with ServerProcess(args, l1_size_gb=0.25) as a:
            w = Worker(a.endpoint, seed=31, num_blocks=256)
            try:
                _pool_ready(w)
                st = l2_stats(w.client)
                assert st.state != "up", "the connect to a frozen Redis completed"
                digests = chunk_digests(tokens(700, CHUNKS), CHUNK)
                ids = w.store(digests, block_seed=1)
                st = l2_stats(w.client)
                assert st.write_queue_objects == OBJECTS_PER_CHUNK * CHUNKS
                assert not st.dropped_writes, st.dropped_writes
                _thaw(r)
                wait_for(lambda: l2_stats(w.client).state == "up", "connected")
                wait_l2_written(w.client, OBJECTS_PER_CHUNK * CHUNKS)
                assert not l2_stats(w.client).dropped_writes
                with l2_server(r.url) as b:
                    reader = Worker(b.endpoint, seed=0, num_blocks=256)
                    try:
                        wait_for(lambda: l2_stats(reader.client).state == "up", "B up")
                        retrieve_exact(reader, w, ids, digests, CHUNKS)
                    finally:
                        reader.close()
            finally:
                w.close()


def test_stores_waiting_for_a_first_connect_that_fails_are_dropped_as_down() -> None:
    """The connect gives up (``--l2-timeout-s`` x 2) while Redis stays frozen: what
    waited is dropped as ``l2_down`` (counted), nothing stays queued or pinned, and
    the server goes on serving from L1."""
    with _frozen_before_start() as r:
        args = [*BASE_ARGS, "--l2", r.url, "--l2-timeout-s", "1.5"]
        with ServerProcess(args, l1_size_gb=0.25) as a:
            w = Worker(a.endpoint, seed=32, num_blocks=256)
            try:
                _pool_ready(w)
                digests = chunk_digests(tokens(800, CHUNKS), CHUNK)
                w.store(digests, block_seed=1)
                objects = OBJECTS_PER_CHUNK * CHUNKS
                wait_for(
                    lambda: l2_stats(w.client).dropped_writes.get("l2_down", 0) >= objects,
                    "the waiting writes dropped",
                )
                st = l2_stats(w.client)
                assert st.write_queue_objects == 0 and st.objects_written == 0
                look = w.client.lookup(w.reg, digests, lease=False)
                assert look.hit_chunks == CHUNKS, "L1 lost the burst"
            finally:
                w.close()
