"""Objects queued for a lower tier stay in L1 until written (within a quarter of L1).

A real server on a real redis-server that is frozen (SIGSTOP) while a burst is stored
and then L1 is flooded with other stores, far past its size; then Redis thaws. The
burst (216 MB, more than the write-behind's batches in flight, less than a quarter of
the 1 GiB L1) is in L2 whole afterwards, byte for byte: L1 evicted the flood's objects,
not the queued ones. Without the pins, LRU evicted the burst first (the oldest) and
its writes were skipped as ``evicted``.
"""

from __future__ import annotations

import os
import signal

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
BURST_CHUNKS = 40
FLOOD_PROMPTS = 100  # of 4 chunks: 2.1 GB into a 1 GiB L1


def test_a_burst_queued_behind_a_frozen_store_survives_an_l1_flood() -> None:
    with RedisProcess() as r:
        args = [*BASE_ARGS, "--l2", r.url, "--l2-timeout-s", "30"]
        with ServerProcess(args, l1_size_gb=1.0) as a:
            w = Worker(a.endpoint, seed=21, num_blocks=512)
            try:
                wait_for(lambda: l2_stats(w.client).state == "up", "connected")
                assert r.proc is not None
                os.kill(r.proc.pid, signal.SIGSTOP)
                try:
                    burst = chunk_digests(tokens(3000, BURST_CHUNKS), CHUNK)
                    ids = w.store(burst, block_seed=1)
                    for p in range(FLOOD_PROMPTS):
                        w.store(chunk_digests(tokens(4000 + p, 4), CHUNK), block_seed=2)
                    assert w.client.stats().counters.evictions > 0, "L1 was not flooded"
                finally:
                    os.kill(r.proc.pid, signal.SIGCONT)
                assert l2_stats(w.client).state == "up"
                wait_l2_written(w.client, 2 * BURST_CHUNKS)
                with l2_server(r.url) as b:
                    reader = Worker(b.endpoint, seed=0, num_blocks=512)
                    try:
                        wait_for(lambda: l2_stats(reader.client).state == "up", "B connected")
                        retrieve_exact(reader, w, ids, burst, BURST_CHUNKS)
                    finally:
                        reader.close()
            finally:
                w.close()
