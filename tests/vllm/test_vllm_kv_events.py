"""vLLM's own KV-event classes decode the server's stream (marker ``vllm``).

A real server process publishes through a store with the connector's event fields,
stores without them, evictions, a replay request and a restart; every payload, live and
replayed, is decoded with ``vllm.distributed.kv_events.KVEventBatch`` (the decoder
vLLM's subscribers and its own tests use), and what the events say is held must agree
with the server's ``stats``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from lmc_server.client import Client, chunk_digests
from lmc_server.testing import ShmKV, simple_model
from lmc_server.testing.events import engine_prompt, replay
from lmc_server.testing.kv import block_ids_for
from lmc_server.testing.process import ServerProcess

pytestmark = pytest.mark.vllm

CHUNK, BLOCK, SLOTS = 256, 16, 8
TOPIC = b"kv@vllm-test@"


def test_vllm_decodes_store_eviction_replay_and_restart(tmp_path: Path) -> None:
    from vllm.distributed.kv_events import (
        MEDIUM_CPU,
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
    )

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    args = [
        "--kv-events-endpoint",
        f"ipc://{tmp_path}/ev",
        "--kv-events-replay-endpoint",
        f"ipc://{tmp_path}/rep",
        "--kv-events-topic",
        TOPIC.decode(),
        "--slab-size-mb",
        "1",
    ]
    ctx: zmq.Context[Any] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"ipc://{tmp_path}/ev")
    geo = simple_model(layers=4, bytes_per_token=1024, num_blocks=256)
    srv = ServerProcess(args, l1_size_gb=SLOTS / 1024).start()
    try:
        with ShmKV(geo) as kv, Client(srv.endpoint) as c:
            kv.fill_random(2)
            reg = c.register(**kv.register_kwargs())
            p = engine_prompt(3, seed=11, chunk_size=CHUNK, block_size=BLOCK)
            assert c.store(reg, p.digests, block_ids_for(reg, 3), events=p.events()).ok.all()
            for i in range(9):
                one = chunk_digests(np.full(CHUNK, 7000 + i), CHUNK)
                assert c.store(reg, one, block_ids_for(reg, 1)).ok.all()
            st = c.stats()
            assert st.kv_events is not None
            # Everything from the start, by replay (the subscriber joined late).
            batches = replay(ctx, f"ipc://{tmp_path}/rep", 0)
            assert [s for _, s, _ in batches] == list(range(st.kv_events.next_seq))
            held: dict[int, int] = {}  # hash -> chunk id
            chunk_of_hash = {h: k for k in range(3) for h in p.chunk_hashes(k)}
            stored = removed = 0
            for topic, _, payload in batches:
                batch = decoder.decode(payload)
                assert isinstance(batch, KVEventBatch)
                for e in batch.events:
                    if isinstance(e, AllBlocksCleared):
                        assert not held
                    elif isinstance(e, BlockStored):
                        assert topic == TOPIC + geo.model.encode()
                        assert e.medium == MEDIUM_CPU
                        if e.token_ids:  # the connector's fields
                            k = chunk_of_hash[e.block_hashes[0]]
                            assert e.block_hashes == p.chunk_hashes(k)
                            assert e.parent_block_hash == p.parent(k)
                            assert e.token_ids == p.chunk_tokens(k)
                            assert e.block_size == BLOCK
                        held.update(dict.fromkeys(e.block_hashes, stored))
                        stored += 1
                    else:
                        assert isinstance(e, BlockRemoved) and e.medium == MEDIUM_CPU
                        gone = {held.pop(h) for h in e.block_hashes}
                        removed += len(gone)
            assert stored == st.counters.stored_objects == 12
            assert removed == st.counters.evictions == 12 - SLOTS
            assert len(set(held.values())) == st.l1.objects == SLOTS
            # The live stream decodes too (stores until the subscriber is connected).
            for i in range(200):
                assert c.store(
                    reg, chunk_digests(np.full(CHUNK, 9000 + i), CHUNK), block_ids_for(reg, 1)
                ).ok.all()
                if sub.poll(100):
                    break
            _, seq, payload = sub.recv_multipart()
            assert isinstance(decoder.decode(payload), KVEventBatch)
        srv.terminate()
        srv = ServerProcess(args, l1_size_gb=SLOTS / 1024).start()
        topic, seq, payload = replay(ctx, f"ipc://{tmp_path}/rep", 0)[0]
        assert (topic, seq) == (TOPIC, 0)
        assert decoder.decode(payload).events == [AllBlocksCleared()]
    finally:
        srv.kill()
        sub.close(linger=0)
        ctx.term()


def test_vllm_requests_are_published_with_their_tokens_and_vllm_hashes(tmp_path: Path) -> None:
    """vLLM's scheduler and ``Request`` block hasher, the connector with
    ``lmcache.mp.kv_events``: each stored chunk is published with its tokens and the
    request's own block hashes reduced as vLLM reduces them for its events."""
    import os

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from engine_sim import SimEngine
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    args = [
        "--chunk-size",
        str(CHUNK),
        "--separate-object-groups",
        "--kv-events-endpoint",
        f"ipc://{tmp_path}/ev",
        "--kv-events-replay-endpoint",
        f"ipc://{tmp_path}/rep",
    ]
    ctx: zmq.Context[Any] = zmq.Context()
    with ServerProcess(args, l1_size_gb=0.5) as srv:
        e = SimEngine(srv.port, tmp_path, model="plain", extra={"lmcache.mp.kv_events": True})
        try:
            tokens = [1000 + (i * 31) % 20000 for i in range(900)]
            req = e.add("a", tokens, max_tokens=2)
            e.run(["a"])
            e.drain()
            assert not e.failed
            hashes = [int.from_bytes(bytes(h), "big") & ((1 << 64) - 1) for h in req.block_hashes]
            per = CHUNK // e.hash_block
        finally:
            e.close()
        stored = [
            ev
            for _, _, p in replay(ctx, f"ipc://{tmp_path}/rep", 0)
            for ev in decoder.decode(p).events
            if isinstance(ev, BlockStored)
        ]
    ctx.term()
    assert len(stored) == 3  # 900 tokens: three whole chunks
    for k, ev in enumerate(stored):
        assert ev.token_ids == tokens[k * CHUNK : (k + 1) * CHUNK]
        assert ev.block_hashes == hashes[k * per : (k + 1) * per]
        assert ev.parent_block_hash == (None if k == 0 else hashes[k * per - 1])
        assert ev.block_size == e.hash_block and ev.medium == "CPU"
