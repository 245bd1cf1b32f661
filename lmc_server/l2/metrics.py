"""Prometheus families of the L2 tier, read at scrape time from its plain counters.

Runs on the metrics HTTP thread while the loop mutates the counters: every dict is
copied with one C-level call first (see :mod:`lmc_server.metrics.collector`).
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

from lmc_server.l2.codec import Invalid
from lmc_server.l2.stats import LATENCY_BUCKETS_S, Latency
from lmc_server.l2.tier import L2Tier

PREFIX = "lmcache_l2_"
DROP_REASONS = ("queue_full", "l2_down", "evicted", "error", "shutdown")


def _labelled(name: str, doc: str, label: str, values: dict[str, int],
              known: tuple[str, ...]) -> CounterMetricFamily:
    fam = CounterMetricFamily(PREFIX + name, doc, labels=[label])
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
    fam = HistogramMetricFamily(PREFIX + name, doc)
    fam.add_metric([], buckets, lat.seconds)
    return fam


class L2Collector(Collector):
    def __init__(self, tier: L2Tier) -> None:
        self.tier = tier

    def collect(self) -> Iterator[Metric]:
        t, s = self.tier, self.tier.stats
        yield GaugeMetricFamily(PREFIX + "up", "1 while the L2 store is reachable, 0 while "
                                "degraded (serving from L1 only).", value=1 if t.up else 0)
        yield GaugeMetricFamily(PREFIX + "write_queue_objects",
                                "Objects waiting to be written to L2.", value=t.writer.depth)
        for name, doc, value in (
            ("hits", "Objects found valid in L2 and brought into L1.", s.hits),
            ("misses", "Objects asked of L2 that it did not have.", s.misses),
            ("read_bytes", "Bytes of values read from L2.", s.bytes_read),
            ("written_bytes", "Bytes of values written to L2.", s.bytes_written),
            ("written_objects", "Objects written to L2.", s.objects_written),
            ("prefetches", "Prefetches started by lookups.", s.prefetches),
            ("prefetches_skipped", "Prefetches not started (too many in flight).",
             s.prefetches_skipped),
            ("prefetch_no_space", "Fetched objects L1 had no room for.", s.prefetch_no_space),
            ("state_changes", "Changes between up and degraded.", s.state_changes),
        ):
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        yield _labelled("invalid", "Values read from L2 and refused (never served), by "
                        "reason.", "reason", s.invalid, tuple(r.value for r in Invalid))
        yield _labelled("dropped_writes", "Objects not written to L2, by reason.", "reason",
                        s.dropped_writes, DROP_REASONS)
        yield _labelled("errors", "Failed L2 calls, by operation.", "operation", s.errors,
                        ("read", "write"))
        yield _histogram("read_duration_seconds", "Wall time of one batched L2 read.",
                         s.read_latency)
        yield _histogram("write_duration_seconds", "Wall time of one batched L2 write.",
                         s.write_latency)
