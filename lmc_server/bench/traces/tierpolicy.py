"""When an object should go to the disk tier: the three policies, replayed on a trace.

An exact model of the two LRU tiers on a request trace (chunks as ints, the order of
``lmcache bench replay``), one per write policy:

- ``commit``: every chunk a request stores is written to disk at once (the server's
  behaviour; the only policy under which a crash or restart loses nothing L1 held);
- ``evict``: a chunk is written when L1 evicts it, if the disk does not have it;
- ``hit``: a chunk is written the first time a later request hits it in L1, if the disk
  does not have it (only what proved reusable is written).

Per request: the L1 hit is the longest prefix in L1; the disk continues it with the
longest run it has (promoted into L1, as the tier's prefetch does, and refreshed in the
disk's LRU); the rest is stored into L1. Both tiers are LRU in chunks (L1 evicts the
least recently used chunk, the disk its least recently written or read file).
Writes are instantaneous here (the real write-behind can fall behind; the real-server
row of ``lmcache bench l2 --replay --disk`` shows by how much). Reported per policy:
token hit ratio per tier, chunks written to disk, bytes written per byte served from
disk (SSD wear per hit), and the share of L1's last content that is also on disk
(what a restart would keep).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

POLICIES = ("commit", "evict", "hit")


@dataclass(frozen=True, slots=True)
class PolicyResult:
    policy: str
    l1_hit_chunks: int
    disk_hit_chunks: int
    disk_writes: int
    disk_evictions: int
    l1_kept_on_disk: float


class _LRU:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.items: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, c: int) -> bool:
        return c in self.items

    def touch(self, c: int) -> None:
        self.items.move_to_end(c)

    def add(self, c: int) -> list[int]:
        """Insert (or refresh) ``c``; the chunks evicted to make room."""
        if c in self.items:
            self.items.move_to_end(c)
            return []
        self.items[c] = None
        out = []
        while len(self.items) > self.capacity:
            out.append(self.items.popitem(last=False)[0])
        return out


def simulate(
    requests: list[list[int]], l1_chunks: int, disk_chunks: int, policy: str
) -> PolicyResult:
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r}: one of {', '.join(POLICIES)}")
    l1, disk = _LRU(l1_chunks), _LRU(disk_chunks)
    hit_before: set[int] = set()  # chunks hit in L1 once already ("hit" policy)
    l1_hits = disk_hits = writes = disk_evictions = 0

    def write(c: int) -> None:
        nonlocal writes, disk_evictions
        if c in disk:
            return
        writes += 1
        disk_evictions += len(disk.add(c))

    def into_l1(c: int) -> None:
        for gone in l1.add(c):
            if policy == "evict":
                write(gone)

    for chunks in requests:
        h = 0
        while h < len(chunks) and chunks[h] in l1:
            l1.touch(chunks[h])
            if policy == "hit" and chunks[h] not in hit_before:
                hit_before.add(chunks[h])
                write(chunks[h])
            h += 1
        l1_hits += h
        d = h
        while d < len(chunks) and chunks[d] in disk:
            disk.touch(chunks[d])
            into_l1(chunks[d])
            d += 1
        disk_hits += d - h
        for c in chunks[d:]:
            into_l1(c)
            if policy == "commit":
                write(c)
    kept = sum(1 for c in l1.items if c in disk) / max(1, len(l1.items))
    return PolicyResult(policy, l1_hits, disk_hits, writes, disk_evictions, kept)


def main() -> None:
    """``python -m lmc_server.bench.traces.tierpolicy TRACE...``: the model alone, per trace and
    capacity pair (fractions of the trace's distinct chunks), in seconds."""
    import argparse

    from lmc_server.bench.traces.trace import load_trace

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("traces", nargs="+")
    p.add_argument("--limit", type=int, default=1000)
    p.add_argument(
        "--sizes",
        default="0.05:0.25,0.05:1.0,0.2:0.5",
        help="L1:disk fractions of the distinct chunks, comma-separated",
    )
    args = p.parse_args()
    from lmc_server.bench.traces.trace import chunk_ids

    print(
        "trace | L1 | disk | policy | token hit | of which disk | disk writes per "
        "disk hit | L1 also on disk"
    )
    for path in args.traces:
        chunks, distinct = chunk_ids(load_trace(path, args.limit))
        total = sum(len(c) for c in chunks)
        for pair in args.sizes.split(","):
            l1f, df = (float(x) for x in pair.split(":"))
            for policy in POLICIES:
                r = simulate(chunks, int(l1f * distinct), int(df * distinct), policy)
                print(
                    f"{path.rsplit('/', 1)[-1]} | {l1f:g} | {df:g} | {policy} | "
                    f"{(r.l1_hit_chunks + r.disk_hit_chunks) / total:.3f} | "
                    f"{r.disk_hit_chunks / total:.3f} | "
                    f"{r.disk_writes / max(1, r.disk_hit_chunks):.2f} | "
                    f"{r.l1_kept_on_disk:.2f}"
                )


if __name__ == "__main__":
    main()
