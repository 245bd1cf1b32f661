"""The disk tier's adapter and index on their own: files, direct and buffered I/O,
capacity, the rebuild. (End to end, with server processes: test_disk_tier.py.)"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest

from lmc_server.tiers import codec
from lmc_server.tiers.backend import L2Error, SlotObject
from lmc_server.tiers.disk import direct_io
from lmc_server.tiers.disk.backend import FileBackend
from lmc_server.tiers.disk.config import DiskConfigError, DiskSettings, check_disk_config, disk_path
from lmc_server.tiers.disk.index import STALE_TMP_S, DiskIndex

SPACE = bytes(range(16))


def key(i: int) -> bytes:
    return codec.l2_key(SPACE, i.to_bytes(32, "big"))


def value(backend: FileBackend, i: int, nbytes: int = 10_000) -> memoryview | bytes:
    payload = np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)
    return backend.encode(SPACE, i.to_bytes(32, "big"), 1, payload.data)


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


@pytest.mark.parametrize("direct", [True, False])
def test_round_trip_whole_files_no_temporaries(tmp_path: Path, direct: bool) -> None:
    async def go() -> None:
        b = FileBackend(str(tmp_path), 1 << 30, direct=direct)
        await b.connect()
        assert b.direct is direct or not direct_io.probe_direct(str(tmp_path))
        items = [(key(i), value(b, i, 5000 + 4096 * i)) for i in range(5)]
        await b.put_many(items)
        got = await b.get_many([k for k, _ in items] + [key(99)])
        for (_, v), g in zip(items, got, strict=False):
            assert g is not None and bytes(g) == bytes(v)
            mask, bad = codec.check_header(g, SPACE, bytes(g[24:56]), len(g) - codec.HEADER_BYTES)
            assert bad is None and codec.check_payload(g)
        assert got[-1] is None
        names = [p.name for p in tmp_path.rglob("*") if p.is_file()]
        assert not [n for n in names if n.endswith(direct_io.TMP_SUFFIX)]
        assert os.path.getsize(b.path_of(key(3))) == len(items[3][1])  # no padding left
        await b.shutdown()

    run(go())


@pytest.mark.parametrize(
    "nbytes", [0, 1, codec.PIECE_BYTES - 1, codec.PIECE_BYTES, 3 * codec.PIECE_BYTES + 4097]
)
def test_encode_into_is_encode_value(nbytes: int) -> None:
    """The one-pass copy and checksum builds exactly the bytes of the reference encoder
    (pieces of every size: none, one short one, several and a ragged end)."""
    payload = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    dst = bytearray(codec.HEADER_BYTES + nbytes + 7)
    n = codec.encode_into(dst, SPACE, bytes(32), 3, payload.data)
    assert n == codec.HEADER_BYTES + nbytes
    assert bytes(dst[:n]) == codec.encode_value(SPACE, bytes(32), 3, payload.data)
    with pytest.raises(ValueError, match="cannot hold"):
        codec.encode_into(bytearray(n - 1), SPACE, bytes(32), 3, payload.data)


@pytest.mark.parametrize("direct", [True, False])
def test_put_slots_writes_the_values_of_the_slots(tmp_path: Path, direct: bool) -> None:
    """Written straight from (unaligned) slots of a pool: each file is the value the
    reference encoder makes of its slot, and passes the reader's checks."""

    async def go() -> None:
        b = FileBackend(str(tmp_path), 1 << 30, direct=direct)
        await b.connect()
        pool = np.random.default_rng(7).integers(0, 256, 10 * 9_999, dtype=np.uint8)
        objs = [
            SlotObject(
                key(i), SPACE, i.to_bytes(32, "big"), 1, pool[i * 9_999 : (i + 1) * 9_999].data
            )
            for i in range(10)
        ]
        await b.put_slots(objs)
        got = await b.get_many([o.key for o in objs])
        for o, g in zip(objs, got, strict=True):
            assert g is not None
            assert bytes(g) == codec.encode_value(SPACE, o.chunk_key, 1, o.payload)
            assert codec.check_header(g, SPACE, o.chunk_key, 9_999)[1] is None
            assert codec.check_payload(g)
        assert b.index.used_bytes == 10 * objs[0].value_bytes
        await b.shutdown()

    run(go())


def test_plain_bytes_are_written_too(tmp_path: Path) -> None:
    async def go() -> None:
        b = FileBackend(str(tmp_path), 1 << 30)
        await b.connect()
        await b.put_many([(key(1), b"x" * 5000)])
        assert bytes((await b.get_many([key(1)]))[0] or b"") == b"x" * 5000
        await b.shutdown()

    run(go())


