"""``lmcache bench latency``: round trips of the control path vs a plain pyzmq echo.

Operations, each at 1, 8 and 64 concurrent clients (one asyncio DEALER connection per
client, all driven by one event loop in this process):

- ``ping``;
- ``lookup`` of 1 and of 256 digests, all hits (256 chunks are stored first), without
  a lease (a lease costs a second round trip, ``release``, which would be measured
  against nothing);
- ``probe-64x8``: a router's probe (no registration, no lease) of 64 prompts of 8 chunks
  each (2,048 tokens at the default chunk size), all hits, in one request; prompts per
  second are 64 x its ops/s (the summary's ``probe_prompts_s``, best over client counts);
- ``store/retrieve``: alternately a store of one fresh chunk and a retrieve of it, on a
  tiny geometry (one 4 KiB chunk), so the copy is negligible and the request path is
  what is timed.

For every operation the same clients then time a pyzmq echo server (a separate process,
same tcp transport) sending back a message of the same size as the request. Ratios are
ours / echo throughout: for p50 and p99 latency lower is better, for operations per
second higher is better (1.0 = as fast as the echo).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import click
import numpy as np
import zmq
import zmq.asyncio

from lmc_server.bench.baselines.echo import EchoServer
from lmc_server.bench.common import (
    DEFAULT_CHUNK_SIZE,
    Report,
    format_table,
    percentiles_us,
    progress,
)
from lmc_server.bench.options import ints, opt
from lmc_server.bench.servers import server_flags
from lmc_server.client.aio import AsyncClient
from lmc_server.client.core import Registration
from lmc_server.client.digests import hash_chain
from lmc_server.protocol import messages as m
from lmc_server.protocol.codec import encode
from lmc_server.testing.kv import ShmKV
from lmc_server.testing.presets import simple_model
from lmc_server.testing.process import ServerProcess

LOOKUP_CHUNKS = 256
PROBE_PROMPTS, PROBE_CHUNKS = 64, 8
PROBE_OP = f"probe-{PROBE_PROMPTS}x{PROBE_CHUNKS}"
OPS = ("ping", "lookup-1", f"lookup-{LOOKUP_CHUNKS}", PROBE_OP, "store/retrieve")


@dataclass(frozen=True)
class LatencyConfig:
    clients: tuple[int, ...] = opt((1, 8, 64), "Concurrent clients, comma-separated.", parse=ints)
    duration_s: float = opt(
        1.0,
        "Seconds timed per (operation, clients) point, ours and echo each.",
        type=click.FloatRange(min=0.01),
    )
    l1_size_gb: float = 1.0
    show_progress: bool = True
    chunk_size: int = DEFAULT_CHUNK_SIZE


class _Echo:
    """A DEALER on the echo server that sends ``payload`` and awaits it back."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, payload: bytes) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.payload = payload

    async def call(self) -> None:
        await self.sock.send(self.payload)
        await self.sock.recv()

    def close(self) -> None:
        self.sock.close(linger=0)


async def _drive(
    calls: list[Callable[[], Awaitable[Any]]], duration_s: float
) -> tuple[list[float], float]:
    """Run every client's call in a loop for ``duration_s``; latencies and wall time."""
    samples: list[float] = []
    for c in calls:  # warm-up: connections up, first-use costs paid
        await c()
    t_end = time.perf_counter() + duration_s

    async def loop(call: Callable[[], Awaitable[Any]]) -> None:
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            await call()
            samples.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(loop(c) for c in calls))
    return samples, time.perf_counter() - t0


