"""The disk tier with the CUDA backend: objects leave and enter L1 through pinned slabs.

What differs from the CPU runs of ``tests/tiers/test_disk_tier.py`` is the pool: the CUDA
engine's L1 is pinned host slabs (``slab_view``), written by the copy kernels on A and
written to disk from there (one copy into an aligned buffer), then read from disk into
B's pinned slabs (B starts on the directory A filled and left) and copied into GPU
pages. Byte-exact at 1, 16 and 64 chunks; a damaged file never reaches GPU pages.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from lmc_server.cache.status import ChunkStatus
from lmc_server.client import Client, chunk_digests
from lmc_server.protocol.stats import DiskReport
from lmc_server.testing.kv import assert_same_pages, block_ids_for
from lmc_server.testing.process import ServerProcess
from lmc_server.testing.tierworker import CHUNK, tokens, wait_for
from lmc_server.tiers import codec

pytestmark = pytest.mark.gpu

ARGS = ["--chunk-size", str(CHUNK), "--separate-object-groups", "--eviction-policy", "LRU"]


def server(directory: Path) -> ServerProcess:
    return ServerProcess(
        [*ARGS, "--disk-dir", str(directory), "--disk-size-gb", "8"],
        backend="cuda",
        l1_size_gb=2,
        start_timeout_s=60,
    )


def disk(c: Client) -> DiskReport:
    out = c.stats().disk
    assert out is not None
    return out


@pytest.mark.parametrize("n,layers", [(1, 8), (16, 44), (64, 44)])
def test_store_on_a_restart_and_retrieve_on_b_byte_exact(
    tmp_path: Path, n: int, layers: int
) -> None:
    """A's pinned slabs -> files -> (A stops, B starts) -> B's pinned slabs -> GPU."""
    from lmc_server.testing.cuda_kv import CudaKV, device_arch
    from lmc_server.testing.presets import dsv41_flash

    geo = dsv41_flash(arch=device_arch(0), num_blocks=8 * n + 8, layers=layers)
    digests = chunk_digests(tokens(100 + n, n), CHUNK)
    bad = n // 2 if n > 1 else None
    with CudaKV(geo, 0) as kva, CudaKV(geo, 0) as kvb:
        kva.fill_random(n)
        kvb.fill(0xA5)
        with server(tmp_path) as a, Client(a.endpoint, timeout_s=60) as ca:
            a.wait_pool_ready()
            ra = ca.register(**kva.register_kwargs(model=f"gpu-disk/{layers}"))
            wait_for(lambda: disk(ca).state == "up", "disk tier up", 60)
            ids = block_ids_for(ra, n, np.random.default_rng(n))
            res = ca.store(ra, digests, ids)
            assert res.ok.all(), res.statuses
            objects = sum(int(s.size) for s in res.statuses.values())
            wait_for(
                lambda: (
                    (st := disk(ca)).objects_written >= objects
                    and not st.write_queue_objects
                    and not st.writes_in_flight
                ),
                "written to disk",
                60,
            )
            fp = next(
                bytes.fromhex(p.fingerprint) for p in ca.stats().partitions if p.name == "full"
            )
            space = codec.space_of(ra.namespace, fp, CHUNK).hex()
        if bad is not None:  # flip one payload byte of chunk `bad`'s full object
            ck = digests[bad * 32 : (bad + 1) * 32].hex()
            f = tmp_path / "lmc2" / space / ck[:2] / ck
            data = bytearray(f.read_bytes())
            data[-100] ^= 0x80
            f.write_bytes(bytes(data))
        want = n if bad is None else bad
        with server(tmp_path) as b, Client(b.endpoint, timeout_s=60) as cb:
            rb = cb.register(**kvb.register_kwargs(model=f"gpu-disk/{layers}"))
            wait_for(lambda: disk(cb).state == "up", "disk tier up", 60)
            t0 = time.perf_counter()
            wait_for(
                lambda: (
                    (r := cb.lookup(rb, digests, lease=False)).hit_chunks >= want
                    and r.l2_pending_chunks == 0
                ),
                "prefetched from disk",
                60,
            )
            ready_ms = (time.perf_counter() - t0) * 1e3
            look = cb.lookup(rb, digests)
            assert look.hit_chunks == want, "a damaged object was served"
            dst = block_ids_for(rb, n, np.random.default_rng(1000 + n))
            got = cb.retrieve(rb, digests, dst)
            assert got.ok_prefix == want
            if bad is not None:
                assert got.statuses["full"][bad] == ChunkStatus.MISS
                assert disk(cb).invalid.get("checksum", 0) == 1
                for g in (g for g in rb.groups if g.kind == "full"):
                    for blk in dst[g.name].reshape(n, rb.blocks_per_chunk(g))[bad]:
                        assert set(kvb.page(g.name, 0, int(blk)).tolist()) == {0xA5}
            head = {g: v.reshape(n, -1)[:want].ravel() for g, v in ids.items()}
            dst2 = block_ids_for(rb, want, np.random.default_rng(7))
            got = cb.retrieve(rb, digests[: want * 32], dst2)
            assert got.ok.all()
            assert_same_pages(rb, kva, head, kvb, dst2, want)  # type: ignore[arg-type]
            cb.release(look.lease_id)
            print(
                f"L1-miss-disk-hit ready on the CUDA backend after a restart: {want} "
                f"chunks x {layers} layers in {ready_ms:.1f} ms"
            )
