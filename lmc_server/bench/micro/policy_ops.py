"""Time per eviction-policy operation, from 10k to 1M objects: is every policy O(1)?

For each policy and each size ``n``: a policy of ``n`` slots, bound to a slot-to-key
table as a partition binds it, is filled with ``n`` objects, then driven through
``--ops`` operations in the mix the index produces: a lookup hit (``touch``), a lease
(``pin`` then ``unpin``), and an eviction with a store into the freed slot (``peek``,
``forget``, ``admit`` of a new key). Slots are drawn uniformly (the worst case for
memory locality). The figure is wall time / operations; flat across sizes means O(1)
per operation (the fill is not timed).

    python -m lmc_server.bench.micro.policy_ops --sizes 10000,100000,1000000 --ops 1000000
"""

from __future__ import annotations

import argparse
import random
import time

from lmc_server.cache.eviction.registry import POLICIES, make_policy


def run_one(name: str, n: int, ops: int, seed: int = 0) -> float:
    """Seconds per operation of policy ``name`` at ``n`` objects over ``ops`` ops."""
    rng = random.Random(seed)
    keys: list[bytes | None] = [b"k%d" % i for i in range(n)]
    policy = make_policy(name, n)
    policy.bind_keys(keys)
    for s in range(n):
        policy.admit(s)
    draws = [rng.randrange(n) for _ in range(4096)]
    kinds = [rng.random() for _ in range(4096)]
    next_key = n
    done = 0
    i = 0
    t0 = time.perf_counter()
    while done < ops:
        s = draws[i & 4095]
        k = kinds[i & 4095]
        i += 1
        if k < 0.4:
            policy.touch(s)
            done += 1
        elif k < 0.7:
            policy.pin(s)
            policy.unpin(s)
            done += 2
        else:
            v = policy.peek()
            assert v is not None
            policy.forget(v)
            keys[v] = b"k%d" % next_key
            next_key += 1
            policy.admit(v)
            done += 3
    return (time.perf_counter() - t0) / done


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--ops", type=int, default=1_000_000)
    ap.add_argument("--policies", default=",".join(POLICIES))
    a = ap.parse_args(argv)
    sizes = [int(x) for x in a.sizes.split(",")]
    names = [p.strip().upper() for p in a.policies.split(",") if p.strip()]
    print(f"{'policy':8}" + "".join(f"{n:>12,}" for n in sizes) + "   (us per operation)")
    for name in names:
        row = [run_one(name, n, a.ops) * 1e6 for n in sizes]
        print(f"{name:8}" + "".join(f"{x:12.2f}" for x in row), flush=True)


if __name__ == "__main__":
    main()
