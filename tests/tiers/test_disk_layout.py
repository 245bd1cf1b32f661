"""The disk tier's aligned layout (payload at 4 KiB, written straight from the slot) and
the packed one beside it: which a write takes, both read back byte for byte, damage in
either a counted miss, and a directory holding both served after a restart.
(The layouts: lmc_server/tiers/disk/layout.py.)"""

from __future__ import annotations

import asyncio
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from lmc_server.client import chunk_digests
from lmc_server.testing.tierworker import (
    CHUNK,
    Worker,
    disk_server,
    disk_stats,
    retrieve_exact,
    tokens,
    value_files,
    wait_disk_written,
    wait_for,
)
from lmc_server.tiers import codec
from lmc_server.tiers.backend import SlotObject
from lmc_server.tiers.disk import direct_io
from lmc_server.tiers.disk import layout as disk_layout
from lmc_server.tiers.disk.backend import FileBackend

SPACE = bytes(range(16))
PAGE = direct_io.ALIGN_BYTES


def ck(i: int) -> bytes:
    return i.to_bytes(32, "big")


@pytest.fixture
def direct_dir(tmp_path: Path) -> Path:
    if not direct_io.probe_direct(str(tmp_path)):
        pytest.skip("tmp_path's filesystem takes no O_DIRECT: every write is packed there")
    return tmp_path


@pytest.fixture
def pool() -> Iterator[memoryview]:
    """A page-aligned "L1 slab" of random bytes (L1's slabs are page-aligned mmaps)."""
    mm = mmap.mmap(-1, 8 << 20)
    mm[:] = np.random.default_rng(5).integers(0, 256, len(mm), dtype=np.uint8).tobytes()
    yield memoryview(mm)


def slot(pool: memoryview, i: int, offset: int, nbytes: int) -> SlotObject:
    return SlotObject(codec.l2_key(SPACE, ck(i)), SPACE, ck(i), 1, pool[offset : offset + nbytes])


def test_each_slot_takes_the_layout_it_can_and_reads_back_byte_exact(
    direct_dir: Path, pool: memoryview
) -> None:
    """Aligned: a whole number of blocks, and a ragged end (last block from a buffer).
    Packed: an unaligned slot, and one too small for 4 KiB of zeros to pay."""
    cases = [  # (offset, bytes, aligned layout?)
        (0, 658 * PAGE, True),
        (700 * PAGE, 300_001, True),
        (800 * PAGE + 64, 300_000, False),
        (900 * PAGE, disk_layout.MIN_ALIGNED_PAYLOAD - PAGE, False),
    ]

    async def go() -> None:
        b = FileBackend(str(direct_dir), 1 << 30)
        await b.connect()
        assert b.direct
        objs = [slot(pool, i, off, n) for i, (off, n, _) in enumerate(cases)]
        await b.put_slots(objs)
        got = await b.get_many([o.key for o in objs])
        for o, g, (_, n, aligned) in zip(objs, got, cases, strict=True):
            assert g is not None
            assert bytes(g) == codec.encode_value(SPACE, o.chunk_key, 1, o.payload)
            assert codec.check_header(g, SPACE, o.chunk_key, n)[1] is None
            assert codec.check_payload(g)
            on_disk = os.path.getsize(b.path_of(o.key))
            assert on_disk == disk_layout.file_bytes(n, aligned)
            assert on_disk == (PAGE + n if aligned else codec.HEADER_BYTES + n)
        assert b.index.used_bytes == sum(disk_layout.file_bytes(n, a) for _, n, a in cases)
        assert not [p for p in direct_dir.rglob("*") if p.name.endswith(direct_io.TMP_SUFFIX)]
        b.release(got)
        await b.shutdown()

    asyncio.run(go())


