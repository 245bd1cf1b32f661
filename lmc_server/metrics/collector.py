"""The Prometheus collector: reads the server's plain counters at scrape time.

The hot path only increments ints in :class:`~lmc_server.cache.counters.CacheStats` and
the server's request counters; nothing here is touched per request. The counter
families are derived from their one definition (:func:`counter_families`), so a counter
added to ``CacheStats`` is exported without a change here. The collector reads
the server's counters and sessions through :class:`RequestCounters` and
:class:`SessionCounts`, protocols that say what it reads, so this layer imports nothing
of the server (the server imports it); the histogram bounds are defined in
:mod:`.buckets` and the server's counters bucket by them.
:meth:`ServerCollector.collect` runs on the HTTP thread while the event loop keeps
mutating those objects, so it copies every dict with one C-level call (atomic under
the GIL: no "changed size during iteration") and derives histogram counts from the
copied buckets, so a scrape is internally consistent even if a request lands mid-way.

Names follow Prometheus conventions: prefix ``lmcache_``, counters end in ``_total``,
units are suffixes, and label values are bounded sets (operation, outcome, direction,
reason, object group and layout fingerprint): never a pid, request id or key.
"""

from __future__ import annotations

import platform
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import msgspec
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from lmc_server import __version__
from lmc_server.cache.counters import CacheStats, CounterInfo, counters_of
from lmc_server.cache.index import L1Index
from lmc_server.metrics.buckets import TRANSFER_BUCKETS_S

PREFIX = "lmcache_"


def counter_families(
    prefix: str, source: object, counters: tuple[CounterInfo, ...]
) -> Iterator[CounterMetricFamily]:
    """One family per counter of ``counters`` (:func:`~lmc_server.cache.counters.counters_of`),
    read from ``source``; a labelled counter exports its ``known`` values as 0 too."""
    for c in counters:
        value = getattr(source, c.name)
        if not c.label:
            yield CounterMetricFamily(prefix + c.metric, c.help, value=value)
            continue
        fam = CounterMetricFamily(prefix + c.metric, c.help, labels=[c.label])
        counted = dict.fromkeys(c.known, 0)
        counted.update(dict(value))  # one C-level copy: the loop mutates it meanwhile
        for k, n in sorted(counted.items()):
            fam.add_metric([k], n)
        yield fam


class CounterCollector(Collector):
    """Every counter of one counter Struct (:class:`~lmc_server.cache.counters.CounterSet`),
    read at scrape time: the KV-event publisher's, ``lmcache_kv_events_*_total``."""

    def __init__(self, prefix: str, source: msgspec.Struct) -> None:
        self.prefix = prefix
        self.source = source
        self.counters = counters_of(type(source))

    def collect(self) -> Iterator[Metric]:
        yield from counter_families(self.prefix, self.source, self.counters)


class TransferCounts(Protocol):
    """One direction's transfers (``lmc_server.server.stats.TransferStats``)."""

    @property
    def nbytes(self) -> int: ...
    @property
    def seconds(self) -> float: ...
    @property
    def buckets(self) -> list[int]: ...


class RequestCounters(Protocol):
    """What the collector reads of the server's counters
    (``lmc_server.server.stats.ServerStats``); mutated by the event loop meanwhile."""

    @property
    def requests(self) -> Mapping[tuple[str, str], int]: ...
    @property
    def transfers(self) -> Mapping[str, TransferCounts]: ...
    @property
    def phases(self) -> Mapping[tuple[str, str], list[float]]: ...


class SessionCounts(Protocol):
    """Sessions (``len``) and registrations (``lmc_server.server.sessions.SessionTable``)."""

    def __len__(self) -> int: ...
    @property
    def registrations(self) -> int: ...


@dataclass(frozen=True)
class ServerInfo:
    """Settings exported once as ``lmcache_config_info`` labels (bounded, fixed)."""

    backend: str
    eviction_policy: str
    chunk_size: int
    object_groups: str  # "separate" or "combined"


@dataclass
class LiveState:
    """Callables the collector asks about the server's state (run on the HTTP thread).

    ``health()`` returns ``(serving, one-line reason)``; ``in_flight()`` the number of
    store/retrieve requests being copied now.
    """

    health: Callable[[], tuple[bool, str]]
    in_flight: Callable[[], int]


