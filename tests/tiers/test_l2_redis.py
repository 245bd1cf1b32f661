"""The L2 tier end to end: real redis-server, real server processes, real bytes.

redis-server is started by the tests on a free loopback port. Without it the tests
skip, except under CI=true, where a missing redis-server fails them (CI installs it:
.ci/install-redis.sh).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from lmc_server.cache.status import ChunkStatus
from lmc_server.client import Client, Registration, chunk_digests
from lmc_server.testing import ShmKV, dsv41_flash
from lmc_server.testing.kv import assert_same_pages, block_ids_for
from lmc_server.testing.process import ServerProcess, free_port
from lmc_server.testing.redis_process import RedisProcess, redis_server_path
from lmc_server.testing.tierworker import (
    BASE_ARGS,
    CHUNK,
    NUM_BLOCKS,
    Worker,
    l2_server,
    l2_stats,
    lookup_until,
    tokens,
    wait_for,
    wait_l2_written,
)
from lmc_server.tiers import codec
from lmc_server.tiers.backend import L2Error, SlotObject
from lmc_server.tiers.redis.backend import RedisBackend

#: A short L2 timeout, so the tests of a store going away converge quickly.
L2_TIMEOUT_S = 0.5
ARGS = [*BASE_ARGS, "--l2-timeout-s", str(L2_TIMEOUT_S)]

if redis_server_path() is None:
    if os.environ.get("CI") == "true":
        pytest.fail(
            "CI=true but redis-server is not installed (.ci/install-redis.sh)", pytrace=False
        )
    pytestmark = pytest.mark.skip(
        reason="redis-server is not installed (apt-get install redis-server)"
    )


def retrieve_exact(
    dst: Worker, src: Worker, src_ids: dict[str, np.ndarray], digests: bytes, n: int
) -> None:
    look = lookup_until(dst.client, dst.reg, digests, n)
    assert look.hit_chunks == n and look.lease_id
    dst.client.clear()  # the lease pins what was prefetched, like any hit
    dst_ids = block_ids_for(dst.reg, n, np.random.default_rng(1234))
    res = dst.client.retrieve(dst.reg, digests[: n * 32], dst_ids)
    assert res.ok.all() and res.ok_prefix == n
    assert_same_pages(dst.reg, src.kv, src_ids, dst.kv, dst_ids, n)
    assert dst.client.release(look.lease_id)


# -- sharing across servers ----------------------------------------------------------


def test_store_on_server_a_retrieve_on_server_b_byte_exact(redis_proc: RedisProcess) -> None:
    n = 8
    digests = chunk_digests(tokens(1, n), CHUNK)
    with l2_server(redis_proc.url) as a, l2_server(redis_proc.url) as b:
        wa, wb = Worker(a.endpoint, seed=11), Worker(b.endpoint, seed=0)
        try:
            wait_for(lambda: l2_stats(wb.client).state == "up", "B connected to L2")
            ids = wa.store(digests, block_seed=2)
            objects = sum(
                int(s.size) for s in wa.client.store(wa.reg, digests, ids).statuses.values()
            )
            wait_l2_written(wa.client, objects)
            first = wb.client.lookup(wb.reg, digests, lease=False)
            assert first.hit_chunks == 0 and first.l2_pending_chunks == n
            retrieve_exact(wb, wa, ids, digests, n)
            st = l2_stats(wb.client)
            assert st.hits >= n and not st.invalid
            # B never stored anything itself, and nothing it fetched is written back.
            assert st.objects_written == 0
        finally:
            wa.close()
            wb.close()


def test_several_connections_split_batches_and_keep_every_byte(redis_proc: RedisProcess) -> None:
    n = 12  # more objects than connections, not a multiple of them
    digests = chunk_digests(tokens(2, n), CHUNK)
    with (
        l2_server(redis_proc.url, "--l2-connections", "3") as a,
        l2_server(redis_proc.url, "--l2-connections", "5") as b,
    ):
        wa = Worker(a.endpoint, seed=13, num_blocks=8 * n)
        wb = Worker(b.endpoint, seed=0, num_blocks=8 * n)
        try:
            wait_for(lambda: l2_stats(wb.client).state == "up", "B connected to L2")
            ids = wa.store(digests, block_seed=4)
            objects = sum(
                int(s.size) for s in wa.client.store(wa.reg, digests, ids).statuses.values()
            )
            wait_l2_written(wa.client, objects)
            retrieve_exact(wb, wa, ids, digests, n)
            assert l2_stats(wb.client).hits == objects and not l2_stats(wb.client).invalid
        finally:
            wa.close()
            wb.close()


def test_prefix_l2_does_not_have_is_not_polled_forever(redis_proc: RedisProcess) -> None:
    with l2_server(redis_proc.url) as a:
        w = Worker(a.endpoint, seed=3)
        try:
            wait_for(lambda: l2_stats(w.client).state == "up", "connected")
            digests = chunk_digests(tokens(9, 4), CHUNK)
            assert w.client.lookup(w.reg, digests).l2_pending_chunks == 4
            wait_for(
                lambda: w.client.lookup(w.reg, digests, lease=False).l2_pending_chunks == 0,
                "the prefetch to end",
            )
            before = l2_stats(w.client).prefetches
            for _ in range(5):
                r = w.client.lookup(w.reg, digests, lease=False)
                assert r.hit_chunks == 0 and r.l2_pending_chunks == 0
            assert l2_stats(w.client).prefetches == before
        finally:
            w.close()


# -- failures ------------------------------------------------------------------------


def test_l2_killed_mid_run_and_restarted(redis_proc: RedisProcess) -> None:
    with l2_server(redis_proc.url) as a:
        w = Worker(a.endpoint, seed=5)
        try:
            wait_for(lambda: l2_stats(w.client).state == "up", "connected")
            d1 = chunk_digests(tokens(21, 4), CHUNK)
            w.store(d1, block_seed=1)
            wait_for(lambda: l2_stats(w.client).objects_written > 0, "first writes")
            redis_proc.kill()
            # Stores go on (writes fail or are dropped, never the store), L1 hits too.
            d2 = chunk_digests(tokens(22, 4), CHUNK)
            for i in range(3):
                w.store(chunk_digests(tokens(30 + i, 4), CHUNK), block_seed=i)
            w.store(d2, block_seed=7)
            assert w.client.lookup(w.reg, d1, lease=False).hit_chunks == 4
            assert w.client.lookup(w.reg, d2, lease=False).hit_chunks == 4
            miss = chunk_digests(tokens(23, 4), CHUNK)
            wait_for(lambda: l2_stats(w.client).state == "degraded", "degraded state")
            r = w.client.lookup(w.reg, miss, lease=False)
            assert r.hit_chunks == 0 and r.l2_pending_chunks == 0  # no prefetch while down
            st = l2_stats(w.client)
            assert sum(st.dropped_writes.values()) > 0
            assert "degraded" in a.log() and "L2" in a.log()
            redis_proc.start()
            wait_for(lambda: l2_stats(w.client).state == "up", "L2 back up", 20)
            written = l2_stats(w.client).objects_written
            d3 = chunk_digests(tokens(24, 4), CHUNK)
            w.store(d3, block_seed=9)
            wait_for(
                lambda: l2_stats(w.client).objects_written > written, "writes after the restart"
            )
            assert redis_proc.client().dbsize() > 0
            assert w.client.lookup(w.reg, d1, lease=False).hit_chunks == 4
        finally:
            w.close()


def test_l2_down_at_start_then_up_healthz_says_so() -> None:
    port, metrics = free_port(), free_port()
    with l2_server(f"redis://127.0.0.1:{port}/0", metrics_port=metrics) as a:
        w = Worker(a.endpoint, seed=6)
        try:
            d = chunk_digests(tokens(41, 2), CHUNK)
            w.store(d, block_seed=3)
            assert w.client.lookup(w.reg, d, lease=False).hit_chunks == 2
            assert l2_stats(w.client).state == "degraded"
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/healthz") as h:
                assert h.status == 200 and b"L2" in (body := h.read())
                assert b"degraded" in body
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics") as h:
                assert b"lmcache_l2_up 0.0" in h.read()
            with RedisProcess(port=port):
                wait_for(lambda: l2_stats(w.client).state == "up", "L2 up", 20)
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics") as h:
                    body = h.read()
                assert b"lmcache_l2_up 1.0" in body
                assert b"lmcache_l2_dropped_writes_total" in body
        finally:
            w.close()


def _l2_keys(r: RedisProcess) -> list[bytes]:
    keys: list[bytes] = list(r.client().scan_iter(match=b"lmc2/*"))
    return keys


def _full_key(
    r: RedisProcess, reg: Registration, full_fp: bytes, digests: bytes, chunk: int
) -> bytes:
    space = codec.space_of(reg.namespace, full_fp, CHUNK)
    return codec.l2_key(space, digests[chunk * 32 : (chunk + 1) * 32])


def _fingerprints(c: Client) -> dict[str, bytes]:
    return {p.name: bytes.fromhex(p.fingerprint) for p in c.stats().partitions}


@pytest.mark.parametrize(
    "damage,n,bad",
    [
        ("flip_byte", 6, 3),
        ("truncate", 6, 3),
        ("other_chunk", 6, 3),
        ("header_length", 6, 3),
        ("flip_byte", 16, 13),  # a prefetch reads 11 chunks of this preset per batch
    ],
)
def test_damaged_value_in_l2_is_never_served(
    redis_proc: RedisProcess, damage: str, n: int, bad: int
) -> None:
    digests = chunk_digests(tokens(50, n), CHUNK)
    with l2_server(redis_proc.url) as a, l2_server(redis_proc.url) as b:
        wa = Worker(a.endpoint, seed=12, num_blocks=8 * n)
        wb = Worker(b.endpoint, seed=0, num_blocks=8 * n)
        try:
            wait_for(lambda: l2_stats(wb.client).state == "up", "B connected")
            ids = wa.store(digests, block_seed=4)
            wait_l2_written(wa.client, 2 * n)
            r = redis_proc.client()
            key = _full_key(redis_proc, wa.reg, _fingerprints(wa.client)["full"], digests, bad)
            value = r.get(key)
            assert value is not None, "the object was not written under the expected key"
            if damage == "flip_byte":
                pos = len(value) - 1000
                value = value[:pos] + bytes([value[pos] ^ 0x01]) + value[pos + 1 :]
            elif damage == "truncate":
                value = value[:-7]
            elif damage == "other_chunk":  # a valid value, written under another key
                value = r.get(
                    _full_key(redis_proc, wa.reg, _fingerprints(wa.client)["full"], digests, 0)
                )
            else:  # a header claiming another length (and a payload to match it)
                length_at = codec.HEADER_BYTES - 16  # payload length u64, checksum u64
                value = (
                    value[:length_at]
                    + (len(value) - codec.HEADER_BYTES + 8).to_bytes(8, "little")
                    + value[length_at + 8 :]
                    + bytes(8)
                )
            r.set(key, value)
            look = lookup_until(wb.client, wb.reg, digests, bad)
            assert look.hit_chunks == bad, "a damaged object was served"
            st = l2_stats(wb.client)
            reason = {
                "flip_byte": "checksum",
                "truncate": "truncated",
                "other_chunk": "foreign",
                "header_length": "length",
            }[damage]
            assert st.invalid.get(reason, 0) >= 1, st
            dst_ids = block_ids_for(wb.reg, bad, np.random.default_rng(77))
            res = wb.client.retrieve(wb.reg, digests[: bad * 32], dst_ids)
            assert res.ok.all()
            src_ids = {g: v.reshape(n, -1)[:bad].ravel() for g, v in ids.items()}
            assert_same_pages(wb.reg, wa.kv, src_ids, wb.kv, dst_ids, bad)
            res = wb.client.retrieve(wb.reg, digests, block_ids_for(wb.reg, n))
            assert res.ok_prefix <= bad
            assert res.statuses["full"][bad] == ChunkStatus.MISS
        finally:
            wa.close()
            wb.close()


def test_value_of_other_arch_is_never_served(redis_proc: RedisProcess) -> None:
    """SM90 objects copied under every SM100 key: the SM100 server must refuse them all."""
    n = 4
    digests = chunk_digests(tokens(60, n), CHUNK)
    with l2_server(redis_proc.url) as a, l2_server(redis_proc.url) as b:
        w90, w100 = Worker(a.endpoint, seed=13), Worker(b.endpoint, seed=0, arch="sm100")
        try:
            wait_for(lambda: l2_stats(w100.client).state == "up", "B connected")
            w90.store(digests, block_seed=5)
            wait_l2_written(w90.client, 2 * n)
            # Plainly: different arch, different keys: nothing to find.
            r0 = lookup_until(w100.client, w100.reg, digests, 0)
            assert r0.hit_chunks == 0
            w100.client.release(r0.lease_id) if r0.lease_id else None
            assert l2_stats(w100.client).hits == 0
            # Trying hard: put the SM90 bytes under the keys SM100 reads.
            r = redis_proc.client()
            fp90, fp100 = _fingerprints(w90.client), _fingerprints(w100.client)
            copied = 0
            for name in ("full", "window128"):
                for i in range(n):
                    src = codec.l2_key(
                        codec.space_of(w90.reg.namespace, fp90[name], CHUNK),
                        digests[i * 32 : (i + 1) * 32],
                    )
                    dst = codec.l2_key(
                        codec.space_of(w100.reg.namespace, fp100[name], CHUNK),
                        digests[i * 32 : (i + 1) * 32],
                    )
                    v = r.get(src)
                    if v is not None:
                        r.set(dst, v)
                        copied += 1
            assert copied == 2 * n
            other = chunk_digests(tokens(61, n), CHUNK)  # a fresh tag: no miss memory
            assert w100.client.lookup(w100.reg, other, lease=False).hit_chunks == 0
            time.sleep(1.1)  # past the memory of the first (plain) miss
            wait_for(
                lambda: (
                    w100.client.lookup(w100.reg, digests, lease=False).l2_pending_chunks == 0
                    and sum(l2_stats(w100.client).invalid.values()) > 0
                ),
                "refusals",
            )
            assert w100.client.lookup(w100.reg, digests, lease=False).hit_chunks == 0
            st = l2_stats(w100.client)
            assert st.hits == 0 and st.invalid.get("foreign", 0) >= 1, st
        finally:
            w90.close()
            w100.close()


def test_write_queue_overflow_is_counted_and_stores_succeed(redis_proc: RedisProcess) -> None:
    with l2_server(redis_proc.url, "--l2-write-queue-objects", "3") as a:
        w = Worker(a.endpoint, seed=7)
        try:
            wait_for(lambda: l2_stats(w.client).state == "up", "connected")
            digests = chunk_digests(tokens(70, 8), CHUNK)
            w.store(digests, block_seed=6)  # 16 objects into a queue of 3
            st = l2_stats(w.client)
            assert st.dropped_writes.get("queue_full", 0) >= 8, st
            assert st.write_queue_capacity == 3
            assert w.client.lookup(w.reg, digests, lease=False).hit_chunks == 8
            wait_for(
                lambda: (
                    l2_stats(w.client).write_queue_objects == 0
                    and l2_stats(w.client).writes_in_flight == 0
                ),
                "queue drained",
            )
            st = l2_stats(w.client)
            assert st.objects_written + st.dropped_writes["queue_full"] == 16, (st, a.log())
        finally:
            w.close()


def test_server_restart_with_warm_l2_serves_hits_from_l2(redis_proc: RedisProcess) -> None:
    n = 5
    digests = chunk_digests(tokens(80, n), CHUNK)
    port = free_port()
    src = Worker.__new__(Worker)  # only its kv is used: the pages stored before
    with ShmKV(dsv41_flash(num_blocks=NUM_BLOCKS)) as kv:
        kv.fill_random(14)
        with ServerProcess([*ARGS, "--l2", redis_proc.url], port=port, l1_size_gb=0.25):
            with Client(f"tcp://127.0.0.1:{port}", timeout_s=30) as c:
                reg = c.register(**kv.register_kwargs())
                ids = block_ids_for(reg, n, np.random.default_rng(8))
                assert c.store(reg, digests, ids).ok.all()
                wait_l2_written(c, 2 * n)
        with ServerProcess([*ARGS, "--l2", redis_proc.url], port=port, l1_size_gb=0.25):
            dst = Worker(f"tcp://127.0.0.1:{port}", seed=0)
            try:
                src.kv = kv
                retrieve_exact(dst, src, ids, digests, n)
                assert l2_stats(dst.client).hits >= 2 * n
            finally:
                dst.close()


# -- credentials and TLS -------------------------------------------------------------


def _make_certs(d: str) -> None:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "1",
        "-subj",
        "/CN=lmc-test-ca",
    )
    run(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=127.0.0.1",
    )
    with open(os.path.join(d, "ext.cnf"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1\n")
    run(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.crt",
        "-days",
        "1",
        "-extfile",
        "ext.cnf",
    )


@pytest.mark.needs_tool("openssl", "Debian: openssl; CI: .ci/install-ops-tools.sh")
def test_tls_and_password_from_a_file(tmp_path: Path) -> None:
    """rediss:// with a CA from the URL query; the password from --l2-password-file
    (and a wrong one from the environment is not used: the file wins)."""
    _make_certs(str(tmp_path))
    pw = tmp_path / "l2-password"
    pw.write_text("s3cret-pw\n")
    n = 3
    digests = chunk_digests(tokens(90, n), CHUNK)
    with RedisProcess(password="s3cret-pw", tls_dir=str(tmp_path)) as r:
        assert r.url.startswith("rediss://")
        with (
            ServerProcess(
                [*ARGS, "--l2", r.url, "--l2-password-file", str(pw)],
                l1_size_gb=0.25,
                env={"LMCACHE_L2_PASSWORD": "wrong"},
            ) as a,
            ServerProcess(
                [*ARGS, "--l2", r.url, "--l2-password-file", str(pw)], l1_size_gb=0.25
            ) as b,
        ):
            w = Worker(a.endpoint, seed=15)
            wb = Worker(b.endpoint, seed=0)
            try:
                wait_for(lambda: l2_stats(w.client).state == "up", "connected over TLS")
                ids = w.store(digests, block_seed=2)
                wait_l2_written(w.client, 2 * n)
                assert len(_l2_keys(r)) == 2 * n
                assert "s3cret-pw" not in a.log()
                # B reads them over TLS, received into its slots through the TLS socket.
                wait_for(lambda: l2_stats(wb.client).state == "up", "B connected over TLS")
                retrieve_exact(wb, w, ids, digests, n)
            finally:
                w.close()
                wb.close()


def test_wrong_password_is_degraded_not_fatal() -> None:
    with (
        RedisProcess(password="right") as r,
        ServerProcess(
            [*ARGS, "--l2", r.url], l1_size_gb=0.25, env={"LMCACHE_L2_PASSWORD": "wrong"}
        ) as a,
    ):
        w = Worker(a.endpoint, seed=16)
        try:
            d = chunk_digests(tokens(91, 2), CHUNK)
            w.store(d, block_seed=1)
            assert w.client.lookup(w.reg, d, lease=False).hit_chunks == 2
            st = wait_for(
                lambda: (s := l2_stats(w.client)).reason != "connecting" and s,
                "the first connection attempt",
            )
            assert st.state == "degraded" and st.objects_written == 0
            assert "auth" in st.reason.lower() or "pass" in st.reason.lower(), st
            assert "wrong" not in a.log()
        finally:
            w.close()


def test_polling_never_reports_nothing_pending_before_the_prefix_is_in(
    redis_proc: RedisProcess,
) -> None:
    """A scheduler polls until the hit stops growing: while L2 has the rest, every
    answer short of the full prefix must say chunks are pending (a prefetch reads 11
    chunks of this preset per batch, so the hit grows in steps), also right after L1
    lost the chunks again. The servers keep the default L2 timeout (2 s): a prefetch reads
    64 MiB per call, which a loaded machine can take longer than the module's 0.5 s
    over, and a timed-out read rightly degrades the tier (nothing pending then)."""
    n = 16
    digests = chunk_digests(tokens(95, n), CHUNK)
    with (
        l2_server(redis_proc.url, l2_timeout_s=2.0) as a,
        l2_server(redis_proc.url, l2_timeout_s=2.0) as b,
    ):
        wa = Worker(a.endpoint, seed=17, num_blocks=8 * n)
        wb = Worker(b.endpoint, seed=0, num_blocks=8 * n)
        try:
            wait_for(lambda: l2_stats(wb.client).state == "up", "B connected")
            wa.store(digests, block_seed=3)
            wait_l2_written(wa.client, 2 * n)
            for _ in range(12):  # the stall showed in about one round of four
                wb.client.clear()
                t0 = time.monotonic()
                while True:
                    r = wb.client.lookup(wb.reg, digests, lease=False)
                    if r.hit_chunks == n:
                        break
                    assert r.l2_pending_chunks > 0, (
                        f"stalled at {r.hit_chunks} of {n}: {l2_stats(wb.client)}"
                    )
                    assert time.monotonic() - t0 < 20
                    time.sleep(0.002)
        finally:
            wa.close()
            wb.close()


# -- the adapter's own RESP writes -----------------------------------------------------


def test_put_slots_writes_exact_values_and_an_error_reply_keeps_the_connection() -> None:
    """Values sent from slots are exactly the reference encoder's bytes; a store that
    refuses (out of memory) is a refusal, and the next calls on the same connections
    work (every reply was read)."""
    space = bytes(range(16))
    pool = np.random.default_rng(3).integers(0, 256, 6 * 300_001, dtype=np.uint8)
    objs = [
        SlotObject(
            codec.l2_key(space, i.to_bytes(32, "big")),
            space,
            i.to_bytes(32, "big"),
            i % 4,
            pool[i * 300_001 : (i + 1) * 300_001].data,
        )
        for i in range(6)
    ]

    async def go(r: RedisProcess) -> None:
        b = RedisBackend(r.url, timeout_s=5.0)
        await b.connect()
        await b.put_slots(objs)
        got = await b.get_many([o.key for o in objs])
        for o, g in zip(objs, got, strict=True):
            assert g == codec.encode_value(space, o.chunk_key, o.mask, o.payload)
        with r.client() as c:
            c.config_set("maxmemory", "1")  # noeviction: every SET refused from now
        with pytest.raises(L2Error) as refused:
            await b.put_slots(objs[:3])
        assert not refused.value.unavailable and "maxmemory" in str(refused.value)
        assert (await b.get_many([objs[0].key]))[0] == got[0]  # in step, still served
        with r.client() as c:
            c.config_set("maxmemory", "0")
        await b.put_slots(objs[3:])
        assert await b.get_many([o.key for o in objs]) == got
        await b.shutdown()

    with RedisProcess(policy="noeviction") as r:
        asyncio.run(go(r))
