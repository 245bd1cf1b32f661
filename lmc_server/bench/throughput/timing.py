"""The timing loops of ``lmcache bench throughput`` (see :mod:`.run`).

:func:`measure_batch` times one batch size through one registration: single stores,
single retrieves (each verified byte for byte), a store and a retrieve at once, and
sustained runs with N requests in flight; every row says where the time went inside
the server (``stats`` ``phases``). :class:`Raw` times the raw copy of the same bytes.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import numpy as np

from lmc_server.bench.baselines.rawcopy import CpuRawCopy
from lmc_server.bench.common import phase_means
from lmc_server.bench.kvregions import A1, A2, B, Regions
from lmc_server.bench.throughput.config import ThroughputConfig
from lmc_server.client.aio import AsyncClient
from lmc_server.client.core import ChunkResult, Registration
from lmc_server.protocol.stats import PhaseSum

WARMUP_ITERS = 3


class Raw:
    """Raw-copy figures for the backend.

    On cpu, one raw copy of the same bytes is timed right after every timed server
    request (:meth:`sample`), so both see the same machine state (a shared VM's memory
    bandwidth drifts by 2x within seconds); the figure is the median. On cuda the
    reference comes from ``raw_copy_gbps`` once per point, timed with CUDA events.
    """

    def __init__(self, cfg: ThroughputConfig, max_bytes: int) -> None:
        self.cfg = cfg
        self._cpu = CpuRawCopy(max_bytes) if cfg.backend != "cuda" else None

    def sample(self, direction: str, nbytes: int, nbytes2: int = 0) -> float | None:
        """Seconds of one raw copy (cpu), or ``None`` where :meth:`gbps` is used."""
        if self._cpu is None:
            return None
        return self._cpu.seconds(direction, nbytes, nbytes2)

    def gbps(self, direction: str, nbytes: int, nbytes2: int, samples: list[float]) -> float:
        if samples:
            return (nbytes + nbytes2) / float(np.median(samples)) / 1e9
        from lmc_server.testing.cuda_kv import raw_copy_gbps  # type: ignore[import-not-found, unused-ignore]

        # "both" there copies one size each way at once: use the larger one
        return float(
            raw_copy_gbps(
                max(nbytes, nbytes2), direction, device=self.cfg.device, iters=self.cfg.raw_iters
            )
        )

    def close(self) -> None:
        if self._cpu is not None:
            self._cpu.close()


class Session:
    """One registration on one server, with the helpers every timed step needs."""

    def __init__(self, client: AsyncClient, reg: Registration, kv: Any, regions: Regions) -> None:
        self.client = client
        self.reg = reg
        self.kv = kv
        self.regions = regions

    async def store(self, n: int, region: int) -> tuple[bytes, ChunkResult]:
        """The pages were written and synchronized at setup, so (as a worker that
        waited for its writes) the store goes out at once."""
        digests = os.urandom(32 * n)
        res = await self.client.store(self.reg, digests, self.regions.ids(region, n))
        return digests, res

    async def retrieve(self, digests: bytes, n: int) -> ChunkResult:
        return await self.client.retrieve(self.reg, digests, self.regions.ids(B, n))

    async def phases(self) -> dict[str, PhaseSum]:
        """The server's cumulative phase sums (``stats`` ``phases``)."""
        return (await self.client.stats()).phases


def _enough(times: list[float], cfg: ThroughputConfig) -> bool:
    return len(times) >= cfg.max_iters or (
        len(times) >= cfg.min_iters and sum(times) >= cfg.min_time_s
    )


