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
from collections.abc import Awaitable, Callable
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


async def _timed(
    s: Session,
    n: int,
    cfg: ThroughputConfig,
    raw: Raw,
    raw_bytes: tuple[str, int, int],
    step: Callable[[int], Awaitable[tuple[int, int | None]]],
    more: Callable[[], bool] = lambda: False,
) -> tuple[list[float], float, int, int, dict[str, PhaseSum]]:
    """Time ``step(i)`` (one request; returns its failed chunks and the region whose
    bytes region B must now hold, or ``None``) until there are enough timings and not
    ``more()``, a raw copy of ``raw_bytes`` (direction, bytes, bytes the other way)
    timed right after each; every step with a region is verified after its timing.
    Returns the timings, raw GB/s, failed chunks, mismatched bytes, the phase sums after."""
    times: list[float] = []
    raw_times: list[float] = []
    failed = bad = 0
    while not _enough(times, cfg) or more():
        t0 = time.perf_counter()
        f, src = await step(len(times))
        times.append(time.perf_counter() - t0)
        t = raw.sample(*raw_bytes)
        if t is not None:
            raw_times.append(t)
        failed += f
        if src is not None:
            bad += s.regions.mismatched_bytes(s.kv, src, B, n)
    return times, raw.gbps(*raw_bytes, raw_times), failed, bad, await s.phases()


async def measure_batch(
    s: Session, n: int, cfg: ThroughputConfig, copy_mode: str, raw: Raw
) -> list[dict[str, Any]]:
    rows = []
    st_bytes, rt_bytes = s.regions.store_bytes(n), s.regions.retrieve_bytes(n)
    last: dict[int, bytes] = {}  # the last batch stored from each source, for retrieve

    async def store(i: int) -> tuple[int, None]:  # fresh digests, alternating sources
        region = A1 if i % 2 == 0 else A2
        digests, res = await s.store(n, region)
        if res.ok.all():
            last[region] = digests
        return len(res.failed_chunks), None

    async def retrieve(i: int) -> tuple[int, int | None]:  # every request changes B
        src = A1 if i % 2 == 0 else A2
        res = await s.retrieve(last[src], n)
        return len(res.failed_chunks), src if res.ok.all() else None  # failed: not written

    async def both(i: int) -> tuple[int, int | None]:
        src = A1 if i % 2 == 0 else A2
        (_, st), rt = await asyncio.gather(s.store(n, A1), s.retrieve(last[src], n))
        return len(st.failed_chunks) + len(rt.failed_chunks), src if rt.ok.all() else None

    for _ in range(WARMUP_ITERS):
        await s.store(n, A1)
    before = await s.phases()
    points = [("store", store, ("d2h", st_bytes, 0)), ("retrieve", retrieve, ("h2d", rt_bytes, 0))]
    if cfg.concurrent:
        points.append(("store+retrieve", both, ("both", st_bytes, rt_bytes)))
    for mode, step, raw_bytes in points:
        if mode == "store+retrieve":
            before = await s.phases()
        more = (lambda: len(last) < 2) if mode == "store" else (lambda: False)
        times, raw_gbps, failed, bad, after = await _timed(s, n, cfg, raw, raw_bytes, step, more)
        nbytes = raw_bytes[1] + raw_bytes[2]
        server_ms = phase_means(before, after)
        rows.append(_row(mode, copy_mode, n, nbytes, times, raw_gbps, bad, failed, server_ms))
        before = after
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
