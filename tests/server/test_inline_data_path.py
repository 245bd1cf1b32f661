"""Stores and retrieves whose copy the cpu engine makes inline (at most ``INLINE_BYTES``)
are answered inside the drain that read them: no task, no loop iteration between the
copy and the reply. Their contract is the one of every store and retrieve, checked here
through a real server process (bytes, refusals, a writer killed while storing) and,
for the one order a socket gives only by chance (the writer's disconnect seen between
its copy and its commit), in process on the server's own handlers.
"""

from __future__ import annotations

import asyncio
import json
import queue
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from lmc_server import PROTOCOL_VERSION
from lmc_server.cache.index import L1Index
from lmc_server.cache.status import ChunkStatus
from lmc_server.client import Client, ServerError, chunk_digests
from lmc_server.client.aio import AsyncClient
from lmc_server.client.requests import raw_call
from lmc_server.client.shm import handed_over
from lmc_server.config import Config
from lmc_server.protocol import messages as m
from lmc_server.server.handlers import Handlers
from lmc_server.server.sessions import Session, SessionTable
from lmc_server.server.stats import PhaseClock, ServerStats
from lmc_server.testing import ShmKV, dsv41_flash
from lmc_server.testing.kv import assert_same_pages, block_ids_for
from lmc_server.testing.poll import wait_for
from lmc_server.testing.presets import simple_model
from lmc_server.testing.process import ServerProcess
from lmc_server.transfer.cpu import INLINE_BYTES, CpuEngine

CHUNK = 256
WORKER = str(Path(__file__).resolve().parents[1] / "kvworker.py")
#: one chunk of this geometry is 16 blocks x 2 layers x 4 KiB: 128 KiB, copied inline
GEO = simple_model(num_blocks=64, layers=2, bytes_per_token=256)


@pytest.fixture
def srv() -> Iterator[ServerProcess]:
    with ServerProcess(["--chunk-size", str(CHUNK), "--separate-object-groups"]) as s:
        yield s


def _digests(i: int, n: int = 1) -> bytes:
    return chunk_digests(np.arange(n * CHUNK) + 100_000 * i, CHUNK)


def test_a_chunk_of_the_test_geometry_is_copied_inline() -> None:
    assert GEO.chunk_bytes(CHUNK) <= INLINE_BYTES


def test_inline_stores_and_retrieves_are_byte_exact_and_counted(srv: ServerProcess) -> None:
    rng = np.random.default_rng(11)
    n = 40
    with Client(srv.endpoint) as c, ShmKV(GEO) as src, ShmKV(GEO) as dst:
        src.fill_random(5)
        rs = c.register(**src.register_kwargs())
        rd = c.register(**dst.register_kwargs())
        for i in range(n):
            dst.fill(0)
            digests = _digests(i)
            ids = block_ids_for(rs, 1, rng)
            assert c.store(rs, digests, ids).ok.all()
            again = c.store(rs, digests, block_ids_for(rs, 1, rng))
            assert (again.statuses["full"] == ChunkStatus.EXISTS).all()
            out = block_ids_for(rd, 1, rng)
            assert c.retrieve(rd, digests, out).ok.all()
            assert_same_pages(rs, src, ids, dst, out, 1)
        st = c.stats()
        assert st.l1.objects == n
        assert all(p.writing == 0 and p.pinned_objects == 0 for p in st.partitions)
        assert st.phases["store:finish"].count == 2 * n
        assert st.phases["store:copy"].count == n  # the stores that copied
        assert st.phases["retrieve:finish"].count == n
        assert st.counters.stored_objects == n
        assert st.counters.retrieved_objects == n


