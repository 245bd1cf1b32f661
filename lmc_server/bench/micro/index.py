"""Micro-benchmark of the L1 index hot path (no server, no bytes copied).

Times, on the DeepSeek-V4.1-Flash preset (``dsv41_flash``, separate and combined object
groups), the index calls one request makes: ``lookup`` of a prefix of ``--chunks``
chunks (64 by default; with and without a lease), ``reserve_store`` + ``commit_store`` of
as many new chunks in a full pool (every reservation evicts), ``reserve_store`` of
chunks already stored (EXISTS), and ``pin_retrieve`` + ``unpin_retrieve``. Uses only
the facade's public methods, so it runs against any revision of the cache core. To
compare two revisions in one process (rounds interleaved, so load on a shared machine
hits both alike), give the other one a package name of its own:

    git archive <rev> lmc_server | tar -x -C /tmp/old
    mv /tmp/old/lmc_server /tmp/old/lmc_old
    grep -rl lmc_server /tmp/old/lmc_old | xargs sed -i 's/\\blmc_server\\b/lmc_old/g'
    PYTHONPATH=/tmp/old python -m lmc_server.bench.micro.index --packages lmc_old,lmc_server

Prints one line per case and package: microseconds per call, the best of ``--repeat``
rounds of ``--calls`` calls (a tenth of them for stores and retrieves).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import time
from collections.abc import Callable
from typing import Any

import numpy as np

MIB = 1 << 20
CHUNKS = 64
CASES = (
    "lookup",
    "lookup+lease+release",
    "reserve+commit new (evicting)",
    "reserve+commit existing",
    "pin+unpin retrieve",
)


def digests(n: int, tag: bytes) -> bytes:
    out, prev = [], bytes(32)
    for i in range(n):
        prev = hashlib.blake2b(prev + tag + i.to_bytes(4, "little"), digest_size=32).digest()
        out.append(prev)
    return b"".join(out)


def setup(
    package: str, separate: bool, chunks: int = CHUNKS
) -> tuple[Any, dict[str, Callable[[int], None]]]:
    """An index of ``package`` holding one hot prefix of ``chunks`` chunks, and one
    callable per case."""
    index_mod = importlib.import_module(f"{package}.cache.index")
    layout_mod = importlib.import_module(f"{package}.cache.layout")
    presets = importlib.import_module(f"{package}.testing.presets")
    geo = presets.dsv41_flash()
    layout = layout_mod.build_layout(geo.groups, 256, separate)
    # Room for 8 prefixes of 64 chunks: the store case evicts on every call.
    pool_bytes = 8 * max(chunks, CHUNKS) * layout.chunk_bytes + 64 * MIB
    if hasattr(index_mod.L1Index, "slab_ready"):  # the index builds its own slab pool
        index = index_mod.L1Index(pool_bytes, 64 * MIB, "LRU")
        for s in range(index.pool_usage().slabs):
            index.slab_ready(s)
    else:  # an older tree: the caller builds it (in cache.slabs, or cache.pool before)
        try:
            pool_mod = importlib.import_module(f"{package}.cache.slabs")
            pool_mod.SlabPool  # noqa: B018 - its module, or the one before
        except (ModuleNotFoundError, AttributeError):
            pool_mod = importlib.import_module(f"{package}.cache.pool")
        pool = pool_mod.SlabPool(pool_bytes, 64 * MIB)
        for s in range(pool.n_slabs):
            pool.mark_ready(s)
        index = index_mod.L1Index(pool, "LRU")
    view = index.view("bench", layout)
    ids = {}
    for og in layout.object_groups:
        for sec in og.sections:
            bpc = sec.blocks_per_chunk
            ids[sec.group_index] = np.arange(chunks * bpc, dtype=np.int64).reshape(chunks, bpc) % 64
    hot = index.keys(view, digests(chunks, b"hot"))
    index.commit_store(index.reserve_store(view, hot, ids))
    # 8 prefixes' worth of fresh chunks, then around again: every store evicts
    fresh = [index.keys(view, digests(chunks, b"f%d" % i)) for i in range(8 * CHUNKS // chunks + 8)]

    def lookup(_: int) -> None:
        k, _lease = index.lookup(view, hot, 1, 10.0, 0.0, take_lease=False)
        assert k == chunks

    def lookup_lease(_: int) -> None:
        k, lease = index.lookup(view, hot, 1, 10.0, 0.0)
        assert k == chunks and lease is not None
        index.release(lease.lease_id)

    def store_new(i: int) -> None:
        index.commit_store(index.reserve_store(view, fresh[i % len(fresh)], ids))

    def store_exists(_: int) -> None:
        index.commit_store(index.reserve_store(view, hot, ids))

    def retrieve(_: int) -> None:
        t = index.pin_retrieve(view, hot, ids)
        index.unpin_retrieve(t, ok=True)

    return index, dict(
        zip(CASES, (lookup, lookup_lease, store_new, store_exists, retrieve), strict=True)
    )


def time_us(fn: Callable[[int], None], n: int) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        fn(i)
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=10_000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--chunks", type=int, default=CHUNKS, help="chunks per request")
    p.add_argument(
        "--packages",
        default="lmc_server",
        help="comma-separated packages to compare, rounds interleaved",
    )
    a = p.parse_args()
    packages = a.packages.split(",")
    for separate in (True, False):
        setups = {pkg: setup(pkg, separate, a.chunks) for pkg in packages}
        for case in CASES:
            calls = a.calls if case.startswith("lookup") else max(1, a.calls // 10)
            best = dict.fromkeys(packages, float("inf"))
            for _ in range(a.repeat):
                for pkg in packages:
                    best[pkg] = min(best[pkg], time_us(setups[pkg][1][case], calls))
            for pkg in packages:
                ratio = f"  x{best[pkg] / best[packages[0]]:.3f}" if len(packages) > 1 else ""
                print(
                    f"{'separate' if separate else 'combined':9s} {case:30s} {pkg:12s} "
                    f"{best[pkg]:8.1f} us{ratio}",
                    flush=True,
                )
        for index, _ in setups.values():
            index.check()


if __name__ == "__main__":
    main()
