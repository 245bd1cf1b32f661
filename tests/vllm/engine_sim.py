"""vLLM 0.33's own scheduler with LMCacheMPConnector, a simulated model runner, and a
byte oracle.

:class:`SimEngine` builds what ``EngineCore`` builds for the scheduler: a
``VllmConfig`` whose ``kv_transfer_config`` names the connector (vLLM's factory
creates the scheduler-side connector), the model's ``KVCacheConfig`` (vLLM's own
grouping and allocation plan), and vLLM's ``Scheduler`` with its ``KVCacheManager``
(prefix caching, chunked prefill, preemption, async loads, load-failure policy). The
worker-side connector is created as a GPU worker creates it and registers the KV
cache vLLM's ``allocate_kv_cache`` lays out, rebuilt over shared memory so a real
server process (CPU engine) copies real bytes.

Each :meth:`SimEngine.step` calls the worker hooks in the V1 model runner's order
(``handle_preemptions``, ``bind_connector_metadata``, forward, ``start_load_kv``,
``wait_for_save``, ``get_transfer_results``, ``get_block_ids_with_load_errors``,
``clear_connector_metadata``) and stands in for the forward pass:

* it first reads, for every scheduled request, every page attention would read (full
  groups: every block below the computed tokens; sliding windows: the blocks still in
  the window) and checks each byte against the oracle;
* then writes the pages of the tokens it computes.

The oracle: a page of block ``j`` holding tokens up to ``f`` of a request (``f`` the
computed end within the block) is the layer's salt and a digest of ``tokens[:f]``,
tiled over the whole page. A page loaded from the server, or left from an earlier
step, is right only if it was produced from exactly the same token prefix; a stale
or foreign page differs in every byte. Scratch groups are never read or written.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 16384,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
    "head_dim": 64,
}

#: the window of the ``swa`` model (tokens)
SWA_WINDOW = 128

_model_config: Any = None


def model_config(tmp: Path) -> Any:
    """A ``ModelConfig`` for a tiny local Llama config (no weights, no download): the
    scheduler needs one; the KV cache config is built separately per model below."""
    global _model_config
    if _model_config is None:
        import json

        from vllm.config import ModelConfig

        d = tmp / "tiny-llama"
        d.mkdir(exist_ok=True)
        (d / "config.json").write_text(json.dumps(TINY_MODEL))
        _model_config = ModelConfig(
            model=str(d), skip_tokenizer_init=True, max_model_len=16384, dtype="bfloat16"
        )
    return _model_config


def fixture_script() -> Any:
    spec = importlib.util.spec_from_file_location(
        "vllm_kv_fixture", REPO / "scripts" / "vllm-kv-fixture.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def kv_cache_config(
    model: str, num_blocks: int, arch: str = "sm90", compressed_block: int = 64
) -> tuple[Any, Any]:
    """vLLM's ``KVCacheConfig`` for ``model`` (``plain``: full attention; ``swa``: one
    sliding-window group, window 128; ``dsv41``) and the KV cache layout its backends
    resolve, as the engine core plans them."""
    import torch
    from vllm.v1.core.kv_cache_planning import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )

    fx = fixture_script()
    if model in ("plain", "swa"):
        vc = fx.vllm_config(16, "auto", num_blocks)
        specs, backends = fx.plain_layers(2)
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

        small: Any = FullAttentionSpec(
            block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16
        )
        if model == "swa":
            small = SlidingWindowSpec(
                block_size=16,
                num_kv_heads=2,
                head_size=64,
                dtype=torch.bfloat16,
                sliding_window=SWA_WINDOW,
            )
        specs = {n: small for n in specs}
    else:
        old = fx.DSV41_BLOCK
        fx.DSV41_BLOCK = compressed_block
        try:
            vc = fx.vllm_config(compressed_block, "fp8_ds_mla", num_blocks)
            specs, backends = fx.dsv41_layers(vc, arch, 4)
        finally:
            fx.DSV41_BLOCK = old
    layout = fx.resolve_layout(vc, specs, backends)
    groups = get_kv_cache_groups(vc, dict(specs))
    cfg = get_kv_cache_config_from_groups(vc, groups, available_memory=1 << 40)
    return cfg, layout


def digest(tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(np.asarray(tokens, dtype="<i4").tobytes(), digest_size=32).digest()


def next_token(tokens: Sequence[int]) -> int:
    """The simulated model's deterministic choice: a function of the whole prefix."""
    return 100 + int.from_bytes(digest(tokens)[:4], "little") % 30000


