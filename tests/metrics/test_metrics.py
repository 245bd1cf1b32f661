"""/metrics and /healthz of a real server process, checked against its stats report.

The scrape is parsed with prometheus_client's own parser; counters are compared with
the ``stats`` reply after a real store, lookup and retrieve, so a metric that is
misnamed, mislabelled or wired to the wrong counter fails here.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import HTTPServer

import numpy as np
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from lmc_server.cache.counters import CacheStats, counters_of
from lmc_server.cli.main import cli
from lmc_server.client import Client
from lmc_server.client.digests import chunk_digests
from lmc_server.metrics.endpoint import MetricsServer
from lmc_server.protocol.stats import StatsReport
from lmc_server.testing.kv import ShmKV, block_ids_for
from lmc_server.testing.presets import dsv41_flash
from lmc_server.testing.process import ServerProcess, free_port

CHUNK = 256
#: Label names allowed on lmcache_ metrics: every one has a small, fixed value set.
BOUNDED_LABELS = {
    "operation",
    "outcome",
    "direction",
    "reason",
    "object_group",
    "layout",
    "state",
    "le",
    "version",
    "python_version",
    "python_implementation",
    "backend",
    "chunk_size",
    "eviction_policy",
    "object_groups",
    "phase",
}


def get(port: int, path: str) -> tuple[int, str, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type") or "", resp.read().decode()
    finally:
        conn.close()


def scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """``{sample name: {sorted label items: value}}`` of one scrape."""
    status, ctype, body = get(port, "/metrics")
    assert status == 200 and ctype.startswith("text/plain"), (status, ctype)
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def one(
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]], name: str, **labels: str
) -> float:
    return samples[name][tuple(sorted(labels.items()))]


@dataclass
class Served:
    """A server process and the port of its metrics endpoint."""

    srv: ServerProcess
    port: int


@pytest.fixture(scope="module")
def metrics_server() -> Iterator[Served]:
    port = free_port()
    with ServerProcess(
        ["--chunk-size", str(CHUNK), "--separate-object-groups"], metrics_port=port
    ) as srv:
        yield Served(srv, port)


@pytest.fixture(scope="module")
def traffic(metrics_server: Served) -> dict[str, object]:
    """One registration; 4 chunks stored, looked up (hit) and retrieved."""
    geo = dsv41_flash(num_blocks=64, layers=2)
    kv = ShmKV(geo)
    kv.fill_random(1)
    with Client(metrics_server.srv.endpoint, client_name="metrics-test") as c:
        reg = c.register(**kv.register_kwargs())
        digests = chunk_digests(np.arange(4 * CHUNK), CHUNK)
        ids = block_ids_for(reg, 4)
        stored = c.store(reg, digests, ids)
        assert stored.ok.all()
        hit = c.lookup(reg, digests)
        assert hit.hit_chunks == 4
        got = c.retrieve(reg, digests, ids)
        assert got.ok.all()
        c.release(hit.lease_id)
        missing = c.lookup(reg, chunk_digests(np.arange(2 * CHUNK) + 7, CHUNK), lease=False)
        assert missing.hit_chunks == 0
        report = c.stats()
        samples = scrape(metrics_server.port)
        c.unregister(reg)
    kv.close()
    return {"report": report, "samples": samples}


def test_counters_match_the_stats_report(traffic: dict[str, object]) -> None:
    """Every counter of the one list is scraped with the value ``stats`` reports."""
    report = traffic["report"]
    samples = traffic["samples"]
    assert isinstance(report, StatsReport) and isinstance(samples, dict)
    counters = report.counters
    for c in counters_of(CacheStats):
        value = getattr(counters, c.name)
        if c.label:
            for label, n in {**dict.fromkeys(c.known, 0), **value}.items():
                assert one(samples, f"lmcache_{c.metric}_total", **{c.label: label}) == n
        else:
            assert one(samples, f"lmcache_{c.metric}_total") == value, c.name
    assert one(samples, "lmcache_hit_tokens_total") == counters.hit_tokens == 4 * CHUNK
    assert one(samples, "lmcache_lookup_tokens_total") == counters.lookup_tokens == 6 * CHUNK
    assert counters.stored_objects == 4 * 2  # two object groups
    assert counters.lookups == 2 and counters.hit_chunks == 4 and counters.leases_taken == 1
    assert counters.stored_bytes > 0
    assert one(samples, "lmcache_requests_total", operation="store", outcome="ok") == 1
    assert one(samples, "lmcache_requests_total", operation="lookup", outcome="ok") == 2
    assert one(samples, "lmcache_requests_total", operation="register", outcome="ok") == 1
    for direction in ("store", "retrieve"):
        assert one(samples, "lmcache_transfer_duration_seconds_count", direction=direction) == 1
        assert (
            one(samples, "lmcache_transfer_duration_seconds_bucket", direction=direction, le="+Inf")
            == 1
        )
        assert one(samples, "lmcache_transfer_duration_seconds_sum", direction=direction) > 0
        assert one(samples, "lmcache_transfer_bytes_total", direction=direction) > 0
    assert one(samples, "lmcache_registrations") == 1
    assert one(samples, "lmcache_leases") == 0
    assert one(samples, "lmcache_serving") == 1


def test_partition_gauges_match_the_stats_report(traffic: dict[str, object]) -> None:
    report = traffic["report"]
    samples = traffic["samples"]
    assert isinstance(report, StatsReport) and isinstance(samples, dict)
    parts = report.partitions
    assert len(parts) >= 2  # separate object groups: full and sliding-window partitions
    for p in parts:
        lv = {"object_group": p.name, "layout": p.fingerprint[:12]}
        assert one(samples, "lmcache_l1_partition_used_bytes", **lv) == p.used_bytes
        assert one(samples, "lmcache_l1_partition_capacity_bytes", **lv) == p.capacity_bytes
        assert one(samples, "lmcache_l1_partition_objects", **lv) == p.objects
        assert one(samples, "lmcache_l1_partition_capacity_objects", **lv) == p.capacity_objects
        assert one(samples, "lmcache_l1_partition_pinned_objects", **lv) == p.pinned_objects
        assert (
            one(samples, "lmcache_l1_partition_pinned_bytes", **lv)
            == p.pinned_objects * p.object_bytes
        )
        assert p.objects > 0
    l1 = report.l1
    assert one(samples, "lmcache_l1_capacity_bytes") == l1.capacity_bytes
    slabs = {s: one(samples, "lmcache_l1_slabs", state=s) for s in ("pending", "free", "owned")}
    assert sum(slabs.values()) == l1.slabs
    assert slabs["owned"] == sum(p.slabs for p in parts)


def test_stats_json_has_every_counter_with_the_scraped_value(
    metrics_server: Served, traffic: dict[str, object]
) -> None:
    """``lmcache stats --json``, the Prometheus scrape and the one list of counters agree:
    a counter added to :class:`CacheStats` appears in all three with the same value."""
    out = CliRunner().invoke(cli, ["stats", "--json", "--port", str(metrics_server.srv.port)])
    assert out.exit_code == 0, out.output
    counters = json.loads(out.output)["counters"]
    samples = scrape(metrics_server.port)
    names = [c.name for c in counters_of(CacheStats)]
    assert sorted(counters) == sorted([*names, "requests"])
    for c in counters_of(CacheStats):
        if not c.label:
            assert counters[c.name] == one(samples, f"lmcache_{c.metric}_total"), c.name
        else:
            for label, n in counters[c.name].items():
                assert one(samples, f"lmcache_{c.metric}_total", **{c.label: label}) == n
    human = CliRunner().invoke(cli, ["stats", "--port", str(metrics_server.srv.port)])
    assert human.exit_code == 0, human.output
    printed = {
        line.split()[0].split(".")[0]
        for line in human.output.splitlines()
        if line and line.split()[0].split(".")[0] in counters
    }
    assert printed == {n for n in counters if not isinstance(counters[n], dict) or counters[n]}


def test_names_and_labels_follow_prometheus_conventions(metrics_server: Served) -> None:
    _, _, body = get(metrics_server.port, "/metrics")
    families = [f for f in text_string_to_metric_families(body) if f.name.startswith("lmcache_")]
    names = {f.name for f in families}
    assert {
        "lmcache_build_info",
        "lmcache_requests",
        "lmcache_transfer_duration_seconds",
        "lmcache_l1_partition_used_bytes",
        "lmcache_allocation_failures",
        "lmcache_leases_expired",
        "lmcache_evicted_bytes",
    } <= names
    for fam in families:
        if fam.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in fam.samples), fam.name
        else:
            assert not fam.name.endswith("_total"), fam.name
        assert fam.documentation, f"{fam.name} has no HELP"
        for s in fam.samples:
            assert set(s.labels) <= BOUNDED_LABELS, (s.name, s.labels)
    build = [s for f in families if f.name == "lmcache_build_info" for s in f.samples]
    assert build and build[0].labels["version"]


@pytest.mark.needs_tool("promtool", "Debian: prometheus; CI: .ci/install-ops-tools.sh")
def test_promtool_finds_no_problems(metrics_server: Served, traffic: dict[str, object]) -> None:
    _, _, body = get(metrics_server.port, "/metrics")
    res = subprocess.run(
        ["promtool", "check", "metrics"], input=body.encode(), capture_output=True, timeout=30
    )
    assert res.returncode == 0 and not res.stdout.strip() and not res.stderr.strip(), res


def test_healthz_and_unknown_paths(metrics_server: Served) -> None:
    port = metrics_server.port
    status, _, body = get(port, "/healthz")
    assert status == 200 and body.startswith("ok: serving on ") and body.count("\n") == 1
    assert get(port, "/nope")[0] == 404


def test_metrics_port_in_use_fails_startup() -> None:
    blocker = HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    try:
        srv = ServerProcess(metrics_port=blocker.server_address[1])
        with pytest.raises(RuntimeError, match="exited with status 3"):
            srv.start()
        assert "startup failed" in srv.log()
    finally:
        blocker.server_close()


def test_healthz_answers_503_with_the_reason() -> None:
    """The endpoint maps health() to the status code; the reason is the body's one line."""
    state = {"serving": False}

    def health() -> tuple[bool, str]:
        return (True, "fine") if state["serving"] else (False, "draining: shutting down")

    ms = MetricsServer("127.0.0.1", 0, CollectorRegistry(), health)
    ms.start()
    try:
        assert get(ms.port, "/healthz")[::2] == (503, "draining: shutting down\n")
        state["serving"] = True
        assert get(ms.port, "/healthz")[::2] == (200, "ok: fine\n")
        results: list[int] = []
        threads = [
            threading.Thread(target=lambda: results.append(get(ms.port, "/metrics")[0]))
            for _ in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [200] * 8
    finally:
        ms.stop()