def test_concurrent_inline_requests_on_one_connection_are_each_answered_exactly(
    srv: ServerProcess,
) -> None:
    """Many stores and retrieves in flight at once: the ones queued behind a request
    answered inside the drain are read by the same drain, and every reply matches its
    request."""
    n = 24

    async def scenario(src: ShmKV, dst: ShmKV) -> None:
        async with AsyncClient(srv.endpoint, timeout_s=30) as c:
            rs = await c.register(**src.register_kwargs())
            rd = await c.register(**dst.register_kwargs())
            ids = [block_ids_for(rs, 1, first_block=2 * i) for i in range(n)]
            stored = await asyncio.gather(
                *(c.store(rs, _digests(1000 + i), ids[i]) for i in range(n))
            )
            assert all(r.ok.all() for r in stored)
            # every retrieve goes to its own blocks: 16 blocks each, 64 in all
            outs = [block_ids_for(rd, 1, first_block=16 * (i % 4)) for i in range(n)]
            for lo in range(0, n, 4):
                got = await asyncio.gather(
                    *(c.retrieve(rd, _digests(1000 + i), outs[i]) for i in range(lo, lo + 4))
                )
                assert all(r.ok.all() for r in got)
                for i in range(lo, lo + 4):
                    assert_same_pages(rs, src, ids[i], dst, outs[i], 1)

    with ShmKV(GEO) as src, ShmKV(GEO) as dst:
        src.fill_random(9)
        asyncio.run(scenario(src, dst))


def test_refused_data_requests_are_answered_and_the_server_serves_on(srv: ServerProcess) -> None:
    with Client(srv.endpoint) as c, ShmKV(GEO) as kv:
        kv.fill_random(2)
        reg = c.register(**kv.register_kwargs())
        lookup_only = c.register(**kv.register_kwargs(buffers=[]))
        digests = _digests(7)
        good = block_ids_for(reg, 1)
        bad = [np.full(16, GEO.groups[0].num_blocks, dtype="<i4").tobytes()]
        rid = reg.registration_id
        refused: list[tuple[m.Store | m.Retrieve, str]] = [
            (m.Store(req_id=0, registration_id=rid, digests=digests, block_ids=bad), "bounds"),
            (m.Retrieve(req_id=0, registration_id=rid, digests=digests, block_ids=bad), "bounds"),
            (
                m.Store(req_id=0, registration_id=b"x" * 16, digests=digests, block_ids=bad),
                "unknown_registration",
            ),
        ]
        for msg, code in refused:
            reply = c._run(raw_call(msg, m.Error))
            assert reply.code == code, reply
        with pytest.raises(ServerError) as e:
            c.store(lookup_only, digests, good)
        assert e.value.code == "lookup_only"
        assert c.store(reg, digests, good).ok.all()
        assert c.retrieve(reg, digests, good).ok.all()
        st = c.stats()
        assert st.l1.objects == 1
        assert all(p.writing == 0 and p.pinned_objects == 0 for p in st.partitions)


