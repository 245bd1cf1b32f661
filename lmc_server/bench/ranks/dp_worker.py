"""One data-parallel engine of ``lmcache bench ranks --mode dp``: its store and load loops.

An engine registers as rank 0 of world size 1 (what the connector does for an engine
without tensor parallelism), so every engine of the run is in one namespace and reads
what the others stored. It runs two loops on one connection until the deadline, at its
own pace (no barrier with the other engines):

- store: its own prompts in turn (``q = j * engines + engine``), each tagged first
  (:meth:`RankKV.tag`) and stored whole from region A;
- load: pick an engine at random (itself included, as a router that does not know where
  a prefix lives would) and one of that engine's :data:`DP_RECENT_PROMPTS` most recent
  prompts (judged by this engine's own progress), look it up with a lease, retrieve
  the hit prefix into one half of region B, release the lease. Every loaded prefix is
  compared byte for byte with what its storer wrote, on a thread while the next load
  runs into the other half; the check then zeroes what the load wrote, so a later load
  that writes nothing there cannot pass.

A lookup that hits nothing (the prompt is not stored yet, or was evicted) is counted,
not an error. A chunk the lease promised that the retrieve did not deliver is a failed
chunk, and so is a store chunk that did not end ``OK``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from lmc_server.bench.ranks.config import (
    DP_LOAD_COUNTS,
    DP_RECENT_PROMPTS,
    REGION_A,
    REGION_B,
    prompt_digests,
    prompt_owner,
    prompt_slots,
)
from lmc_server.bench.ranks.counts import Counts
from lmc_server.bench.ranks.kv import RankKV
from lmc_server.cache.keys import DIGEST_BYTES
from lmc_server.cache.status import ChunkStatus
from lmc_server.client.core import ChunkResult, Registration, ServerError

_ERRORS = (ServerError, TimeoutError, ConnectionError)
#: A stored chunk ends OK (or NOT_AVAILABLE / SKIPPED for sections a hit cannot use);
#: EXISTS or IN_PROGRESS would mean another engine wrote this engine's prompt.
_STORE_FAILED = ("failed", "no_space", "miss", "exists", "in_progress")
_LOAD_FAILED = (ChunkStatus.FAILED, ChunkStatus.MISS)


class DPEngine:
    """Engine ``engine`` of ``engines``: prompts of ``prompt_chunks`` chunks."""

    def __init__(self, client: Any, reg: Registration, kv: RankKV, cfg: dict[str, Any]) -> None:
        self.client, self.reg, self.kv = client, reg, kv
        self.engine: int = cfg["rank"]
        self.engines: int = cfg["ranks"]
        self.chunks: int = cfg["chunks"]
        self.prompt_chunks: int = cfg["batch"]
        self.seed: int = cfg["seed"]
        ob = {og.name: og.object_bytes for og in reg.object_groups}
        self.st, self.lt = Counts(ob), Counts(ob)
        self.stored_prompts = 0
        self.rng = np.random.default_rng(self.seed * 1000 + 7919 * self.engine + 1)
        self.n: dict[str, int] = dict.fromkeys(DP_LOAD_COUNTS, 0)
        self.verify_s = 0.0

    # -- store ----------------------------------------------------------------------------

    async def store_next(self, counts: Counts) -> None:
        """Tag and store this engine's next prompt, counting into ``counts``."""
        q = self.stored_prompts * self.engines + self.engine
        slots = prompt_slots(q, self.prompt_chunks, self.chunks)
        await asyncio.to_thread(self.kv.tag, slots, q)
        t0 = time.perf_counter()
        try:
            res: ChunkResult = await self.client.store(
                self.reg,
                prompt_digests(self.seed, q, self.prompt_chunks),
                self.kv.slots.ids(REGION_A, slots),
            )
        except _ERRORS as e:
            counts.error(e)
            return
        counts.add(res, time.perf_counter() - t0)
        self.stored_prompts += 1

    async def seed_prompt(self) -> dict[str, Any]:
        """Before the timed phase: store prompt 0, so every engine has one to load."""
        counts = Counts(self.st.object_bytes)
        await self.store_next(counts)
        return counts.to_json()

    # -- load -----------------------------------------------------------------------------

    def _pick(self) -> int:
        owner = int(self.rng.integers(self.engines))
        horizon = max(self.stored_prompts, 1)  # prompt 0 of every engine: the seed
        j = horizon - 1 - int(self.rng.integers(min(DP_RECENT_PROMPTS, horizon)))
        return j * self.engines + owner

    def _check(self, q: int, src: np.ndarray, dst: np.ndarray) -> tuple[int, int, float]:
        t0 = time.perf_counter()
        bad, checked = self.kv.mismatch(src, dst, prompt=q)
        self.kv.poison(dst)
        return bad, checked, time.perf_counter() - t0

    async def _verify(self, q: int, src: np.ndarray, dst: np.ndarray) -> None:
        bad, checked, seconds = await asyncio.to_thread(self._check, q, src, dst)
        self.n["mismatched_bytes"] += bad
        self.n["checked_bytes"] += checked
        self.n["verified_loads"] += 1
        self.verify_s += seconds

    async def _release(self, lease_id: int) -> None:
        if not lease_id:
            return
        try:
            await self.client.release(lease_id)
        except _ERRORS as e:
            self.lt.error(e)

    async def load_one(self, half: int, pending: list[asyncio.Future[None] | None]) -> None:
        """Once region-B half ``half``'s previous check is done: look up one prompt,
        retrieve its hit prefix into that half, start this load's check."""
        prev = pending[half]
        if prev is not None:  # before the lookup: a lease is held only around its load
            await prev
        q = self._pick()
        digs = prompt_digests(self.seed, q, self.prompt_chunks)
        try:
            found = await self.client.lookup(self.reg, digs)
        except _ERRORS as e:
            self.lt.error(e)
            return
        self.n["lookups"] += 1
        h = int(found.hit_chunks)
        if h == 0:
            self.n["lookup_misses"] += 1
            await self._release(found.lease_id)
            return
        self.n["partial_hits"] += int(h < self.prompt_chunks)
        src = prompt_slots(q, self.prompt_chunks, self.chunks)[:h]
        dst = half * self.prompt_chunks + np.arange(h)
        t0 = time.perf_counter()
        try:
            res: ChunkResult = await self.client.retrieve(
                self.reg, digs[: h * DIGEST_BYTES], self.kv.slots.ids(REGION_B, dst)
            )
        except _ERRORS as e:
            self.lt.error(e)
            pending[half] = asyncio.ensure_future(asyncio.to_thread(self.kv.poison, dst))
            return
        finally:
            await self._release(found.lease_id)
        self.lt.add(res, time.perf_counter() - t0)
        self.n["loads"] += 1
        failed = sum(int(np.isin(st, _LOAD_FAILED).sum()) for st in res.statuses.values())
        if failed:  # the lease promised these chunks: a failure, and nothing to check
            self.n["failed_load_chunks"] += failed
            pending[half] = asyncio.ensure_future(asyncio.to_thread(self.kv.poison, dst))
            return
        mine = prompt_owner(q, self.engines) == self.engine
        self.n["own_chunks" if mine else "cross_engine_chunks"] += h
        pending[half] = asyncio.ensure_future(self._verify(q, src, dst))

    # -- the phase ------------------------------------------------------------------------

    async def run(self, duration_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + duration_s
        pending: list[asyncio.Future[None] | None] = [None, None]

        async def store_loop() -> None:
            while time.monotonic() < deadline:
                await self.store_next(self.st)

        async def load_loop() -> None:
            half = 0
            while time.monotonic() < deadline:
                await self.load_one(half, pending)
                half ^= 1

        t0 = time.monotonic()
        await asyncio.gather(store_loop(), load_loop())
        seconds = time.monotonic() - t0
        for task in pending:
            if task is not None:
                await task
        return self.report(seconds)

    def report(self, seconds: float) -> dict[str, Any]:
        st, lt = self.st.to_json(), self.lt.to_json()
        return {
            "seconds": seconds,
            "store": st,
            "load": lt,
            "stored_prompts": self.stored_prompts,
            "verify_s": self.verify_s,
            "failed_store_chunks": sum(st["status"][s] for s in _STORE_FAILED),
            "store_exists_chunks": st["status"]["exists"] + st["status"]["in_progress"],
            **self.n,
        }
