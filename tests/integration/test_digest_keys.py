"""The connector's chunk digests are cache keys: their bytes never change.

Other ranks, other engine instances and restarted servers look chunks up by these
digests, so a faster way of computing them must give the same bytes. Held three ways,
for several geometries (vLLM's 16-token hash blocks, DeepSeek-V4.1's hybrid groups
hashed every 32 tokens, other chunk sizes) and for block hashes salted per request:

* against golden values (a SHA-256 of all digests of each case), recorded once;
* against the format written out here, independently of the code
  (``digest[k] = blake2b(digest[k-1] || hashes of chunk k)``, a zero seed, 32 bytes);
* through the planner: what a lookup, a load and a store send is those bytes, however
  the digests were reached (all at once, a chunk at a time, a lookup of fewer chunks
  first).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest

from lmc_server.integration.chunks import ChunkGeometry, EngineGroup
from lmc_server.integration.planning import SchedulerPlanner
from lmc_server.integration.plans import LookupAnswer, LookupBatch, ScheduledRequest

PLAIN = [EngineGroup("full", 16)]
DSV41 = [
    EngineGroup("swa0", 32, window_tokens=128),
    EngineGroup("swa1", 32, window_tokens=128),
    EngineGroup("compressed", 64, server_groups=("kv", "indexer")),
    EngineGroup("scratch", 64, cached=False),
]
#: (name, chunk size, hash block size, groups)
GEOMETRIES = [
    ("plain-256", 256, 16, PLAIN),
    ("plain-512", 512, 16, PLAIN),
    ("plain-64", 64, 16, PLAIN),
    ("dsv41-256", 256, 32, DSV41),
    ("dsv41-512", 512, 32, DSV41),
    ("dsv41-b64-256", 256, 64, DSV41),
]
#: SHA-256 of every digest of a case, keyed by (geometry, salt): recorded once from the
#: scheduler thread's hashing, so that moving or rewriting the hashing cannot change a key
#: that caches already hold
GOLDEN = {
    ("plain-256", b""): "c8d6ae6d68f591faf711f35e4f31d78c6e38b390f766c9eb370e00d8e164d37b",
    ("plain-256", b"salt-a"): "9abbc60654dfdf2d854c288d569d6078576117a59ed5a9da70e6005ba80c3e92",
    ("plain-512", b""): "f6d53fa3b3052467f5ddac7ec1d634767df8661bf2be65893f1d7937854dff61",
    ("plain-512", b"salt-a"): "7c12a72cfa502d02ca4f6ee008c84484855a216bd2389b2b16291347ad8f714c",
    ("plain-64", b""): "cea2787a4a62f7ced4838c12df226cc5befd59f7b99e9e8039c89014da4d6688",
    ("plain-64", b"salt-a"): "ca692a7db3304c25662425f4c2ade13277e6512c4e8b5fdc831206a1f33473c2",
    ("dsv41-256", b""): "bcc0a5be92c8efb9e7991e8a49a697ac25e790a8a6905210562732362adf1c97",
    ("dsv41-256", b"salt-a"): "db2ef720c471dd52dbc10469b19eecc5824c09000c2e4ae343bef13d7980db9e",
    ("dsv41-512", b""): "258f6a63c5fa66f00aecd7563550070dbcf8ab202ac4619d293f3422662bedcf",
    ("dsv41-512", b"salt-a"): "0090c1478cc0581cc81504f1764793fac8068206eb98550f97d7c5dbfda7dab0",
    ("dsv41-b64-256", b""): "5329270d21d7fffbcfb79b1cbc4fc421bad1e40ef444a5c7c98e36ed07e4debc",
    (
        "dsv41-b64-256",
        b"salt-a",
    ): "65e375b7b30f554d74df6ca9d1b6e9e8b39b3cd9710ba74005ad78dbfe119003",
}
TOKENS = 2100  # several chunks and a tail at every chunk size above


def engine_hashes(tokens: Sequence[int], per: int, salt: bytes) -> list[bytes]:
    """Block hashes shaped like vLLM's: SHA-256, chained, the request's cache salt in
    the first block's extra keys (so a salt changes every hash after it)."""
    out, prev = [], b"\0" * 32
    for i in range(len(tokens) // per):
        extra = salt if i == 0 else b""
        body = b"".join(t.to_bytes(4, "little") for t in tokens[i * per : (i + 1) * per])
        prev = hashlib.sha256(prev + body + extra).digest()
        out.append(prev)
    return out


def reference(hashes: Sequence[bytes], per: int, n_chunks: int) -> bytes:
    """The digest format, spelled out."""
    out, prev = b"", bytes(32)
    for k in range(n_chunks):
        prev = hashlib.blake2b(
            prev + b"".join(hashes[k * per : (k + 1) * per]), digest_size=32
        ).digest()
        out += prev
    return out


def case(name: str, salt: bytes) -> tuple[ChunkGeometry, list[bytes], int]:
    _, chunk, hash_block, groups = next(g for g in GEOMETRIES if g[0] == name)
    geometry = ChunkGeometry(chunk, hash_block, groups)
    tokens = [(i * 7919 + 13) % 50000 for i in range(TOKENS)]
    hashes = engine_hashes(tokens, hash_block, salt)
    return geometry, hashes, geometry.max_chunks(TOKENS, len(hashes))


@pytest.mark.parametrize(("name", "salt"), sorted(GOLDEN))
def test_digests_are_the_recorded_bytes(name: str, salt: bytes) -> None:
    geometry, hashes, n = case(name, salt)
    got = geometry.digests(hashes, n)
    assert got == reference(hashes, geometry.hashes_per_chunk, n)
    assert hashlib.sha256(got).hexdigest() == GOLDEN[(name, salt)]


class ThreadedLookups:
    """A lookup service that hashes on its own thread, as the link does, records what
    each lookup asked for and answers ``hit`` chunks with a lease."""

    def __init__(self, hit: int) -> None:
        self.hit = hit
        self.sent: list[bytes] = []
        self.released: list[int] = []
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lookups")

    def lookup_hashed(self, chunks: Sequence[int], digests: Callable[[int], bytes]) -> LookupBatch:
        batch = LookupBatch(len(chunks))

        def run() -> None:
            for i in range(len(chunks)):
                d = digests(i)
                assert len(d) == chunks[i] * 32
                self.sent.append(d)
                hit = min(self.hit, chunks[i])
                batch.set([LookupAnswer(hit, 5 if hit else 0, 30.0)], at=[i])

        self._pool.submit(run)
        return batch

    def release(self, lease_id: int) -> None:
        self.released.append(lease_id)

    def close(self) -> None:
        self._pool.shutdown()


@pytest.mark.parametrize(("name", "salt"), sorted(GOLDEN))
def test_what_the_planner_sends_is_those_bytes(name: str, salt: bytes) -> None:
    """A lookup hashed on the service's thread, the load of its hit and the store of
    the rest carry the reference digests; a lookup of fewer chunks first, then of all
    (the prompt grew), sends each prefix of the same bytes."""
    geometry, hashes, n = case(name, salt)
    chunk = geometry.chunk_size
    ref = reference(hashes, geometry.hashes_per_chunk, n)
    svc = ThreadedLookups(hit=n - 1)
    try:
        p = SchedulerPlanner(geometry, svc, lookup_wait_s=10.0)
        p.request_arrived("a", hashes, TOKENS, TOKENS)
        assert p.matched_tokens("a", hashes, TOKENS, TOKENS, 0) == (n - 1) * chunk
        assert svc.sent == [ref]
        blocks = [list(range(1, TOKENS // g.tokens_per_block + 2)) for g in geometry.groups]
        p.after_alloc("a", blocks, (n - 1) * chunk)
        plan = p.build_step(
            [ScheduledRequest("a", (n - 1) * chunk, TOKENS - (n - 1) * chunk, None, False)]
        )
        [load] = plan.loads
        assert load.digests == ref[: (n - 1) * 32] and load.lease_id == 5
        [store] = plan.stores
        assert store.first_chunk == n - 1 and store.digests == ref[(n - 1) * 32 :]

        svc.sent.clear()
        p.request_arrived("b", hashes, chunk + 1, TOKENS)  # one chunk when it arrived
        assert p.matched_tokens("b", hashes, TOKENS, TOKENS, 0) == (n - 1) * chunk
        assert svc.sent == [ref[:32], ref]
    finally:
        svc.close()


def test_a_salt_changes_every_digest() -> None:
    geometry, plain, n = case("dsv41-256", b"")
    _, salted, _ = case("dsv41-256", b"salt-a")
    a, b = geometry.digests(plain, n), geometry.digests(salted, n)
    assert all(a[k * 32 : (k + 1) * 32] != b[k * 32 : (k + 1) * 32] for k in range(n))
