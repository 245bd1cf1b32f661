"""Two servers on one tier below L1, the harness the Redis run (:mod:`.run`) and the
disk tier's (:mod:`.disk`) share: the rounds, the byte check and the latency points,
each against a plain client of the same store.

Completion is polled every millisecond (``POLL_S``), which is the resolution of the
server-side timings.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import numpy as np

from lmc_server.bench.common import Report
from lmc_server.bench.l2.config import L2Config
from lmc_server.bench.servers import server_flags
from lmc_server.cache.geometry import blocks_per_chunk
from lmc_server.client import Client, chunk_digests
from lmc_server.testing.kv import ShmKV, block_ids_for
from lmc_server.testing.poll import wait_for
from lmc_server.testing.process import ServerProcess
from lmc_server.tiers import codec

#: Poll interval (stats, lookups): short enough to add little to a timing, long enough
#: not to take the CPU the server and redis-server need on a small host.
POLL_S = 0.001


#: The flag that gives a server each tier, for the message when it runs without one.
TIER_FLAGS = {"l2": "--l2", "disk": "--disk-dir"}


def tier_stats(c: Client, tier: str) -> Any:
    """The ``stats`` report of the server's ``tier`` (``l2`` or ``disk``)."""
    st = getattr(c.stats(), tier)
    assert st is not None, f"the server runs without {TIER_FLAGS[tier]}"
    return st


def random_digests(seed: int, n: int, chunk_size: int) -> bytes:
    """Digests of ``n`` chunks of random tokens (``chunk_size`` from the server)."""
    tokens = np.random.default_rng(seed).integers(0, 100_000, n * chunk_size)
    return chunk_digests(tokens, chunk_size)


