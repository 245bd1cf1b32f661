"""Worker side of ``lmcache bench ranks``: one process per rank, driven over JSON lines.

``python -m lmc_server.bench.ranks.worker`` reads commands on stdin (``init``, phase-1
store and retrieve, raw-copy baseline, TP phases, phase 2; in DP mode the seed prompt and
the DP phase) and answers one JSON line each on stdout; see :mod:`lmc_server.bench.ranks.run`
for the phases and what the parent checks. The rank's KV and byte checks are in
:mod:`lmc_server.bench.ranks.kv`; a DP engine's loops in :mod:`.dp_worker`.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import signal
import sys
import time
from typing import Any

import numpy as np

from lmc_server.bench.jsonproc import reply
from lmc_server.bench.ranks.config import (
    IN_PROGRESS_POLL_S,
    IN_PROGRESS_RETRY_S,
    REGION_A,
    REGION_B,
    digests,
)
from lmc_server.bench.ranks.counts import Counts
from lmc_server.bench.ranks.dp_worker import DPEngine
from lmc_server.bench.ranks.kv import RankKV
from lmc_server.cache.status import ChunkStatus
from lmc_server.client.core import ChunkResult, Registration, ServerError

log = logging.getLogger(__name__)


class _Worker:
    """One rank: its KV, its registration, and the commands the parent sends."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.rank: int = cfg["rank"]
        self.chunks: int = cfg["chunks"]
        self.batch: int = cfg["batch"]
        self.seed: int = cfg["seed"]
        self.kv = RankKV(cfg)
        self.client: Any = None
        self.reg: Registration | None = None
        self.raw: Any = None
        self.raw_iters = 0
        self.raw_nbytes = 0
        self.dp: DPEngine | None = None

    # -- requests -------------------------------------------------------------------------

    def _object_bytes(self) -> dict[str, int]:
        assert self.reg is not None
        return {og.name: og.object_bytes for og in self.reg.object_groups}

    async def _request(
        self, op: str, phase: str, idx: np.ndarray, region: int, slots: np.ndarray, counts: Counts
    ) -> ChunkResult | None:
        """A store or retrieve of chunks ``idx`` of ``phase`` from or into ``slots`` of
        ``region``, counted into ``counts``; ``None`` if it raised."""
        t0 = time.perf_counter()
        try:
            res: ChunkResult = await getattr(self.client, op)(
                self.reg, digests(self.seed, phase, idx), self.kv.slots.ids(region, slots)
            )
        except (ServerError, TimeoutError, ConnectionError) as e:
            counts.error(e)
            return None
        counts.add(res, time.perf_counter() - t0)
        return res

    async def _store(self, phase: str, idx: np.ndarray, counts: Counts) -> ChunkResult | None:
        return await self._request("store", phase, idx, REGION_A, idx % self.chunks, counts)

    async def _store_settled(
        self, idx: np.ndarray, counts: Counts, until: float
    ) -> dict[str, np.ndarray]:
        """Store chunks ``idx`` of phase 2, storing again the ones another rank was
        writing (``IN_PROGRESS``) until each is committed (``EXISTS``), failed, or
        ``until`` passes. Returns the last status per object group (255: no reply)."""
        final = {og: np.full(idx.size, 255, dtype=np.uint8) for og in self._object_bytes()}
        todo = np.arange(idx.size)
        while True:
            res = await self._store("p2", idx[todo], counts)
            if res is None:
                return final
            busy = np.zeros(todo.size, dtype=bool)
            for og, st in res.statuses.items():
                final[og][todo] = st
                busy |= st == ChunkStatus.IN_PROGRESS
            if not busy.any() or time.monotonic() > until:
                return final
            todo = todo[busy]
            await asyncio.sleep(IN_PROGRESS_POLL_S)

    async def _retrieve(
        self, phase: str, idx: np.ndarray, dst: np.ndarray, counts: Counts
    ) -> ChunkResult | None:
        return await self._request("retrieve", phase, idx, REGION_B, dst, counts)

    async def init(self) -> dict[str, Any]:
        from lmc_server.client.aio import AsyncClient

        dp = self.cfg["mode"] == "dp"  # an engine of its own: rank 0 of world size 1
        self.client = await AsyncClient.connect(
            self.cfg["endpoint"],
            timeout_s=120,
            client_name=f"bench-{'engine' if dp else 'rank'}{self.rank}",
        )
        self.reg = await self.client.register(
            **self.kv.kv.register_kwargs(
                world_size=1 if dp else self.cfg["ranks"],
                rank=0 if dp else self.rank,
                replicated=True,
            )
        )
        assert self.reg.chunk_size == self.kv.chunk_size, "the server's chunk size is ours"
        assert self.reg.chunk_bytes == self.kv.layout.chunk_bytes, "layouts agree"
        if dp:
            self.dp = DPEngine(self.client, self.reg, self.kv, self.cfg)
        names = [s.name for s in self.kv.kv.segments] if not self.kv.cuda else []
        return {
            "chunk_bytes": self.reg.chunk_bytes,
            "object_bytes": self._object_bytes(),
            "namespace": self.reg.namespace,
            "arch": self.kv.kv.geometry.arch,
            "device": self.kv.device,
            "device_count": self.kv.device_count,
            "segments": names,
            "pid": os.getpid(),
        }

    async def p1_store(self) -> dict[str, Any]:
        counts = Counts(self._object_bytes())
        t0 = time.perf_counter()
        for start in range(0, self.chunks, self.batch):
            await self._store("p1", np.arange(start, min(start + self.batch, self.chunks)), counts)
        return {"seconds": time.perf_counter() - t0, **counts.to_json()}

    async def p1_retrieve(self) -> dict[str, Any]:
        counts = Counts(self._object_bytes())
        src = np.arange(self.chunks)
        dst = (src + self.rank) % self.chunks
        t0 = time.perf_counter()
        for i in range(self.chunks):
            await self._retrieve("p1", src[i : i + 1], dst[i : i + 1], counts)
        seconds = time.perf_counter() - t0
        bad, checked = 0, 0
        for lo in range(0, self.chunks, 64):
            b, c = await asyncio.to_thread(
                self.kv.mismatch, src[lo : lo + 64], dst[lo : lo + 64], False
            )
            bad, checked = bad + b, checked + c
        return {
            "seconds": seconds,
            "mismatched_bytes": bad,
            "checked_bytes": checked,
            **counts.to_json(),
        }

    async def p2(self, duration_s: float, verify_every: int) -> dict[str, Any]:
        """Store and retrieve loops on one connection until ``duration_s`` has passed."""
        ob = self._object_bytes()
        st, rt = Counts(ob), Counts(ob)
        committed: list[int] = []
        stored_ok: dict[str, list[np.ndarray]] = {og: [] for og in ob}
        stored_pending: dict[str, list[np.ndarray]] = {og: [] for og in ob}
        verify = {"mismatched_bytes": 0, "checked_bytes": 0, "verified_requests": 0}
        rng = np.random.default_rng(self.seed * 1000 + self.rank)
        t0 = time.monotonic()
        deadline = t0 + duration_s
        next_chunk = 0

        async def store_loop() -> None:
            nonlocal next_chunk
            while time.monotonic() < deadline:
                idx = np.arange(next_chunk, next_chunk + self.batch)
                next_chunk += self.batch
                final = await self._store_settled(idx, st, deadline + IN_PROGRESS_RETRY_S)
                ok = np.ones(self.batch, dtype=bool)
                for og in ob:
                    good = (final[og] == ChunkStatus.OK) | (final[og] == ChunkStatus.EXISTS)
                    stored_ok[og].append(good)
                    stored_pending[og].append(final[og] == ChunkStatus.IN_PROGRESS)
                    ok &= good
                if ok.all():
                    committed.append(int(idx[0]))
                await asyncio.sleep(0)

        async def retrieve_loop() -> None:
            n_ok = 0
            while time.monotonic() < deadline:
                if not committed:
                    await asyncio.sleep(0.001)
                    continue
                start = committed[-1 - int(rng.integers(0, min(8, len(committed))))]
                idx = np.arange(start, start + self.batch)
                src = idx % self.chunks
                shift = int(rng.integers(1, self.chunks)) if self.chunks > 1 else 0
                dst = (src + shift) % self.chunks
                check = n_ok % verify_every == 0
                if check:
                    await asyncio.to_thread(self.kv.poison, dst)
                res = await self._retrieve("p2", idx, dst, rt)
                if res is None or not res.ok.all():
                    continue
                n_ok += 1
                if check:
                    b, c = await asyncio.to_thread(self.kv.mismatch, src, dst)
                    verify["mismatched_bytes"] += b
                    verify["checked_bytes"] += c
                    verify["verified_requests"] += 1

        await asyncio.gather(store_loop(), retrieve_loop())
        seconds = time.monotonic() - t0

        def bits(parts: list[np.ndarray]) -> str:
            a = np.concatenate(parts) if parts else np.zeros(0, dtype=bool)
            return base64.b64encode(np.packbits(a).tobytes()).decode()

        return {
            "seconds": seconds,
            "store": st.to_json(),
            "retrieve": rt.to_json(),
            "stored_chunks": next_chunk,
            **verify,
            "committed_bits": {og: bits(v) for og, v in stored_ok.items()},
            "pending_bits": {og: bits(v) for og, v in stored_pending.items()},
        }

    async def tp(
        self, mode: str, duration_s: float, n: int, inflight: int, tag: str
    ) -> dict[str, Any]:
        """Steady-state transfer, the tensor-parallel load pattern: every rank retrieves
        the same prefix (phase-1 chunks ``0..n-1``) into the same region-B block ids of
        its own KV (the ranks of one engine share one block table), with
        ``inflight`` requests in flight, until ``duration_s`` has passed; in mode
        ``mixed`` rank 0 also stores fresh chunks with as many in flight. Nothing is
        verified inside the timed loop; one poisoned retrieve after it is compared byte
        for byte, so a loop that wrote nothing cannot pass. ``tag`` names the phase's
        fresh chunks (one name per phase of a run: a store is never an ``EXISTS``)."""
        ob = self._object_bytes()
        rt, st, vt = Counts(ob), Counts(ob), Counts(ob)
        src = np.arange(n)
        dst = (src + 1) % self.chunks
        next_chunk = 0
        t0 = time.monotonic()
        deadline = t0 + duration_s

        async def retrieve_loop() -> None:
            while time.monotonic() < deadline:
                await self._retrieve("p1", src, dst, rt)

        async def store_loop() -> None:
            nonlocal next_chunk
            while time.monotonic() < deadline:
                idx = np.arange(next_chunk, next_chunk + n)
                next_chunk += n
                await self._store(f"tp-{tag}", idx, st)

        loops = [retrieve_loop() for _ in range(inflight)]
        if mode == "mixed" and self.rank == 0:
            loops += [store_loop() for _ in range(inflight)]
        await asyncio.gather(*loops)
        seconds = time.monotonic() - t0
        await asyncio.to_thread(self.kv.poison, dst)
        res = await self._retrieve("p1", src, dst, vt)
        bad, checked = await asyncio.to_thread(self.kv.mismatch, src, dst)
        return {
            "seconds": seconds,
            "retrieve": rt.to_json(),
            "store": st.to_json(),
            "verify_ok": bool(res is not None and res.ok.all()),
            "mismatched_bytes": bad,
            "checked_bytes": checked,
        }

    def raw_prepare(self, nbytes: int, raw_s: float) -> dict[str, Any]:
        self.raw_nbytes = nbytes
        if self.kv.cuda:
            from lmc_server.testing.cuda_kv import raw_copy_gbps

            gbps = raw_copy_gbps(nbytes, "d2h", device=self.kv.device, iters=3)
            self.raw_iters = max(3, int(raw_s * gbps * 1e9 / nbytes))
        else:
            from lmc_server.bench.baselines.rawcopy import CpuRawCopy

            self.raw = CpuRawCopy(nbytes)
            self.raw.seconds("d2h", nbytes)
        return {}

    def raw_go(self, direction: str, raw_s: float) -> dict[str, Any]:
        if self.kv.cuda:
            from lmc_server.testing.cuda_kv import raw_copy_gbps

            return {
                "gbps": raw_copy_gbps(
                    self.raw_nbytes, direction, device=self.kv.device, iters=self.raw_iters
                )
            }
        total, spent = 0, 0.0
        while spent < raw_s or total == 0:
            spent += self.raw.seconds(direction, self.raw_nbytes)
            total += self.raw_nbytes
        return {"gbps": total / spent / 1e9}

    def command(self, cmd: dict[str, Any]) -> Any:
        """What answers ``cmd`` (a dict, or a coroutine that makes one)."""
        c, dp = cmd, self.dp
        if c["cmd"] in ("dp_seed", "dp"):
            assert dp is not None, "dp commands need mode dp"
        handlers = {
            "p1_store": lambda: self.p1_store(),
            "p1_retrieve": lambda: self.p1_retrieve(),
            "raw_prepare": lambda: self.raw_prepare(c["nbytes"], c["raw_s"]),
            "raw_go": lambda: self.raw_go(c["direction"], c["raw_s"]),
            "tp": lambda: self.tp(c["mode"], c["duration_s"], c["chunks"], c["inflight"], c["tag"]),
            "p2": lambda: self.p2(c["duration_s"], c["verify_every"]),
            "dp_seed": lambda: dp.seed_prompt(),  # type: ignore[union-attr]
            "dp": lambda: dp.run(c["duration_s"]),  # type: ignore[union-attr]
        }
        if c["cmd"] not in handlers:
            raise ValueError(f"unknown command {c['cmd']!r}")
        return handlers[c["cmd"]]()

    async def close(self) -> None:
        if self.client is not None:
            if self.reg is not None:
                await self.client.unregister(self.reg)
            await self.client.close()
        if self.raw is not None:
            self.raw.close()
        self.kv.close()


async def _serve(first: dict[str, Any]) -> None:
    worker = _Worker(first)
    loop = asyncio.get_running_loop()
    try:
        reply(await worker.init())
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                return
            cmd = json.loads(line)
            if cmd["cmd"] == "exit":
                break
            out = worker.command(cmd)
            reply(await out if asyncio.iscoroutine(out) else out)
    finally:
        await worker.close()


def worker_main() -> int:
    """Entry point of a rank process: config on the first stdin line, then commands."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when ranks end
    first = json.loads(sys.stdin.readline())
    try:
        asyncio.run(_serve(first))
    except Exception as e:
        log.exception("rank %s failed", first.get("rank"))
        reply({"error": f"{type(e).__name__}: {e}"})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