class ServerCollector(Collector):
    """Exports one server's counters and L1 occupancy; see docs/operations.md."""

    def __init__(
        self,
        info: ServerInfo,
        index: L1Index,
        stats: RequestCounters,
        sessions: SessionCounts,
        live: LiveState,
    ) -> None:
        self.info = info
        self.index = index
        self.stats = stats
        self.sessions = sessions
        self.live = live

    def collect(self) -> Iterator[Metric]:
        yield from self._info()
        yield from self._requests()
        yield from self._cache_counters()
        yield from self._transfers()
        yield from self._pool()
        yield from self._partitions()
        yield from self._sessions()

    # -- families -----------------------------------------------------------------------

    def _info(self) -> Iterator[Metric]:
        build = InfoMetricFamily(PREFIX + "build", "Version of lmc-server and its Python.")
        build.add_metric(
            [],
            {
                "version": __version__,
                "python_version": platform.python_version(),
                "python_implementation": sys.implementation.name,
            },
        )
        yield build
        cfg = InfoMetricFamily(PREFIX + "config", "Settings that shape what the cache stores.")
        cfg.add_metric(
            [],
            {
                "backend": self.info.backend,
                "eviction_policy": self.info.eviction_policy,
                "chunk_size": str(self.info.chunk_size),
                "object_groups": self.info.object_groups,
            },
        )
        yield cfg
        serving, _ = self.live.health()
        yield GaugeMetricFamily(
            PREFIX + "serving",
            "1 while the server answers requests (what /healthz says).",
            value=1 if serving else 0,
        )

    def _requests(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            PREFIX + "requests",
            "Requests answered, by operation and outcome (ok or an error code).",
            labels=["operation", "outcome"],
        )
        for (op, outcome), n in sorted(dict(self.stats.requests).items()):
            requests.add_metric([op, outcome], n)
        yield requests
        yield GaugeMetricFamily(
            PREFIX + "requests_in_flight",
            "Store and retrieve requests whose copies are running.",
            value=self.live.in_flight(),
        )

    def _cache_counters(self) -> Iterator[Metric]:
        yield from counter_families(PREFIX, self.index.stats, counters_of(CacheStats))

    def _transfers(self) -> Iterator[Metric]:
        hist = HistogramMetricFamily(
            PREFIX + "transfer_duration_seconds",
            "Wall time of one request's copies, by direction (store: to L1, retrieve: from L1).",
            labels=["direction"],
        )
        nbytes = CounterMetricFamily(
            PREFIX + "transfer_bytes",
            "Bytes copied by completed transfers, by direction.",
            labels=["direction"],
        )
        for direction, ts in sorted(dict(self.stats.transfers).items()):
            counts = list(ts.buckets)
            cumulative, buckets = 0, []
            for bound, n in zip(TRANSFER_BUCKETS_S, counts, strict=False):
                cumulative += n
                buckets.append((repr(float(bound)), cumulative))
            buckets.append(("+Inf", sum(counts)))
            hist.add_metric([direction], buckets, ts.seconds)
            nbytes.add_metric([direction], ts.nbytes)
        yield hist
        yield nbytes
        phases = SummaryMetricFamily(
            PREFIX + "request_phase_seconds",
            "Where a store's or retrieve's time goes inside the server, by phase: queue, "
            "prepare (index work), submit (engine planning and launch), copy, hop_out "
            "(engine completion to the event loop), finish.",
            labels=["operation", "phase"],
        )
        for (op, phase), (count, seconds) in sorted(dict(self.stats.phases).items()):
            phases.add_metric([op, phase], count_value=int(count), sum_value=seconds)
        yield phases

    def _pool(self) -> Iterator[Metric]:
        pool = self.index.pool_usage()  # one snapshot: the families agree
        ready_slabs, free_slabs = pool.ready_slabs, pool.free_slabs
        yield GaugeMetricFamily(
            PREFIX + "l1_capacity_bytes",
            "Size of the L1 pool (all slabs, prepared or not).",
            value=pool.capacity_bytes,
        )
        yield GaugeMetricFamily(
            PREFIX + "l1_ready_bytes",
            "L1 bytes pinned (cuda) or populated (cpu) and usable.",
            value=ready_slabs * pool.slab_bytes,
        )
        yield GaugeMetricFamily(
            PREFIX + "l1_slab_bytes", "Size of one pool slab.", value=pool.slab_bytes
        )
        slabs = GaugeMetricFamily(
            PREFIX + "l1_slabs",
            "Pool slabs by state (pending: not prepared yet; free; owned by a partition).",
            labels=["state"],
        )
        slabs.add_metric(["pending"], pool.slabs - ready_slabs)
        slabs.add_metric(["free"], free_slabs)
        slabs.add_metric(["owned"], ready_slabs - free_slabs)
        yield slabs

    def _partitions(self) -> Iterator[Metric]:
        labels = ["object_group", "layout"]

        def family(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(PREFIX + name, doc, labels=labels)

        capacity_b = family("l1_partition_capacity_bytes", "Bytes of the slabs a partition owns.")
        used_b = family(
            "l1_partition_used_bytes",
            "Bytes of committed and being-written objects of a partition.",
        )
        pinned_b = family(
            "l1_partition_pinned_bytes",
            "Bytes of objects pinned by leases, retrieves or queued tier writes (not evictable).",
        )
        capacity_o = family(
            "l1_partition_capacity_objects", "Object slots in the slabs a partition owns."
        )
        objects = family("l1_partition_objects", "Committed (visible) objects of a partition.")
        writing = family("l1_partition_writing_objects", "Objects being written (invisible).")
        pinned_o = family("l1_partition_pinned_objects", "Objects pinned by leases or retrieves.")
        object_b = family("l1_partition_object_bytes", "Size of one object of a partition.")
        for u in self.index.usage():
            lv = [u.name, u.fingerprint.hex()[:12]]
            capacity_b.add_metric(lv, u.capacity_bytes)
            used_b.add_metric(lv, u.used_bytes)
            pinned_b.add_metric(lv, u.pinned_bytes)
            capacity_o.add_metric(lv, u.capacity_objects)
            objects.add_metric(lv, u.objects)
            writing.add_metric(lv, u.writing)
            pinned_o.add_metric(lv, u.pinned_objects)
            object_b.add_metric(lv, u.object_bytes)
        yield from (capacity_b, used_b, pinned_b, capacity_o, objects, writing, pinned_o, object_b)

    def _sessions(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            PREFIX + "sessions", "Client connections known.", value=len(self.sessions)
        )
        yield GaugeMetricFamily(
            PREFIX + "registrations",
            "Active worker registrations (mapped KV buffers).",
            value=self.sessions.registrations,
        )
        yield GaugeMetricFamily(
            PREFIX + "leases",
            "Active leases (chunks pinned for a retrieve that follows a lookup).",
            value=self.index.lease_count,
        )
