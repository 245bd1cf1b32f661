"""LMCacheMPConnector driven through vLLM 0.33's real classes against a real server.

vLLM's own ``Request`` (with its block hasher), ``KVCacheConfig`` / spec classes,
``KVCacheBlocks``, ``SchedulerOutput`` / ``NewRequestData`` and ``KVConnectorOutput``
feed a scheduler-role and a worker-role connector; the worker's KV tensors are torch
CPU views of shared memory, so the CPU engine copies real bytes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from lmc_server.client.shm import ShmSegment
from lmc_server.testing.process import ServerProcess

pytestmark = pytest.mark.vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

NUM_BLOCKS = 128
BLOCK = 16
LAYERS = 3


@pytest.fixture(scope="module")
def srv() -> Iterator[ServerProcess]:
    with ServerProcess(["--chunk-size", "256", "--separate-object-groups"], l1_size_gb=0.25) as s:
        yield s


def _setup(srv: ServerProcess) -> tuple[Any, ...]:
    import torch
    from vllm.config import DeviceConfig, KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    from lmc_server.integration.exporters import register_shm_segment
    from lmc_server.integration.vllm import LMCacheMPConnector

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    page = spec.page_size_bytes
    names = [f"model.layers.{i}.attn" for i in range(LAYERS)]
    size = LAYERS * NUM_BLOCKS * page
    cfg = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[
            KVCacheTensor(
                size=size, layers=names, layer_stride=NUM_BLOCKS * page, block_stride=page
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
        hash_block_size=BLOCK,
    )
    extra = {
        "lmcache.mp.host": "127.0.0.1",
        "lmcache.mp.port": srv.port,
        "lmcache.mp.model": "test/vllm-connector",
    }
    vcfg = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="LMCacheMPConnector",
            kv_connector_module_path="lmc_server.integration.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        ),
    )
    seg = ShmSegment(size)
    register_shm_segment(seg)
    raw = torch.frombuffer(seg._mm, dtype=torch.uint8)
    caches = {
        n: raw[i * NUM_BLOCKS * page : (i + 1) * NUM_BLOCKS * page].view(NUM_BLOCKS, page)
        for i, n in enumerate(names)
    }
    g = torch.Generator().manual_seed(3)
    raw.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g))
    sched = LMCacheMPConnector(vcfg, KVConnectorRole.SCHEDULER, cfg)
    worker = LMCacheMPConnector(vcfg, KVConnectorRole.WORKER, cfg)
    worker.register_kv_caches(caches)
    return sched, worker, caches, seg


def _request(req_id: str, tokens: list[int]) -> Any:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(
        req_id,
        tokens,
        SamplingParams(max_tokens=1),
        None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def _blocks(ids: list[int]) -> Any:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks(blocks=([KVCacheBlock(i) for i in ids],))


def _matched(sched: Any, req: Any, computed: int) -> tuple[int, bool]:
    deadline = time.monotonic() + 10
    while True:
        n, is_async = sched.get_num_new_matched_tokens(req, computed)
        if n is not None:
            return n, is_async
        assert time.monotonic() < deadline, "lookup never answered"
        time.sleep(0.005)


def _step(worker: Any, meta: Any, finished: set[str]) -> Any:
    worker.handle_preemptions(meta)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    res = worker.get_transfer_results(finished)
    worker.clear_connector_metadata()
    return res


def _poll(worker: Any, finished: set[str], want: str) -> Any:
    deadline = time.monotonic() + 10
    while True:
        res = worker.get_transfer_results(finished)
        if getattr(res, want):
            return res
        assert time.monotonic() < deadline, f"no {want} reported"
        time.sleep(0.005)


def test_store_then_async_load_through_vllm_classes(srv: ServerProcess) -> None:
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput

    sched, worker, caches, seg = _setup(srv)
    try:
        tokens = list(range(1000, 1700))  # 700 tokens: two whole 256-token chunks
        a = _request("A", tokens)
        assert len(a.block_hashes) == 700 // BLOCK
        assert _matched(sched, a, 0) == (0, False)
        a_blocks = list(range(1, 45))
        sched.update_state_after_alloc(a, _blocks(a_blocks), 0)
        out = SchedulerOutput.make_empty()
        out.scheduled_new_reqs = [NewRequestData.from_request(a, (a_blocks,))]
        out.num_scheduled_tokens = {"A": 700}
        out.total_num_scheduled_tokens = 700
        meta = sched.build_connector_meta(out)
        assert [s.n_chunks for s in meta.plan.stores] == [2]
        _step(worker, meta, set())
        delay, _ = sched.request_finished_all_groups(a, (a_blocks,))
        assert delay is True  # blocks held until the store is reported
        res = _poll(worker, {"A"}, "finished_sending")
        assert res.finished_sending == {"A"}
        sched.update_connector_output(KVConnectorOutput(finished_sending={"A"}))

        b = _request("B", tokens + [5, 6])
        n, is_async = _matched(sched, b, 0)
        assert (n, is_async) == (512, True)
        b_blocks = list(range(60, 104))
        allocated = _blocks(b_blocks)
        sched.update_state_after_alloc(b, allocated, 512)
        # vLLM's table changing after the allocation does not move the load
        allocated.blocks[0][:] = _blocks(list(range(110, 154))).blocks[0]
        meta = sched.build_connector_meta(SchedulerOutput.make_empty())
        assert len(meta.plan.loads) == 1
        (ids,) = {tuple(a.tolist()) for a in meta.plan.loads[0].block_ids.values()}
        assert list(ids) == b_blocks[:32]
        res = _step(worker, meta, set())
        if not res.finished_recving:
            res = _poll(worker, set(), "finished_recving")
        assert res.finished_recving == {"B"} and not res.failed_recving
        assert worker.get_block_ids_with_load_errors() == set()
        for name, t in caches.items():
            assert bytes(t[60:92].numpy()) == bytes(t[1:33].numpy()), name
        sched.update_connector_output(KVConnectorOutput(finished_recving={"B"}))
        assert sched.request_finished_all_groups(b, (b_blocks,))[0] is False

        # a prefix the server never saw: a miss, nothing to load
        c = _request("C", list(range(7000, 7600)))
        assert _matched(sched, c, 0) == (0, False)
    finally:
        from lmc_server.integration.exporters import unregister_shm_segment

        worker.shutdown()
        sched.shutdown()
        unregister_shm_segment(seg)
        seg.close()


def test_a_loads_block_ids_are_read_as_vllm_reads_them() -> None:
    """The adapter reads the ids of the blocks a load writes from ``KVCacheBlocks.blocks``
    (vLLM's ``KVCacheBlock`` objects, per group), not ``get_block_ids()``: the same ids."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from lmc_server.integration.vllm.geometry import block_ids

    blocks = KVCacheBlocks(([KVCacheBlock(i) for i in range(3)], [KVCacheBlock(7)]))
    assert tuple(block_ids(group) for group in blocks.blocks) == blocks.get_block_ids()
    assert block_ids(blocks.blocks[0][1:]) == [1, 2]
