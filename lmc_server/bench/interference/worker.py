"""The "worker" process of ``lmcache bench interference``: KV in GPU memory, driving a server.

Run as ``python -m lmc_server.bench.interference.worker`` by the benchmark (JSON lines on
stdin and stdout, no pickle). It holds the DeepSeek-V4.1 preset's KV cache in GPU memory
(:class:`~lmc_server.testing.cuda_kv.CudaKV`, three block regions as in ``bench
throughput``: sources ``A1``/``A2``, destination ``B``), registers it with the server
(CUDA IPC) and runs request loops against it for a given time:

``store``
    stores of ``chunks`` chunks with fresh digests (every chunk copied), alternating
    between the two source regions;
``retrieve``
    a load as the connector does one: lookup (with a lease), retrieve into ``B``,
    release, of one batch stored before the loop;
``both``
    the two loops at once.

``inflight`` requests of each kind are kept in flight. Before a loop with retrieves,
``B`` is overwritten with a sentinel byte; after it, ``B`` is compared byte for byte
with the source (what every retrieve wrote), so a retrieve that wrote nothing, wrote
stale bytes or wrote the wrong blocks shows up as mismatched bytes.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

import numpy as np
import torch

from lmc_server.bench.common import GeometryArgs, phase_means
from lmc_server.bench.jsonproc import reply, serve_lines
from lmc_server.bench.kvregions import A1, A2, B, Regions, max_blocks_per_chunk
from lmc_server.client.aio import AsyncClient
from lmc_server.testing.cuda_kv import CudaKV, device_arch
from lmc_server.testing.process import wait_pool_ready

SENTINEL = 0xEE


class Worker:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.device = int(cfg.get("device", 0))
        torch.cuda.set_device(self.device)
        self.max_chunks = int(cfg["max_chunks"])
        geo_args = GeometryArgs(**cfg["geometry"])
        arch = device_arch(self.device)
        geo_args = GeometryArgs(**{**geo_args.__dict__, "arch": arch})
        probe = geo_args.build(1)
        chunk_size = int(cfg["chunk_size"])
        num_blocks = 3 * self.max_chunks * max_blocks_per_chunk(probe, chunk_size)
        self.kv = CudaKV(geo_args.build(num_blocks), device=self.device)
        self.kv.fill_random(int(cfg.get("seed", 0)))
        self.endpoint = cfg["endpoint"]
        self.separate = bool(cfg.get("separate", True))
        self.block_order = str(cfg.get("block_order", "consecutive"))
        self.loop = asyncio.new_event_loop()
        self.client: AsyncClient | None = None
        self.reg: Any = None
        self.regions: Regions | None = None
        self.sources: dict[int, bytes] = {}

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    async def setup(self) -> dict[str, Any]:
        self.client = await AsyncClient.connect(
            self.endpoint, timeout_s=120, client_name="lmcache-bench-interference"
        )
        wait_pool_ready(self.endpoint, 600)  # time a ready server, not one still pinning
        self.reg = await self.client.register(**self.kv.register_kwargs())
        self.regions = Regions.build(
            self.kv.geometry, self.reg.chunk_size, self.max_chunks, self.separate, self.block_order
        )
        return {
            "arch": self.kv.geometry.arch,
            "chunk_bytes": self.regions.layout.chunk_bytes,
            "chunk_size": self.reg.chunk_size,
            "store_bytes": self.regions.store_bytes(self.max_chunks),
            "retrieve_bytes": self.regions.retrieve_bytes(self.max_chunks),
        }

    def _poison_b(self, n: int) -> None:
        """Overwrite what a retrieve of ``n`` chunks writes in ``B`` with the sentinel."""
        assert self.regions is not None
        for sec in self.regions.sections():
            g = self.kv.group(sec.group_name)
            blocks = self.regions.written_blocks(sec, B, n)
            idx = torch.as_tensor(blocks, dtype=torch.int64, device=self.kv.device)
            for spec in g.layers:  # one kernel per layer, not per page
                pages = self.kv.tensors[spec.buffer].as_strided(
                    (g.num_blocks, spec.page_bytes), (spec.block_stride, 1), spec.offset
                )
                pages.index_fill_(0, idx, SENTINEL)
        torch.cuda.synchronize(self.device)

    async def _store(self, n: int, region: int) -> tuple[bytes, Any]:
        assert self.client is not None and self.regions is not None
        digests = os.urandom(32 * n)
        res = await self.client.store(self.reg, digests, self.regions.ids(region, n))
        return digests, res

    async def _load(self, digests: bytes, n: int) -> tuple[Any, int]:
        """Lookup, retrieve, release: one connector load. Returns the result and the
        chunks the lookup promised."""
        assert self.client is not None and self.regions is not None
        hit = await self.client.lookup(self.reg, digests)
        try:
            res = await self.client.retrieve(
                self.reg, digests[: 32 * hit.hit_chunks], self.regions.ids(B, hit.hit_chunks)
            )
        finally:
            if hit.lease_id:
                await self.client.release(hit.lease_id)
        return res, hit.hit_chunks

    async def load(self, op: str, n: int, inflight: int, seconds: float) -> dict[str, Any]:
        assert self.regions is not None and self.client is not None
        if op in ("retrieve", "both"):
            src, res = await self._store(n, A1)
            if not res.ok.all():
                raise RuntimeError(
                    "the source batch of the retrieves was not stored: "
                    f"{ {k: v.tolist() for k, v in res.statuses.items()} }"
                )
            self._poison_b(n)
        deadline = time.perf_counter() + seconds
        lat: dict[str, list[float]] = {"store": [], "retrieve": []}
        failed = {"store": 0, "retrieve": 0}
        short = 0

        async def stores() -> None:
            k = 0
            while time.perf_counter() < deadline:
                k += 1
                t0 = time.perf_counter()
                _, r = await self._store(n, A1 if k % 2 else A2)
                lat["store"].append(time.perf_counter() - t0)
                failed["store"] += len(r.failed_chunks)

        async def retrieves() -> None:
            nonlocal short
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                r, hits = await self._load(src, n)
                lat["retrieve"].append(time.perf_counter() - t0)
                failed["retrieve"] += len(r.failed_chunks)
                short += n - hits

        tasks = []
        phases_before = (await self.client.stats()).phases
        t_start = time.perf_counter()
        for _ in range(inflight):
            if op in ("store", "both"):
                tasks.append(stores())
            if op in ("retrieve", "both"):
                tasks.append(retrieves())
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t_start
        out: dict[str, Any] = {
            "wall_s": wall,
            "server_ms": phase_means(phases_before, (await self.client.stats()).phases),
        }
        st_bytes = self.regions.store_bytes(n)
        rt_bytes = self.regions.retrieve_bytes(n)
        for kind, nbytes in (("store", st_bytes), ("retrieve", rt_bytes)):
            xs = lat[kind]
            if not xs:
                continue
            a = np.asarray(xs) * 1e3
            out[kind] = {
                "requests": len(xs),
                "bytes": nbytes,
                "gbps": len(xs) * nbytes / wall / 1e9,
                "p50_ms": float(np.percentile(a, 50)),
                "p99_ms": float(np.percentile(a, 99)),
                "failed_chunks": failed[kind],
            }
        if op in ("retrieve", "both"):
            out["retrieve"]["mismatched_bytes"] = self.regions.mismatched_bytes(self.kv, A1, B, n)
            out["retrieve"]["short_chunks"] = short
        return out

    async def close(self) -> None:
        if self.client is not None:
            await self.client.unregister(self.reg)
            await self.client.close()


def main() -> None:
    cfg = json.loads(sys.stdin.readline())
    w = Worker(cfg)
    reply(w.run(w.setup()))
    serve_lines(
        {
            "load": lambda c: w.run(
                w.load(c["op"], int(c["chunks"]), int(c["inflight"]), float(c["seconds"]))
            )
        }
    )
    w.run(w.close())
    w.kv.close()


if __name__ == "__main__":
    main()
