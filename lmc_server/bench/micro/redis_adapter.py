"""The Redis adapter alone, without a server: what it moves against one store.

``--objects`` objects of ``--object-bytes`` (the preset's 2.7 MB objects by default),
from and into a page-aligned buffer standing for L1, through
:class:`~lmc_server.tiers.redis.backend.RedisBackend` against a redis-server or
valkey-server started here: per round, one ``put_slots`` of all of them under fresh
keys (split across ``--connections`` connections, as the writer's batches are), their
headers (``heads``), and one ``get_into`` of all of them, checked byte for byte at the
end. No server, no L1 index, no batching of the writer or the prefetch, no polling: the
adapter and the store. So it tells the store's limit from ours: on the H200 host the
adapter read 1.3-2.6 GB/s from Valkey 8.0 and 8.7-11.8 GB/s from Valkey 9.1 with the same
code, which is Valkey 9's reply copy avoidance (its I/O threads send a big value from
the stored object; Valkey 8's main thread first copies each one into a reply buffer).
The store is warmed first (``--warm-store-gb``, as ``lmcache bench l2`` does). Usage::

    python -m lmc_server.bench.micro.redis_adapter --redis-server valkey-server \\
        --io-threads 8 --connections 8,16 --rounds 6
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import statistics
import time

import numpy as np

from lmc_server.bench.l2.config import WARM_STORE_GB
from lmc_server.bench.l2.run import warm_store
from lmc_server.testing.kv import fill_random_bytes
from lmc_server.testing.redis_process import RedisProcess, server_version
from lmc_server.tiers import codec
from lmc_server.tiers.backend import SlotObject, SlotRead
from lmc_server.tiers.redis.backend import RedisBackend

SPACE = b"micro-redis-adpt"
DEFAULT_OBJECT_BYTES = 2694912  # one object of the DSV4.1-Flash preset's chunk


def _view(buf: np.ndarray, s: slice) -> memoryview:
    return buf[s].data


def _keys(round_: int, n: int) -> list[bytes]:
    return [codec.l2_key(SPACE, b"%016d%016d" % (round_, i)) for i in range(n)]


async def _one(url: str, connections: int, objects: int, object_bytes: int, rounds: int) -> dict:
    src_map, dst_map = (mmap.mmap(-1, objects * object_bytes) for _ in range(2))
    src = np.frombuffer(src_map, np.uint8)
    dst = np.frombuffer(dst_map, np.uint8)
    fill_random_bytes([src], connections)
    dst[:] = 0  # touched: no page faults inside a timing
    span = [slice(i * object_bytes, (i + 1) * object_bytes) for i in range(objects)]
    backend = RedisBackend(url, timeout_s=30, connections=connections)
    await backend.connect()
    put_s, heads_s, get_s = [], [], []
    try:
        for rnd in range(rounds):
            keys = _keys(1000 * connections + rnd, objects)
            puts = [
                SlotObject(k, SPACE, k[-32:], 1, _view(src, s))
                for k, s in zip(keys, span, strict=True)
            ]
            t0 = time.perf_counter()
            await backend.put_slots(puts)
            put_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            heads = await backend.heads(keys)
            heads_s.append(time.perf_counter() - t0)
            if any(h is None for h in heads):
                raise RuntimeError("a value just written has no header")
            reads = [
                SlotRead(k, SPACE, k[-32:], 1, _view(dst, s))
                for k, s in zip(keys, span, strict=True)
            ]
            t0 = time.perf_counter()
            got = await backend.get_into(reads)
            get_s.append(time.perf_counter() - t0)
            if not all(r is True for r in got):
                raise RuntimeError(f"a read was refused: {[r for r in got if r is not True][:3]}")
        if not np.array_equal(src, dst):
            raise RuntimeError("the bytes read back differ from the bytes written")
    finally:  # the mappings go with the last view of them
        await backend.shutdown()
    gb = objects * object_bytes / 1e9
    return {
        "connections": connections,
        "write_gbps": gb / statistics.median(put_s),
        "read_gbps": gb / statistics.median(get_s),
        "heads_ms": 1e3 * statistics.median(heads_s),
        "write_gbps_rounds": [round(gb / t, 2) for t in put_s],
        "read_gbps_rounds": [round(gb / t, 2) for t in get_s],
    }


async def main(args: argparse.Namespace) -> dict:
    with RedisProcess(io_threads=args.io_threads, exe=args.redis_server or None) as r:
        warm_s = warm_store(r.url, [codec.HEADER_BYTES + args.object_bytes], args.warm_store_gb)
        rows = [
            await _one(r.url, c, args.objects, args.object_bytes, args.rounds)
            for c in args.connections
        ]
        return {
            "store": server_version(r.exe),
            "io_threads": args.io_threads,
            "objects": args.objects,
            "object_bytes": args.object_bytes,
            "rounds": args.rounds,
            "warm_store_gb": args.warm_store_gb,
            "warm_store_s": warm_s,
            "rows": rows,
        }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--redis-server", default="", help="binary [default: redis-server]")
    ap.add_argument("--io-threads", type=int, default=1)
    ap.add_argument("--connections", default="8", help="comma-separated, one run each")
    ap.add_argument("--objects", type=int, default=128)
    ap.add_argument("--object-bytes", type=int, default=DEFAULT_OBJECT_BYTES)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warm-store-gb", type=float, default=WARM_STORE_GB)
    ap.add_argument("--json", default="", help="also write the report here")
    a = ap.parse_args()
    a.connections = [int(c) for c in a.connections.split(",")]
    report = asyncio.run(main(a))
    for row in report["rows"]:
        print(
            f"{report['store'].split(' sha=')[0]}, io-threads {a.io_threads}, "
            f"{row['connections']} connections: write {row['write_gbps']:.2f} GB/s, "
            f"read {row['read_gbps']:.2f} GB/s, heads {row['heads_ms']:.1f} ms  "
            f"(rounds: write {row['write_gbps_rounds']}, read {row['read_gbps_rounds']})"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
