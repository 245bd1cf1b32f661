"""How long a hit takes to load through the connector: from the scheduler's decision
(the planner told the engine allocated the request's blocks for an external hit) to
the worker reporting the loaded blocks ready (``finished_recving``), for hits of a
given number of chunks.

Drives the connector's own planner, worker transfers and link against a real server
over a :class:`~lmc_server.testing.kv.ShmKV` (CPU engine) or
:class:`~lmc_server.testing.cuda_kv.CudaKV` (GPU memory exported as CUDA IPC handles,
CUDA engine); every load is checked byte-exact against the stored pages. Used by
``tests/gpu/test_connector_load_time.py`` (the figures) and its CPU twin in
``tests/integration/test_connector_runtime.py``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from lmc_server.integration.chunks import ChunkGeometry, EngineGroup
from lmc_server.integration.link.link import ServerLink
from lmc_server.integration.planning import SchedulerPlanner
from lmc_server.integration.plans import ScheduledRequest
from lmc_server.integration.worker import Report, TransferTracker, WorkerTransfers
from lmc_server.testing.connector_flow import block_hashes

#: how often the worker side polls for finished loads while timing (the engine polls
#: once per step; this measures the load, not a step)
POLL_S = 0.0002


def blocks_needed(chunk_counts: Sequence[int], tokens_per_block: int = 16) -> int:
    """Blocks a full-attention KV cache needs for :func:`load_times` (source and
    destination tables of the largest hit, and the null block)."""
    return 2 * (max(chunk_counts) * 256 // tokens_per_block + 1) + 1


def load_times(
    endpoint: str,
    kv: Any,
    chunk_counts: Sequence[int],
    repeats: int = 5,
    ready: Callable[[], None] | None = None,
    timeout_s: float = 60.0,
) -> dict[int, dict[str, float]]:
    """Per hit size (chunks): median and max seconds from the scheduler's decision to
    the worker reporting the load finished, over ``repeats`` loads.

    ``kv`` holds one full-attention group of 16-token blocks and at least
    :func:`blocks_needed` blocks; ``ready`` is what stores wait for (``stream_done`` on
    CUDA). Raises ``AssertionError`` on a failed or wrong load.
    """
    (g,) = kv.geometry.groups
    assert g.tokens_per_block == 16 and g.num_blocks >= blocks_needed(chunk_counts)
    sched = ServerLink(endpoint, timeout_s=timeout_s, client_name="timing-scheduler")
    work = ServerLink(endpoint, timeout_s=timeout_s, client_name="timing-worker")
    out: dict[int, dict[str, float]] = {}
    try:
        sched.register(**kv.register_kwargs(buffers=[]))
        work.register(**kv.register_kwargs())
        geometry = ChunkGeometry(work.reg.chunk_size, 16, [EngineGroup(g.name, 16)])
        planner = SchedulerPlanner(geometry, sched)
        tracker = TransferTracker(by_block_ids=True)
        wt = WorkerTransfers(work, tracker)
        per_chunk = geometry.chunk_size // 16

        def matched(rid: str, toks: list[int]) -> int:
            h = block_hashes(toks, 16)
            deadline = time.monotonic() + timeout_s
            while (m := planner.matched_tokens(rid, h, len(toks), len(toks), 0)) is None:
                assert time.monotonic() < deadline, "lookup never answered"
                time.sleep(0.001)
            return m

        def poll(finished: set[str], want: str) -> Report:
            deadline = time.monotonic() + timeout_s
            while True:
                rep = tracker.poll(finished)
                if getattr(rep, want):
                    return rep
                assert time.monotonic() < deadline, f"no {want} reported"
                time.sleep(POLL_S)

        for n in chunk_counts:
            n_tok = n * geometry.chunk_size + 1
            toks = [n] * 3 + list(range(10_000 * n, 10_000 * n + n_tok - 3))
            blocks = -(-n_tok // 16)
            src = [list(range(1, 1 + blocks))]
            dst = [list(range(1 + blocks, 1 + 2 * blocks))]
            assert matched(f"a{n}", toks) == 0
            planner.after_alloc(f"a{n}", src, 0)
            plan = planner.build_step([ScheduledRequest(f"a{n}", 0, n_tok, src, True)])
            wt.begin_step(plan)
            wt.start_stores(plan.stores, ready)
            assert planner.request_finished(f"a{n}") is True
            rep = poll({f"a{n}"}, "finished_sending")
            planner.transfers_finished([], rep.finished_sending)
            assert tracker.failed_store_chunks == 0
            times_s = []
            for i in range(repeats):
                rid = f"h{n}-{i}"
                assert matched(rid, toks) == n * geometry.chunk_size
                t0 = time.perf_counter()  # the scheduler decided: load into dst
                planner.after_alloc(rid, dst, n * geometry.chunk_size)
                plan = planner.build_step([])
                wt.begin_step(plan)
                rep = poll(set(), "finished_recving")
                times_s.append(time.perf_counter() - t0)
                assert rep.finished_recving == {rid}
                assert not rep.failed_recving and not rep.invalid_block_ids
                planner.transfers_finished(rep.finished_recving, [])
                planner.request_finished(rid)
                assert kv.pages(g.name, dst[0][: n * per_chunk]) == kv.pages(
                    g.name, src[0][: n * per_chunk]
                )
            out[n] = {"median_s": statistics.median(times_s), "max_s": max(times_s)}
    finally:
        sched.close()
        work.close()
    return out