def test_a_writer_killed_during_inline_stores_leaves_nothing_partial(srv: ServerProcess) -> None:
    """A worker storing one small chunk after another (each copied inline) is killed
    with -9: its registration goes, nothing stays WRITING, and every chunk the server
    reports comes back byte-exact."""
    layers, num_blocks = 2, 32
    geo = dsv41_flash(num_blocks=num_blocks, layers=layers)
    assert geo.chunk_bytes(CHUNK) <= INLINE_BYTES
    args = {
        "endpoint": srv.endpoint,
        "num_blocks": num_blocks,
        "layers": layers,
        "seed": 7,
        "token_seed": 3000,
        "block_seed": 3,
        "loop": True,
        "chunks": 1,
    }
    w = subprocess.Popen(
        [sys.executable, WORKER, json.dumps(args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert w.stdout is not None
        last = 0
        while last < 200:
            line = w.stdout.readline()
            assert line, f"worker ended early: {w.stderr.read() if w.stderr else ''}"
            if line.startswith("storing"):
                last = int(line.split()[1])
    finally:
        w.kill()
        w.wait()
        for f in (w.stdin, w.stdout, w.stderr):
            if f is not None:
                f.close()
    with Client(srv.endpoint) as c:
        wait_for(lambda: c.stats().registrations == 0, "the killed worker's drop", 5)
        st = c.stats()
        for p in st.partitions:
            assert p.writing == 0 and p.pinned_objects == 0, p
            assert p.used_bytes == p.objects * p.object_bytes, p
        with ShmKV(geo) as src, ShmKV(geo) as dst:
            src.fill_random(7)
            reg = c.register(**dst.register_kwargs())
            src_ids = block_ids_for(reg, 1, np.random.default_rng(3))
            checked = 0
            for b in range(last + 2):
                tokens = np.random.default_rng(3000 + b).integers(0, 100_000, CHUNK)
                digests = chunk_digests(tokens, CHUNK)
                if not c.lookup(reg, digests, lease=False).hit_chunks:
                    continue
                dst.fill(0)
                ids = block_ids_for(reg, 1, np.random.default_rng(50 + b))
                assert c.retrieve(reg, digests, ids).ok.all()
                assert_same_pages(reg, src, src_ids, dst, ids, 1)
                checked += 1
            assert checked >= last - 1


def test_a_store_whose_writer_is_seen_gone_at_its_commit_is_aborted() -> None:
    """The copy completed inline, and the writer's disconnect is handled between the
    copy and the commit (``before_commit``, the router's monitor drain): the store is
    answered at once with every chunk failed, nothing becomes visible, its slots are
    free, and the next writer of the same keys stores them."""

    async def scenario() -> None:
        cfg = Config(chunk_size=CHUNK, separate_object_groups=True, l1_size_gb=0.0625)
        engine = CpuEngine(copy_threads=1)
        pool = engine.create_pool(cfg.l1_size_bytes, cfg.slab_bytes)
        index = L1Index(pool.size_bytes, cfg.slab_bytes, cfg.eviction_policy)
        prepared: queue.Queue[int] = queue.Queue()
        pool.start(prepared.put)
        for _ in range(index.pool_usage().slabs):
            index.slab_ready(prepared.get(timeout=30))
        sessions = SessionTable()
        gone: list[Session] = []

        def disconnect_seen() -> None:  # what the monitor drain does for a dead peer
            if gone:
                h.drop_session(gone.pop(), "connection closed")

        h = Handlers(cfg, index, engine, sessions, ServerStats(), before_commit=disconnect_seen)
        ids = [np.arange(16, dtype="<i4").tobytes()]
        digests = _digests(3)
        with ShmKV(GEO) as kv:
            kv.fill_random(4)

            def join(identity: bytes) -> tuple[Session, m.Store]:
                session = sessions.get_or_create(identity, 0.0)
                h.hello(session, m.Hello(req_id=1, protocol_version=PROTOCOL_VERSION))
                passed = handed_over(kv.buffers, engine.fd_socket, 10.0)
                msg = m.Register(req_id=2, **kv.register_kwargs(buffers=passed))
                rid = h.register(session, msg).registration_id
                return session, m.Store(
                    req_id=3, registration_id=rid, digests=digests, block_ids=ids
                )

            a, store_a = join(b"a")
            answers: list[tuple[m.StoreResult | None, BaseException | None]] = []
            gone.append(a)
            h.start_store(
                a,
                h.data_request(a, store_a),
                PhaseClock(time.perf_counter()),
                lambda reply, error: answers.append((reply, error)),
            )
            assert len(answers) == 1, "an inline store is answered before start_store returns"
            reply, error = answers[0]
            assert error is None and reply is not None
            assert (np.frombuffer(reply.statuses[0], dtype=np.uint8) == ChunkStatus.FAILED).all()
            assert all(u.writing == 0 and u.objects == 0 for u in index.usage())
            b, store_b = join(b"b")
            again = await h.store(b, h.data_request(b, store_b), PhaseClock(0.0))
            assert (np.frombuffer(again.statuses[0], dtype=np.uint8) == ChunkStatus.OK).all()
            h.drop_session(b, "done")
        engine.close()

    asyncio.run(scenario())
