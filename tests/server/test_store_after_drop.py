"""A store or retrieve whose session drops before its task runs.

The dispatcher checks a request into a :class:`DataRequest` and gives it a task; the
session's drop can run before that task does (after a SIGSTOP/SIGCONT of the server the
store and the heartbeat's disconnect arrive in one loop iteration), and an idle
registration unmaps at once. Such a request must not wait for a copy that is never
started: its reserved slots would stay WRITING, every later store of the same keys would
wait its whole settle timeout in vain, and the server would not exit on SIGTERM (seen as
``test_store_to_a_stalled_server_is_not_failed_early`` failing about one run in eight).

These tests drive the server's own handlers, index and CPU engine in-process, because
the order they need (drop between check and run) is one a real socket gives only by
chance; the effect is checked as a client sees it: an answer, nothing visible, and the
keys stored by the next writer.
"""

from __future__ import annotations

import asyncio
import queue

import numpy as np

from lmc_server import PROTOCOL_VERSION
from lmc_server.cache.index import L1Index
from lmc_server.cache.status import ChunkStatus
from lmc_server.client.shm import handed_over
from lmc_server.config import Config
from lmc_server.protocol import messages as m
from lmc_server.server.handlers import Handlers
from lmc_server.server.sessions import Session, SessionTable
from lmc_server.server.stats import PhaseClock, ServerStats
from lmc_server.testing.kv import ShmKV
from lmc_server.testing.presets import simple_model
from lmc_server.transfer.cpu import CpuEngine

CHUNK = 256
TOKENS_PER_BLOCK = 16
CHUNKS = 2


def _digests(seed: int) -> bytes:
    return np.random.default_rng(seed).bytes(32 * CHUNKS)


def _ids() -> list[bytes]:
    return [np.arange(1, 1 + CHUNKS * CHUNK // TOKENS_PER_BLOCK, dtype=np.int32).tobytes()]


async def _scenario(op: str) -> None:
    cfg = Config(chunk_size=CHUNK, separate_object_groups=True, l1_size_gb=0.0625, slab_size_mb=16)
    engine = CpuEngine(copy_threads=1)
    pool = engine.create_pool(cfg.l1_size_bytes, cfg.slab_bytes)
    index = L1Index(pool.size_bytes, cfg.slab_bytes, cfg.eviction_policy)
    prepared: queue.Queue[int] = queue.Queue()
    pool.start(prepared.put)  # the preparing thread reports each slab
    for _ in range(index.pool_usage().slabs):
        index.slab_ready(prepared.get(timeout=30))
    sessions = SessionTable()
    h = Handlers(cfg, index, engine, sessions, ServerStats())
    geo = simple_model(num_blocks=64, layers=1, bytes_per_token=32)
    with ShmKV(geo) as kv:
        kv.fill_random(7)

        def join(identity: bytes) -> tuple[Session, bytes]:
            session = sessions.get_or_create(identity, 0.0)
            h.hello(session, m.Hello(req_id=1, protocol_version=PROTOCOL_VERSION))
            # a raw register, as the client sends it: the segments handed over first
            passed = handed_over(kv.buffers, engine.fd_socket, 10.0)
            reg = h.register(session, m.Register(req_id=2, **kv.register_kwargs(buffers=passed)))
            return session, reg.registration_id

        a, a_reg = join(b"a")
        digests = _digests(1)
        if op == "retrieve":  # something to retrieve: stored by a first, with a lease
            store = m.Store(req_id=3, registration_id=a_reg, digests=digests, block_ids=_ids())
            await h.store(a, h.data_request(a, store), PhaseClock(0.0))
        msg: m.Store | m.Retrieve = (
            m.Store(req_id=4, registration_id=a_reg, digests=digests, block_ids=_ids())
            if op == "store"
            else m.Retrieve(req_id=4, registration_id=a_reg, digests=digests, block_ids=_ids())
        )
        req = h.data_request(a, msg)  # checked: the dispatcher gives it a task next ...
        h.drop_session(a, "connection closed")  # ... but the drop runs first
        reply: m.StoreResult | m.RetrieveResult
        if op == "store":
            reply = await asyncio.wait_for(h.store(a, req, PhaseClock(0.0)), 5)
        else:
            reply = await asyncio.wait_for(h.retrieve(a, req, PhaseClock(0.0)), 5)
        statuses = np.frombuffer(reply.statuses[0], dtype=np.uint8)
        assert (statuses == ChunkStatus.FAILED).all(), statuses

        # the next writer of the same keys is not kept waiting, and stores them
        b, b_reg = join(b"b")
        store = m.Store(req_id=5, registration_id=b_reg, digests=digests, block_ids=_ids())
        again = await asyncio.wait_for(h.store(b, h.data_request(b, store), PhaseClock(0.0)), 5)
        got = np.frombuffer(again.statuses[0], dtype=np.uint8)
        want = ChunkStatus.EXISTS if op == "retrieve" else ChunkStatus.OK
        assert (got == want).all(), got
        h.drop_session(b, "done")
    engine.close()


def test_a_store_whose_session_dropped_before_it_ran_fails_and_frees_its_slots() -> None:
    asyncio.run(_scenario("store"))


def test_a_retrieve_whose_session_dropped_before_it_ran_fails_and_unpins() -> None:
    asyncio.run(_scenario("retrieve"))


def test_a_part_reported_twice_counts_once() -> None:
    """An engine that reports a part and then raises (its caller reports the failure
    as well) must not leave the request waiting: the second report is ignored."""
    from lmc_server.server.completion import Completion

    async def run() -> list[str]:
        c = Completion(asyncio.get_running_loop())
        first, second = c.part(), c.part()
        first("")
        first("copy not started: internal error")  # the second report of one part
        asyncio.get_running_loop().call_later(0.01, second, "")
        return await asyncio.wait_for(c.wait(), 5)

    assert asyncio.run(run()) == ["", ""]