def _row(
    mode: str,
    copy_mode: str,
    n: int,
    nbytes: int,
    times: list[float],
    raw_gbps: float,
    mismatched: int,
    failed: int,
    server_ms: dict[str, dict[str, float]],
    seconds_per_request: float | None = None,
) -> dict[str, Any]:
    """One table row; GB/s is ``nbytes`` over the median of ``times`` or, for sustained
    runs, over ``seconds_per_request`` (wall time / requests)."""
    med = float(np.median(times))
    ours = nbytes / (seconds_per_request or med) / 1e9
    one_op = next(iter(server_ms.values())) if len(server_ms) == 1 else None
    return {
        "mode": mode,
        "copy_mode": copy_mode,
        "chunks": n,
        "bytes": nbytes,
        "iters": len(times),
        "p50_ms": med * 1e3,
        "ours_gbps": ours,
        "raw_gbps": raw_gbps,
        "ratio": ours / raw_gbps if raw_gbps > 0 else float("nan"),
        "mismatched_bytes": mismatched,
        "failed_chunks": failed,
        "srv_ms": sum(one_op.values()) if one_op else float("nan"),
        "copy_ms": one_op.get("copy", 0.0) if one_op else float("nan"),
        "server_ms": server_ms,
    }


async def measure_batch(
    s: Session, n: int, cfg: ThroughputConfig, copy_mode: str, raw: Raw
) -> list[dict[str, Any]]:
    rows = []
    regions = s.regions
    st_bytes, rt_bytes = regions.store_bytes(n), regions.retrieve_bytes(n)

    def sample(direction: str, n1: int, n2: int = 0) -> None:
        t = raw.sample(direction, n1, n2)
        if t is not None:
            raw_times.append(t)

    # store: fresh digests, alternating sources; the last two batches stay for retrieve
    for _ in range(WARMUP_ITERS):
        await s.store(n, A1)
    times: list[float] = []
    raw_times: list[float] = []
    failed = 0
    last: dict[int, bytes] = {}
    before = await s.phases()
    while not _enough(times, cfg) or len(last) < 2:
        region = A1 if len(times) % 2 == 0 else A2
        t0 = time.perf_counter()
        digests, res = await s.store(n, region)
        times.append(time.perf_counter() - t0)
        sample("d2h", st_bytes)
        failed += len(res.failed_chunks)
        if res.ok.all():
            last[region] = digests
    after = await s.phases()
    rows.append(
        _row(
            "store",
            copy_mode,
            n,
            st_bytes,
            times,
            raw.gbps("d2h", st_bytes, 0, raw_times),
            0,
            failed,
            phase_means(before, after),
        )
    )
    # retrieve: alternate sources so every request changes region B, verify each
    times, raw_times, failed, bad = [], [], 0, 0
    before = after
    while not _enough(times, cfg):
        src = A1 if len(times) % 2 == 0 else A2
        t0 = time.perf_counter()
        res = await s.retrieve(last[src], n)
        times.append(time.perf_counter() - t0)
        sample("h2d", rt_bytes)
        failed += len(res.failed_chunks)
        if res.ok.all():  # a failed chunk is reported, not written (fail closed)
            bad += regions.mismatched_bytes(s.kv, src, B, n)
    after = await s.phases()
    rows.append(
        _row(
            "retrieve",
            copy_mode,
            n,
            rt_bytes,
            times,
            raw.gbps("h2d", rt_bytes, 0, raw_times),
            bad,
            failed,
            phase_means(before, after),
        )
    )
    if cfg.concurrent:
        times, raw_times, failed, bad = [], [], 0, 0
        before = await s.phases()
        while not _enough(times, cfg):
            src = A1 if len(times) % 2 == 0 else A2
            t0 = time.perf_counter()
            (_, st), rt = await asyncio.gather(s.store(n, A1), s.retrieve(last[src], n))
            times.append(time.perf_counter() - t0)
            sample("both", st_bytes, rt_bytes)
            failed += len(st.failed_chunks) + len(rt.failed_chunks)
            if rt.ok.all():
                bad += regions.mismatched_bytes(s.kv, src, B, n)
        rows.append(
            _row(
                "store+retrieve",
                copy_mode,
                n,
                st_bytes + rt_bytes,
                times,
                raw.gbps("both", st_bytes, rt_bytes, raw_times),
                bad,
                failed,
                phase_means(before, await s.phases()),
            )
        )
    for k in cfg.inflight:  # last: their stores evict what the rows above read
        rows += await _measure_inflight(s, n, k, cfg, copy_mode, raw)
    return rows


