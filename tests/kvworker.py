"""A worker process for end-to-end tests: ``python tests/kvworker.py JSON``.

It creates a DSV4.1-Flash-shaped KV cache in shared memory filled from ``seed``,
registers it, stores ``chunks`` chunks (digests from ``token_seed``) into the blocks
``block_ids_for(reg, chunks, default_rng(block_seed))`` picks, prints a JSON line with
the per-object-group statuses, and exits (unlinking its segments). The test process
regenerates the same bytes from the seeds to check what it retrieves.

Modes for failure tests: ``hang`` waits on stdin after storing (to be killed between
operations); ``loop`` stores batches of ``chunks`` fresh chunks forever, printing
``storing <batch>`` before each (to be killed mid-store); ``lookup_then_hang`` looks the
chunks up with a lease, prints the lease, and waits (to be killed between lookup and
retrieve); ``retrieve_loop`` retrieves the stored chunks forever (killed mid-retrieve).
"""

from __future__ import annotations

import json
import sys

import numpy as np

from lmc_server.client import Client, chunk_digests
from lmc_server.testing import ShmKV, dsv41_flash
from lmc_server.testing.kv import block_ids_for


def tokens(token_seed: int, chunks: int, chunk_size: int = 256) -> np.ndarray:
    return np.random.default_rng(token_seed).integers(0, 100_000, chunks * chunk_size)


def main() -> None:
    args = json.loads(sys.argv[1])
    geo = dsv41_flash(
        arch=args.get("arch", "sm90"),
        num_blocks=args.get("num_blocks", 32),
        layers=args.get("layers", 44),
    )
    with Client(args["endpoint"], client_name="kvworker") as c, ShmKV(geo) as kv:
        kv.fill_random(args["seed"])
        reg = c.register(
            **kv.register_kwargs(
                world_size=args.get("world_size", 1),
                rank=args.get("rank", 0),
                replicated=args.get("replicated", False),
            )
        )
        n = args["chunks"]
        ids = block_ids_for(reg, n, np.random.default_rng(args["block_seed"]))
        if args.get("loop"):
            for batch in range(1_000_000):
                print(f"storing {batch}", flush=True)
                c.store(reg, chunk_digests(tokens(args["token_seed"] + batch, n), 256), ids)
        digests = chunk_digests(tokens(args["token_seed"], n), 256)
        res = c.store(reg, digests, ids)
        print(json.dumps({k: v.tolist() for k, v in res.statuses.items()}), flush=True)
        if args.get("lookup_then_hang"):
            print(json.dumps({"lease": c.lookup(reg, digests).lease_id}), flush=True)
        if args.get("retrieve_loop"):
            other = block_ids_for(reg, n, np.random.default_rng(args["block_seed"] + 1))
            for i in range(1_000_000):
                print(f"retrieving {i}", flush=True)
                c.retrieve(reg, digests, other)
        if args.get("hang") or args.get("lookup_then_hang"):
            sys.stdin.read()


if __name__ == "__main__":
    main()
