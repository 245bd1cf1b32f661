"""Soak worker: random stores, lookups and retrieves with byte checks until told to stop.

``python tests/soakworker.py ENDPOINT SEED SECONDS``: prints one JSON line when it ends
on its own (``{"ops": n, "mismatches": m, "errors": e}``); soak tests kill some workers
with SIGKILL at random instead. Its shared memory is unlinked right after registering,
so a killed worker leaves nothing in /dev/shm.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from lmc_server.client import Client, ServerError, chunk_digests
from lmc_server.testing import ShmKV, dsv41_flash
from lmc_server.testing.kv import block_ids_for

CHUNK_POOL = 64  # distinct prefixes shared by all workers (same tokens, same bytes)


def main() -> None:
    endpoint, seed, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    rng = np.random.default_rng(seed)
    geo = dsv41_flash(num_blocks=64, layers=8)
    ops = mismatches = errors = 0
    with (
        Client(endpoint, timeout_s=20) as c,
        ShmKV(geo) as src,
        ShmKV(geo) as dst,
    ):
        src.fill_random(1234)  # every worker holds the same bytes for the same prefix
        reg = c.register(**src.register_kwargs(replicated=True, world_size=2))
        dreg = c.register(**dst.register_kwargs(replicated=True, world_size=2, rank=1))
        print("ready", flush=True)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            p = int(rng.integers(CHUNK_POOL))
            n = int(rng.integers(1, 5))
            digests = chunk_digests(np.full(n * 256, p), 256)
            ids = block_ids_for(reg, n)  # fixed blocks: same bytes for the same prefix
            try:
                op = rng.random()
                if op < 0.4:
                    c.store(reg, digests, ids)
                else:
                    look = c.lookup(dreg, digests)
                    k = look.hit_chunks
                    if k:
                        dst.fill(0)
                        target = block_ids_for(dreg, k, first_block=32)
                        res = c.retrieve(dreg, digests[: 32 * k], target)
                        for g in reg.groups:
                            if not g.cached or not res.ok.all():
                                continue
                            bpc = reg.blocks_per_chunk(g)
                            a = ids[g.name].reshape(n, bpc)[:k]
                            b = target[g.name].reshape(k, bpc)
                            if g.kind == "sliding_window":
                                a, b = a[-1:, bpc // 2 :], b[-1:, bpc // 2 :]
                            if src.pages(g.name, a.ravel().tolist()) != dst.pages(
                                g.name, b.ravel().tolist()
                            ):
                                mismatches += 1
                        c.release(look.lease_id)
                ops += 1
            except (ServerError, TimeoutError):
                errors += 1
    print(json.dumps({"ops": ops, "mismatches": mismatches, "errors": errors}), flush=True)


if __name__ == "__main__":
    main()