async def _sustained(
    s: Session, n: int, k: int, cfg: ThroughputConfig, mode: str, source: bytes
) -> tuple[list[float], list[ChunkResult], float]:
    """Keep ``k`` requests in flight; returns latencies, results, wall time."""
    latencies: list[float] = []
    results: list[ChunkResult] = []
    t_start = time.perf_counter()
    deadline = t_start + cfg.min_time_s
    issued = 0

    async def slot() -> None:
        nonlocal issued
        while issued < cfg.max_iters * k and (
            issued < cfg.min_iters * k or time.perf_counter() < deadline
        ):
            issued += 1
            t0 = time.perf_counter()
            if mode == "store":
                _, res = await s.store(n, A1 if issued % 2 else A2)
            else:
                res = await s.retrieve(source, n)
            latencies.append(time.perf_counter() - t0)
            results.append(res)

    await asyncio.gather(*(slot() for _ in range(k)))
    return latencies, results, time.perf_counter() - t_start


async def _measure_inflight(
    s: Session, n: int, k: int, cfg: ThroughputConfig, copy_mode: str, raw: Raw
) -> list[dict[str, Any]]:
    """Sustained throughput with ``k`` requests in flight.

    A new request goes out as soon as one completes (what a pipelining worker does), for
    at least ``min_time_s`` and ``min_iters`` requests per slot; GB/s is the bytes of
    every request over the wall time from the first send to the last reply, and
    ``p50 ms`` the median latency of one request. Stores alternate between the two
    source regions; the retrieves all read one batch stored just before them into the
    same blocks (the bytes they write agree, so they are verified after the run).
    """
    rows = []
    regions = s.regions
    st_bytes, rt_bytes = regions.store_bytes(n), regions.retrieve_bytes(n)
    for mode, nbytes, direction in (("store", st_bytes, "d2h"), ("retrieve", rt_bytes, "h2d")):
        source = b""
        if mode == "retrieve":
            source, res0 = await s.store(n, A1)  # the most recent: never evicted by the run
            assert res0.ok.all(), "the source batch of the retrieves was not stored"
        before = await s.phases()
        latencies, results, wall = await _sustained(s, n, k, cfg, mode, source)
        issued = len(latencies)
        after = await s.phases()
        raw_times = [t for t in (raw.sample(direction, nbytes) for _ in range(3)) if t is not None]
        failed = sum(len(r.failed_chunks) for r in results)
        bad = 0
        if mode == "retrieve" and all(r.ok.all() for r in results):
            bad = regions.mismatched_bytes(s.kv, A1, B, n)
        rows.append(
            _row(
                f"{mode} x{k}",
                copy_mode,
                n,
                nbytes,
                latencies,
                raw.gbps(direction, nbytes, 0, raw_times),
                bad,
                failed,
                phase_means(before, after),
                seconds_per_request=wall / issued,
            )
        )
    if cfg.concurrent:  # k stores and k retrieves in flight at once, both directions
        source, res0 = await s.store(n, A1)
        assert res0.ok.all(), "the source batch of the retrieves was not stored"
        before = await s.phases()
        (lat_s, res_s, wall_s), (lat_r, res_r, wall_r) = await asyncio.gather(
            _sustained(s, n, k, cfg, "store", b""), _sustained(s, n, k, cfg, "retrieve", source)
        )
        after = await s.phases()
        nbytes = len(lat_s) * st_bytes + len(lat_r) * rt_bytes
        raw_times = [
            t for t in (raw.sample("both", st_bytes, rt_bytes) for _ in range(3)) if t is not None
        ]
        failed = sum(len(r.failed_chunks) for r in res_s + res_r)
        bad = regions.mismatched_bytes(s.kv, A1, B, n) if all(r.ok.all() for r in res_r) else 0
        row = _row(
            f"store+retrieve x{k}",
            copy_mode,
            n,
            nbytes,
            lat_s + lat_r,
            raw.gbps("both", st_bytes, rt_bytes, raw_times),
            bad,
            failed,
            phase_means(before, after),
            seconds_per_request=max(wall_s, wall_r),
        )
        row["bytes"] = st_bytes + rt_bytes  # one store and one retrieve, like the x1 row
        rows.append(row)
    return rows