@pytest.mark.parametrize(
    "damage,reason",
    [
        ("flip_payload", codec.Invalid.CHECKSUM),
        ("flip_header", codec.Invalid.CHECKSUM),
        ("cut_one_byte", codec.Invalid.TRUNCATED),
        ("cut_to_packed_size", codec.Invalid.CHECKSUM),
        ("one_byte_more", codec.Invalid.TRUNCATED),
    ],
)
def test_a_damaged_aligned_file_never_passes_the_checks(
    direct_dir: Path, pool: memoryview, damage: str, reason: codec.Invalid
) -> None:
    """Whatever is done to the file, what the reader gets fails the header or the
    checksum (the tier then counts a miss and removes the file, test_disk_tier.py)."""
    n = 100 * PAGE

    async def go() -> None:
        b = FileBackend(str(direct_dir), 1 << 30)
        await b.connect()
        o = slot(pool, 1, 0, n)
        await b.put_slots([o])
        path = Path(b.path_of(o.key))
        data = bytearray(path.read_bytes())
        assert len(data) == PAGE + n
        if damage == "flip_payload":
            data[PAGE + n // 2] ^= 1
        elif damage == "flip_header":
            data[5] ^= 1  # the mask byte: any mask passes the header check, not the sum
        elif damage == "cut_one_byte":
            del data[-1]
        elif damage == "cut_to_packed_size":  # as long as a packed file of this length
            del data[codec.HEADER_BYTES + n :]
        else:
            data += b"\0"
        path.write_bytes(bytes(data))
        (g,) = await b.get_many([o.key])
        assert g is not None
        mask, bad = codec.check_header(g, SPACE, o.chunk_key, n)
        verdict = bad if bad is not None else (None if codec.check_payload(g) else "checksum")
        assert verdict in (reason, reason.value)
        await b.shutdown()

    asyncio.run(go())


def test_the_zeros_between_header_and_payload_are_never_served(
    direct_dir: Path, pool: memoryview
) -> None:
    """The padding is outside the value: what it holds changes nothing that is served."""
    n = 100 * PAGE

    async def go() -> None:
        b = FileBackend(str(direct_dir), 1 << 30)
        await b.connect()
        o = slot(pool, 2, 0, n)
        await b.put_slots([o])
        path = Path(b.path_of(o.key))
        data = bytearray(path.read_bytes())
        assert data[codec.HEADER_BYTES : PAGE] == bytes(PAGE - codec.HEADER_BYTES)
        data[codec.HEADER_BYTES : PAGE] = b"\xff" * (PAGE - codec.HEADER_BYTES)
        path.write_bytes(bytes(data))
        (g,) = await b.get_many([o.key])
        assert g is not None and bytes(g) == codec.encode_value(SPACE, o.chunk_key, 1, o.payload)
        await b.shutdown()

    asyncio.run(go())


def test_a_directory_of_both_layouts_is_served_after_a_restart(
    direct_dir: Path, pool: memoryview
) -> None:
    """Packed files (written before the aligned layout, or of small or unaligned slots)
    and aligned ones side by side: the rebuilt index knows each by its size on disk,
    and both read back byte for byte."""
    n = 100 * PAGE
    aligned = slot(pool, 3, 0, n)
    packed_payload = pool[PAGE + 8 : PAGE + 8 + n]

    async def fill() -> None:
        a = FileBackend(str(direct_dir), 1 << 30)
        await a.connect()
        await a.put_slots([aligned])
        await a.put_many([(codec.l2_key(SPACE, ck(4)), a.encode(SPACE, ck(4), 1, packed_payload))])
        await a.shutdown()

    async def serve() -> None:
        b = FileBackend(str(direct_dir), 1 << 30)
        await b.connect()
        while not b.index.progress.done:
            await asyncio.sleep(0.01)
        keys = [aligned.key, codec.l2_key(SPACE, ck(4))]
        assert b.index.entries == {
            keys[0]: disk_layout.file_bytes(n, True),
            keys[1]: disk_layout.file_bytes(n, False),
        }
        got = await b.get_many(keys)
        assert got[0] is not None and got[1] is not None
        assert bytes(got[0]) == codec.encode_value(SPACE, ck(3), 1, aligned.payload)
        assert bytes(got[1]) == codec.encode_value(SPACE, ck(4), 1, packed_payload)
        await b.shutdown()

    asyncio.run(fill())
    asyncio.run(serve())


def test_the_server_writes_the_aligned_layout_and_a_restart_serves_it(tmp_path: Path) -> None:
    """Through real servers (CPU backend): the preset's objects (2-3 MB, not whole 4 KiB
    blocks) sit in 4 KiB-aligned slots, so with direct I/O every file is aligned (and
    ends in a ragged block); a second server on the directory serves them byte for
    byte."""
    digests = chunk_digests(tokens(71, 4), CHUNK)
    with disk_server(tmp_path) as a:
        w = Worker(a.endpoint, seed=23)
        try:
            wait_for(lambda: disk_stats(w.client).state == "up", "disk tier up")
            direct = disk_stats(w.client).direct_io
            ids = w.store(digests, block_seed=5)
            groups = w.reg.object_groups
            wait_disk_written(w.client, 4 * len(groups))
            expect = {
                og.name: disk_layout.file_bytes(
                    og.object_bytes, direct and og.object_bytes >= disk_layout.MIN_ALIGNED_PAYLOAD
                )
                for og in groups
            }
            assert all(og.object_bytes >= disk_layout.MIN_ALIGNED_PAYLOAD for og in groups)
            sizes = sorted(f.stat().st_size for f in value_files(tmp_path))
            assert sizes == sorted(4 * list(expect.values()))
            w.client.close()
            assert a.terminate() == 0
            with disk_server(tmp_path) as b:
                wb = Worker(b.endpoint, seed=0)
                try:
                    wait_for(lambda: disk_stats(wb.client).state == "up", "disk tier up")
                    retrieve_exact(wb, w, ids, digests, 4)
                    assert not disk_stats(wb.client).invalid
                finally:
                    wb.close()
        finally:
            w.kv.close()
