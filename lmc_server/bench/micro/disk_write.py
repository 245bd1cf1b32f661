"""The disk tier's write path in one process, without a server: how its structure
compares with plain writes of the same bytes, on one directory, rounds interleaved.

Ways to write ``--objects`` objects of ``--object-bytes`` from a "pool" (a page-aligned
mapping carved with L1's slot stride, :func:`lmc_server.cache.slabs.slot_stride`) into
the tier's directory layout:

- ``batch``: the writer's generic path (each batch's values built first with
  ``FileBackend.encode`` on four threads, then ``put_many``; one batch built while the
  previous one is written): how the disk tier wrote before ``writes_from_slots``;
- ``slots``: ``put_slots`` (each I/O thread copies, checksums and writes one object),
  batches one after the other: the disk tier's path until the writer kept two batches
  in flight;
- ``inflight``: the same with the writer's ``SLOT_BATCHES_IN_FLIGHT`` batches in
  flight: the I/O threads go on to the next batch while the last objects of one are
  written; with
  direct I/O, aligned slots are written in the aligned layout, straight from the slot
  (:mod:`lmc_server.tiers.disk.layout`): the tier's path now;
- ``packed``: ``inflight`` from slots 64 bytes off alignment, so each object is copied
  with its header into an aligned buffer first (the packed layout): the tier's path
  before the aligned layout;
- ``plain``: ``os.pwrite`` of ready values on four threads (``bench l2 --disk-dir``'s
  plain side).

No server, no stores, no polling: what is left is the tier's own work. Usage::

    python -m lmc_server.bench.micro.disk_write /tmp/diskbench --rounds 7
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import os
import shutil
import statistics
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from lmc_server.bench.l2.disk import _Plain
from lmc_server.cache.slabs import slot_stride
from lmc_server.tiers import codec
from lmc_server.tiers.backend import SlotObject
from lmc_server.tiers.disk import direct_io
from lmc_server.tiers.disk.backend import FileBackend
from lmc_server.tiers.writer import SLOT_BATCHES_IN_FLIGHT, WRITE_BATCH_BYTES, WRITE_BATCH_OBJECTS

SPACE = bytes(16)
#: L1's slabs at the server's default ``--slab-size-mb`` (the slot stride depends on it).
SLAB_BYTES = 64 << 20


def _batches(n: int, object_bytes: int) -> list[range]:
    per = max(1, min(WRITE_BATCH_OBJECTS, WRITE_BATCH_BYTES // object_bytes))
    return [range(i, min(n, i + per)) for i in range(0, n, per)]


async def _batch_path(
    fb: FileBackend, pool: np.ndarray, size: int, tag: int, executor: ThreadPoolExecutor
) -> None:
    loop = asyncio.get_running_loop()
    stride = slot_stride(size, SLAB_BYTES)
    sending: asyncio.Future[None] | None = None
    for part in _batches(len(pool) // stride, size):
        values = await asyncio.gather(
            *(
                loop.run_in_executor(
                    executor,
                    fb.encode,
                    SPACE,
                    _ck(tag, i),
                    0,
                    pool[i * stride : i * stride + size].data,
                )
                for i in part
            )
        )
        items = [(codec.l2_key(SPACE, _ck(tag, i)), v) for i, v in zip(part, values, strict=True)]
        if sending is not None:
            await sending
        sending = asyncio.ensure_future(fb.put_many(items))
    if sending is not None:
        await sending


async def _slots_path(
    fb: FileBackend, pool: np.ndarray, size: int, tag: int, in_flight: int, skew: int = 0
) -> None:
    """``put_slots`` batch after batch, with at most ``in_flight`` batches handed over
    before waiting for the oldest (the writer's ``SLOT_BATCHES_IN_FLIGHT``); slot ``i``
    at ``i * slot_stride(size, SLAB_BYTES) + skew``."""
    stride = slot_stride(size, SLAB_BYTES)
    sending: deque[asyncio.Future[None]] = deque()
    for part in _batches((len(pool) - skew) // stride, size):
        while len(sending) >= in_flight:
            await sending.popleft()
        sending.append(
            asyncio.ensure_future(
                fb.put_slots(
                    [
                        SlotObject(
                            codec.l2_key(SPACE, _ck(tag, i)),
                            SPACE,
                            _ck(tag, i),
                            0,
                            pool[skew + i * stride : skew + i * stride + size].data,
                        )
                        for i in part
                    ]
                )
            )
        )
    await asyncio.gather(*sending)


def _ck(tag: int, i: int) -> bytes:
    return (tag * 1_000_000 + i).to_bytes(32, "big")


def _ratio(plain: Sequence[float], other: Sequence[float]) -> float:
    return statistics.median(plain) / statistics.median(other)


async def main(directory: str, objects: int, object_bytes: int, rounds: int) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    stride = slot_stride(object_bytes, SLAB_BYTES)
    mm = mmap.mmap(-1, objects * stride + direct_io.ALIGN_BYTES)  # page-aligned, as L1
    pool = np.frombuffer(mm, np.uint8)
    pool[:] = np.random.default_rng(0).integers(0, 256, len(pool), dtype=np.uint8)
    fb = FileBackend(directory, 1 << 40)
    await fb.connect()
    plain = _Plain(directory, fb.direct)
    executor = ThreadPoolExecutor(4)
    times: dict[str, list[float]] = {
        "batch": [],
        "slots": [],
        "inflight": [],
        "packed": [],
        "plain": [],
    }
    ready = [
        fb.encode(SPACE, _ck(0, i), 0, pool[i * stride : i * stride + object_bytes].data)
        for i in range(objects)
    ]
    for rnd in range(1, rounds + 1):
        t0 = time.perf_counter()
        await _batch_path(fb, pool[: objects * stride], object_bytes, 4 * rnd, executor)
        times["batch"].append(time.perf_counter() - t0)
        for name, tag, in_flight, skew in (
            ("slots", 4 * rnd + 1, 1, 0),
            ("inflight", 4 * rnd + 2, SLOT_BATCHES_IN_FLIGHT, 0),
            ("packed", 4 * rnd + 3, SLOT_BATCHES_IN_FLIGHT, 64),
        ):
            t0 = time.perf_counter()
            await _slots_path(
                fb, pool[: skew + objects * stride], object_bytes, tag, in_flight, skew
            )
            times[name].append(time.perf_counter() - t0)
        t, _ = plain.write(ready, f"r{rnd}")
        times["plain"].append(t)
    nbytes = objects * (object_bytes + codec.HEADER_BYTES)
    print(
        f"{objects} objects of {object_bytes} bytes, direct I/O {fb.direct}, "
        f"medians of {rounds} rounds:"
    )
    for name, ts in times.items():
        med = statistics.median(ts)
        print(
            f"  {name:8s} {med:.3f} s  {nbytes / med / 1e9:.2f} GB/s  plain/this "
            f"{_ratio(times['plain'], ts):.2f}  rounds {' '.join(f'{t:.3f}' for t in ts)}"
        )
    plain.close()
    executor.shutdown()
    await fb.shutdown()
    shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("directory")
    ap.add_argument("--objects", type=int, default=128)
    ap.add_argument("--object-bytes", type=int, default=2_694_912)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    asyncio.run(main(a.directory, a.objects, a.object_bytes, a.rounds))
