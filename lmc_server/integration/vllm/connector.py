"""``LMCacheMPConnector``: the thin adapter between vLLM 0.33's KV connector API and the
planning code (:mod:`lmc_server.integration.planning`, :mod:`lmc_server.integration.worker`).

Scheduler role: a lookup-only registration; lookups run on a background thread and
``get_num_new_matched_tokens`` answers ``None`` until the server replied. Hits load
asynchronously (the request waits in ``WAITING_FOR_REMOTE_KVS`` and no forward pass
computes it until every worker reported the load finished), so a load is always
complete before any layer reads those blocks.

Worker role: registers the KV tensors, starts the step's loads, and after the forward
pass starts the step's stores; on CUDA each store is sent from a background thread once
an event recorded after the forward pass has completed, so neither the engine's stream
nor the forward pass waits for it, and the server never reads a page mid-write.
Replicated KV (MLA) is stored by one rank (``lmcache.mp.store_rank``) and retrieved by
every rank; sharded KV is stored and retrieved by every rank for its own shard.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from lmc_server.integration.chunks import ChunkGeometry
from lmc_server.integration.kvlayout import KVLayout, derive_registration
from lmc_server.integration.link.link import ServerLink
from lmc_server.integration.planning import SchedulerPlanner
from lmc_server.integration.plans import ScheduledRequest, StepPlan
from lmc_server.integration.settings import ConnectorSettings
from lmc_server.integration.vllm.geometry import block_ids, build_groups, describe
from lmc_server.integration.vllm.roles import LMCacheMPHandshake, LMCacheMPMetadata, detect_arch
from lmc_server.integration.worker import (
    TransferTracker,
    WorkerTransfers,
    failures_by_block_ids,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class LMCacheMPConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM v1 KV connector backed by an ``lmcache server`` on this host."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if kv_cache_config is None:
            raise ValueError("LMCacheMPConnector needs vLLM's kv_cache_config")
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.settings = ConnectorSettings.from_extra(extra)
        self._kv_events = self.settings.kv_events
        self.kv_cache_config = kv_cache_config
        parallel = vllm_config.parallel_config
        self.world_size = int(parallel.tensor_parallel_size) * int(parallel.pipeline_parallel_size)
        self.model = self.settings.model or str(vllm_config.model_config.model)
        self.arch = self.settings.arch or detect_arch()
        self.link = ServerLink(
            self.settings.endpoint,
            timeout_s=self.settings.timeout_s,
            client_name=f"vllm-{role.name.lower()}",
            max_inflight=self.settings.max_inflight,
        )
        welcome = self.link._client.welcome
        assert welcome is not None
        self.chunk_size = int(welcome.chunk_size)
        self.hash_block = int(
            kv_cache_config.hash_block_size or vllm_config.cache_config.block_size
        )
        self.layout = describe(kv_cache_config)
        self.planner: SchedulerPlanner | None = None
        self.transfers: WorkerTransfers | None = None
        self._invalid_block_ids: set[int] = set()
        self._use_layout(self.layout)

    def _use_layout(self, layout: KVLayout) -> None:
        """Plan over ``layout``; the scheduler (re)registers lookup-only for it."""
        self.layout = layout
        vg = derive_registration(layout)
        self.geometry = ChunkGeometry(self.chunk_size, self.hash_block, vg.engine_groups)
        self.loaded_group_ids = tuple(i for i, g in enumerate(vg.engine_groups) if g.cached)
        if self._role == KVConnectorRole.SCHEDULER:
            self.link.register(
                model=self.model,
                kv_dtype=vg.kv_dtype,
                arch=self.arch,
                groups=vg.groups,
                world_size=self.world_size,
                rank=0,
                replicated=vg.replicated,
            )
            self.planner = SchedulerPlanner(
                self.geometry,
                self.link,
                store=self.settings.store,
                load=self.settings.load,
                store_generated=self.settings.store_generated,
                l2_wait_s=self.settings.l2_wait_s,
                lookup_wait_s=self.settings.lookup_wait_s,
            )

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """The worker's KV cache as it registered it, for the scheduler (below)."""
        if self.transfers is None:
            return None
        return LMCacheMPHandshake(layout=self.layout.to_dict())

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        """Plan with the workers' view of the KV cache when it differs from ours.

        vLLM hands the scheduler a copy of the KV cache config in which a group's
        per-layer specs are replaced by one of them
        (``generate_scheduler_kv_cache_config``); a group holding layers with
        different records (DeepSeek-V4.1's compressed KV and indexer) then looks like
        one record, and a lookup-only registration derived from it would not match
        the workers' objects. The workers send theirs once, at start-up, before any
        request is scheduled.
        """
        if self.planner is None or not metadata:
            return
        first = metadata[min(metadata)]
        if not isinstance(first, LMCacheMPHandshake):
            return
        layout = KVLayout.from_dict(first.layout)
        if layout != self.layout:
            assert not self.planner.tracked, "KV layout changed with requests in flight"
            logger.info("scheduler plans with the workers' KV cache layout")
            self._use_layout(layout)

    @property
    def requires_kv_delivery(self) -> bool:
        """False: this is a best-effort cache, not a hand-off. vLLM 0.33 defaults to
        True for producers (``kv_both`` included), which makes a preemption under async
        scheduling drop and resample in-flight output. Nothing here needs that: a
        preempted request's stores are fenced before its freed blocks can be written
        (:meth:`handle_preemptions`), and a store that does not happen is a later miss."""
        return False

    # -- worker side --------------------------------------------------------------------

    def _rank(self) -> int:
        from vllm.distributed.parallel_state import (
            get_pp_group,
            get_tensor_model_parallel_rank,
        )

        tp = int(self._vllm_config.parallel_config.tensor_parallel_size)
        return int(get_pp_group().rank_in_group) * tp + int(get_tensor_model_parallel_rank())

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        rank = self._rank() if self.world_size > 1 else 0
        vg = build_groups(self.kv_cache_config, kv_caches)
        self.link.register(
            model=self.model,
            kv_dtype=vg.kv_dtype,
            arch=self.arch,
            groups=vg.groups,
            buffers=vg.buffers,
            world_size=self.world_size,
            rank=rank,
            replicated=vg.replicated,
        )
        stores = self.settings.store and (not vg.replicated or rank == self.settings.store_rank)
        tracker = TransferTracker(by_block_ids=failures_by_block_ids(vg.engine_groups))
        self._exporter_event = any(getattr(t, "is_cuda", False) for t in kv_caches.values())
        self._zeroes_blocks = bool(getattr(self.kv_cache_config, "needs_kv_cache_zeroing", False))
        self.transfers = WorkerTransfers(
            self.link, tracker, stores=stores, fence_timeout_s=self.settings.fence_timeout_s
        )

    def _plan(self) -> StepPlan | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        assert isinstance(meta, LMCacheMPMetadata)
        return meta.plan

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Called every step before the forward pass and the step's loads: wait for
        the stores reading blocks this step's scheduling may have freed."""
        if self.transfers is not None and isinstance(kv_connector_metadata, LMCacheMPMetadata):
            self.transfers.fence(kv_connector_metadata.plan.fence_store_ids)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start the step's loads. When vLLM zeroes newly allocated blocks
        (``needs_kv_cache_zeroing``: mixed-precision caches such as DeepSeek-V4.1's,
        Mamba) it does so on its stream in this step's preprocessing, into the very
        blocks a load writes; the server copies on its own streams, so on CUDA the
        retrieve is sent only once an event recorded here (after the zeroing was
        queued) completed, else a late zeroing could overwrite loaded KV."""
        plan = self._plan()
        if plan is None or self.transfers is None or not plan.loads:
            return
        ready = None
        if self._exporter_event and self._zeroes_blocks:
            from lmc_server.client.cuda import stream_done

            ready = stream_done()
        self.transfers.start_loads(plan.loads, ready)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous: a request is computed only after its load finished."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Stores are issued once per step in :meth:`wait_for_save`."""

    def wait_for_save(self) -> None:
        plan = self._plan()
        if plan is None or self.transfers is None or not plan.stores:
            return
        ready = None
        if self._exporter_event and self.transfers.stores:
            from lmc_server.client.cuda import stream_done

            ready = stream_done()  # awaited off-thread before each store is sent
        self.transfers.start_stores(plan.stores, ready)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """What finished since the last step. In a step without a forward pass (the
        engine waits for nothing but loads) the step's loads are waited for, at most
        ``idle_load_wait_s``, so that a hit is reported, and its prefill scheduled,
        one step earlier."""
        if self.transfers is None:
            return KVConnectorTransferResults()
        plan = self._plan()
        if plan is not None and plan.loads and not plan.scheduled_tokens:
            self.transfers.wait_loads(self.settings.idle_load_wait_s)
        rep = self.transfers.tracker.poll(finished_req_ids)
        self._invalid_block_ids |= rep.invalid_block_ids
        return KVConnectorTransferResults(
            finished_sending=rep.finished_sending,
            finished_recving=rep.finished_recving,
            failed_recving=rep.failed_recving,
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid_block_ids = self._invalid_block_ids, set()
        return out

    def shutdown(self) -> None:
        """Wait (at most ``shutdown_timeout_s``) for stores and loads in flight, then
        unregister; past the wait the connection closes and the server aborts what
        is unfinished (nothing half-written becomes visible)."""
        drained = True
        if self.transfers is not None:
            drained = self.transfers.drain(self.settings.shutdown_timeout_s)
        self.link.close(None if drained else 1.0)

    # -- scheduler side -----------------------------------------------------------------

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self.loaded_group_ids

    def on_new_request(self, request: Request) -> None:
        """Queue the request's lookup; it goes out with the others that arrive before
        the next step, and its answer is usually back by the first
        :meth:`get_num_new_matched_tokens`."""
        assert self.planner is not None
        self.planner.request_arrived(
            request.request_id, request.block_hashes, request.num_tokens, request.num_prompt_tokens
        )

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        planner = self.planner
        assert planner is not None
        answered = planner.answered
        if answered.by_req and not self._kv_events:  # settled as its round came in
            m = answered.pop(
                request.request_id,
                request.num_tokens,
                len(request.block_hashes),
                num_computed_tokens,
            )
            if m is not None:
                return m, m > 0
        n = planner.matched_tokens(
            request.request_id,
            request.block_hashes,
            request.num_tokens,
            request.num_prompt_tokens,
            num_computed_tokens,
            self._event_tokens(request) if self.settings.kv_events else None,
        )
        if n is None:
            return None, False
        return n, n > 0

    def _event_tokens(self, request: Request) -> Any:
        """The request's tokens for the server's KV events (``lmcache.mp.kv_events``),
        or None. None too for a request whose block hashes cover more than its tokens
        (LoRA, multimodal inputs, a cache salt): a router hashing the tokens alone would
        take its chunks for another prompt's."""
        if (
            not self.settings.kv_events
            or request.lora_request is not None
            or request.mm_features
            or request.cache_salt
        ):
            return None
        return request.all_token_ids

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Queue the hit's load: the planner reads the ids of the blocks it writes, now,
        from ``KVCacheBlocks.blocks`` (vLLM's ``KVCacheBlock`` objects, fresh from the
        allocation), not ``get_block_ids()``'s whole tables; vLLM sends a request's
        whole tables when it schedules it."""
        assert self.planner is not None
        self.planner.after_alloc(
            request.request_id, blocks.blocks, num_external_tokens, None, block_ids
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.planner is not None
        n_sched = scheduler_output.num_scheduled_tokens
        scheduled = [
            ScheduledRequest(
                r.req_id, r.num_computed_tokens, n_sched.get(r.req_id, 0), r.block_ids, True
            )
            for r in scheduler_output.scheduled_new_reqs
        ]
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            scheduled.append(
                ScheduledRequest(
                    req_id,
                    cached.num_computed_tokens[i],
                    n_sched.get(req_id, 0),
                    cached.new_block_ids[i],
                    req_id in cached.resumed_req_ids,
                )
            )
        plan = self.planner.build_step(scheduled, scheduler_output.preempted_req_ids or ())
        return LMCacheMPMetadata(plan)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.planner is not None
        self.planner.transfers_finished(
            connector_output.finished_recving or (),
            connector_output.finished_sending or (),
            connector_output.failed_recving or (),
        )

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.planner is not None
        return self.planner.request_finished(request.request_id), None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self.planner is not None
        return self.planner.request_finished(request.request_id), None
