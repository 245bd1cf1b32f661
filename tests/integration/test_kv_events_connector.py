"""The connector carries what routers need into the server's KV events.

With ``lmcache.mp.kv_events`` the scheduler plans each store with its tokens, its engine
block hashes reduced to 64 bits as vLLM publishes them, and each chunk's parent; the
worker's batched store carries them; the server publishes them. Checked on vLLM 0.33's
own allocation of Llama (the fixture), through the connector's machinery without vLLM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import zmq

from lmc_server.integration.chunks import ChunkGeometry, EngineGroup
from lmc_server.integration.link.batches import join_events
from lmc_server.protocol.messages import StoreEvents
from lmc_server.testing.connector_flow import ConnectorFlow, block_hashes
from lmc_server.testing.events import replay
from lmc_server.testing.kvfixture import KVFixture, ShmBacking
from lmc_server.testing.process import ServerProcess

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-llama.json"


class BlockStored(msgspec.Struct, tag=True):  # the fields of vLLM 0.33's this test reads
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str | None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


class KVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | AllBlocksCleared]
    data_parallel_rank: int | None = None


def test_store_events_of_chunks_reduce_hashes_as_vllm_does() -> None:
    g = ChunkGeometry(64, 16, [EngineGroup("full", 16)])
    hashes = [bytes([i]) * 24 + i.to_bytes(8, "big") for i in range(1, 13)]  # 3 chunks
    tokens = list(range(1000, 1000 + 3 * 64))
    e = g.store_events(hashes, tokens, 1, 2)
    assert e.block_size == 16
    assert e.token_ids == b"".join(t.to_bytes(4, "little") for t in tokens[64:])
    # vLLM's maybe_convert_block_hash: int.from_bytes(h, "big") & (2**64 - 1)
    assert [int.from_bytes(e.block_hashes[i : i + 8], "big") for i in range(0, 64, 8)] == [
        int.from_bytes(h, "big") & (2**64 - 1) for h in hashes[4:12]
    ]
    assert e.parent_hashes == (4).to_bytes(8, "big") + (8).to_bytes(8, "big")
    first = g.store_events(hashes, tokens, 0, 1)
    assert first.parent_hashes == bytes(8)  # chunk 0 starts the prompt
    joined = join_events([first, e])
    assert joined is not None and joined.parent_hashes == bytes(8) + e.parent_hashes
    assert join_events([first, None]) is None  # a request carries them for all or none
    assert join_events([first, StoreEvents(32, b"", b"", b"")]) is None


def test_a_prefill_is_published_with_its_tokens_and_vllm_hashes(tmp_path: Path) -> None:
    fx = KVFixture.load(FIXTURE)
    args = [
        "--chunk-size",
        "256",
        "--kv-events-endpoint",
        f"ipc://{tmp_path}/ev",
        "--kv-events-replay-endpoint",
        f"ipc://{tmp_path}/rep",
        "--kv-events-topic",
        "kv@flow@",
    ]
    ctx: zmq.Context[Any] = zmq.Context()
    tokens = [7_000 + i for i in range(2 * 256 + 60)]  # two whole chunks and a tail
    try:
        with (
            ServerProcess(args, l1_size_gb=0.25) as srv,
            ShmBacking(fx.backing_size_bytes) as mem,
            ConnectorFlow(fx, mem, srv.endpoint, fx.arch or "cpu", kv_events=True) as flow,
        ):
            plan, _ = flow.prefill("r1", tokens, flow.tables(len(tokens)))
            assert [s.events is not None for s in plan.stores] == [True]
            got = replay(ctx, f"ipc://{tmp_path}/rep", 0)
        stored = [
            e
            for _, _, p in got
            for e in msgspec.msgpack.decode(p, type=KVEventBatch).events
            if isinstance(e, BlockStored)
        ]
        per = 256 // flow.hash_block
        engine = [int.from_bytes(h[-8:], "big") for h in block_hashes(tokens, flow.hash_block)]
        assert len(stored) == 2
        for k, e in enumerate(stored):
            assert e.token_ids == tokens[k * 256 : (k + 1) * 256]
            assert e.block_hashes == engine[k * per : (k + 1) * per]
            assert e.parent_block_hash == (None if k == 0 else engine[k * per - 1])
            assert (e.block_size, e.medium) == (flow.hash_block, "CPU")
    finally:
        ctx.term()