class _Bench:
    """Clients on the server (with their registrations) and on the echo server."""

    def __init__(self, endpoint: str, echo_endpoint: str) -> None:
        self.endpoint = endpoint
        self.echo_endpoint = echo_endpoint
        self.clients: list[AsyncClient] = []
        self.regs: list[Registration] = []
        self.kv: ShmKV | None = None
        self.digests = hash_chain(i.to_bytes(8, "little") for i in range(LOOKUP_CHUNKS))

    async def setup(self, n: int) -> None:
        self.kv = ShmKV(
            simple_model(num_blocks=64, layers=1, tokens_per_block=16, bytes_per_token=16)
        )
        self.kv.fill_random(1)
        for i in range(n):
            c = await AsyncClient.connect(self.endpoint, timeout_s=60, client_name=f"bench-{i}")
            self.clients.append(c)
            self.regs.append(await c.register(**self.kv.register_kwargs()))
        ids = {"full": np.arange(16, dtype=np.int32)}
        for i in range(0, LOOKUP_CHUNKS):
            res = await self.clients[0].store(self.regs[0], self.digests[32 * i : 32 * i + 32], ids)
            assert res.ok.all(), "storing the lookup chunks failed"
        hit = await self.clients[0].lookup(self.regs[0], self.digests, lease=False)
        assert hit.hit_chunks == LOOKUP_CHUNKS, f"only {hit.hit_chunks} chunks hit"

    async def close(self) -> None:
        for c in self.clients:
            await c.close()
        if self.kv is not None:
            self.kv.close()

    def ours(self, op: str, n: int) -> list[Callable[[], Awaitable[Any]]]:
        calls: list[Callable[[], Awaitable[Any]]] = []
        ids = {"full": np.arange(16, dtype=np.int32)}
        for c, reg in zip(self.clients[:n], self.regs[:n], strict=True):
            if op == "ping":
                calls.append(c.ping)
            elif op.startswith("lookup"):
                k = int(op.split("-")[1])
                calls.append(_lookup_call(c, reg, self.digests[: 32 * k], k))
            elif op == PROBE_OP:
                calls.append(_probe_call(c, reg.namespace, self.digests[: 32 * PROBE_CHUNKS]))
            else:
                calls.append(_store_retrieve(c, reg, ids))
        return calls

    def request_bytes(self, op: str) -> int:
        """Size of the request frame ``op`` sends (the echo sends the same size)."""
        reg_id = self.regs[0].registration_id
        if op == "ping":
            return len(encode(m.Ping(req_id=1 << 20)))
        if op.startswith("lookup"):
            k = int(op.split("-")[1])
            return len(
                encode(
                    m.Lookup(
                        req_id=1 << 20,
                        registration_id=reg_id,
                        digests=self.digests[: 32 * k],
                        lease=False,
                    )
                )
            )
        if op == PROBE_OP:
            return len(
                encode(_probe_msg(self.regs[0].namespace, self.digests[: 32 * PROBE_CHUNKS]))
            )
        ids = [np.arange(16, dtype="<i4").tobytes()]
        return len(
            encode(
                m.Store(
                    req_id=1 << 20, registration_id=reg_id, digests=self.digests[:32], block_ids=ids
                )
            )
        )


def _lookup_call(
    c: AsyncClient, reg: Registration, d: bytes, k: int
) -> Callable[[], Awaitable[Any]]:
    async def call() -> None:
        res = await c.lookup(reg, d, lease=False)
        if res.hit_chunks != k:
            raise RuntimeError(f"lookup hit {res.hit_chunks} of {k} chunks")

    return call


def _probe_ends() -> list[int]:
    return list(range(PROBE_CHUNKS, PROBE_CHUNKS * PROBE_PROMPTS + 1, PROBE_CHUNKS))


def _probe_msg(namespace: str, prompt: bytes) -> m.Probe:
    return m.Probe(
        req_id=1 << 20,
        namespace=namespace,
        digests=prompt * PROBE_PROMPTS,
        prefix_ends=np.asarray(_probe_ends(), dtype="<i4").tobytes(),
    )


def _probe_call(c: AsyncClient, namespace: str, prompt: bytes) -> Callable[[], Awaitable[Any]]:
    digests, ends = prompt * PROBE_PROMPTS, _probe_ends()

    async def call() -> None:
        hits = await c.probe(namespace, digests, prefix_ends=ends)
        if hits != [PROBE_CHUNKS] * PROBE_PROMPTS:
            raise RuntimeError(f"probe hit {hits}")

    return call


def _store_retrieve(
    c: AsyncClient, reg: Registration, ids: dict[str, np.ndarray]
) -> Callable[[], Awaitable[Any]]:
    """Alternately store a fresh chunk and retrieve it: one request per call."""
    last: list[bytes] = []

    async def call() -> None:
        if last:
            res = await c.retrieve(reg, last.pop(), ids)
        else:
            d = os.urandom(32)
            res = await c.store(reg, d, ids)
            last.append(d)
        if not res.ok.all():
            raise RuntimeError(f"store/retrieve failed: {res.statuses}")

    return call


