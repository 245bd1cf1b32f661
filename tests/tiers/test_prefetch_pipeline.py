"""The prefetch pipeline over many batches, against backends that try to break it.

One prefetch of a long prefix, in batches of one to three chunks (``READ_BATCH_BYTES``
shrunk), through both sinks: the copy path (values read, then verified and copied on
threads) and the slot path (headers read, then values received into the slots, up to
four batches at once, each finishing after a random delay, so later batches often end
first). A real L1 index and pool; a watcher runs at every turn of the event loop and at
every step of the fake stores, and checks what a lookup could see:

- no hole: the committed chunks of the full object group are a prefix ``0..m-1`` of
  the looked-up keys, no object group (the sliding window's) has an object past it,
  and the hit a lookup finds never shrinks;
- nothing wrong: every committed object holds exactly the bytes written to L2;

and at the end no slot is left WRITING or pinned. The damaged, vanished and failing
cases check that the prefix stops exactly where L2 stops having it, however far the
later batches had got.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from lmc_server.cache.index import L1Index
from lmc_server.cache.view import CacheView, hit_chunks
from lmc_server.testing.l1 import MIB, dsv_view, make_index
from lmc_server.tiers import codec, prefetch
from lmc_server.tiers.backend import Head, L2Backend, L2Error, ReadResult, SlotRead, Value
from lmc_server.tiers.context import TierContext
from lmc_server.tiers.poolview import PoolView
from lmc_server.tiers.prefetch import Prefetcher
from lmc_server.tiers.stats import L2Stats

NS = "model=x;kv_dtype=fp8;arch=sm90;world=1;rank=replicated"
CHUNKS = 24


def space(namespace: str, fingerprint: bytes) -> bytes:
    return codec.space_of(namespace, fingerprint, 256)


class Pool:
    """The bytes behind a :func:`make_index` pool (what :class:`PoolView` reads)."""

    def __init__(self, pool_mib: int, slab_mib: int) -> None:
        self.array = np.zeros(pool_mib * MIB, dtype=np.uint8)
        self.slab_bytes = slab_mib * MIB


class Watch:
    """Checks what a lookup could see of ``keys`` (see the module docstring)."""

    def __init__(self, view: CacheView, keys: list[bytes], pool: Pool) -> None:
        self.view, self.keys, self.pool = view, keys, pool
        self.expected: dict[tuple[int, int], bytes] = {}
        self.verified: set[tuple[int, int, int]] = set()
        self.samples = 0
        self.hit = 0

    def committed(self, og_index: int) -> list[int]:
        """The chunks whose object of ``og_index`` is committed: evictable (in the
        policy's order) or pinned (only a committed slot can be); a WRITING one is
        neither."""
        part = self.view._partitions[og_index]
        out = []
        for i, k in enumerate(self.keys):
            slot = part.keys.get(k)
            if slot is not None and (slot in part.policy or part.pins[slot] > 0):
                out.append(i)
        return out

    def __call__(self) -> None:
        self.samples += 1
        ogs = self.view.layout.object_groups
        seen = [self.committed(og.index) for og in ogs]
        full = len(self.keys)
        for og, chunks in zip(ogs, seen, strict=True):
            if og.has_full:
                assert chunks == list(range(len(chunks))), f"a hole in group {og.index}: {chunks}"
                full = min(full, len(chunks))
        for og, chunks in zip(ogs, seen, strict=True):
            assert not chunks or chunks[-1] < full, f"group {og.index} past the prefix: {chunks}"
            part = self.view._partitions[og.index]
            for i in chunks:
                slot = part.keys[self.keys[i]]
                if (og.index, i, slot) in self.verified:
                    continue
                offset = int(part.offsets(np.array([slot]))[0])
                got = self.pool.array[offset : offset + og.object_bytes]
                assert got.tobytes() == self.expected[(og.index, i)], (og.index, i)
                self.verified.add((og.index, i, slot))
        hit = hit_chunks(self.view, self.keys)[0]
        assert hit >= self.hit, f"the hit shrank from {self.hit} to {hit}"
        self.hit = hit


class Store(L2Backend):
    """An in-memory store whose every call takes a random while and checks ``watch``
    at each of its steps; ``slots`` makes it read into slots (the slot sink)."""

    name = "fake"

    def __init__(self, seed: int, watch: Watch, slots: bool) -> None:
        self.reads_into_slots = slots
        self.values: dict[bytes, bytes] = {}
        self.rng = random.Random(seed)
        self.watch = watch
        self.discarded: list[bytes] = []
        #: L2 keys deleted between the header read and the value read.
        self.vanish: set[bytes] = set()
        #: The ``get_into`` / ``get_many`` call (1-based) that raises after its reads.
        self.fail_call = 0
        self.calls = 0
        #: Multiplies every call's random while.
        self.scale = 1.0

    async def _pause(self, most_s: float = 0.003) -> None:
        self.watch()
        await asyncio.sleep(self.rng.uniform(0, most_s * self.scale))
        self.watch()

    async def connect(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def put_many(self, items: Sequence[tuple[bytes, Value]]) -> None:
        raise AssertionError("a prefetch never writes")

    async def discard(self, keys: Sequence[bytes]) -> None:
        self.discarded += keys

    async def get_many(self, keys: Sequence[bytes]) -> list[Value | None]:
        self.calls += 1
        await self._pause()
        if self.calls == self.fail_call:
            raise L2Error("the store went away")
        return [self.values.get(k) for k in keys]

    async def heads(self, keys: Sequence[bytes]) -> list[Head | None]:
        await self._pause(0.001)
        out: list[Head | None] = []
        for k in keys:
            v = self.values.get(k)
            out.append(None if v is None else (v[: codec.HEADER_BYTES], len(v)))
        for k in self.vanish & set(keys):
            del self.values[k]
        return out

    async def get_into(self, reads: Sequence[SlotRead]) -> list[ReadResult]:
        self.calls += 1
        call = self.calls
        await self._pause(0.006)  # a later call often ends first
        out: list[ReadResult] = []
        for r in reads:
            v = self.values.get(r.key)
            if v is None:
                out.append(None)
                continue
            mask, reason = codec.check_head(v, len(v), r.space, r.chunk_key, len(r.dest))
            if reason is not None or mask != r.mask:
                out.append(reason)
                continue
            payload = codec.payload(v)
            half = len(payload) // 2
            r.dest[:half] = payload[:half]  # half written across a turn of the loop
            await self._pause(0.001)
            r.dest[half:] = payload[half:]
            out.append(True if codec.check_payload(v) else codec.Invalid.CHECKSUM)
        if call == self.fail_call:
            raise L2Error("the store went away mid-batch")
        return out


class Setup:
    def __init__(self, seed: int, slots: bool, pool_mib: int = 32, slab_mib: int = 4) -> None:
        self.index: L1Index = make_index(pool_mib=pool_mib, slab_mib=slab_mib)
        self.pool = Pool(pool_mib, slab_mib)
        self.view = dsv_view(self.index, layers=2)
        rng = np.random.default_rng(seed)
        prefix = (1).to_bytes(4, "little")
        self.keys = [prefix + rng.bytes(32) for _ in range(CHUNKS)]
        self.watch = Watch(self.view, self.keys, self.pool)
        self.store = Store(seed, self.watch, slots)
        self.l2key: dict[tuple[int, int], bytes] = {}
        for og in self.view.layout.object_groups:
            sp = space(NS, og.fingerprint)
            mask = (1 << len(og.sections)) - 1
            for i, key in enumerate(self.keys):
                payload = rng.bytes(og.object_bytes)
                ck = key[-codec.CHUNK_KEY_BYTES :]
                k = codec.l2_key(sp, ck)
                self.l2key[(og.index, i)] = k
                self.store.values[k] = codec.encode_value(sp, ck, mask, memoryview(payload))
                self.watch.expected[(og.index, i)] = payload
        self.stats = L2Stats()
        self.errors: list[L2Error] = []
        self.executor = ThreadPoolExecutor(4)
        ctx = TierContext(
            self.index,
            self.store,
            self.stats,
            PoolView(self.pool, "cpu"),  # type: ignore[arg-type]
            self.executor,
            space,
            lambda: True,
            self.errors.append,
        )
        self.prefetcher = Prefetcher(ctx, CHUNKS)

    def damage(self, og_index: int, chunk: int) -> None:
        """Flip a payload bit: the header passes, the checksum fails."""
        k = self.l2key[(og_index, chunk)]
        v = bytearray(self.store.values[k])
        v[-1] ^= 1
        self.store.values[k] = bytes(v)

    def run(self, stop_after_s: float | None = None) -> None:
        async def main() -> None:
            done = asyncio.Event()

            async def sample() -> None:
                while not done.is_set():
                    self.watch()
                    await asyncio.sleep(0)

            sampler = asyncio.get_running_loop().create_task(sample())
            assert self.prefetcher.start(self.view, NS, self.keys, 0) == CHUNKS
            if stop_after_s is not None:
                await asyncio.sleep(stop_after_s)
            await self.prefetcher.stop(10.0 if stop_after_s is None else 0.0)
            done.set()
            await sampler

        try:
            asyncio.run(main())
        finally:
            self.executor.shutdown()
        self.watch()
        for part in self.view._partitions:
            assert part.n_writing == 0, "a slot was left WRITING"
            assert not any(part.pins), "a slot was left pinned"

    def prefix(self) -> int:
        return hit_chunks(self.view, self.keys)[0]


def batches(monkeypatch: pytest.MonkeyPatch, s: Setup, chunks: int) -> None:
    chunk_bytes = sum(og.object_bytes for og in s.view.layout.object_groups)
    monkeypatch.setattr(prefetch, "READ_BATCH_BYTES", chunks * chunk_bytes)


CASES = [(slots, per, seed) for slots in (False, True) for per in (1, 2, 3) for seed in (1, 2)]
IDS = [f"{'slots' if s else 'copy'}-{p}chunk-seed{d}" for s, p, d in CASES]


@pytest.mark.parametrize("slots,per_batch,seed", CASES, ids=IDS)
def test_a_many_batch_prefetch_commits_in_chunk_order(
    monkeypatch: pytest.MonkeyPatch, slots: bool, per_batch: int, seed: int
) -> None:
    s = Setup(seed, slots)
    batches(monkeypatch, s, per_batch)
    s.run()
    assert s.prefix() == CHUNKS
    assert s.stats.hits == 2 * CHUNKS and s.stats.misses == 0
    assert s.watch.samples > 3 * CHUNKS // per_batch, "the watcher ran between the batches"
    assert len(s.watch.verified) == 2 * CHUNKS


@pytest.mark.parametrize("slots", [False, True], ids=["copy", "slots"])
@pytest.mark.parametrize("chunk", [5, 17])
def test_a_value_damaged_in_its_payload_ends_the_prefix_exactly_there(
    monkeypatch: pytest.MonkeyPatch, slots: bool, chunk: int
) -> None:
    """Found only by the checksum, while later batches are already received into their
    slots (slot path): nothing past it is committed, however far they got."""
    s = Setup(3, slots)
    batches(monkeypatch, s, 2)
    s.damage(0, chunk)
    s.run()
    assert s.stats.invalid == {"checksum": 1}
    assert s.store.discarded == [s.l2key[(0, chunk)]]
    assert s.watch.committed(0) == list(range(chunk))
    assert s.watch.committed(1) == list(range(chunk))
    assert s.prefix() == chunk


@pytest.mark.parametrize("slots", [False, True], ids=["copy", "slots"])
def test_a_damaged_window_object_costs_only_the_hit_that_ends_there(
    monkeypatch: pytest.MonkeyPatch, slots: bool
) -> None:
    """A sliding-window object (object group 1, a window of one chunk) is needed only by
    a hit that ends at its chunk: the prefetch goes on past it, the whole prefix hits."""
    s = Setup(3, slots)
    batches(monkeypatch, s, 2)
    s.damage(1, 9)
    s.run()
    assert s.stats.invalid == {"checksum": 1}
    assert s.watch.committed(0) == list(range(CHUNKS))
    assert s.watch.committed(1) == [i for i in range(CHUNKS) if i != 9]
    assert s.prefix() == CHUNKS


def test_a_value_that_vanishes_after_its_header_is_a_miss_and_ends_the_prefix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = Setup(4, True)
    batches(monkeypatch, s, 1)
    s.store.vanish = {s.l2key[(0, 11)]}
    s.run()
    assert s.prefix() == 11 and s.watch.committed(1) == list(range(11))
    assert s.stats.misses == 1 and not s.stats.invalid


@pytest.mark.parametrize("slots", [False, True], ids=["copy", "slots"])
def test_a_store_failing_mid_prefetch_leaves_a_whole_prefix_and_no_slot_behind(
    monkeypatch: pytest.MonkeyPatch, slots: bool
) -> None:
    """The 5th read raises after writing into its slots (slot path: half a batch in,
    three more batches in flight): what was committed is a prefix of whole, verified
    objects, every other slot aborted, and the failure reported once."""
    s = Setup(5, slots)
    batches(monkeypatch, s, 2)
    s.store.fail_call = 5
    s.run()
    assert len(s.errors) == 1 and s.stats.errors == {"read": 1}
    assert s.prefix() <= 8
    assert s.watch.committed(0) == list(range(s.prefix()))


@pytest.mark.parametrize("slots", [False, True], ids=["copy", "slots"])
def test_a_prefetch_cancelled_mid_run_leaves_a_whole_prefix_and_no_slot_behind(
    monkeypatch: pytest.MonkeyPatch, slots: bool
) -> None:
    s = Setup(6, slots)
    batches(monkeypatch, s, 1)
    s.store.scale = 4.0
    s.run(stop_after_s=0.02)
    assert s.prefix() < CHUNKS, "the prefetch ended before it was cancelled"
    assert s.watch.committed(0) == list(range(s.prefix()))


@pytest.mark.parametrize("slots", [False, True], ids=["copy", "slots"])
def test_after_a_many_batch_prefetch_lru_evicts_its_last_chunk_first(
    monkeypatch: pytest.MonkeyPatch, slots: bool
) -> None:
    """The prefetch pins what it commits until it ends, then unpins from the last chunk
    to the first: chunk 0, which every longer hit needs, is evicted last, across batches
    as within one (as after a store of the whole prefix)."""
    s = Setup(7, slots)
    batches(monkeypatch, s, 2)
    s.run()
    for og in s.view.layout.object_groups:
        part = s.view._partitions[og.index]
        order: list[int] = []
        while (slot := part.policy.pop_victim()) is not None:
            key: Any = part.slot_key[slot]
            order.append(s.keys.index(key))
        assert order == list(range(CHUNKS - 1, -1, -1)), og.index


def test_a_prefetch_larger_than_l1_keeps_its_head_and_stops_where_l1_is_full(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its later batches cannot evict its earlier ones (pinned until it ends): L1 full,
    the run stops there (counted as no space) with chunk 0 on, never a headless tail."""
    s = Setup(8, True, pool_mib=4, slab_mib=1)
    batches(monkeypatch, s, 2)
    s.run()
    got = s.prefix()
    assert 0 < got < CHUNKS
    assert s.stats.prefetch_no_space > 0
    assert s.watch.committed(0)[0] == 0 and s.watch.committed(1)[0] == 0
