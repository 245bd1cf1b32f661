"""Prometheus families of the L2 tier, read at scrape time from its plain counters.

Runs on the metrics HTTP thread while the loop mutates the counters: every dict is
copied with one C-level call first (see :mod:`lmc_server.metrics.collector`). The counter
families come from their one definition, :class:`lmc_server.cache.counters.L2Counters`.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from lmc_server.cache.counters import L2Counters, counters_of
from lmc_server.tiers.codec import Invalid
from lmc_server.tiers.disk.index import DiskIndex
from lmc_server.tiers.stats import LATENCY_BUCKETS_S, Latency
from lmc_server.tiers.tier import L2Tier

PREFIX = "lmcache_l2_"
#: Label values known here rather than in the counter's definition: the reasons a
#: value is refused are the codec's (which the cache core cannot import).
KNOWN_LABELS = {"invalid": tuple(r.value for r in Invalid)}


def _labelled(
    name: str, doc: str, label: str, values: dict[str, int], known: tuple[str, ...]
) -> CounterMetricFamily:
    fam = CounterMetricFamily(name, doc, labels=[label])
    counted = dict.fromkeys(known, 0)
    counted.update(dict(values))
    for k, n in sorted(counted.items()):
        fam.add_metric([k], n)
    return fam


def _histogram(name: str, doc: str, lat: Latency) -> HistogramMetricFamily:
    counts = list(lat.buckets)
    cumulative, buckets = 0, []
    for bound, n in zip(LATENCY_BUCKETS_S, counts, strict=False):
        cumulative += n
        buckets.append((repr(float(bound)), cumulative))
    buckets.append(("+Inf", sum(counts)))
    fam = HistogramMetricFamily(name, doc)
    fam.add_metric([], buckets, lat.seconds)
    return fam


class L2Collector(Collector):
    """One tier's families: ``lmcache_l2_*`` for the L2 store, ``lmcache_disk_*`` for the
    disk tier (the same counters, and the disk's space and index rebuild)."""

    def __init__(self, tier: L2Tier) -> None:
        self.tier = tier
        self.prefix = PREFIX if tier.kind == "l2" else f"lmcache_{tier.kind}_"

    def collect(self) -> Iterator[Metric]:
        t, s, pre = self.tier, self.tier.stats, self.prefix
        yield GaugeMetricFamily(
            pre + "up",
            f"1 while the {t.label} tier is reachable, 0 while degraded (serving from L1 only).",
            value=1 if t.up else 0,
        )
        yield GaugeMetricFamily(
            pre + "write_queue_objects",
            "Objects waiting to be written to this tier.",
            value=t.writer.depth,
        )
        for c in counters_of(L2Counters):  # the one definition of the L2 counters
            value = getattr(s, c.name)
            if c.label:
                yield _labelled(
                    pre + c.metric, c.help, c.label, value, c.known + KNOWN_LABELS.get(c.name, ())
                )
            else:
                yield CounterMetricFamily(pre + c.metric, c.help, value=value)
        yield _histogram(
            pre + "read_duration_seconds", "Wall time of one batched read.", s.read_latency
        )
        yield _histogram(
            pre + "write_duration_seconds", "Wall time of one batched write.", s.write_latency
        )
        index = getattr(t.backend, "index", None)
        if isinstance(index, DiskIndex):
            ledger = getattr(t.backend, "ledger", None)
            used = ledger.used_bytes if ledger is not None else index.used_bytes
            yield from _disk_families(pre, index, used, getattr(t.backend, "evicted_objects", 0))


def _disk_families(pre: str, index: DiskIndex, used: int, evicted: int) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        pre + "capacity_bytes", "Bytes the disk tier may hold.", value=index.capacity_bytes
    )
    yield GaugeMetricFamily(
        pre + "used_bytes",
        "Bytes of the disk tier's files in its directory (every server sharing it).",
        value=used,
    )
    yield GaugeMetricFamily(
        pre + "files", "Files the disk tier's index knows.", value=len(index.entries)
    )
    yield CounterMetricFamily(
        pre + "evicted_objects", "Files removed to stay within capacity.", value=evicted
    )
    yield GaugeMetricFamily(
        pre + "index_rebuild_ratio",
        "How far the index rebuild after start is (1: done).",
        value=index.progress.fraction,
    )