def test_capacity_evicts_the_least_recently_used(tmp_path: Path) -> None:
    async def go() -> None:
        b = FileBackend(str(tmp_path), 3 * 20_000)
        await b.connect()
        for i in range(3):
            await b.put_many([(key(i), value(b, i, 20_000 - codec.HEADER_BYTES))])
        await b.get_many([key(0)])  # 0 is now hotter than 1
        await b.put_many([(key(3), value(b, 3, 20_000 - codec.HEADER_BYTES))])
        assert not os.path.exists(b.path_of(key(1)))
        assert all(os.path.exists(b.path_of(key(i))) for i in (0, 2, 3))
        assert b.index.used_bytes == 60_000 and b.evicted_objects == 1
        await b.shutdown()

    run(go())


def test_capacity_holds_for_a_batch_larger_than_it(tmp_path: Path) -> None:
    """A batch (or one object) larger than the whole capacity is written only as far as
    it fits: the rest is refused (a counted refusal, the tier stays up), never written
    past ``--disk-size-gb``; what was written is said so the writer counts it."""

    async def go() -> None:
        b = FileBackend(str(tmp_path), 50_000)
        await b.connect()
        with pytest.raises(L2Error) as refused:
            await b.put_many([(key(i), value(b, i, 20_000 - codec.HEADER_BYTES)) for i in range(4)])
        assert not refused.value.unavailable and "--disk-size-gb" in str(refused.value)
        assert refused.value.written == [key(0), key(1)]
        assert [os.path.exists(b.path_of(key(i))) for i in range(4)] == [True, True, False, False]
        assert b.index.used_bytes == 40_000
        with pytest.raises(L2Error) as too_big:  # larger than the capacity on its own
            await b.put_many([(key(9), value(b, 9, 60_000))])
        assert too_big.value.written == [] and not os.path.exists(b.path_of(key(9)))
        assert b.index.used_bytes <= 50_000
        await b.put_many([(key(5), value(b, 5, 20_000 - codec.HEADER_BYTES))])  # serves on
        assert os.path.exists(b.path_of(key(5))) and b.index.used_bytes <= 50_000
        await b.shutdown()

    run(go())


def test_rebuild_finds_files_and_removes_stale_temporaries(tmp_path: Path) -> None:
    async def go() -> tuple[FileBackend, str, str]:
        a = FileBackend(str(tmp_path), 1 << 30)
        await a.connect()
        await a.put_many([(key(i), value(a, i)) for i in range(4)])
        await a.shutdown()
        leaf = os.path.dirname(a.path_of(key(0)))
        stale, live = (os.path.join(leaf, f".x.{n}{direct_io.TMP_SUFFIX}") for n in "ab")
        for p in (stale, live):
            Path(p).write_bytes(b"half")
        os.utime(stale, (1.0, 1.0))
        Path(leaf, "not-a-key").write_bytes(b"?")
        b = FileBackend(str(tmp_path), 1 << 30)
        await b.connect()
        while not b.index.progress.done:
            await asyncio.sleep(0.01)
        assert set(b.index.entries) == {key(i) for i in range(4)}
        assert b.index.progress.stale_tmp_removed == 1 and b.status() == ""
        await b.shutdown()
        return b, stale, live

    _, stale, live = run(go())
    assert not os.path.exists(stale) and os.path.exists(live)


def test_rebuild_evicts_what_is_over_capacity_oldest_first(tmp_path: Path) -> None:
    async def go() -> None:
        a = FileBackend(str(tmp_path), 1 << 30)
        await a.connect()
        for i in range(4):
            await a.put_many([(key(i), value(a, i, 10_000 - codec.HEADER_BYTES))])
            os.utime(a.path_of(key(i)), (1000.0 + i, 1000.0 + i))
        await a.shutdown()
        b = FileBackend(str(tmp_path), 2 * 10_000)
        await b.connect()
        while not b.index.progress.done:
            await asyncio.sleep(0.01)
        assert list(b.index.entries) == [key(2), key(3)]
        assert not os.path.exists(b.path_of(key(0))) and os.path.exists(b.path_of(key(3)))
        await b.shutdown()

    run(go())


def test_unusable_directory_is_unavailable(tmp_path: Path) -> None:
    async def go() -> None:
        f = tmp_path / "file"
        f.write_bytes(b"")
        b = FileBackend(str(f), 1 << 30)
        with pytest.raises(L2Error) as e:
            await b.connect()
        assert e.value.unavailable
        await b.shutdown()

    run(go())


