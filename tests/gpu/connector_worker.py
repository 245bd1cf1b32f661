"""A second connector worker process for tests/gpu/test_connector_gpu.py.

Rank ``rank`` of a replicated (MLA) deployment: it rebuilds the fixture's KV cache in
its own GPU memory with the same seeded bytes as rank 0, allocates the same block
tables, looks up the prompt rank 0 stored, loads the hit into its second request's
blocks and checks every byte of its allocation. Prints ``LOAD OK``; exits non-zero
otherwise. Argument: one JSON object (endpoint, fixture, seed, tokens = [first, count],
rank, world_size).
"""

from __future__ import annotations

import json
import sys

from lmc_server.integration.exporters import CudaExporter
from lmc_server.testing.connector_flow import ConnectorFlow
from lmc_server.testing.cuda_backing import CudaBacking
from lmc_server.testing.cuda_kv import device_arch
from lmc_server.testing.kvfixture import KVFixture, describe_byte


def main(args: dict) -> int:
    fx = KVFixture.load(args["fixture"])
    first, count = args["tokens"]
    tokens = list(range(first, first + count))
    with (
        CudaBacking(fx.backing_size_bytes) as mem,
        ConnectorFlow(
            fx,
            mem,
            args["endpoint"],
            device_arch(0),
            exporter=CudaExporter(),
            rank=args["rank"],
            world_size=args["world_size"],
        ) as flow,
    ):
        mem.fill_random(args["seed"])
        a, b = flow.tables(count), flow.tables(count)
        before = mem.snapshot()
        n, load, rep = flow.load_hit("B", tokens, b)
        if n != 512 or load is None:
            print(f"LOAD FAILED: hit of {n} tokens")
            return 1
        if rep.finished_recving != {"B"} or rep.failed_recving or rep.invalid_block_ids:
            print(f"LOAD FAILED: report {rep}")
            return 1
        bad = mem.first_difference(mem.snapshot(), mem.apply(before, flow.copies(load, a)))
        if bad is not None:
            print(f"LOAD FAILED: byte {bad} differs: {describe_byte(fx.groups, bad)}")
            return 1
    print("LOAD OK")
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
