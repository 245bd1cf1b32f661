"""Honest replies, quiet clients kept, transparent
re-handshakes, and clients that never hang a process at exit."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import zmq

from lmc_server import PROTOCOL_VERSION
from lmc_server.cache.status import ChunkStatus
from lmc_server.client import Client, chunk_digests
from lmc_server.client.aio import AsyncClient
from lmc_server.protocol import messages as m
from lmc_server.protocol.codec import decode_reply, encode
from lmc_server.server import housekeeping
from lmc_server.testing import ShmKV, dsv41_flash, simple_model
from lmc_server.testing.inprocess import FakeClock, run_server
from lmc_server.testing.kv import block_ids_for
from lmc_server.testing.process import ServerProcess, free_port

# -- item 4: unknown registrations are not "busy" ------------------------------------------


def test_burst_with_unknown_registration_is_answered_unknown_registration() -> None:
    """A burst larger than the in-flight limit, all naming an unknown registration: every
    reply says so (not ``busy``, which would send the client retrying), and the server
    serves on."""
    with run_server(max_inflight_per_client=2, l1_size_gb=0.25) as srv:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(srv.endpoint)
        try:
            sock.send(encode(m.Hello(req_id=1, protocol_version=PROTOCOL_VERSION)))
            assert isinstance(decode_reply(sock.recv()), m.Welcome)
            n = 32
            for i in range(n):
                sock.send(
                    encode(
                        m.Store(
                            req_id=100 + i,
                            registration_id=b"\x07" * 16,
                            digests=b"\x01" * 32,
                            block_ids=[b""],
                        )
                    )
                )
            codes = []
            for _ in range(n):
                assert sock.poll(10_000)
                reply = decode_reply(sock.recv())
                assert isinstance(reply, m.Error)
                codes.append(reply.code)
            assert set(codes) == {"unknown_registration"}, codes
        finally:
            sock.close(linger=0)
            ctx.term()
        with Client(srv.endpoint) as c, ShmKV(simple_model()) as kv:
            kv.fill_random(1)
            reg = c.register(**kv.register_kwargs())
            assert c.store(reg, chunk_digests(np.arange(256), 256), block_ids_for(reg, 1)).ok.all()


# -- item 4: replicated ranks storing the same chunk at once -------------------------------


def test_replicated_ranks_racing_on_a_chunk_get_no_in_progress() -> None:
    """Eight replicated ranks store the same 16 chunks at once. The losers wait for the
    winner: every status is OK or EXISTS (never IN_PROGRESS), exactly one copy is stored,
    and every rank retrieves the winner's bytes exactly."""
    ranks, n_chunks = 8, 16
    geo = dsv41_flash(num_blocks=n_chunks * 8 + 64)
    digests = chunk_digests(np.arange(256 * n_chunks), 256)

    async def main(endpoint: str, kvs: list[ShmKV]) -> list[np.ndarray]:
        clients = [await AsyncClient.connect(endpoint) for _ in range(ranks)]
        try:
            regs = [
                await c.register(**kv.register_kwargs(), world_size=ranks, rank=r, replicated=True)
                for r, (c, kv) in enumerate(zip(clients, kvs, strict=True))
            ]
            src = block_ids_for(regs[0], n_chunks)
            results = await asyncio.gather(
                *(c.store(reg, digests, src) for c, reg in zip(clients, regs, strict=True))
            )
            dst = block_ids_for(regs[0], n_chunks, first_block=n_chunks * 8)
            for c, reg, kv in zip(clients, regs, kvs, strict=True):
                assert (await c.retrieve(reg, digests, dst)).ok.all()
                for g in reg.groups:  # full groups: every chunk; windows: the last one's
                    if not g.cached:
                        continue
                    bpc = reg.blocks_per_chunk(g)
                    a = src[g.name].reshape(n_chunks, bpc)
                    b = dst[g.name].reshape(n_chunks, bpc)
                    if g.kind == "sliding_window":
                        keep = -(-g.window_tokens // g.tokens_per_block)
                        a, b = a[-1:, bpc - keep :], b[-1:, bpc - keep :]
                    assert kv.pages(g.name, a.ravel().tolist()) == kv.pages(
                        g.name, b.ravel().tolist()
                    ), g.name
            return [st for res in results for st in res.statuses.values()]
        finally:
            for c in clients:
                await c.close()

    # a process: eight clients' copies and numpy checks would share the GIL with an
    # in-process server (twice as slow, measured)
    with ServerProcess(["--separate-object-groups"], l1_size_gb=0.5) as srv:
        kvs = [ShmKV(geo) for _ in range(ranks)]
        try:
            kvs[0].fill_random(seed=7)
            for kv in kvs[1:]:  # replicated: identical KV on every rank (a copy is cheaper)
                for mine, first in zip(kv.segments, kvs[0].segments, strict=True):
                    mine.array[:] = first.array
            codes = np.concatenate(asyncio.run(main(srv.endpoint, kvs)))
            assert not (codes == ChunkStatus.IN_PROGRESS).any(), np.bincount(codes)
            assert set(np.unique(codes).tolist()) <= {ChunkStatus.OK, ChunkStatus.EXISTS}
            assert (codes == ChunkStatus.OK).sum() == 2 * n_chunks  # one copy per object
            with Client(srv.endpoint) as c:
                report = c.stats()
            assert sum(p.objects for p in report.partitions) == 2 * n_chunks
        finally:
            for kv in kvs:
                kv.close()


# -- item 8: quiet connected clients are kept; clients re-handshake ------------------------


def test_quiet_connected_client_is_not_forgotten() -> None:
    """The soak failure: a client holding no registration, quiet past IDLE_SESSION_S, still
    connected. Its session must survive the idle sweep (checked at the protocol level,
    with a raw socket that would not say hello again). In process with a fake clock: the
    clock jumps past the idle limit and the sweep interval, and the housekeeping tick
    that follows runs the sweep (no real waiting)."""
    clock = FakeClock()
    with run_server(clock=clock, l1_size_gb=0.125, slab_size_mb=16) as ts:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(ts.endpoint)
        try:
            sock.send(encode(m.Hello(req_id=1, protocol_version=PROTOCOL_VERSION)))
            assert isinstance(decode_reply(sock.recv()), m.Welcome)
            clock.advance(housekeeping.IDLE_SESSION_S * 3)  # > the sweep interval too
            ts.wait_housekeeping()  # a whole tick, hence the sweep, ran after the jump
            sock.send(encode(m.Stats(req_id=2)))
            assert sock.poll(10_000)
            reply = decode_reply(sock.recv())
            assert isinstance(reply, m.StatsResult), reply
        finally:
            sock.close(linger=0)
            ctx.term()


def test_clients_say_hello_again_after_a_server_restart() -> None:
    port = free_port()
    with run_server(port=port, l1_size_gb=0.25) as srv:
        c = Client(srv.endpoint, timeout_s=10)

        async def connect() -> AsyncClient:
            return await AsyncClient.connect(srv.endpoint, timeout_s=10)

        loop = asyncio.new_event_loop()
        ac = loop.run_until_complete(connect())
        assert c.stats().sessions >= 1
    try:
        with run_server(port=port, l1_size_gb=0.25):
            assert c.stats().version  # new server, no session: hello again, then stats
            assert loop.run_until_complete(ac.stats()).version
            with ShmKV(simple_model()) as kv:
                kv.fill_random(3)
                reg = c.register(**kv.register_kwargs())
                assert c.store(
                    reg, chunk_digests(np.arange(256), 256), block_ids_for(reg, 1)
                ).ok.all()
    finally:
        c.close()
        loop.run_until_complete(ac.close())
        loop.close()


# -- item 7: a forgotten AsyncClient never hangs the interpreter ---------------------------

LEAKER = """
import asyncio, sys
from lmc_server.client.aio import AsyncClient

async def main() -> None:
    for mode in ("plain", "cycle", "pending"):
        c = await AsyncClient.connect(sys.argv[1], timeout_s=30)
        await c.ping()
        if mode == "cycle":
            c._cycle = c  # collected by the last GC at teardown, in any order
        if mode == "pending":
            asyncio.get_running_loop().create_task(c.ping())
            await asyncio.sleep(0)
        globals().setdefault("leaked", []).append(c)

asyncio.run(main())
print("done", flush=True)
"""


def test_never_closed_async_clients_do_not_hang_exit(tmp_path: Path) -> None:
    script = tmp_path / "leak.py"
    script.write_text(LEAKER)
    with run_server(l1_size_gb=0.25) as srv:
        t0 = time.monotonic()
        out = subprocess.run(
            [sys.executable, str(script), srv.endpoint], capture_output=True, text=True, timeout=30
        )
        assert out.returncode == 0 and out.stdout == "done\n", out.stderr
        assert time.monotonic() - t0 < 15
    # and after the server went away, with requests pending
    port = free_port()
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import asyncio\n"
            "from lmc_server.client.aio import AsyncClient\n"
            "async def m():\n"
            f"    c = AsyncClient('tcp://127.0.0.1:{port}', timeout_s=30)\n"
            "    asyncio.get_running_loop().create_task(c.__aenter__())\n"
            "    await asyncio.sleep(0.1)\n"
            "    globals()['c'] = c\n"
            "asyncio.run(m())\nprint('done')\n",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0 and out.stdout == "done\n", out.stderr
