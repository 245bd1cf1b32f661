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
from lmc_server.l2.codec import Invalid
from lmc_server.l2.stats import LATENCY_BUCKETS_S, Latency
from lmc_server.l2.tier import L2Tier

PREFIX = "lmcache_l2_"
#: Label values known here rather than in the counter's definition: the reasons a
#: value is refused are the codec's (which the cache core cannot import).
KNOWN_LABELS = {"invalid": tuple(r.value for r in Invalid)}


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
        for c in counters_of(L2Counters):  # the one definition of the L2 counters
            value = getattr(s, c.name)
            if c.label:
                yield _labelled(c.metric, c.help, c.label, value,
                                c.known + KNOWN_LABELS.get(c.name, ()))
            else:
                yield CounterMetricFamily(PREFIX + c.metric, c.help, value=value)
        yield _histogram("read_duration_seconds", "Wall time of one batched L2 read.",
                         s.read_latency)
        yield _histogram("write_duration_seconds", "Wall time of one batched L2 write.",
                         s.write_latency)