@dataclass
class Page:
    offset: int
    stride: int
    nbytes: int
    salt: bytes


@dataclass
class GroupPages:
    tokens_per_block: int
    window_tokens: int
    pages: list[Page]


@dataclass
class Oracle:
    checked_pages: int = 0
    checked_bytes: int = 0
    wrong: list[str] = field(default_factory=list)


class SimEngine:
    """vLLM's scheduler + the connector on both sides + a simulated forward pass."""

    def __init__(
        self,
        endpoint_port: int,
        tmp: Path,
        *,
        model: str = "plain",
        num_blocks: int = 600,
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 256,
        load_failure_policy: str = "fail",
        extra: dict[str, Any] | None = None,
        arch: str = "sm90",
        compressed_block: int = 64,
        model_name: str = "",
        async_scheduling: bool = False,
        forward_s: float = 0.0,
        idle_step_s: float = 0.0,
    ) -> None:
        import torch
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.kv_cache_utils import (
            generate_scheduler_kv_cache_config,
            resolve_cache_hit_alignment_tokens,
            resolve_kv_cache_block_sizes,
        )
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import allocate_kv_cache

        from lmc_server.client.shm import ShmSegment
        from lmc_server.integration.exporters import register_shm_segment
        from lmc_server.integration.vllm import LMCacheMPConnector
        from lmc_server.integration.vllm.geometry import build_groups

        cfg, layout = kv_cache_config(model, num_blocks, arch, compressed_block)
        settings = {
            "lmcache.mp.port": endpoint_port,
            "lmcache.mp.timeout_s": 5,
            "lmcache.mp.arch": arch,
            "lmcache.mp.model": model_name or f"sim/{model}-{arch}",
            **(extra or {}),
        }
        block = min(g.kv_cache_spec.block_size for g in cfg.kv_cache_groups)
        self.vc = VllmConfig(
            model_config=model_config(tmp),
            device_config=DeviceConfig(device="cpu"),
            cache_config=CacheConfig(
                block_size=block, enable_prefix_caching=True, num_gpu_blocks_override=cfg.num_blocks
            ),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=min(max_num_seqs, max_num_batched_tokens),
                max_model_len=16384,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
                async_scheduling=async_scheduling,
            ),
            kv_transfer_config=KVTransferConfig(
                kv_connector="LMCacheMPConnector",
                kv_connector_module_path="lmc_server.integration.vllm",
                kv_role="kv_both",
                kv_load_failure_policy=load_failure_policy,
                kv_connector_extra_config=settings,
            ),
        )
        self.vc.cache_config.num_gpu_blocks = cfg.num_blocks
        # the CPU platform turns async scheduling off; GPU platforms default it on
        self.vc.scheduler_config.async_scheduling = async_scheduling
        sched_block, hash_block = resolve_kv_cache_block_sizes(cfg, self.vc)
        cfg.hash_block_size = hash_block
        cfg.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
            generate_scheduler_kv_cache_config([cfg]), self.vc, sched_block, hash_block
        )
        self.cfg = cfg
        self.hash_block = hash_block
        # the scheduler gets what EngineCore gives it: a copy with per-layer specs folded
        self.async_scheduling = async_scheduling
        scheduler_cls = self.vc.scheduler_config.get_scheduler_cls()
        assert issubclass(scheduler_cls, Scheduler)
        self.scheduler = scheduler_cls(
            self.vc,
            generate_scheduler_kv_cache_config([cfg]),
            StructuredOutputManager(self.vc),
            block_size=sched_block,
            hash_block_size=hash_block,
        )
        self.connector = self.scheduler.connector
        assert isinstance(self.connector, LMCacheMPConnector)

        # the worker: vLLM's allocation, rebuilt over shared memory
        caches = allocate_kv_cache(cfg, torch.device("cpu"), layout)
        storage = next(iter(caches.values())).untyped_storage()
        base, size = storage.data_ptr(), storage.nbytes()
        self.segment = ShmSegment(size)
        register_shm_segment(self.segment)
        raw = torch.frombuffer(self.segment._mm, dtype=torch.uint8)
        self.views: dict[str, Any] = {}
        for name, t in caches.items():
            off = t.data_ptr() - base
            assert off % t.element_size() == 0
            self.views[name] = raw.view(t.dtype).as_strided(
                t.shape, t.stride(), off // t.element_size()
            )
        del caches
        self.mem = self.segment.array
        self.worker = LMCacheMPConnector(self.vc, KVConnectorRole.WORKER, cfg)
        self.worker.register_kv_caches(self.views)
        # EngineCore._set_kv_connector_handshake_metadata: workers -> scheduler, once
        self.connector.set_xfer_handshake_metadata_pp_aware(
            {(0, 0): self.worker.get_handshake_metadata()}
        )
        plan = build_groups(cfg, self.views)
        by_name = {g.name: g for g in plan.groups}
        self.groups: list[GroupPages | None] = []
        for eg in plan.engine_groups:
            if not eg.cached:
                self.groups.append(None)
                continue
            pages = [
                Page(
                    layer.offset,
                    layer.block_stride,
                    layer.page_bytes,
                    hashlib.blake2b(layer.name.encode(), digest_size=8).digest(),
                )
                for key in eg.block_id_keys
                for layer in by_name[key].layers
            ]
            self.groups.append(GroupPages(eg.tokens_per_block, eg.window_tokens, pages))
        self.oracle = Oracle()
        self.finished: dict[str, list[int]] = {}
        self.failed: dict[str, str] = {}
        self.steps = 0
        self.loaded_tokens: dict[str, int] = {}
        self.preempted: set[str] = set()
        self.requests: dict[str, Any] = {}
        self.seq: dict[str, list[int]] = {}
        self._in_flight: tuple[Any, Any] | None = None
        self.max_loads_per_step = 0
        self.before_worker: Callable[[Any], None] | None = None
        #: seconds a simulated forward pass with tokens scheduled takes, and a step
        #: without (the round trip to the workers; the thread waits, as on an RPC)
        self.forward_s = forward_s
        self.idle_step_s = idle_step_s
        #: per request: the step count when it was added, and the step that first
        #: scheduled tokens of it (its prefill's first step)
        self.added_at_step: dict[str, int] = {}
        self.first_scheduled_step: dict[str, int] = {}
        #: the same as times (``time.perf_counter``): arrival, first scheduled tokens
        self.added_at_s: dict[str, float] = {}
        self.first_scheduled_s: dict[str, float] = {}

    # -- requests -------------------------------------------------------------------------

    def add(self, req_id: str, prompt: Sequence[int], max_tokens: int = 1) -> Any:
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)
        req = Request(
            req_id,
            list(prompt),
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            None,
            block_hasher=get_request_block_hasher(self.hash_block, sha256),
        )
        self.scheduler.add_request(req)
        self.requests[req_id] = req
        self.seq[req_id] = list(prompt)
        self.added_at_step[req_id] = self.steps
        self.added_at_s[req_id] = time.perf_counter()
        return req

    # -- the oracle -----------------------------------------------------------------------

    @staticmethod
    def _fill(page: Page, prefix_digest: bytes) -> np.ndarray:
        unit = np.frombuffer(page.salt + prefix_digest[:24], dtype=np.uint8)
        return np.resize(unit, page.nbytes)

    def _blocks(self, req_id: str) -> tuple[list[int], ...]:
        return tuple(self.scheduler.kv_cache_manager.get_block_ids(req_id))

    def _check_reads(self, req_id: str, tokens: Sequence[int], computed: int) -> None:
        tables = self._blocks(req_id)
        digests: dict[int, bytes] = {}
        for gi, g in enumerate(self.groups):
            if g is None or computed == 0:
                continue
            tpb = g.tokens_per_block
            first = 0
            if g.window_tokens:
                first = max(0, computed - g.window_tokens + 1) // tpb
            for j in range(first, -(-computed // tpb)):
                b = tables[gi][j] if j < len(tables[gi]) else -1
                f = min((j + 1) * tpb, computed)
                if b <= 0:
                    self.oracle.wrong.append(
                        f"{req_id}: group {gi} block index {j} (tokens < {f}) has no block ({b})"
                    )
                    continue
                d = digests.get(f)
                if d is None:
                    d = digests[f] = digest(tokens[:f])
                for p in g.pages:
                    lo = p.offset + b * p.stride
                    got = self.mem[lo : lo + p.nbytes]
                    want = self._fill(p, d)
                    self.oracle.checked_pages += 1
                    self.oracle.checked_bytes += p.nbytes
                    if not np.array_equal(got, want):
                        bad = int(np.count_nonzero(got != want))
                        self.oracle.wrong.append(
                            f"{req_id}: group {gi} block {b} (index {j}, tokens < {f}) "
                            f"at computed {computed}: {bad} of {p.nbytes} bytes wrong"
                        )

    def _write(self, req_id: str, tokens: Sequence[int], start: int, end: int) -> None:
        tables = self._blocks(req_id)
        for gi, g in enumerate(self.groups):
            if g is None:
                continue
            tpb = g.tokens_per_block
            for j in range(start // tpb, -(-end // tpb)):
                b = tables[gi][j]
                assert b > 0, f"{req_id}: writing tokens of block index {j} into {b}"
                d = digest(tokens[: min((j + 1) * tpb, end)])
                for p in g.pages:
                    lo = p.offset + b * p.stride
                    self.mem[lo : lo + p.nbytes] = self._fill(p, d)

    # -- one engine step ------------------------------------------------------------------

    def wait_lookups(self, timeout_s: float = 20.0) -> None:
        """Until every lookup the scheduler-side connector sent has been answered."""
        deadline = time.monotonic() + timeout_s
        while self.connector.planner.lookups_in_flight:
            assert time.monotonic() < deadline, "lookups not answered"
            time.sleep(0.002)

    def forget_local_cache(self) -> None:
        """Drop vLLM's own prefix cache (as its eviction would): hits must come from
        the server from now on."""
        assert self.scheduler.reset_prefix_cache(), "vLLM refused to reset its cache"

    def step(self) -> Any:
        """One engine step. With async scheduling (vLLM's batch queue of two), step
        N+1 is scheduled and executed before step N's output is processed, as
        ``EngineCore.step_with_batch_queue`` does."""
        out = self.scheduler.schedule()
        self.steps += 1
        mro = self._execute(out)
        if self.async_scheduling:
            if self._in_flight is not None:
                self._update(*self._in_flight)
            self._in_flight = (out, mro)
        else:
            self._update(out, mro)
        return out

    def _execute(self, out: Any) -> Any:
        """The worker side in the V1 model runner's order, the simulated forward pass
        between ``bind_connector_metadata`` and ``start_load_kv``."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        self.preempted |= set(out.preempted_req_ids or ())
        meta = out.kv_connector_metadata
        self.max_loads_per_step = max(self.max_loads_per_step, len(meta.plan.loads))
        if self.before_worker is not None:
            self.before_worker(out)
        w = self.worker
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        runs: list[tuple[str, int, int]] = [
            (r.req_id, r.num_computed_tokens, out.num_scheduled_tokens[r.req_id])
            for r in out.scheduled_new_reqs
        ]
        cached = out.scheduled_cached_reqs
        runs += [
            (rid, cached.num_computed_tokens[i], out.num_scheduled_tokens[rid])
            for i, rid in enumerate(cached.req_ids)
        ]
        sampled: dict[str, list[int]] = {}
        now_s = time.perf_counter()
        for rid, _, _ in runs:
            self.first_scheduled_step.setdefault(rid, self.steps)
            self.first_scheduled_s.setdefault(rid, now_s)
        for rid, computed, n in runs:  # the forward pass
            seq = self.seq[rid]
            assert computed + n <= len(seq), f"{rid}: scheduled past its known tokens"
            self._check_reads(rid, seq, computed)
            self._write(rid, seq, computed, computed + n)
            sampled[rid] = []
            if computed + n == len(seq):
                seq.append(next_token(seq))
                sampled[rid] = [seq[-1]]
        w.start_load_kv(None)
        if runs and self.forward_s:  # the GPU runs the forward pass; loads overlap it
            time.sleep(self.forward_s)
        elif not runs and self.idle_step_s:
            time.sleep(self.idle_step_s)
        w.wait_for_save()
        res = w.get_transfer_results(out.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        ids = [rid for rid, _, _ in runs]
        return ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[sampled[r] for r in ids],
            kv_connector_output=KVConnectorOutput(
                finished_sending=res.finished_sending or None,
                finished_recving=res.finished_recving or None,
                failed_recving=res.failed_recving,
                invalid_block_ids=invalid,
            ),
        )

    def _update(self, out: Any, mro: Any) -> None:
        for rid in mro.kv_connector_output.finished_recving or ():
            r = self.scheduler.requests.get(rid)
            if r is not None:
                self.loaded_tokens[rid] = r.num_computed_tokens
        engine_outputs = self.scheduler.update_from_output(out, mro)
        for eco in engine_outputs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.finished[o.request_id] = list(o.new_token_ids)
                    if int(o.finish_reason) not in (0, 1):  # STOP, LENGTH
                        self.failed[o.request_id] = str(o.finish_reason)

    def run(self, req_ids: Iterable[str], max_steps: int = 2000, timeout_s: float = 120.0) -> None:
        """Step until every request in ``req_ids`` finished (and nothing is held)."""
        want = set(req_ids)
        deadline = time.monotonic() + timeout_s
        for _ in range(max_steps):
            if want <= set(self.finished) and not self.scheduler.has_unfinished_requests():
                break
            out = self.step()
            if out.total_num_scheduled_tokens == 0:
                time.sleep(0.002)
            assert time.monotonic() < deadline, "engine did not finish in time"
        else:
            raise AssertionError(
                f"not finished after {max_steps} steps: {sorted(want - set(self.finished))}"
            )
        self.drain()
        if self._in_flight is not None:
            self._update(*self._in_flight)
            self._in_flight = None

    def drain(self, timeout_s: float = 30.0) -> None:
        """Step until the connector holds no request (stores reported)."""
        deadline = time.monotonic() + timeout_s
        while self.connector.planner is not None and self.connector.planner.tracked:
            self.step()
            time.sleep(0.002)
            assert time.monotonic() < deadline, "connector still holds requests"

    def assert_no_wrong_bytes(self) -> None:
        assert not self.oracle.wrong, "\n".join(self.oracle.wrong[:20])
        assert self.oracle.checked_pages > 0

    def close(self) -> None:
        from lmc_server.integration.exporters import unregister_shm_segment

        self.worker.shutdown()
        self.connector.shutdown()
        unregister_shm_segment(self.segment)
        self.views.clear()
        self.segment.close()
