"""The typed ``stats`` reply and the one list of counters (lmc_server.cache.counters).

A counter is defined once; the Prometheus collectors, the report and the wire carry it
without naming it again. These tests give every counter a distinct value and check that
each reader sees that value under the counter's name, so a counter that is added but not
exported, or exported from the wrong field, fails here. The wire checks pin the keys the
untyped dict had, so typing the reply changed nothing a script or an older client sees.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from prometheus_client.core import CounterMetricFamily

from lmc_server.cache.counters import CacheStats, CounterInfo, L2Counters, counters_of
from lmc_server.metrics.collector import PREFIX, counter_families
from lmc_server.protocol import messages as m
from lmc_server.protocol.codec import decode_reply, encode
from lmc_server.protocol.stats import (
    Counters,
    L1Report,
    L2Report,
    PartitionReport,
    PhaseSum,
    StatsReport,
)
from lmc_server.server.report import copy_counters, l2_report
from lmc_server.tiers.metrics import L2Collector
from lmc_server.tiers.stats import L2Stats


def numbered(cls: type[msgspec.Struct], first: int = 1) -> Any:
    """An instance of ``cls`` whose every counter has its own value (a dict: one key)."""
    values: dict[str, Any] = {}
    for i, c in enumerate(counters_of(cls), start=first):
        values[c.name] = {f"label{i}": i} if c.label else i
    return cls(**values)


def families(fams: Iterable[Any]) -> dict[str, dict[tuple[str, ...], float]]:
    """``{family name: {label values: value}}`` of counter families (``_total`` samples)."""
    out: dict[str, dict[tuple[str, ...], float]] = {}
    for fam in fams:
        if isinstance(fam, CounterMetricFamily):
            out[fam.name] = {
                tuple(s.labels.values()): s.value for s in fam.samples if s.name.endswith("_total")
            }
    return out


def expect(c: CounterInfo, value: Any) -> dict[tuple[str, ...], float]:
    if not c.label:
        return {(): value}
    return {**{(k,): 0 for k in c.known}, **{(k,): n for k, n in value.items()}}


def test_counter_list_is_well_formed() -> None:
    for cls in (CacheStats, L2Counters):
        infos = counters_of(cls)
        assert [c.name for c in infos] == list(cls.__struct_fields__)  # every field counts
        assert len({c.metric for c in infos}) == len(infos)
        for c in infos:
            assert c.help.endswith(".") and not c.metric.endswith("_total"), c
            assert isinstance(getattr(cls(), c.name), dict) == bool(c.label), c


def test_every_l1_counter_is_exported_and_reported_from_its_own_field() -> None:
    stats = numbered(CacheStats)
    fams = families(counter_families(PREFIX, stats, counters_of(CacheStats)))
    counters = Counters(**copy_counters(stats, CacheStats), requests={"store:ok": 3})
    wire = msgspec.to_builtins(counters)
    for c in counters_of(CacheStats):
        value = getattr(stats, c.name)
        assert fams.pop(PREFIX + c.metric) == expect(c, value), c.name
        assert getattr(counters, c.name) == value and wire[c.name] == value, c.name
    assert not fams
    assert wire["requests"] == {"store:ok": 3}


def fake_tier(stats: L2Stats) -> Any:
    """What the L2 collector and the report read of a tier (a real one needs Redis)."""
    return SimpleNamespace(
        stats=stats,
        kind="l2",
        label="L2",
        up=True,
        state_reason="connected",
        display_url="redis://127.0.0.1:1",
        backend=SimpleNamespace(name="redis"),
        clock=lambda: 12.5,
        state_since_s=10.0,
        writer=SimpleNamespace(depth=4, max_objects=64, in_flight=2),
    )


def test_every_l2_counter_is_exported_and_reported_from_its_own_field() -> None:
    stats = numbered(L2Stats)
    stats.read_latency.observe(0.002)
    tier = fake_tier(stats)
    fams = families(L2Collector(tier).collect())
    report = l2_report(tier)
    wire = msgspec.to_builtins(report)
    for c in counters_of(L2Counters):
        value = getattr(stats, c.name)
        got = fams.pop("lmcache_l2_" + c.metric)
        want = expect(c, value)
        assert {k: v for k, v in got.items() if k in want or v} == want, c.name
        assert getattr(report, c.name) == value and wire[c.name] == value, c.name
    assert not fams
    assert report.state == "up" and report.state_for_s == 2.5
    assert report.write_queue_objects == 4 and report.writes_in_flight == 2
    assert report.read_seconds.count == 1 and abs(report.read_seconds.sum - 0.002) < 1e-12


def sample_report() -> StatsReport:
    l2 = l2_report(fake_tier(numbered(L2Stats)))
    return StatsReport(
        version="0.1.0",
        backend="cpu",
        chunk_size=256,
        separate_object_groups=True,
        eviction_policy="LRU",
        uptime_s=1.5,
        l1=L1Report(
            capacity_bytes=1 << 30,
            ready_bytes=1 << 30,
            slab_bytes=1 << 26,
            slabs=16,
            ready_slabs=16,
            free_slabs=14,
            used_bytes=4096,
            objects=2,
        ),
        partitions=[
            PartitionReport(
                name="full",
                fingerprint="ab" * 16,
                object_bytes=2048,
                slabs=2,
                capacity_objects=64,
                objects=2,
                writing=0,
                used_bytes=4096,
                capacity_bytes=1 << 27,
                pinned_objects=1,
            )
        ],
        sessions=1,
        registrations=1,
        leases=1,
        counters=Counters(
            **copy_counters(numbered(CacheStats), CacheStats), requests={"lookup:ok": 2}
        ),
        phases={"store:copy": PhaseSum(count=2, seconds=0.25)},
        l2=l2,
    )


def test_stats_reply_round_trips_typed() -> None:
    sent = m.StatsResult(req_id=7, stats=sample_report())
    got = decode_reply(encode(sent))
    assert isinstance(got, m.StatsResult) and got == sent
    assert isinstance(got.stats.counters, Counters) and isinstance(got.stats.l2, L2Report)
    assert isinstance(got.stats.phases["store:copy"], PhaseSum)
    assert got.stats.counters.hit_tokens == sent.stats.counters.hit_tokens


def test_wire_keys_are_those_of_the_untyped_report() -> None:
    """The keys a script or a client of this protocol version reads (docs/protocol.md)."""
    wire = msgspec.msgpack.decode(encode(m.StatsResult(req_id=1, stats=sample_report())))
    stats = wire["stats"]
    assert set(stats) == {
        "version",
        "backend",
        "chunk_size",
        "separate_object_groups",
        "eviction_policy",
        "uptime_s",
        "l1",
        "partitions",
        "sessions",
        "registrations",
        "leases",
        "counters",
        "phases",
        "l2",
        "disk",
        "kv_events",
    }
    assert set(stats["l1"]) == {
        "capacity_bytes",
        "ready_bytes",
        "slab_bytes",
        "slabs",
        "ready_slabs",
        "free_slabs",
        "used_bytes",
        "objects",
    }
    assert set(stats["partitions"][0]) == {
        "name",
        "fingerprint",
        "object_bytes",
        "slabs",
        "capacity_objects",
        "objects",
        "writing",
        "used_bytes",
        "capacity_bytes",
        "pinned_objects",
    }
    assert set(stats["counters"]) == {
        "lookups",
        "lookup_chunks",
        "hit_chunks",
        "lookup_tokens",
        "hit_tokens",
        "probes",
        "probe_tokens",
        "probe_hit_tokens",
        "stored_objects",
        "stored_bytes",
        "retrieved_objects",
        "retrieved_bytes",
        "evictions",
        "evicted_bytes",
        "slabs_moved",
        "leases_taken",
        "leases_released",
        "leases_expired",
        "alloc_failures",
        "retrieve_plans",
        "requests",
    }
    assert stats["phases"] == {"store:copy": {"count": 2, "seconds": 0.25}}
    assert set(stats["l2"]) == {
        "url",
        "backend",
        "state",
        "reason",
        "state_for_s",
        "write_queue_objects",
        "write_queue_capacity",
        "writes_in_flight",
        "hits",
        "misses",
        "invalid",
        "bytes_read",
        "bytes_written",
        "objects_written",
        "dropped_writes",
        "errors",
        "prefetches",
        "prefetches_skipped",
        "prefetch_no_space",
        "state_changes",
        "read_seconds",
        "write_seconds",
    }
    assert stats["l2"]["read_seconds"] == {"count": 0, "sum": 0.0}
    without_l2 = msgspec.structs.replace(sample_report(), l2=None)
    assert msgspec.msgpack.decode(encode(without_l2))["l2"] is None


def test_a_reply_with_fields_this_client_does_not_know_still_decodes() -> None:
    """A newer server of the same protocol version may report more; nothing breaks."""
    wire = msgspec.to_builtins(m.StatsResult(req_id=3, stats=sample_report()))
    wire["stats"]["counters"]["a_new_counter"] = 5
    wire["stats"]["l1"]["a_new_gauge"] = 1
    wire["stats"]["something_new"] = {"x": 1}
    got = decode_reply(msgspec.msgpack.encode(wire))
    assert isinstance(got, m.StatsResult) and got.stats == sample_report()


def test_a_malformed_stats_reply_is_refused_not_half_read() -> None:
    wire = msgspec.to_builtins(m.StatsResult(req_id=3, stats=sample_report()))
    wire["stats"]["counters"]["evictions"] = "many"
    with pytest.raises(Exception, match="evictions"):
        decode_reply(msgspec.msgpack.encode(wire))
