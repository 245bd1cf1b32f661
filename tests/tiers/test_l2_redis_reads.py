"""The Redis adapter's own reader: values received straight into L1 slots.

Against a real redis-server: every value lands byte for byte, every damaged, short,
foreign or misplaced one is refused with its reason (and its slot never committed),
and the connection stays usable. Against a store that cuts a value mid-stream (a
small fake speaking RESP, so the cut is exact) and a redis-server killed mid-read: a
miss and an error, never a wrong byte, and the server serves on.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import numpy as np
import pytest

from lmc_server.client import chunk_digests
from lmc_server.testing.kv import block_ids_for
from lmc_server.testing.process import ServerProcess
from lmc_server.testing.redis_process import RedisProcess, redis_server_path
from lmc_server.testing.tierworker import (
    BASE_ARGS,
    CHUNK,
    Worker,
    l2_server,
    l2_stats,
    lookup_until,
    retrieve_exact,
    tokens,
    wait_for,
    wait_l2_written,
)
from lmc_server.tiers import codec
from lmc_server.tiers.backend import L2Error, SlotObject, SlotRead
from lmc_server.tiers.redis.backend import RedisBackend

if redis_server_path() is None:
    pytestmark = pytest.mark.skip(reason="redis-server is not installed")

SPACE = bytes(range(16))


def _ck(i: int) -> bytes:
    return i.to_bytes(32, "big")


def _values(object_bytes: int, n: int) -> list[bytes]:
    rng = np.random.default_rng(object_bytes)
    return [
        codec.encode_value(
            SPACE, _ck(i), i % 4, rng.integers(0, 256, object_bytes, dtype=np.uint8).data
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("object_bytes,connections", [(300_001, 1), (1_000, 3)])
def test_get_into_lands_exact_values_and_refuses_every_bad_one(
    object_bytes: int, connections: int
) -> None:
    """Large values (past the reader's own 64 KiB buffer) and small ones (many per
    receive), over one and several connections."""
    good = _values(object_bytes, 6)
    key = [codec.l2_key(SPACE, _ck(i)) for i in range(12)]
    flipped = bytearray(good[1])
    flipped[-100] ^= 0x01
    stored = {
        **{key[i]: good[i] for i in range(6)},
        key[6]: good[0][:-7],  # truncated
        key[7]: bytes(flipped),  # a bit flip in the payload: checksum
        key[8]: good[2],  # chunk 2's value under chunk 8's key: foreign
        key[9]: good[3],  # right key, read for another section mask (below)
        # key[10] holds a list (not a string); key[11] is absent
    }
    # What each read expects (key, chunk key, mask): its value's chunk and mask, except
    # key[8] (expects chunk 8, holds chunk 2's) and key[9] (expects mask 1, holds 3).
    reads_for = [(key[i], _ck(i), i % 4) for i in range(6)] + [
        (key[6], _ck(0), 0),
        (key[7], _ck(1), 1),
        (key[8], _ck(8), 2),
        (key[9], _ck(3), 1),
        (key[10], _ck(10), 2),
        (key[11], _ck(11), 3),
    ]

    async def go(r: RedisProcess) -> None:
        with r.client() as c:
            for k, v in stored.items():
                c.set(k, v)
            c.rpush(key[10], b"x")
        b = RedisBackend(r.url, timeout_s=5.0, connections=connections)
        await b.connect()
        heads = await b.heads(key)
        assert heads[10] is None and heads[11] is None
        for i in range(10):
            head = heads[i]
            assert head is not None and head == (stored[key[i]][:72], len(stored[key[i]]))
        pool = np.full(12 * object_bytes, 0xAA, dtype=np.uint8)
        reads = [
            SlotRead(k, SPACE, ck, mask, pool[i * object_bytes : (i + 1) * object_bytes].data)
            for i, (k, ck, mask) in enumerate(reads_for)
        ]
        got = await b.get_into(reads)
        assert got[:6] == [True] * 6
        for i in range(6):
            assert pool[i * object_bytes : (i + 1) * object_bytes].tobytes() == good[i][72:]
        assert got[6:] == [
            codec.Invalid.TRUNCATED,
            codec.Invalid.CHECKSUM,
            codec.Invalid.FOREIGN,
            None,  # a valid value of other sections: not this slot's
            None,  # not a string
            None,  # absent
        ]
        for i in (6, 8, 9, 10, 11):  # refused before its payload: the slot untouched
            assert (pool[i * object_bytes : (i + 1) * object_bytes] == 0xAA).all()
        # Every reply was read: the same connections serve on, byte for byte.
        pool[:] = 0
        assert await b.get_into(reads[:6]) == [True] * 6
        assert (await b.get_many([key[0]]))[0] == good[0]
        assert pool[:object_bytes].tobytes() == good[0][72:]
        await b.shutdown()

    with RedisProcess() as r:
        asyncio.run(go(r))


# -- a store that cuts values mid-stream --------------------------------------------


class CuttingStore:
    """A RESP store on a loopback port, holding ``values``; while ``cut`` is set, every
    ``GET`` reply stops halfway and the connection is closed."""

    def __init__(self, values: dict[bytes, bytes]) -> None:
        self.values = dict(values)
        self.cut = True
        self.cuts = 0
        self.refuse: set[bytes] = set()  # SET of these keys: an error reply at once
        self.slow_s: dict[bytes, float] = {}  # SET of these keys: reply after a delay
        self.set_replied_s: list[float] = []  # monotonic time just before each SET's +OK
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._stop = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        f = conn.makefile("rb")
        try:
            while True:
                line = f.readline()
                if not line:
                    return
                args = []
                for _ in range(int(line[1:])):
                    n = int(f.readline()[1:])
                    args.append(f.read(n + 2)[:-2])
                if not self._reply(conn, args):
                    return
        except (OSError, ValueError):
            return
        finally:
            f.close()
            conn.close()

    def _reply(self, conn: socket.socket, args: list[bytes]) -> bool:
        cmd = args[0].upper()
        v = self.values.get(args[1]) if len(args) > 1 else None
        if cmd == b"PING":
            conn.sendall(b"+PONG\r\n")
        elif cmd == b"STRLEN":
            conn.sendall(b":%d\r\n" % len(v or b""))
        elif cmd == b"GETRANGE":
            part = (v or b"")[int(args[2]) : int(args[3]) + 1]
            conn.sendall(b"$%d\r\n%b\r\n" % (len(part), part))
        elif cmd in (b"GET", b"MGET"):
            if v is None:
                conn.sendall(b"$-1\r\n" if cmd == b"GET" else b"*1\r\n$-1\r\n")
            elif self.cut:
                self.cuts += 1
                conn.sendall(b"$%d\r\n%b" % (len(v), v[: len(v) // 2]))
                conn.shutdown(socket.SHUT_RDWR)
                return False
            else:
                lead = b"" if cmd == b"GET" else b"*1\r\n"
                conn.sendall(lead + b"$%d\r\n%b\r\n" % (len(v), v))
        elif cmd == b"SET":
            if args[1] in self.refuse:
                conn.sendall(b"-OOM command not allowed when used memory > 'maxmemory'\r\n")
                return True
            time.sleep(self.slow_s.get(args[1], 0.0))
            self.values[args[1]] = args[2]
            # recorded before the reply: the client may return as soon as it reads it
            self.set_replied_s.append(time.monotonic())
            conn.sendall(b"+OK\r\n")
        else:  # CLIENT SETINFO, SELECT, ...
            conn.sendall(b"+OK\r\n")
        return True

    def close(self) -> None:
        self._stop = True
        self._listener.close()


def test_a_value_cut_mid_stream_is_a_miss_and_the_server_serves_on(
    redis_proc: RedisProcess,
) -> None:
    n = 6
    digests = chunk_digests(tokens(300, n), CHUNK)
    with l2_server(redis_proc.url, l2_timeout_s=2.0) as a:
        wa = Worker(a.endpoint, seed=31, num_blocks=8 * n)
        try:
            wait_for(lambda: l2_stats(wa.client).state == "up", "A connected")
            ids = wa.store(digests, block_seed=5)
            wait_l2_written(wa.client, 2 * n)
            with redis_proc.client() as c:
                held = {k: c.get(k) for k in c.scan_iter(match=b"lmc2/*")}
            store = CuttingStore(held)
            try:
                with l2_server(store.url, l2_timeout_s=2.0) as b:
                    wb = Worker(b.endpoint, seed=0, num_blocks=8 * n)
                    try:
                        wait_for(lambda: l2_stats(wb.client).state == "up", "B connected")
                        assert wb.client.lookup(wb.reg, digests, lease=False).l2_pending_chunks
                        wait_for(lambda: l2_stats(wb.client).errors.get("read"), "a read error")
                        assert store.cuts >= 1
                        st = l2_stats(wb.client)
                        assert st.hits == 0 and not st.invalid, st
                        look = wb.client.lookup(wb.reg, digests, lease=False)
                        assert look.hit_chunks == 0  # nothing half-received is visible
                        # B serves on: its own stores and L1 hits, byte for byte.
                        own = chunk_digests(tokens(301, 2), CHUNK)
                        wb.store(own, block_seed=2)
                        assert wb.client.lookup(wb.reg, own, lease=False).hit_chunks == 2
                        # The store answers whole values again: B reconnects and reads
                        # exactly what A stored.
                        store.cut = False
                        wait_for(lambda: l2_stats(wb.client).state == "up", "B reconnected")
                        retrieve_exact(wb, wa, ids, digests, n)
                        assert not l2_stats(wb.client).invalid
                    finally:
                        wb.close()
            finally:
                store.close()
        finally:
            wa.close()


def test_redis_killed_mid_read_serves_no_wrong_byte(redis_proc: RedisProcess) -> None:
    """Wherever the kill lands in B's prefetch, what B then hits is byte-exact, and B
    stores and serves on (the read errors or finds nothing; never a wrong byte)."""
    n = 24
    digests = chunk_digests(tokens(310, n), CHUNK)
    with (
        l2_server(redis_proc.url, l2_timeout_s=2.0) as a,
        l2_server(redis_proc.url, "--l2-connections", "2", l2_timeout_s=2.0) as b,
    ):
        wa = Worker(a.endpoint, seed=32, num_blocks=8 * n)
        wb = Worker(b.endpoint, seed=0, num_blocks=8 * n)
        try:
            wait_for(lambda: l2_stats(wb.client).state == "up", "B connected")
            ids = wa.store(digests, block_seed=6)
            wait_l2_written(wa.client, 2 * n)
            assert wb.client.lookup(wb.reg, digests, lease=False).l2_pending_chunks == n
            redis_proc.kill()
            wait_for(
                lambda: wb.client.lookup(wb.reg, digests, lease=False).l2_pending_chunks == 0,
                "the prefetch to end",
            )
            got = wb.client.lookup(wb.reg, digests, lease=False).hit_chunks
            if got:
                retrieve_exact(wb, wa, ids, digests, got)
            own = chunk_digests(tokens(311, 2), CHUNK)
            wb.store(own, block_seed=3)
            res = wb.client.retrieve(wb.reg, own, block_ids_for(wb.reg, 2))
            assert res.ok.all()
            assert not l2_stats(wb.client).invalid
        finally:
            wa.close()
            wb.close()


def test_l2_connections_read_into_slots_byte_exact_through_the_server(
    redis_proc: RedisProcess,
) -> None:
    """A prefetch longer than one read batch (11 chunks of this preset), split over 4
    connections, reads every byte A stored."""
    n = 16
    digests = chunk_digests(tokens(320, n), CHUNK)
    with (
        ServerProcess([*BASE_ARGS, "--l2", redis_proc.url], l1_size_gb=0.25) as a,
        l2_server(redis_proc.url, "--l2-connections", "4", l2_timeout_s=2.0) as b,
    ):
        wa = Worker(a.endpoint, seed=33, num_blocks=8 * n)
        wb = Worker(b.endpoint, seed=0, num_blocks=8 * n)
        try:
            wait_for(lambda: l2_stats(wb.client).state == "up", "B connected")
            ids = wa.store(digests, block_seed=7)
            wait_l2_written(wa.client, 2 * n)
            lookup_until(wb.client, wb.reg, digests, n)
            retrieve_exact(wb, wa, ids, digests, n)
            st = l2_stats(wb.client)
            assert st.hits == 2 * n and not st.invalid and not st.errors, st
        finally:
            wa.close()
            wb.close()


def test_get_into_on_a_dead_store_raises_unavailable() -> None:
    async def go() -> None:
        store = CuttingStore({codec.l2_key(SPACE, _ck(0)): _values(100_000, 1)[0]})
        try:
            b = RedisBackend(store.url, timeout_s=2.0)
            await b.connect()
            dest = np.zeros(100_000, np.uint8)
            with pytest.raises(L2Error) as e:
                await b.get_into(
                    [SlotRead(codec.l2_key(SPACE, _ck(0)), SPACE, _ck(0), 0, dest.data)]
                )
            assert e.value.unavailable
            store.cut = False  # the cut connection was dropped; a new one reads it whole
            got = await b.get_into(
                [SlotRead(codec.l2_key(SPACE, _ck(0)), SPACE, _ck(0), 0, dest.data)]
            )
            assert got == [True] and dest.tobytes() == _values(100_000, 1)[0][72:]
            await b.shutdown()
        finally:
            store.close()

    asyncio.run(go())


def test_put_slots_returns_only_once_every_connection_is_done_with_the_slots() -> None:
    """One connection's share refused at once, the other's still being sent: the call
    must not return (and the writer unpin the slots) while a thread still sends from
    them, whatever share is refused first."""
    pool = np.random.default_rng(5).integers(0, 256, 4 * 200_000, dtype=np.uint8)
    objs = [
        SlotObject(
            codec.l2_key(SPACE, _ck(i)),
            SPACE,
            _ck(i),
            0,
            pool[i * 200_000 : (i + 1) * 200_000].data,
        )
        for i in range(4)
    ]

    async def go(store: CuttingStore) -> None:
        b = RedisBackend(store.url, timeout_s=5.0, connections=2)
        await b.connect()
        store.refuse = {objs[0].key}  # the first share: objects 0 and 1
        store.slow_s = {objs[2].key: 0.5}  # the second share: objects 2 and 3
        with pytest.raises(L2Error) as refused:
            await b.put_slots(objs)
        returned_s = time.monotonic()
        assert not refused.value.unavailable and "maxmemory" in str(refused.value)
        assert len(store.set_replied_s) == 3, "the second share was not sent whole"
        assert max(store.set_replied_s) <= returned_s
        await b.shutdown()

    store = CuttingStore({})
    try:
        asyncio.run(go(store))
    finally:
        store.close()
