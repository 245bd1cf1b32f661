"""Every monotonic counter the server exports, each defined once.

A counter is a field of one of the Structs below, annotated with :func:`counter`:

- the field name is the attribute the hot path increments and the key in the ``stats``
  reply (``counters`` for :class:`CacheStats`, ``l2`` for :class:`L2Counters`);
- the description is the Prometheus HELP text, and the metric is ``<prefix><name>_total``
  (``metric=`` names it where the stats key and the metric name differ);
- a ``dict[str, int]`` field is a counter by a label (``label=``, its value is the key),
  exported as 0 for each of ``known`` before the first one, so ``rate()`` and alerts
  see the series from the start.

The Prometheus collectors (:mod:`lmc_server.metrics.collector`, ``lmc_server.tiers.metrics``),
the ``stats`` reply (``lmc_server.protocol.stats``, built by ``lmc_server.server.report``),
``lmcache stats`` and the benchmarks all read these definitions (:func:`counters_of`), so a
counter added here shows up in each of them; tests/metrics/test_stats_types.py checks it. They
live in the cache core because every layer that reads them may import it (protocol,
metrics, l2, server) and nothing else they all share.

The Structs are mutable: the hot path only increments ints (nothing Prometheus is
touched per request); a scrape or a ``stats`` request reads them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Annotated

import msgspec
import msgspec.inspect as mi


def counter(
    help_text: str, *, metric: str = "", label: str = "", known: tuple[str, ...] = ()
) -> msgspec.Meta:
    """The metadata that makes a Struct field a counter (see the module docstring)."""
    extra: dict[str, object] = {}
    if metric:
        extra["metric"] = metric
    if label:
        extra["label"] = label
    if known:
        extra["known"] = known
    return msgspec.Meta(description=help_text, extra=extra)


@dataclass(frozen=True, slots=True)
class CounterInfo:
    """One counter as its readers see it."""

    name: str  # the attribute and the key in the ``stats`` reply
    metric: str  # the Prometheus name after the prefix, without ``_total``
    help: str
    label: str = ""  # non-empty: a ``dict[str, int]`` counted by this label
    known: tuple[str, ...] = ()  # label values exported before their first count


@functools.cache
def counters_of(cls: type[msgspec.Struct]) -> tuple[CounterInfo, ...]:
    """The counters ``cls`` defines (fields annotated with :func:`counter`), in order.

    Fields without that annotation (a subclass's report fields, a histogram) are not
    counters and are left out.
    """
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType), cls
    out = []
    for f in info.fields:
        t = f.type
        if not isinstance(t, mi.Metadata) or not t.extra_json_schema:
            continue
        extra = t.extra or {}
        out.append(
            CounterInfo(
                name=f.name,
                metric=str(extra.get("metric", f.name)),
                help=str(t.extra_json_schema["description"]),
                label=str(extra.get("label", "")),
                known=tuple(extra.get("known", ())),
            )
        )
    return tuple(out)


class CounterSet(msgspec.Struct, kw_only=True):
    """Base of the counter Structs: no fields, the one way to count by a label."""

    @staticmethod
    def bump(counter: dict[str, int], label: str, n: int = 1) -> None:
        """Add ``n`` to the ``label`` entry of a labelled (``dict[str, int]``) counter."""
        counter[label] = counter.get(label, 0) + n


class CacheStats(CounterSet, kw_only=True):
    """The L1 cache's counters (``lmcache_<name>_total``, the ``stats`` ``counters``).

    The index counts every one of them (lookup tokens are chunks times the chunk size
    of the registration's layout).
    """

    lookups: Annotated[int, counter("Lookup requests evaluated.")] = 0
    lookup_chunks: Annotated[int, counter("Chunks asked about by lookups.")] = 0
    hit_chunks: Annotated[int, counter("Chunks reported as hits (the hit prefix) by lookups.")] = 0
    lookup_tokens: Annotated[
        int, counter("Tokens asked about by lookups (chunks x chunk size).")
    ] = 0
    hit_tokens: Annotated[int, counter("Tokens reported as hits by lookups.")] = 0
    probes: Annotated[
        int, counter("Prompts asked about by routers' probes (no lease, not counted as lookups).")
    ] = 0
    probe_tokens: Annotated[int, counter("Tokens asked about by probes.")] = 0
    probe_hit_tokens: Annotated[int, counter("Tokens probes reported as hits.")] = 0
    stored_objects: Annotated[
        int, counter("Objects (one chunk of one object group) committed to L1.")
    ] = 0
    stored_bytes: Annotated[int, counter("Bytes of objects committed to L1.")] = 0
    retrieved_objects: Annotated[int, counter("Objects read from L1 by retrieves.")] = 0
    retrieved_bytes: Annotated[int, counter("Bytes of objects read from L1 by retrieves.")] = 0
    evictions: Annotated[int, counter("Objects evicted from L1 to make room.")] = 0
    evicted_bytes: Annotated[int, counter("Bytes of objects evicted from L1.")] = 0
    slabs_moved: Annotated[int, counter("Slabs taken from a colder partition for another.")] = 0
    leases_taken: Annotated[int, counter("Leases taken by lookups.")] = 0
    leases_released: Annotated[
        int, counter("Leases released explicitly or with their session.")
    ] = 0
    leases_expired: Annotated[int, counter("Leases that reached their TTL unreleased.")] = 0
    alloc_failures: Annotated[
        dict[str, int],
        counter(
            "Objects that could not be stored, by reason (no_space: nothing evictable; "
            "aborted: the copy failed or its writer left).",
            metric="allocation_failures",
            label="reason",
            known=("aborted", "no_space"),
        ),
    ] = {}
    retrieve_plans: Annotated[
        dict[str, int],
        counter(
            "Retrieves by how the index planned them (planned: anew; reused: the plan of an "
            "identical earlier retrieve, as the ranks of one tensor-parallel engine send).",
            label="outcome",
            known=("planned", "reused"),
        ),
    ] = {}


class KvEventCounters(CounterSet, kw_only=True):
    """The KV-event publisher's counters (``lmcache_kv_events_<name>_total``, the
    ``stats`` ``kv_events``); counted by ``lmc_server.server.events.publisher`` on the loop."""

    batches: Annotated[
        int, counter("Event batches published (one sequence number each).", metric="batches")
    ] = 0
    events: Annotated[
        int, counter("Events in published batches (stored, removed, cleared).", metric="events")
    ] = 0
    dropped_batches: Annotated[
        int,
        counter(
            "Batches not sent because a subscriber's queue was at the high-water mark (still "
            "kept for replay).",
            metric="dropped_batches",
        ),
    ] = 0
    stall_resets: Annotated[
        int,
        counter(
            "Times the PUB socket was re-created because a full subscriber queue blocked "
            "every batch for longer than the heartbeat timeout.",
            metric="stall_resets",
        ),
    ] = 0
    replays: Annotated[int, counter("Replay requests served.", metric="replays")] = 0
    replays_cut: Annotated[
        int,
        counter("Replays cut short because the requester's queue was full.", metric="replays_cut"),
    ] = 0


class L2Counters(CounterSet, kw_only=True):
    """The L2 tier's counters (``lmcache_l2_<metric>_total``, the ``stats`` ``l2``).

    Objects are one chunk of one object group. The tier's threads and the event loop
    increment them (``lmc_server.tiers.stats.L2Stats`` adds the latency histograms).
    """

    hits: Annotated[int, counter("Objects found valid in L2 and brought into L1.")] = 0
    misses: Annotated[int, counter("Objects asked of L2 that it did not have.")] = 0
    invalid: Annotated[
        dict[str, int],
        counter("Values read from L2 and refused (never served), by reason.", label="reason"),
    ] = {}
    bytes_read: Annotated[int, counter("Bytes of values read from L2.", metric="read_bytes")] = 0
    bytes_written: Annotated[
        int, counter("Bytes of values written to L2.", metric="written_bytes")
    ] = 0
    objects_written: Annotated[int, counter("Objects written to L2.", metric="written_objects")] = 0
    dropped_writes: Annotated[
        dict[str, int],
        counter(
            "Objects not written to L2, by reason.",
            label="reason",
            known=("queue_full", "l2_down", "evicted", "error", "full", "shutdown"),
        ),
    ] = {}
    errors: Annotated[
        dict[str, int],
        counter("Failed L2 calls, by operation.", label="operation", known=("read", "write")),
    ] = {}
    prefetches: Annotated[int, counter("Prefetches started by lookups.")] = 0
    prefetches_skipped: Annotated[int, counter("Prefetches not started (too many in flight).")] = 0
    prefetch_no_space: Annotated[int, counter("Fetched objects L1 had no room for.")] = 0
    state_changes: Annotated[int, counter("Changes between up and degraded.")] = 0
