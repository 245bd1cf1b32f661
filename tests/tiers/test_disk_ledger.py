"""The disk directory's ledger and start-up clean-up, on real files (no server).

The ledger counts the bytes of every server sharing a directory; these tests check
its arithmetic, that a missing ledger is rebuilt from what is there, that a server
alone on the directory sets it to what is really there after its index rebuild, and
that temporary files of a dead writer on this host go at start (not after 60 s),
while a live writer's and another host's young ones stay.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from lmc_server.tiers import codec
from lmc_server.tiers.disk import direct_io
from lmc_server.tiers.disk.backend import FileBackend
from lmc_server.tiers.disk.ledger import LEDGER_NAME, DiskLedger

SPACE = bytes(16)


def key(i: int) -> bytes:
    return codec.l2_key(SPACE, i.to_bytes(32, "big"))


def value(b: FileBackend, i: int, n: int = 10_000) -> memoryview:
    return b.encode(SPACE, i.to_bytes(32, "big"), 1, memoryview(bytes([i % 256]) * n))


async def _rebuilt(b: FileBackend) -> None:
    await b.connect()
    while not b.index.progress.done:
        await asyncio.sleep(0.01)


def test_reserve_release_and_shortfall(tmp_path: Path) -> None:
    led = DiskLedger(str(tmp_path / "lmc2"), 100)
    led.open()
    try:
        assert led.reserve([("a", 40), ("b", 40), ("c", 40)]) == 2
        assert led.used_bytes == 80 and led.shortfall(40) == 20
        led.settled([("a", 40), ("b", 40)])
        led.release(40)
        assert led.reserve([("c", 40)]) == 1 and led.used_bytes == 80
    finally:
        led.close()


def test_a_missing_ledger_is_summed_from_the_files_there(tmp_path: Path) -> None:
    async def go() -> None:
        a = FileBackend(str(tmp_path), 1 << 30)
        await _rebuilt(a)
        await a.put_many([(key(i), value(a, i)) for i in range(3)])
        await a.shutdown()
        os.unlink(tmp_path / "lmc2" / LEDGER_NAME)
        b = FileBackend(str(tmp_path), 1 << 30)
        await b.connect()
        assert b.ledger.used_bytes == 3 * (codec.HEADER_BYTES + 10_000)
        await b.shutdown()

    asyncio.run(go())


def test_alone_on_the_directory_the_ledger_is_set_to_what_is_there(tmp_path: Path) -> None:
    """What a writer killed mid-write left reserved goes back at the next start."""

    async def go() -> None:
        a = FileBackend(str(tmp_path), 1 << 30)
        await _rebuilt(a)
        await a.put_many([(key(i), value(a, i)) for i in range(2)])
        await a._run(a.ledger.reserve, [("/nowhere", 123_456)])  # a write that never ends
        await a.shutdown()
        b = FileBackend(str(tmp_path), 1 << 30)
        await _rebuilt(b)
        assert b.ledger.used_bytes == 2 * (codec.HEADER_BYTES + 10_000)
        await b.shutdown()

    asyncio.run(go())


def test_the_same_value_is_not_written_twice(tmp_path: Path) -> None:
    async def go() -> None:
        a = FileBackend(str(tmp_path), 1 << 30)
        await _rebuilt(a)
        await a.put_many([(key(1), value(a, 1))])
        path = a.path_of(key(1))
        before = os.stat(path).st_ino
        b = FileBackend(str(tmp_path), 1 << 30)  # another server on the directory
        await _rebuilt(b)
        await b.put_many([(key(1), value(b, 1))])
        assert os.stat(path).st_ino == before  # left as it was
        assert b.ledger.used_bytes == codec.HEADER_BYTES + 10_000  # counted once
        await b.put_many([(key(1), value(b, 1, 20_000))])  # another value: replaced
        assert os.stat(path).st_size == codec.HEADER_BYTES + 20_000
        assert b.ledger.used_bytes == codec.HEADER_BYTES + 20_000
        await b.shutdown()
        await a.shutdown()

    asyncio.run(go())


def test_a_dead_writers_temporary_files_go_at_start(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead_pid = int(dead.stdout)

    async def go() -> tuple[Path, Path, Path, int]:
        a = FileBackend(str(tmp_path), 1 << 30)
        await _rebuilt(a)
        await a.put_many([(key(1), value(a, 1))])
        await a.shutdown()
        leaf = Path(a.path_of(key(1))).parent
        name = leaf / ("0" * 64)
        stale = leaf / f".{name.name}.{direct_io.HOST}.{dead_pid}.7{direct_io.TMP_SUFFIX}"
        live = leaf / f".{name.name}.{direct_io.HOST}.{os.getppid()}.8{direct_io.TMP_SUFFIX}"
        remote = leaf / f".{name.name}.another-host.{dead_pid}.9{direct_io.TMP_SUFFIX}"
        for p in (stale, live, remote):
            p.write_bytes(b"half a file")
        b = FileBackend(str(tmp_path), 1 << 30)
        await _rebuilt(b)
        removed = b.index.progress.stale_tmp_removed
        await b.shutdown()
        return stale, live, remote, removed

    stale, live, remote, removed = asyncio.run(go())
    assert removed == 1 and not stale.exists()
    assert live.exists() and remote.exists()  # a live writer's; another host's, young