async def _run(
    endpoint: str, echo_endpoint: str, cfg: LatencyConfig, bar: Any
) -> list[dict[str, Any]]:
    b = _Bench(endpoint, echo_endpoint)
    ctx = zmq.asyncio.Context()
    rows = []
    try:
        await b.setup(max(cfg.clients))
        for op in OPS:
            size = b.request_bytes(op)
            for n in cfg.clients:
                ours, wall = await _drive(b.ours(op, n), cfg.duration_s)
                echoes = [_Echo(ctx, echo_endpoint, bytes(size)) for _ in range(n)]
                try:
                    base, base_wall = await _drive([e.call for e in echoes], cfg.duration_s)
                finally:
                    for e in echoes:
                        e.close()
                po, pe = percentiles_us(ours), percentiles_us(base)
                ops, ops_echo = len(ours) / wall, len(base) / base_wall
                rows.append(
                    {
                        "op": op,
                        "clients": n,
                        "request_bytes": size,
                        "p50_us": po["p50_us"],
                        "p99_us": po["p99_us"],
                        "ops_s": ops,
                        "echo_p50_us": pe["p50_us"],
                        "echo_p99_us": pe["p99_us"],
                        "echo_ops_s": ops_echo,
                        "p50_ratio": po["p50_us"] / pe["p50_us"],
                        "p99_ratio": po["p99_us"] / pe["p99_us"],
                        "ops_ratio": ops / ops_echo,
                        "samples": len(ours),
                    }
                )
                bar.update(1)
    finally:
        await b.close()
        ctx.term()
    return rows


def run(cfg: LatencyConfig) -> Report:
    report = Report(
        "latency",
        {
            "clients": list(cfg.clients),
            "duration_s": cfg.duration_s,
            "chunk_size": cfg.chunk_size,
            "transport": "tcp 127.0.0.1",
            "l1_size_gb": cfg.l1_size_gb,
        },
    )
    with (
        ServerProcess(
            server_flags(cfg.chunk_size, True),
            backend="cpu",
            l1_size_gb=cfg.l1_size_gb,
        ) as srv,
        EchoServer() as echo,
        progress(len(OPS) * len(cfg.clients), "latency", cfg.show_progress) as bar,
    ):
        srv.wait_pool_ready()  # time a ready server (a store before the first slab: busy)
        report.rows = asyncio.run(_run(srv.endpoint, echo.endpoint, cfg, bar))
    by = {(r["op"], r["clients"]): r for r in report.rows}
    key = (f"lookup-{LOOKUP_CHUNKS}", min(cfg.clients))
    if key in by:
        report.summary["lookup256_p50_ratio"] = by[key]["p50_ratio"]
    probes = [r["ops_s"] for r in report.rows if r["op"] == PROBE_OP]
    if probes:
        report.summary["probe_prompts_s"] = max(probes) * PROBE_PROMPTS
    report.notes += [
        "echo = a plain pyzmq ROUTER process sending each request back, same tcp "
        "transport, request-sized messages; ratios are ours / echo (latency: lower is "
        "better, 1.0 = echo; ops/s: higher is better)",
        f"{PROBE_OP}: one probe request of {PROBE_PROMPTS} prompts of {PROBE_CHUNKS} "
        f"chunks, all hits; prompts/s = {PROBE_PROMPTS} x ops/s",
        f"lookups are all hits and take no lease; store/retrieve alternate on a "
        f"{16 * 16 * 16} B chunk (copy negligible); clients share one event loop in the "
        "benchmark process",
    ]
    return report


COLUMNS = (
    "op|op; clients|clients|d; request_bytes|req B|d; p50_us|p50 us|.0f; "
    "p99_us|p99 us|.0f; ops_s|ops/s|.0f; echo_p50_us|echo p50|.0f; "
    "echo_p99_us|echo p99|.0f; echo_ops_s|echo ops/s|.0f; p50_ratio|p50 x|.2f; "
    "p99_ratio|p99 x|.2f; ops_ratio|ops/s x|.2f"
)


def table(report: Report) -> str:
    return format_table(report.rows, COLUMNS)


def plot(report: Report, path: str) -> None:
    from lmc_server.bench.common import plot_figure, save_figure

    fig, ax = plot_figure()
    labels = [f"{r['op']}\n{r['clients']}c" for r in report.rows]
    x = np.arange(len(labels))
    ax.bar(x - 0.2, [r["p50_us"] for r in report.rows], 0.4, label="ours p50")
    ax.bar(x + 0.2, [r["echo_p50_us"] for r in report.rows], 0.4, label="pyzmq echo p50")
    ax.set_xticks(x, labels, fontsize=6)
    ax.set_yscale("log")
    ax.set_ylabel("round trip, us")
    ax.set_title("lmcache bench latency (p50, ours vs pyzmq echo)")
    ax.legend()
    save_figure(fig, path)
