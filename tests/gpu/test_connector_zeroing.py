"""A load is not overwritten by the engine zeroing the blocks it loads into.

vLLM 0.33 zeroes newly allocated blocks when ``needs_kv_cache_zeroing`` (mixed-precision
caches such as DeepSeek-V4.1's, Mamba) on its own stream in the step's preprocessing,
the very blocks a hit is loaded into; the server copies on its own streams. The
connector therefore sends the retrieve only once an event recorded after the zeroing
was queued completed (``LMCacheMPConnector.start_load_kv``, ``ready=stream_done()``).
Here the engine's stream has GPU work queued ahead of the zeroing (as under async
scheduling, a step behind): with the event the loaded pages are the stored ones; the
control without it shows the hazard (the late zeroing wins), so the check can fail.

    LMC_REQUIRE_GPU=1 pytest tests/gpu/test_connector_zeroing.py -q
"""

from __future__ import annotations

import time

import pytest

from lmc_server.testing.process import ServerProcess

pytestmark = pytest.mark.gpu

SERVER_ARGS = ["--chunk-size", "256", "--separate-object-groups", "--eviction-policy", "LRU"]
GPU_BUSY_CYCLES = 400_000_000  # about 0.2 s of GPU time queued before the zeroing


def test_load_waits_for_the_engines_zeroing_of_its_blocks() -> None:
    import torch

    from lmc_server.client.cuda import stream_done
    from lmc_server.integration.chunks import ChunkGeometry, EngineGroup
    from lmc_server.integration.link.link import ServerLink
    from lmc_server.integration.planning import SchedulerPlanner
    from lmc_server.integration.plans import ScheduledRequest
    from lmc_server.integration.worker import TransferTracker, WorkerTransfers
    from lmc_server.testing.connector_flow import block_hashes
    from lmc_server.testing.cuda_kv import CudaKV, device_arch
    from lmc_server.testing.presets import simple_model

    geo = simple_model(arch=device_arch(0), num_blocks=80, layers=4)
    (g,) = geo.groups
    with (
        ServerProcess(SERVER_ARGS, backend="cuda", l1_size_gb=1, start_timeout_s=60) as srv,
        CudaKV(geo) as kv,
    ):
        srv.wait_pool_ready()
        kv.fill_random(31)
        sched = ServerLink(srv.endpoint, timeout_s=30, client_name="zero-scheduler")
        work = ServerLink(srv.endpoint, timeout_s=30, client_name="zero-worker")
        try:
            sched.register(**kv.register_kwargs(buffers=[]))
            work.register(**kv.register_kwargs())
            geometry = ChunkGeometry(256, 16, [EngineGroup(g.name, 16)])
            planner = SchedulerPlanner(geometry, sched)
            tracker = TransferTracker(by_block_ids=True)
            wt = WorkerTransfers(work, tracker)
            toks = list(range(7000, 7000 + 513))
            h = block_hashes(toks, 16)
            src, dst = [list(range(1, 34))], [list(range(34, 67))]

            def matched(rid: str) -> int:
                while (m := planner.matched_tokens(rid, h, 513, 513, 0)) is None:
                    time.sleep(0.001)
                return m

            def poll(want: str, finished: set[str]) -> None:
                deadline = time.monotonic() + 30
                while not getattr(tracker.poll(finished), want):
                    assert time.monotonic() < deadline, f"no {want}"
                    time.sleep(0.001)

            assert matched("a") == 0
            planner.after_alloc("a", src, 0)
            plan = planner.build_step([ScheduledRequest("a", 0, 513, src, True)])
            wt.start_stores(plan.stores, stream_done())
            planner.request_finished("a")
            poll("finished_sending", {"a"})
            want = kv.pages(g.name, src[0][:32])
            outcome = {}
            for ordered in (True, False):
                rid = f"b-{ordered}"
                assert matched(rid) == 512
                planner.after_alloc(rid, dst, 512)
                plan = planner.build_step([])
                torch.cuda._sleep(GPU_BUSY_CYCLES)  # the engine's stream is busy
                for layer in range(len(g.layers)):  # then it zeroes the new blocks
                    for b in dst[0]:
                        kv.page_tensor(g.name, layer, b).zero_()
                wt.start_loads(plan.loads, stream_done() if ordered else None)
                poll("finished_recving", set())
                torch.cuda.synchronize()
                outcome[ordered] = kv.pages(g.name, dst[0][:32]) == want
                planner.transfers_finished({rid}, ())
                planner.request_finished(rid)
        finally:
            sched.close()
            work.close()
    assert outcome[True], "a load ordered after the zeroing lost its pages"
    assert not outcome[False], (
        "control: the unordered load was not overwritten "
        "(GPU_BUSY_CYCLES too few to show the hazard on this GPU)"
    )