def test_index_merge_puts_scanned_files_coldest_first() -> None:
    ix = DiskIndex(100)
    ix.touch(b"new", 10)
    ix.merge([(b"old", 10, 1.0), (b"older", 10, 0.5), (b"new", 10, 0.1)])
    assert list(ix.entries) == [b"older", b"old", b"new"] and ix.used_bytes == 30
    assert ix.victims(75) == [b"older"] and ix.used_bytes == 20
    assert STALE_TMP_S >= 10  # a live writer's temporary file is never this old


def _check(disk_dir: str, disk_size_gb: float, backend: str = "cpu") -> None:
    check_disk_config(DiskSettings(disk_dir, disk_size_gb), backend)


@pytest.mark.parametrize(
    "settings,needle",
    [
        (("", 1.0), "needs --disk-dir"),
        (("{tmp}", 0.0), "needs --disk-size-gb"),
        (("{tmp}", 1.0, "null"), "null backend"),
        (("{tmp}/f", 1.0), "not a directory"),
        (("{tmp}", 1 << 20), "more than the filesystem"),
        (("file://relative", 1.0), "absolute path"),
    ],
)
def test_config_refusals_name_the_setting(tmp_path: Path, settings: tuple, needle: str) -> None:
    (tmp_path / "f").write_bytes(b"")
    d, *rest = settings
    with pytest.raises(DiskConfigError, match=needle):
        _check(d.format(tmp=tmp_path), *rest)


def test_file_url_and_paths() -> None:
    assert disk_path("file:///var/cache/x") == "/var/cache/x"
    _check("file:///tmp/lmc-disk-check-never-made", 0.001)


def test_rewriting_a_known_file_never_evicts_it_under_its_own_write(tmp_path: Path) -> None:
    """A key written again while it is the coldest must not be chosen as the victim that
    makes room for itself (its unlink would race its own rename)."""

    async def go() -> None:
        b = FileBackend(str(tmp_path), 2 * 10_000)
        await b.connect()
        removed: list[bytes] = []
        b.listeners.subscribe(removed=lambda kind, keys, why: removed.extend(keys))
        await b.put_many([(key(1), value(b, 1, 10_000 - codec.HEADER_BYTES))])
        await b.put_many([(key(2), value(b, 2, 10_000 - codec.HEADER_BYTES))])
        await b.put_many([(key(1), value(b, 1, 10_000 - codec.HEADER_BYTES))])
        assert b.evicted_objects == 0 and not removed
        assert os.path.exists(b.path_of(key(1))) and os.path.exists(b.path_of(key(2)))
        assert list(b.index.entries) == [key(2), key(1)] and b.index.used_bytes == 20_000
        await b.shutdown()

    run(go())


def test_buffer_pool_reuses_and_never_hands_one_buffer_to_two_takers() -> None:
    pool = direct_io.BufferPool(3 * direct_io.ALIGN_BYTES)
    a = pool.take(100)
    pool.give(a)
    pool.give(a)
    assert pool.take(100) is a
    assert pool.take(100) is not a  # given twice, kept once
    big = [pool.take(10_000) for _ in range(2)]  # 3 blocks each: only one fits idle
    for b in big:
        pool.give(b)
    assert pool.take(10_000) is big[0] and pool.take(10_000) is not big[1]


def test_a_file_evicted_while_the_rebuild_runs_is_not_merged_back() -> None:
    """The scan lists a directory, then the loop evicts (or forgets) one of its files
    before the scan's list is merged: the gone file is not counted again (an index at
    60,000 of 50,000 bytes under load, before), and after the rebuild a key evicted
    anew is not remembered as gone."""
    ix = DiskIndex(50_000)
    ix.touch(b"a", 20_000)
    ix.touch(b"b", 20_000)
    listed = [(b"a", 20_000, 1.0), (b"b", 20_000, 2.0), (b"old", 5_000, 0.5)]  # the scan
    assert ix.victims(20_000) == [b"a"]  # the loop makes room for a new file ...
    ix.touch(b"c", 20_000)
    ix.forget(b"b")  # ... and a read found b damaged
    ix.merge(listed)  # then the scan's list arrives
    assert sorted(ix.entries) == [b"c", b"old"] and ix.used_bytes == 25_000
    ix.rebuild_done()
    assert ix.progress.done and not ix.gone
    assert ix.victims(30_000) == [b"old"]
    assert not ix.gone
