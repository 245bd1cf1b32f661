"""The L2 tier with the CUDA backend: objects leave and enter L1 through pinned slabs.

What differs from the CPU runs of ``tests/tiers/test_l2_redis.py`` is the pool: the CUDA
engine's L1 is pinned host slabs (``slab_view``), written by the copy kernels on one
server and filled from Redis by the prefetch on another, then copied into GPU pages.
Two CUDA servers, one redis-server, GPU workers (``CudaKV``): store on A, lookup and
retrieve on B into other blocks, byte-exact; a damaged value is never served.

Needs redis-server on PATH: skipped without it, failed instead when
``LMC_REQUIRE_REDIS=1`` (set by scripts/gpu-perf.sh, which carries a redis-server to
the GPU machine).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from lmc_server.cache.status import ChunkStatus
from lmc_server.client import Client, Registration, chunk_digests
from lmc_server.protocol.stats import L2Report
from lmc_server.testing import poll
from lmc_server.testing.kv import assert_same_pages, block_ids_for
from lmc_server.testing.process import ServerProcess
from lmc_server.testing.redis_process import RedisProcess, redis_server_path
from lmc_server.tiers import codec

pytestmark = pytest.mark.gpu

CHUNK = 256
ARGS = [
    "--chunk-size",
    str(CHUNK),
    "--separate-object-groups",
    "--eviction-policy",
    "LRU",
    "--l2-timeout-s",
    "2",
]


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    if redis_server_path() is None:
        if os.environ.get("LMC_REQUIRE_REDIS") == "1":
            pytest.fail("LMC_REQUIRE_REDIS=1 but redis-server is not on PATH", pytrace=False)
        pytest.skip("redis-server is not installed")
    with RedisProcess() as r:
        yield r.url


@pytest.fixture(scope="module")
def servers(redis_url: str) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    with (
        ServerProcess(
            [*ARGS, "--l2", redis_url], backend="cuda", l1_size_gb=2, start_timeout_s=60
        ) as a,
        ServerProcess(
            [*ARGS, "--l2", redis_url], backend="cuda", l1_size_gb=2, start_timeout_s=60
        ) as b,
    ):
        a.wait_pool_ready()
        b.wait_pool_ready()
        yield a, b


def wait_for(cond: Callable[[], Any], what: str, timeout_s: float = 60.0) -> Any:
    return poll.wait_for(cond, what, timeout_s, poll_s=0.002)


def l2(c: Client) -> L2Report:
    out = c.stats().l2
    assert out is not None, "the server runs without --l2"
    return out


def written(c: Client, objects: int) -> bool:
    st = l2(c)
    return bool(
        st.objects_written >= objects and not st.write_queue_objects and not st.writes_in_flight
    )


def tokens(seed: int, chunks: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 100_000, chunks * CHUNK)


def full_key(c: Client, reg: Registration, digests: bytes, chunk: int) -> bytes:
    fp = next(bytes.fromhex(p.fingerprint) for p in c.stats().partitions if p.name == "full")
    return codec.l2_key(
        codec.space_of(reg.namespace, fp, CHUNK), digests[chunk * 32 : (chunk + 1) * 32]
    )


@pytest.mark.parametrize("n,layers", [(1, 8), (16, 44), (64, 44)])
def test_store_on_a_prefetch_and_retrieve_on_b_byte_exact(
    servers: tuple[ServerProcess, ServerProcess], n: int, layers: int
) -> None:
    """A's pinned slabs -> Redis -> B's pinned slabs -> B's worker's GPU pages."""
    from lmc_server.testing.cuda_kv import CudaKV, device_arch
    from lmc_server.testing.presets import dsv41_flash

    a, b = servers
    geo = dsv41_flash(arch=device_arch(0), num_blocks=8 * n + 8, layers=layers)
    digests = chunk_digests(tokens(100 + n, n), CHUNK)
    with (
        CudaKV(geo, 0) as kva,
        CudaKV(geo, 0) as kvb,
        Client(a.endpoint, timeout_s=60) as ca,
        Client(b.endpoint, timeout_s=60) as cb,
    ):
        kva.fill_random(n)
        kvb.fill(0)
        ra = ca.register(**kva.register_kwargs(model=f"gpu-l2/{layers}"))
        rb = cb.register(**kvb.register_kwargs(model=f"gpu-l2/{layers}"))
        wait_for(lambda: l2(cb).state == "up", "B connected to L2")
        before = l2(ca).objects_written
        ids = block_ids_for(ra, n, np.random.default_rng(n))
        res = ca.store(ra, digests, ids)
        assert res.ok.all(), res.statuses
        objects = sum(int(s.size) for s in res.statuses.values())
        wait_for(lambda: written(ca, before + objects), f"{objects} objects written")

        t0 = time.perf_counter()
        first = cb.lookup(rb, digests, lease=False)
        assert first.hit_chunks == 0 and first.l2_pending_chunks == n
        wait_for(
            lambda: (
                (r := cb.lookup(rb, digests, lease=False)).hit_chunks == n
                and r.l2_pending_chunks == 0
            ),
            f"{n} chunks prefetched into B's L1",
        )
        ready_ms = (time.perf_counter() - t0) * 1e3
        look = cb.lookup(rb, digests)
        assert look.hit_chunks == n and look.lease_id

        dst = block_ids_for(rb, n, np.random.default_rng(1000 + n))
        got = cb.retrieve(rb, digests, dst)
        assert got.ok.all() and got.ok_prefix == n
        assert_same_pages(rb, kva, ids, kvb, dst, n)  # type: ignore[arg-type]
        assert cb.release(look.lease_id)
        st = l2(cb)
        assert st.hits >= n and not sum(st.invalid.values())
        print(
            f"L1-miss-L2-hit ready on the CUDA backend: {n} chunks x {layers} layers "
            f"in {ready_ms:.1f} ms"
        )


def test_damaged_value_never_reaches_gpu_pages(
    servers: tuple[ServerProcess, ServerProcess], redis_url: str
) -> None:
    """Chunk 2 of 4 flipped in Redis: B serves the two chunks before it, never chunk 2,
    and the GPU pages meant for it keep their sentinel bytes."""
    import redis

    from lmc_server.testing.cuda_kv import CudaKV, device_arch
    from lmc_server.testing.presets import dsv41_flash

    a, b = servers
    n, bad = 4, 2
    geo = dsv41_flash(arch=device_arch(0), num_blocks=64, layers=8)
    digests = chunk_digests(tokens(777, n), CHUNK)
    with (
        CudaKV(geo, 0) as kva,
        CudaKV(geo, 0) as kvb,
        Client(a.endpoint, timeout_s=60) as ca,
        Client(b.endpoint, timeout_s=60) as cb,
    ):
        kva.fill_random(77)
        kvb.fill(0xA5)
        ra = ca.register(**kva.register_kwargs(model="gpu-l2/damaged"))
        rb = cb.register(**kvb.register_kwargs(model="gpu-l2/damaged"))
        before = l2(ca).objects_written
        ids = block_ids_for(ra, n, np.random.default_rng(5))
        res = ca.store(ra, digests, ids)
        assert res.ok.all()
        wait_for(
            lambda: written(ca, before + sum(int(s.size) for s in res.statuses.values())), "written"
        )
        r = redis.Redis.from_url(redis_url)
        key = full_key(ca, ra, digests, bad)
        value = r.get(key)
        assert isinstance(value, bytes)
        pos = len(value) - 100
        r.set(key, value[:pos] + bytes([value[pos] ^ 0x80]) + value[pos + 1 :])
        invalid_before = sum(l2(cb).invalid.values())

        wait_for(
            lambda: (
                (x := cb.lookup(rb, digests, lease=False)).l2_pending_chunks == 0
                and x.hit_chunks >= bad
            ),
            "the prefetch to end",
        )
        look = cb.lookup(rb, digests, lease=False)
        assert look.hit_chunks == bad, "a damaged object was served"
        assert sum(l2(cb).invalid.values()) > invalid_before
        assert l2(cb).invalid.get("checksum", 0) >= 1
        # The whole prefix asked for: served up to the damaged chunk, which is a miss,
        # and its GPU pages keep their sentinel.
        dst = block_ids_for(rb, n, np.random.default_rng(6))
        got = cb.retrieve(rb, digests, dst)
        assert got.ok_prefix == bad
        assert got.statuses["full"][bad] == ChunkStatus.MISS
        for g in (g for g in rb.groups if g.kind == "full"):
            for blk in dst[g.name].reshape(n, rb.blocks_per_chunk(g))[bad]:
                assert set(kvb.page(g.name, 0, int(blk)).tolist()) == {0xA5}, g.name
        # What was served is byte-exact.
        dst2 = block_ids_for(rb, bad, np.random.default_rng(7))
        got = cb.retrieve(rb, digests[: bad * 32], dst2)
        assert got.ok.all()
        src2 = {g: v.reshape(n, -1)[:bad].ravel() for g, v in ids.items()}
        assert_same_pages(rb, kva, src2, kvb, dst2, bad)  # type: ignore[arg-type]
