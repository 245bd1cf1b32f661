"""A vLLM-like worker process for the GPU tests (run as a script, one JSON argument).

Modes:

``roundtrip``
    Register GPU buffers with a real server, fill them, store ``chunks`` chunks (after
    a slow engine write, waited for with ``stream_done`` as a worker does), wipe the
    buffers, retrieve into *different* blocks (some marked -1), and check every stored
    page byte for byte and every untouched page unchanged. Prints ``ROUNDTRIP OK`` or fails.
``export``
    Allocate and fill buffers, print them (msgspec JSON) and wait until stdin closes,
    so the test process can map them into an in-process engine.
``bench``
    Register, then time (wall clock) the client's ``store`` and ``retrieve`` calls for
    1-, 16- and 64-chunk batches: what a vLLM worker waits for, socket and server
    included. Prints one line ``BENCH <json>`` with the raw pinned copy of the same bytes
    for reference; asserts nothing about speed.
``store-until-killed``
    Register, fill the buffers (seeded), print the block ids as ``IDS <json>``, then
    store the same blocks under fresh digests (``kill_digests(i)``), two requests in
    flight at a time, until killed; prints ``STORING`` after the first reply.
``verify-kill``
    Register the same geometry, recreate the seeded contents, and for each digest set
    ``kill_digests(i)`` that the server reports as a hit, retrieve it into other blocks
    and compare with the killed worker's pages. Prints ``VERIFIED <json>``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import time

import msgspec
import numpy as np
import torch

from lmc_server.cache.geometry import GroupSpec
from lmc_server.cache.status import ChunkStatus
from lmc_server.client import Client
from lmc_server.client.aio import AsyncClient
from lmc_server.client.cuda import stream_done
from lmc_server.testing.cuda_kv import CudaKV, device_arch
from lmc_server.testing.kv import block_ids_for
from lmc_server.testing.presets import KVGeometry, dsv41_flash, llama3_8b

#: ``model`` of a worker's args -> the Llama-like preset's attention backend
LLAMA_MODELS = {"llama-flash-attn": "flash_attn", "llama-flashinfer": "flashinfer"}


def geometry(args: dict) -> KVGeometry:
    model = args.get("model", "dsv41")
    if model in LLAMA_MODELS:
        return llama3_8b(
            arch=args.get("arch") or device_arch(0),
            num_blocks=args.get("num_blocks", 64),
            layers=args.get("layers", 4),
            backend=LLAMA_MODELS[model],
            placement=args.get("placement", "layer"),
        )
    return dsv41_flash(
        arch=args.get("arch") or device_arch(0),
        num_blocks=args.get("num_blocks", 64),
        layers=args.get("layers", 8),
        stride_pad=args.get("stride_pad", 0),
        placement=args.get("placement", "layer"),
    )


def stored_blocks(g: GroupSpec, bpc: int) -> list[int]:
    """Which of a chunk's ``bpc`` blocks its object holds: all of them, or for a
    sliding window only the last ones the window reaches."""
    keep = (
        bpc if g.kind != "sliding_window" else min(bpc, -(-g.window_tokens // g.tokens_per_block))
    )
    return list(range(bpc - keep, bpc))


def slow_rewrite(kv: CudaKV, seed: int) -> None:
    """Sleep ~0.3 s on the current stream, then overwrite every buffer (not synced)."""
    torch.cuda._sleep(int(0.3 * 2e9))
    gen = torch.Generator(device=kv.device)
    gen.manual_seed(seed)
    for t in kv.tensors:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, device=kv.device, generator=gen))


def roundtrip(args: dict) -> None:
    geo = geometry(args)
    n = args.get("chunks", 4)
    rng = np.random.default_rng(args.get("seed", 0))
    with (
        CudaKV(geo, 0) as kv,
        Client(args["endpoint"], timeout_s=60, client_name="gpu-worker") as c,
    ):
        reg = c.register(**kv.register_kwargs(replicated=True))
        ids_a = block_ids_for(reg, n, rng)
        digests = rng.bytes(32 * n)
        stored: dict[str, list[int]] = {}
        for g in geo.groups:
            if not g.cached:
                continue
            bpc = reg.blocks_per_chunk(g)
            stored[g.name] = stored_blocks(g, bpc)

        def expected() -> dict[str, list[bytes]]:
            out = {}
            for name, cols in stored.items():
                a = np.asarray(ids_a[name]).reshape(n, -1)[:, cols]
                out[name] = [kv.pages(name, a[ci].tolist()) for ci in range(n)]
            return out

        kv.fill_random(1)
        before = expected()
        slow_rewrite(kv, 2)  # queued, not finished: the store must come after it
        stream_done()()  # what the connector runs off the engine thread
        res = c.store(reg, digests, ids_a)
        assert res.ok.all(), res.statuses
        torch.cuda.synchronize()
        expect = expected()
        kv.fill(0xEE)
        ids_b = {}
        for name, a in ids_a.items():
            others = np.setdiff1d(
                np.arange(geo.groups[[g.name for g in geo.groups].index(name)].num_blocks), a
            )
            b = rng.permutation(others)[: a.size].astype(np.int32)
            assert b.size == a.size, "need more blocks for a disjoint retrieve"
            ids_b[name] = b
        holes = {name: b.copy() for name, b in ids_b.items()}
        # the -1 hole goes in the compressed group (DSV4.1) or the first one (Llama)
        hole_group = "compressed" if "compressed" in holes else next(iter(holes))
        holes[hole_group].reshape(n, -1)[0, 1] = -1
        res = c.retrieve(reg, digests, holes)
        assert res.ok.all(), res.statuses
        og_of = {gname: og.name for og in reg.object_groups for gname in og.groups}
        for name, cols in stored.items():
            b = np.asarray(holes[name]).reshape(n, -1)[:, cols]
            status = res.statuses[og_of[name]]
            # Window objects are loaded only for the chunks the window covers (the last).
            assert status[-1] == ChunkStatus.OK, (name, status)
            for ci in range(n):
                row = b[ci].tolist()
                got = kv.pages(name, [x for x in row if x >= 0])
                if status[ci] != ChunkStatus.OK:
                    assert status[ci] == ChunkStatus.SKIPPED, (name, status)
                    assert set(got) == {0xEE}, f"{name} chunk {ci}: skipped but written"
                    continue
                want = b"".join(
                    expect[name][ci][(li * len(row) + j) * pl : (li * len(row) + j + 1) * pl]
                    for li, pl in enumerate(
                        lay.page_bytes
                        for lay in geo.groups[[g.name for g in geo.groups].index(name)].layers
                    )
                    for j, x in enumerate(row)
                    if x >= 0
                )
                if got != want:
                    old = b"".join(
                        before[name][ci][(li * len(row) + j) * pl : (li * len(row) + j + 1) * pl]
                        for li, pl in enumerate(
                            lay.page_bytes
                            for lay in geo.groups[[g.name for g in geo.groups].index(name)].layers
                        )
                        for j, x in enumerate(row)
                        if x >= 0
                    )
                    g_arr = np.frombuffer(got, np.uint8)
                    raise AssertionError(
                        f"group {name} chunk {ci}: retrieved bytes differ: "
                        f"{len(got)}/{len(want)} bytes, equal to the pages before the "
                        f"engine's last write: {got == old}, share equal to expected "
                        f"{(g_arr == np.frombuffer(want, np.uint8)).mean():.3f}, share "
                        f"0xEE {(g_arr == 0xEE).mean():.3f}"
                    )
        # Blocks never named in the retrieve, and the -1 hole, still hold 0xEE.
        comp = geo.groups[[g.name for g in geo.groups].index(hole_group)]
        hole = int(ids_b[hole_group].reshape(n, -1)[0, 1])
        for li in range(len(comp.layers)):
            assert (kv.page(hole_group, li, hole) == 0xEE).all(), "a -1 block was written"
        untouched = np.setdiff1d(np.arange(comp.num_blocks), np.concatenate([ids_b[hole_group]]))
        assert (kv.page(hole_group, 0, int(untouched[0])) == 0xEE).all()
        c.unregister(reg)
    print("ROUNDTRIP OK", flush=True)


def bench(args: dict) -> None:
    from lmc_server.testing.cuda_kv import raw_copy_gbps

    geo = geometry(args)
    iters = args.get("iters", 10)
    rng = np.random.default_rng(args.get("seed", 0))
    out: dict[str, dict[str, float]] = {}
    with CudaKV(geo, 0) as kv, Client(args["endpoint"], timeout_s=60, client_name="gpu-bench") as c:
        reg = c.register(**kv.register_kwargs(replicated=True))
        kv.fill_random(1)
        for n in args.get("chunks", [1, 16, 64]):
            ids = block_ids_for(reg, n, rng)
            nbytes = n * reg.chunk_bytes
            store_s = []
            for it in range(iters + 2):
                digests = rng.bytes(32 * n)  # new chunks: every store copies
                t0 = time.perf_counter()
                res = c.store(reg, digests, ids)
                if it >= 2:
                    store_s.append(time.perf_counter() - t0)
                assert res.ok.all(), res.statuses
            retrieve_s = []
            moved = 0
            for it in range(iters + 2):
                t0 = time.perf_counter()
                res = c.retrieve(reg, digests, ids)
                if it >= 2:
                    retrieve_s.append(time.perf_counter() - t0)
                assert res.ok.all(), res.statuses
                # Window objects load only for the chunks the window covers.
                moved = sum(
                    int((np.asarray(res.statuses[og.name]) == ChunkStatus.OK).sum())
                    * og.object_bytes
                    for og in reg.object_groups
                )
            store, retrieve = float(np.mean(store_s)), float(np.mean(retrieve_s))
            raw_d2h = raw_copy_gbps(nbytes, "d2h")
            raw_h2d = raw_copy_gbps(moved, "h2d")
            out[str(n)] = {
                "chunks": n,
                "store_bytes": nbytes,
                "retrieve_bytes": moved,
                "store_ms": 1e3 * store,
                "retrieve_ms": 1e3 * retrieve,
                "store_gbps": nbytes / store / 1e9,
                "retrieve_gbps": moved / retrieve / 1e9,
                "raw_d2h_gbps": raw_d2h,
                "raw_h2d_gbps": raw_h2d,
                "store_ratio": nbytes / store / 1e9 / raw_d2h,
                "retrieve_ratio": moved / retrieve / 1e9 / raw_h2d,
            }
        c.unregister(reg)
    print("BENCH " + json.dumps(out), flush=True)


def export(args: dict) -> None:
    with CudaKV(geometry(args), 0) as kv:
        kv.fill_random(args.get("seed", 1))
        print(msgspec.json.encode(kv.buffers).decode(), flush=True)
        sys.stdin.read()


def kill_digests(i: int, n: int) -> bytes:
    """The digests of the ``i``-th store of ``store-until-killed`` (reproducible)."""
    return b"".join(hashlib.sha256(f"kill-{i}-{c}".encode()).digest() for c in range(n))


def store_until_killed(args: dict) -> None:
    geo = geometry(args)
    n = args["chunks"]

    async def main() -> None:
        kv = CudaKV(geo, 0)
        client = await AsyncClient.connect(
            args["endpoint"], timeout_s=600, client_name="doomed-worker"
        )
        reg = await client.register(**kv.register_kwargs(replicated=True))
        kv.fill_random(args["seed"])  # synchronized: the pages are final from here on
        ids = block_ids_for(reg, n, np.random.default_rng(5))
        print("IDS " + json.dumps({k: np.asarray(v).tolist() for k, v in ids.items()}), flush=True)
        i = 0
        while True:
            await asyncio.gather(
                *(client.store(reg, kill_digests(i + j, n), ids) for j in range(2))
            )
            if i == 0:
                print("STORING", flush=True)
            i += 2

    asyncio.run(main())


def verify_kill(args: dict) -> None:
    """Every digest set the server reports must hold exactly the killed worker's bytes."""
    geo = geometry(args)
    n = args["chunks"]
    ids_a = {k: np.asarray(v, dtype=np.int32) for k, v in args["ids"].items()}
    visible: list[int] = []
    misses, i = 0, 0
    with CudaKV(geo, 0) as kv, Client(args["endpoint"], timeout_s=60, client_name="verifier") as c:
        reg = c.register(**kv.register_kwargs(replicated=True))
        kv.fill_random(args["seed"])
        og_of = {gname: og.name for og in reg.object_groups for gname in og.groups}
        ids_b, cols = {}, {}
        for g in geo.groups:
            if g.name not in ids_a:
                continue
            others = np.setdiff1d(np.arange(g.num_blocks), ids_a[g.name])
            ids_b[g.name] = others[: ids_a[g.name].size].astype(np.int32)
            assert ids_b[g.name].size == ids_a[g.name].size, "need more blocks"
            cols[g.name] = stored_blocks(g, ids_a[g.name].size // n)
        want = {
            name: [
                kv.pages(name, ids_a[name].reshape(n, -1)[ci, cols[name]].tolist())
                for ci in range(n)
            ]
            for name in ids_a
        }
        # Stores went out in order, two at a time; the oldest were evicted by the newest
        # (the pool holds a few batches), so scan until well past the last hit.
        while i < 20000 and not (visible and misses >= 64):
            digests = kill_digests(i, n)
            hit = c.lookup(reg, digests, lease=True)
            if hit.hit_chunks == 0:
                misses += 1
                i += 1
                continue
            misses = 0
            kv.fill(0xEE)
            res = c.retrieve(
                reg,
                digests[: 32 * hit.hit_chunks],
                {k: v.reshape(n, -1)[: hit.hit_chunks].reshape(-1) for k, v in ids_b.items()},
            )
            c.release(hit.lease_id)
            for name, b in ids_b.items():
                status = res.statuses[og_of[name]]
                rows = b.reshape(n, -1)
                for ci in range(hit.hit_chunks):
                    if status[ci] != ChunkStatus.OK:
                        continue  # window objects load only where the window needs them
                    got = kv.pages(name, rows[ci, cols[name]].tolist())
                    assert got == want[name][ci], f"store {i} group {name} chunk {ci} differs"
            visible.append(i)
            i += 1
        c.unregister(reg)
    print("VERIFIED " + json.dumps({"visible": visible, "tried": i}), flush=True)


if __name__ == "__main__":
    a = json.loads(sys.argv[1])
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    modes = {
        "roundtrip": roundtrip,
        "export": export,
        "bench": bench,
        "store-until-killed": store_until_killed,
        "verify-kill": verify_kill,
    }
    modes[a["mode"]](a)
