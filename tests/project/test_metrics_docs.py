"""Every metric the docs and deploy files name is one the server exports, with those labels.

Operators copy metric names from docs/operations.md, docs/l2.md and the alert rules in
deploy/ into dashboards and alerts; a name or label the server does not export is an
alert that never fires. The exported names come from a scrape of a real server process
with every optional family on (L1 traffic, the disk tier, an L2 tier on a redis-server,
the KV-event publisher); the docs' names are every ``lmcache_*`` token in them, and a
``{a,b}`` or ``{a="x"}`` after a name lists its labels; the labels column of
docs/operations.md's metrics table is held to the exported labels exactly.
"""

from __future__ import annotations

import http.client
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from lmc_server.client import Client
from lmc_server.client.digests import chunk_digests
from lmc_server.testing.kv import ShmKV, block_ids_for
from lmc_server.testing.presets import dsv41_flash
from lmc_server.testing.process import ServerProcess, free_port
from lmc_server.testing.redis_process import RedisProcess, redis_server_path

ROOT = Path(__file__).resolve().parents[2]
CHUNK = 256
#: A metric name, optionally followed by its labels: ``{operation,outcome}`` or
#: ``{reason="checksum"}``. A name ending in ``_`` is a prefix (``lmcache_disk_``).
NAMED = re.compile(r"\b(lmcache_[a-z0-9_]*)(\*)?(\{[^}\n]*\})?")
#: Metric-like names with the wrong prefix (the package is ``lmc_server``, its metrics
#: ``lmcache_*``).
MISPREFIXED = re.compile(r"\blmc_[a-z0-9_]+_(?:total|bytes|seconds|info)\b")

#: Labels Prometheus adds to every series of a target (and a histogram's bucket bound).
TARGET_LABELS = {"instance", "job", "le"}

if redis_server_path() is None:
    if os.environ.get("CI") == "true":
        pytest.fail(
            "CI=true but redis-server is not installed (.ci/install-redis.sh)", pytrace=False
        )
    pytestmark = pytest.mark.skip(
        reason="redis-server is not installed (apt-get install redis-server)"
    )


def _documents() -> list[Path]:
    deploy = [p for p in sorted((ROOT / "deploy").rglob("*")) if p.is_file()]
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *deploy]


def _scrape(port: int) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        assert resp.status == 200, resp.status
        return resp.read().decode()
    finally:
        conn.close()


def _exported(text: str) -> dict[str, set[str]]:
    """``{name: label names}`` of every family and sample in a scrape (histogram
    ``_bucket``/``_sum``/``_count`` samples and info ``_info`` samples included)."""
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            out.setdefault(line.split()[2], set())
        elif line and not line.startswith("#"):
            m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?", line)
            assert m is not None, line
            labels = set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', m.group(3) or ""))
            labels.discard("le")  # a histogram's bucket bound, not a label a doc names
            out.setdefault(m.group(1), set()).update(labels)
    families = {n: set(ls) for n, ls in out.items()}
    for name, labels in out.items():  # a family is named by its samples' labels too
        for suffix in ("_bucket", "_sum", "_count", "_info", "_total"):
            if name.endswith(suffix):
                families.setdefault(name.removesuffix(suffix), set()).update(labels)
    return families


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, set[str]]]:
    disk = tmp_path_factory.mktemp("disk")
    metrics_port = free_port()
    with RedisProcess() as redis:
        args = [
            "--chunk-size",
            str(CHUNK),
            "--separate-object-groups",
            "--disk-dir",
            str(disk),
            "--disk-size-gb",
            "1",
            "--l2",
            redis.url,
            "--kv-events-endpoint",
            f"tcp://127.0.0.1:{free_port()}",
        ]
        with ServerProcess(args, metrics_port=metrics_port) as srv:
            geo = dsv41_flash(num_blocks=64, layers=2)
            with ShmKV(geo) as kv, Client(srv.endpoint, client_name="docs-test") as c:
                kv.fill_random(1)
                reg = c.register(**kv.register_kwargs())
                digests = chunk_digests(np.arange(4 * CHUNK), CHUNK)
                ids = block_ids_for(reg, 4)
                assert c.store(reg, digests, ids).ok.all()
                hit = c.lookup(reg, digests)
                assert c.retrieve(reg, digests, ids).ok.all()
                c.release(hit.lease_id)
                yield _exported(_scrape(metrics_port))
                c.unregister(reg)


def test_the_scrape_has_every_optional_family(exported: dict[str, set[str]]) -> None:
    """The fixture is only as good as what it turns on."""
    for name in (
        "lmcache_requests",
        "lmcache_l1_partition_used_bytes",
        "lmcache_l2_up",
        "lmcache_disk_index_rebuild_ratio",
        "lmcache_kv_events_batches",
    ):
        assert name in exported, name


def test_every_metric_the_docs_name_is_exported(exported: dict[str, set[str]]) -> None:
    wrong: list[str] = []
    checked = 0
    for path in _documents():
        text = path.read_text(errors="replace")
        where = path.relative_to(ROOT)
        for bad in MISPREFIXED.findall(text):
            wrong.append(f"{where}: {bad} (metrics are named lmcache_*)")
        for name, star, labels in NAMED.findall(text):
            if name.endswith("_") or star:
                if not any(n.startswith(name) for n in exported):
                    wrong.append(f"{where}: no metric starts with {name}")
                continue
            if name not in exported:
                wrong.append(f"{where}: {name} is not exported")
                continue
            checked += 1
            inside = (labels or "{}")[1:-1].strip()
            if not inside:
                continue
            if re.search(r"[=~]", inside):  # a selector: {reason="x", instance=~"$i"}
                named = set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", inside))
            else:  # a list of label names: {operation,outcome}
                named = {part.strip() for part in inside.split(",")}
            named -= TARGET_LABELS
            if not named <= exported[name]:
                wrong.append(f"{where}: {name} has labels {sorted(exported[name])}, not {inside}")
    assert checked >= 40, checked  # the docs name most families; a broken regex finds none
    assert not wrong, "\n".join(wrong)


def _table_rows(doc: str) -> Iterator[tuple[list[str], set[str]]]:
    """The metrics table of docs/operations.md: (full names in the first cell, label
    names of the third cell, their values in parentheses left out)."""
    text = (ROOT / "docs" / doc).read_text()
    section = text.split("## Metrics reference", 1)[1].split("\n## ", 1)[0]
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`lmcache_"):
            continue
        names = re.findall(r"`(lmcache_[a-z0-9_]*[a-z0-9])`", cells[0])
        labels = set(re.findall(r"[a-z_]+", re.sub(r"\([^)]*\)", "", cells[2])))
        yield names, labels


def test_the_metrics_tables_labels_are_the_exported_ones(exported: dict[str, set[str]]) -> None:
    rows = list(_table_rows("operations.md"))
    assert len(rows) >= 25, len(rows)
    for names, labels in rows:
        for name in names:
            assert exported[name] == labels, (name, sorted(exported[name]), sorted(labels))
