"""The server end to end: real server process, real client processes, real bytes.

Every test compares retrieved pages byte for byte with what the storing process had,
regenerated from the same seeds (tests/kvworker.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lmc_server.cache.status import ChunkStatus
from lmc_server.client import Client, ServerError, chunk_digests
from lmc_server.protocol.stats import PhaseSum
from lmc_server.testing import ShmKV, dsv41_flash
from lmc_server.testing.kv import assert_same_pages, block_ids_for
from lmc_server.testing.process import ServerProcess

WORKER = str(Path(__file__).resolve().parents[1] / "kvworker.py")
NUM_BLOCKS = 64


def run_worker(endpoint: str, **kw: object) -> dict[str, list[int]]:
    args = {"endpoint": endpoint, "num_blocks": NUM_BLOCKS, **kw}
    out = subprocess.run(
        [sys.executable, WORKER, json.dumps(args)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def tokens(token_seed: int, chunks: int) -> np.ndarray:
    return np.random.default_rng(token_seed).integers(0, 100_000, chunks * 256)


def expected_kv(seed: int, arch: str = "sm90") -> ShmKV:
    kv = ShmKV(dsv41_flash(arch=arch, num_blocks=NUM_BLOCKS))
    kv.fill_random(seed)
    return kv


def test_store_in_one_process_retrieve_in_another_into_other_blocks(client: Client) -> None:
    n = 6
    st = run_worker(client.endpoint, seed=11, token_seed=1, block_seed=2, chunks=n)
    assert st["full"] == [ChunkStatus.OK] * n and st["window128"] == [ChunkStatus.OK] * n
    with expected_kv(11) as src, ShmKV(dsv41_flash(num_blocks=NUM_BLOCKS)) as dst:
        dst.fill(0)
        reg = client.register(**dst.register_kwargs())
        digests = chunk_digests(tokens(1, n), 256)
        look = client.lookup(reg, digests)
        assert look.hit_chunks == n and look.lease_id
        dst_ids = block_ids_for(reg, n, np.random.default_rng(99))
        res = client.retrieve(reg, digests, dst_ids)
        assert res.ok.all() and res.ok_prefix == n
        assert_same_pages(
            reg, src, block_ids_for(reg, n, np.random.default_rng(2)), dst, dst_ids, n
        )
        assert client.release(look.lease_id)
        scratch = dst.group("compressor_scratch")
        assert not dst.segments[scratch.layers[0].buffer].array.any(), "scratch was written"
        client.unregister(reg)


def test_replicated_namespace_rank0_stores_once_all_ranks_retrieve(server: ServerProcess) -> None:
    n = 4
    with Client(server.endpoint) as admin:
        admin.clear()
        before = admin.stats().counters.stored_bytes
        st = run_worker(
            server.endpoint,
            seed=21,
            token_seed=3,
            block_seed=4,
            chunks=n,
            world_size=8,
            rank=0,
            replicated=True,
        )
        assert st["full"] == [0] * n
        digests = chunk_digests(tokens(3, n), 256)
        with expected_kv(21) as src:
            src_ids = None
            for rank in range(1, 8):
                with ShmKV(dsv41_flash(num_blocks=NUM_BLOCKS)) as dst, Client(server.endpoint) as c:
                    dst.fill(0)
                    reg = c.register(
                        **dst.register_kwargs(world_size=8, rank=rank, replicated=True)
                    )
                    src_ids = src_ids or block_ids_for(reg, n, np.random.default_rng(4))
                    assert c.lookup(reg, digests, lease=False).hit_chunks == n
                    # a second store by another rank copies nothing
                    again = c.store(reg, digests, block_ids_for(reg, n))
                    assert again.count(ChunkStatus.EXISTS) == 2 * n
                    ids = block_ids_for(reg, n, np.random.default_rng(100 + rank))
                    assert c.retrieve(reg, digests, ids).ok.all()
                    assert_same_pages(reg, src, src_ids, dst, ids, n)
        stats = admin.stats()
        chunk_bytes = dsv41_flash().chunk_bytes(256)
        assert stats.counters.stored_bytes - before == n * chunk_bytes
        assert stats.l1.objects == 2 * n


def test_sm90_chunks_are_invisible_to_sm100(client: Client) -> None:
    n = 2
    run_worker(client.endpoint, seed=31, token_seed=5, block_seed=6, chunks=n, arch="sm90")
    digests = chunk_digests(tokens(5, n), 256)
    with ShmKV(dsv41_flash(arch="sm100", num_blocks=NUM_BLOCKS)) as kv:
        reg = client.register(**kv.register_kwargs())
        assert reg.namespace != run_namespace("sm90")
        assert client.lookup(reg, digests).hit_chunks == 0
        res = client.retrieve(reg, digests, block_ids_for(reg, n))
        assert res.count(ChunkStatus.MISS) >= n


def run_namespace(arch: str) -> str:
    return f"model=deepseek-ai/DeepSeek-V4.1-Flash;kv_dtype=fp8_ds_mla;arch={arch};world=1;rank=0"


def test_out_of_range_block_id_refused_and_nothing_copied(client: Client) -> None:
    n = 2
    run_worker(client.endpoint, seed=41, token_seed=7, block_seed=8, chunks=n)
    digests = chunk_digests(tokens(7, n), 256)
    with ShmKV(dsv41_flash(num_blocks=NUM_BLOCKS)) as dst:
        dst.fill(0x5A)
        reg = client.register(**dst.register_kwargs())
        ids = block_ids_for(reg, n)
        ids["indexer"] = ids["indexer"].copy()
        ids["indexer"][3] = NUM_BLOCKS
        with pytest.raises(ServerError) as e:
            client.retrieve(reg, digests, ids)
        assert e.value.code == "bounds" and f"block id {NUM_BLOCKS}" in e.value.message
        assert "'indexer'" in e.value.message
        assert all((s.array == 0x5A).all() for s in dst.segments), "bytes were copied"
        ids["indexer"][3] = -2
        stored_before = client.stats().counters.stored_objects
        with pytest.raises(ServerError, match="bounds"):
            client.store(reg, chunk_digests(tokens(70, n), 256), ids)
        assert client.stats().counters.stored_objects == stored_before
        # still serving, nothing lost
        assert client.lookup(reg, digests, lease=False).hit_chunks == n
        good = block_ids_for(reg, n)
        assert client.retrieve(reg, digests, good).ok.all()


def test_scratch_group_never_copied_and_refused_in_requests(client: Client) -> None:
    with ShmKV(dsv41_flash(num_blocks=NUM_BLOCKS)) as kv:
        kv.fill_random(5)
        scratch = kv.group("compressor_scratch")
        buf = kv.segments[scratch.layers[0].buffer].array
        buf[:] = 0xAB
        reg = client.register(**kv.register_kwargs())
        assert all("compressor_scratch" not in og.groups for og in reg.object_groups)
        assert reg.chunk_bytes == dsv41_flash().chunk_bytes(256)
        digests = chunk_digests(tokens(9, 1), 256)
        assert client.store(reg, digests, block_ids_for(reg, 1)).ok.all()
        buf[:] = 0
        assert client.retrieve(reg, digests, block_ids_for(reg, 1, first_block=8)).ok.all()
        assert not buf.any(), "retrieve wrote into the scratch group"
        raw = reg.encode_block_ids(block_ids_for(reg, 1), 1)
        raw[-1] = np.zeros(1, "<i4").tobytes()
        from lmc_server.protocol import messages as m

        with pytest.raises(ServerError, match="scratch and never cached"):
            client._call(
                m.Store(
                    req_id=999, registration_id=reg.registration_id, digests=digests, block_ids=raw
                ),
                m.StoreResult,
            )


def test_partial_hit_reports_only_the_prefix(client: Client) -> None:
    with ShmKV(dsv41_flash(num_blocks=NUM_BLOCKS)) as kv:
        kv.fill_random(6)
        reg = client.register(**kv.register_kwargs())
        digests = chunk_digests(tokens(12, 5), 256)
        ids = block_ids_for(reg, 5)
        one = {k: v.reshape(5, -1) for k, v in ids.items()}
        for c in (0, 1, 3, 4):
            part = {k: v[c] for k, v in one.items()}
            assert client.store(reg, digests[32 * c : 32 * (c + 1)], part).ok.all()
        look = client.lookup(reg, digests)
        assert look.hit_chunks == 2
        res = client.retrieve(reg, digests, ids)
        assert res.statuses["full"].tolist() == [0, 0, ChunkStatus.MISS, 0, 0]
        assert res.ok_prefix == 2
        client.release(look.lease_id)


def test_second_registration_same_namespace_shares_chunks(client: Client) -> None:
    with (
        ShmKV(dsv41_flash(num_blocks=NUM_BLOCKS)) as a,
        ShmKV(dsv41_flash(num_blocks=NUM_BLOCKS, stride_pad=64)) as b,
    ):
        a.fill_random(8)
        b.fill(0)
        ra = client.register(**a.register_kwargs())
        with Client(client.endpoint) as other:
            rb = other.register(**b.register_kwargs())
            assert ra.namespace == rb.namespace
            digests = chunk_digests(tokens(13, 3), 256)
            ids_a = block_ids_for(ra, 3, np.random.default_rng(1))
            assert client.store(ra, digests, ids_a).ok.all()
            ids_b = block_ids_for(rb, 3, np.random.default_rng(2))
            assert other.retrieve(rb, digests, ids_b).ok.all()
            assert_same_pages(ra, a, ids_a, b, ids_b, 3)


def test_registration_of_another_connection_is_unreachable(client: Client) -> None:
    with ShmKV(dsv41_flash(num_blocks=NUM_BLOCKS)) as kv:
        reg = client.register(**kv.register_kwargs())
        with Client(client.endpoint) as thief:
            with pytest.raises(ServerError) as e:
                thief.lookup(reg, chunk_digests(tokens(1, 1), 256))
            assert e.value.code == "unknown_registration"
        client.unregister(reg)
        with pytest.raises(ServerError, match="unknown_registration"):
            client.lookup(reg, chunk_digests(tokens(1, 1), 256))


def test_unregister_unmaps_shared_memory(server: ServerProcess, client: Client) -> None:
    assert server.proc is not None
    maps = Path(f"/proc/{server.proc.pid}/maps")
    with ShmKV(dsv41_flash(num_blocks=8)) as kv:
        reg = client.register(**kv.register_kwargs())
        names = [s.name for s in kv.segments]
        assert any(name in maps.read_text() for name in names)
        client.unregister(reg)
        client.ping()
        assert not any(name in maps.read_text() for name in names)


def test_lookup_only_registration_sees_the_workers_chunks_and_cannot_copy(client: Client) -> None:
    """The scheduler's registration (no buffers) looks up what a worker of the same model
    stored, and nothing else, and may not copy."""
    geo = dsv41_flash(num_blocks=NUM_BLOCKS)
    reg = client.register(model=geo.model, kv_dtype=geo.kv_dtype, arch="sm90", groups=geo.groups)
    assert reg.lookup_only
    stored = chunk_digests(tokens(7, 2), 256)
    unseen = chunk_digests(tokens(8, 2), 256)
    with ShmKV(geo) as kv:
        worker = client.register(**kv.register_kwargs())
        assert client.store(worker, stored, block_ids_for(worker, 2)).ok.all()
        hit = client.lookup(reg, stored)
        assert hit.hit_chunks == 2
        client.release(hit.lease_id)
        assert client.lookup(reg, unseen).hit_chunks == 0
        with pytest.raises(ServerError, match="lookup_only"):
            client.store(reg, unseen[:32], block_ids_for(reg, 1))
        client.unregister(worker)


def test_bad_shared_memory_name_refused(client: Client) -> None:
    geo = dsv41_flash(num_blocks=NUM_BLOCKS)
    from lmc_server.buffers import ShmBuffer

    bufs = [ShmBuffer(name="../etc/passwd", size_bytes=s) for s in geo.buffer_sizes]
    with pytest.raises(ServerError, match="transfer.*must match"):
        client.register(
            model=geo.model, kv_dtype=geo.kv_dtype, arch="sm90", groups=geo.groups, buffers=bufs
        )
    bufs = [ShmBuffer(name="lmc-does-not-exist", size_bytes=s) for s in geo.buffer_sizes]
    with pytest.raises(ServerError, match="cannot open shared memory"):
        client.register(
            model=geo.model, kv_dtype=geo.kv_dtype, arch="sm90", groups=geo.groups, buffers=bufs
        )


def test_nvfp4_on_sm90_refused_with_arch_error(client: Client) -> None:
    geo = dsv41_flash(num_blocks=NUM_BLOCKS)
    g = geo.groups[2]
    fp4 = type(g)(
        **{**{f: getattr(g, f) for f in g.__struct_fields__}, "record_format": "nvfp4_ds_mla"}
    )
    groups = [fp4 if x is g else x for x in geo.groups]
    with ShmKV(geo) as kv:
        with pytest.raises(ServerError) as e:
            client.register(**kv.register_kwargs(groups=groups))
        assert e.value.code == "arch" and "sm100" in e.value.message
    client.ping()


def test_stats_say_where_data_requests_spend_their_time(client: Client) -> None:
    """Each store and retrieve adds one sample to every phase it went through; the
    phases of a copying request cover its whole time in the server, in order."""

    def phases() -> dict[str, PhaseSum]:
        return client.stats().phases

    with ShmKV(dsv41_flash(num_blocks=NUM_BLOCKS)) as kv:
        kv.fill_random(8)
        reg = client.register(**kv.register_kwargs())
        digests = np.random.default_rng(8).bytes(32 * 2)
        ids = block_ids_for(reg, 2)
        before = phases()
        assert client.store(reg, digests, ids).ok.all()
        assert (client.store(reg, digests, ids).statuses["full"] == ChunkStatus.EXISTS).all()
        assert client.retrieve(reg, digests, ids).ok.all()
        bad = {k: np.full_like(v, NUM_BLOCKS) for k, v in ids.items()}
        with pytest.raises(ServerError, match="out of range"):
            client.store(reg, digests, bad)  # refused: not counted in any phase
        after = phases()
        client.unregister(reg)

    none = PhaseSum(count=0, seconds=0.0)

    def count(key: str) -> int:
        return after.get(key, none).count - before.get(key, none).count

    copying = ("queue", "prepare", "submit", "copy", "hop_out", "finish")
    assert [count(f"store:{p}") for p in copying] == [2, 2, 1, 1, 1, 2]  # 2nd: all EXISTS
    assert [count(f"retrieve:{p}") for p in copying] == [1] * 6
    assert all(after[k].seconds >= before.get(k, none).seconds for k in after)