class TwoServers:
    """Servers A and B on one tier below L1 (``tier``, given by ``args``): A stores from
    a KV of random bytes, B (an empty L1 and an empty KV) finds the objects in the tier.
    Shared by the Redis run (:mod:`.run`) and the disk tier's (:mod:`.disk`)."""

    def __init__(self, cfg: L2Config, stack: ExitStack, tier: str, args: list[str]) -> None:
        self.cfg, self.tier = cfg, tier
        n = self.max_chunks = max(cfg.chunks, *cfg.latency_chunks)
        self.args = server_flags(
            cfg.chunk_size, True, *args, "--l2-write-queue-objects", str(8 * n)
        )
        self.a = stack.enter_context(ServerProcess(self.args, l1_size_gb=cfg.l1_size_gb))
        self.b = stack.enter_context(ServerProcess(self.args, l1_size_gb=cfg.l1_size_gb))
        for srv in (self.a, self.b):  # measure ready servers (a store before the first
            srv.wait_pool_ready()  # slab is answered busy)
        probe = cfg.geometry.build(1)
        per_chunk = max(blocks_per_chunk(g, cfg.chunk_size) for g in probe.groups if g.cached)
        geometry = cfg.geometry.build(n * per_chunk)
        self.src = stack.enter_context(ShmKV(geometry))
        self.src.fill_random(1)
        self.dst = stack.enter_context(ShmKV(geometry))
        self.dst.fill(0)
        self.ca = stack.enter_context(Client(self.a.endpoint, timeout_s=60))
        self.cb = stack.enter_context(Client(self.b.endpoint, timeout_s=60))
        self.rega = self.ca.register(**self.src.register_kwargs())
        self.regb = self.cb.register(**self.dst.register_kwargs())
        for c in (self.ca, self.cb):
            self.wait(functools.partial(self.is_up, c), f"{tier} tier up", 30)
        self.fps = {p.name: bytes.fromhex(p.fingerprint) for p in self.ca.stats().partitions}
        self.obj_bytes = sum(og.object_bytes for og in self.rega.object_groups)

    def stats(self, c: Client) -> Any:
        return tier_stats(c, self.tier)

    def is_up(self, c: Client) -> bool:
        return bool(self.stats(c).state == "up")

    @staticmethod
    def wait(cond: Callable[[], object], what: str, timeout_s: float = 60.0) -> None:
        wait_for(cond, what, timeout_s, POLL_S, TimeoutError)

    def written(self, c: Client) -> int:
        """Objects the tier wrote, or -1 while a write is queued or in flight."""
        st = self.stats(c)
        return -1 if st.write_queue_objects or st.writes_in_flight else int(st.objects_written)

    def spaces(self) -> list[bytes]:
        """The tier's key space of each of A's object groups."""
        reg = self.rega
        return [
            codec.space_of(reg.namespace, self.fps[og.name], reg.chunk_size)
            for og in reg.object_groups
        ]

    def store(self, digests: bytes, seed: int) -> tuple[float, float, dict[str, np.ndarray]]:
        """(store s, store until written s, block ids) of a store on A."""
        n = len(digests) // 32
        ids = block_ids_for(self.rega, n, np.random.default_rng(seed))
        objects = n * len(self.rega.object_groups)
        before = self.written(self.ca)
        t0 = time.perf_counter()
        res = self.ca.store(self.rega, digests, ids)
        if not res.ok.all():
            raise RuntimeError(f"store failed: {res.statuses}")
        t_store = time.perf_counter() - t0
        self.wait(lambda: self.written(self.ca) >= before + objects, "write-behind")
        return t_store, time.perf_counter() - t0, ids

    def hit(self, digests: bytes, n: int) -> float:
        """Seconds from a lookup that misses B's L1 until all ``n`` chunks hit in L1."""
        self.cb.clear()
        t0 = time.perf_counter()

        def all_hit() -> bool:
            r = self.cb.lookup(self.regb, digests, lease=False)
            if r.hit_chunks < n and not r.l2_pending_chunks:
                raise RuntimeError(f"{self.tier} read stopped at {r.hit_chunks} of {n} chunks")
            return r.hit_chunks >= n

        self.wait(all_hit, f"{n} chunks read from the {self.tier} tier", 600)
        return time.perf_counter() - t0

    def measure(
        self,
        report: Report,
        locate: Callable[[bytes], Any],
        raw_write: Callable[[Any, int], tuple[float, Any]],
        raw_read: Callable[[Any], float],
        raw_kept: bool,
    ) -> tuple[bytes, list[float], list[float]]:
        """The rounds, the byte check and the latency points, as rows of ``report``:
        ``locate`` finds the tier's copies of some digests, ``raw_write`` writes them
        again beside them plainly (seconds, where to read those back), ``raw_read`` reads
        them; ``raw_kept``: rows keep every round's times. Returns the last round's
        digests, its store times and its until-written times."""
        cfg, n = self.cfg, self.cfg.chunks
        nbytes, objects = n * self.obj_bytes, n * len(self.rega.object_groups)
        w_srv, w_raw, r_srv, r_raw, w_store = [], [], [], [], []
        digests, ids = b"", dict[str, np.ndarray]()
        for rnd in range(cfg.rounds):
            digests = random_digests(1000 + rnd, n, self.rega.chunk_size)
            t_store, t_all, ids = self.store(digests, rnd)
            w_store.append(t_store)
            w_srv.append(t_all)
            t_raw, written = raw_write(locate(digests), rnd)
            w_raw.append(t_raw)
            r_srv.append(self.hit(digests, n))
            r_raw.append(raw_read(written))
        dst_ids = block_ids_for(self.regb, n, np.random.default_rng(99))
        look = self.cb.lookup(self.regb, digests)
        res = self.cb.retrieve(self.regb, digests, dst_ids)
        self.cb.release(look.lease_id)
        report.summary["mismatched_groups"] = sum(  # full groups: every chunk, byte for byte
            1
            for g in self.regb.groups
            if g.cached
            and g.kind != "sliding_window"
            and self.src.pages(g.name, ids[g.name].tolist())
            != self.dst.pages(g.name, dst_ids[g.name].tolist())
        )
        report.summary["retrieved_ok"] = bool(res.ok.all())
        row = functools.partial(_row, kept=raw_kept)
        report.rows.append(row(f"write {n} chunks", w_srv, w_raw, nbytes, objects))
        report.rows[0]["store_s"] = statistics.median(w_store)
        if raw_kept:
            behind = [a - b for a, b in zip(w_srv, w_store, strict=True)]
            report.rows.append(row(f"write-behind {n} chunks", behind, w_raw, nbytes, objects))
        report.rows.append(row(f"read {n} chunks", r_srv, r_raw, nbytes, objects))
        for k in cfg.latency_chunks:
            base = random_digests(5000 + k, k, self.rega.chunk_size)
            self.store(base, k)
            where = locate(base)
            srv = [self.hit(base, k) for _ in range(cfg.repeats)]
            raw = [raw_read(where) for _ in range(cfg.repeats)]
            op = f"{'L2' if self.tier == 'l2' else self.tier} hit {k} chunks"
            report.rows.append(
                row(op, srv, raw, k * self.obj_bytes, k * len(self.rega.object_groups))
            )
        return digests, w_store, w_srv


def _row(
    op: str, srv: list[float], raw: list[float], nbytes: int, objects: int, kept: bool
) -> dict[str, Any]:
    t_srv, t_raw = statistics.median(srv), statistics.median(raw)
    out = {
        "op": op,
        "server_s": t_srv,
        "raw_s": t_raw,
        "server_gbps": nbytes / t_srv / 1e9,
        "raw_gbps": nbytes / t_raw / 1e9,
        "server_objps": objects / t_srv,
        "raw_objps": objects / t_raw,
        "ratio": t_raw / t_srv,
    }
    return {**out, "server_rounds_s": srv, "raw_rounds_s": raw} if kept else out
