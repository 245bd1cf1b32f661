"""The probe: hit chunks per prompt for a router, without a registration or a lease.

In process, the batched hit rule (``cache/view.prompt_hits``) must agree with the
lookup's (``hit_chunks``) on every prompt, with holes, missing window objects and both
object-group layouts. Through a server: the probe answers what lookups answer, takes no
lease, leaves the eviction order alone, is counted apart from lookups, and its refusals
leave the server serving.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from lmc_server.cache.index import L1Index
from lmc_server.cache.layout import build_layout
from lmc_server.cache.view import hit_chunks, prompt_hits
from lmc_server.client import Client, Registration, ServerError, chunk_digests
from lmc_server.testing import ShmKV, simple_model
from lmc_server.testing.digests import chained_digests
from lmc_server.testing.inprocess import FakeClock, ThreadServer, run_server
from lmc_server.testing.kv import block_ids_for
from lmc_server.testing.presets import dsv41_flash

MIB = 1 << 20


def _index() -> L1Index:
    index = L1Index(256 * MIB, 16 * MIB, "LRU")
    for s in range(index.pool_usage().slabs):
        index.slab_ready(s)
    return index


@pytest.mark.parametrize("separate", [True, False])
@pytest.mark.parametrize("preset", ["dsv41", "simple"])
def test_batched_hit_rule_agrees_with_the_lookups(separate: bool, preset: str) -> None:
    rng = np.random.default_rng(7)
    idx = _index()
    geo = dsv41_flash(layers=2) if preset == "dsv41" else simple_model()
    view = idx.view("ns", build_layout(geo.groups, 256, separate))
    prompts = [
        idx.keys(view, chained_digests(int(rng.integers(1, 12)), tag=bytes([p]))) for p in range(40)
    ]
    for keys in prompts:  # store a random subset, some with their window blocks gone
        ids = {}
        for og in view.layout.object_groups:
            for sec in og.sections:
                a = (
                    np.arange(len(keys) * sec.blocks_per_chunk, dtype=np.int64).reshape(
                        len(keys), sec.blocks_per_chunk
                    )
                    % 64
                )
                if sec.group_index != 0:
                    a[rng.random(len(keys)) < 0.3] = -1
                ids[sec.group_index] = a
        keep = rng.random(len(keys)) < 0.8
        chosen = [k for k, y in zip(keys, keep, strict=True) if y]
        sub = {g: a[keep] for g, a in ids.items()}
        if chosen:
            idx.commit_store(idx.reserve_store(view, chosen, sub))
    flat = [k for keys in prompts for k in keys]
    ends = np.cumsum([len(k) for k in prompts]).tolist()
    expected = [hit_chunks(view, keys)[0] for keys in prompts]
    assert prompt_hits(view, flat, ends) == expected
    assert 0 < sum(expected) < len(flat)  # both hits and misses were probed
    idx.check()


# -- through a server ------------------------------------------------------------------------

SLOTS = 8


@pytest.fixture(scope="module")
def tiny() -> Iterator[ThreadServer]:
    with run_server(clock=FakeClock(), l1_size_gb=SLOTS / 1024, slab_size_mb=1) as ts:
        yield ts


@pytest.fixture
def setup(tiny: ThreadServer) -> Iterator[tuple[Client, Registration]]:
    with Client(tiny.endpoint) as c, ShmKV(simple_model(layers=4, bytes_per_token=1024)) as kv:
        kv.fill_random(3)
        c.clear()
        yield c, c.register(**kv.register_kwargs())


def one_chunk(i: int) -> bytes:
    return chunk_digests(np.full(256, i), 256)


def test_probe_answers_what_lookups_answer_without_a_lease(
    setup: tuple[Client, Registration],
) -> None:
    c, reg = setup
    three = chunk_digests(np.arange(3 * 256), 256)
    assert c.store(reg, three[:64], block_ids_for(reg, 2)).ok.all()  # chunks 0, 1
    before = c.stats()
    prompts = [three, three[:32], one_chunk(99), three[:64]]
    ends = np.cumsum([len(p) // 32 for p in prompts]).tolist()
    assert c.probe(reg.namespace, b"".join(prompts), prefix_ends=ends) == [2, 1, 0, 2]
    assert [c.lookup(reg, p, lease=False).hit_chunks for p in prompts] == [2, 1, 0, 2]
    after = c.stats()
    assert after.leases == before.leases == 0
    assert after.counters.probes - before.counters.probes == 4
    assert after.counters.probe_hit_tokens - before.counters.probe_hit_tokens == 5 * 256
    assert after.counters.lookups - before.counters.lookups == 4  # the lookups only
    # A namespace nobody registered hits nothing; so does an empty probe.
    assert c.probe(reg.namespace.replace("rank=0", "rank=1"), three) == [0]
    assert c.probe(reg.namespace, b"") == []


def test_a_probe_leaves_the_eviction_order_alone(setup: tuple[Client, Registration]) -> None:
    c, reg = setup
    ids = block_ids_for(reg, 1)
    for i in range(SLOTS):
        assert c.store(reg, one_chunk(i), ids).ok.all()
    assert c.probe(reg.namespace, one_chunk(0)) == [1]  # not a use: 0 stays the oldest
    assert c.store(reg, one_chunk(SLOTS), ids).ok.all()
    assert c.probe(reg.namespace, one_chunk(0)) == [0]
    assert c.probe(reg.namespace, one_chunk(1)) == [1]


def test_bad_probes_are_refused_and_the_server_serves_on(
    setup: tuple[Client, Registration],
) -> None:
    c, reg = setup
    two = chunk_digests(np.arange(2 * 256), 256)
    for kwargs, message in (
        ({"prefix_ends": [2, 1]}, "prefix_ends"),
        ({"prefix_ends": [1]}, "prefix_ends"),
        ({"salt": b"x" * 300}, "salt"),
    ):
        with pytest.raises(ServerError) as e:
            c.probe(reg.namespace, two, **kwargs)
        assert e.value.code == "bad_request" and message in str(e.value)
    for digests, ends in ((two[:40], ()), (b"", (1,))):  # ragged digests; ends past them
        with pytest.raises(ServerError) as e:
            c.probe(reg.namespace, digests, prefix_ends=ends)
        assert e.value.code == "bad_request"
    assert c.store(reg, two, block_ids_for(reg, 2)).ok.all()
    assert c.probe(reg.namespace, two) == [2]
    # two prompts of one chunk each: digests are keys, the second is chunk 1's (cached)
    assert c.probe(reg.namespace, two, prefix_ends=[1, 2]) == [1, 1]
