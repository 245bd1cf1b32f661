#!/usr/bin/env bash
# Operations checks, run by .ci/run after the test suite:
#   bash .ci/ops-checks.sh "$VENV/bin/python"
# 1. a live server's /metrics (after real traffic) passes `promtool check metrics`;
# 2. every lmcache_* name used by the alert rules and the Grafana dashboard exists in
#    that scrape; the rules and the scrape config pass promtool;
# 3. the server exits 0 on SIGTERM;
# 4. `systemd-analyze verify` accepts deploy/lmcache-server.service.
# Installs promtool and systemd-analyze if missing (.ci/install-ops-tools.sh).
set -euo pipefail

PY="${1:?usage: .ci/ops-checks.sh /path/to/venv/bin/python}"
cd "$(dirname "$0")/.."
ROOT="$PWD"

bash .ci/install-ops-tools.sh  # a no-op under .ci/run, which installed them already

CHECK=ops-checks
# shellcheck source=.ci/server-scratch.sh
. .ci/server-scratch.sh

read -r PORT METRICS_PORT < <("$PY" - <<'PYEOF'
from lmc_server.testing.process import free_port
print(free_port(), free_port())
PYEOF
)

echo "ops-checks: starting a server (cpu backend, 1 GiB, a 1 GiB disk tier) on $PORT, metrics on $METRICS_PORT"
mkdir -p "$WORK/disk"  # with a disk tier, so the alerts' lmcache_disk_* series exist too
"$PY" -m lmc_server server --backend cpu --l1-size-gb 1 --chunk-size 256 \
    --separate-object-groups --port "$PORT" --metrics-port "$METRICS_PORT" \
    --disk-dir "$WORK/disk" --disk-size-gb 1 \
    >"$WORK/server.log" 2>&1 &
SERVER_PID=$!

# Wait for /healthz, then make real traffic so every labelled series exists.
"$PY" - "$PORT" "$METRICS_PORT" "$WORK/metrics.txt" <<'PYEOF' || fail "traffic/scrape"
import sys, time, urllib.error, urllib.request
import numpy as np
from lmc_server.client import Client
from lmc_server.client.digests import chunk_digests
from lmc_server.testing.kv import ShmKV, block_ids_for
from lmc_server.testing.presets import dsv41_flash

port, mport, out = sys.argv[1], sys.argv[2], sys.argv[3]
base = f"http://127.0.0.1:{mport}"
deadline = time.monotonic() + 60
while True:
    try:
        with urllib.request.urlopen(base + "/healthz", timeout=2) as r:
            print("healthz:", r.status, r.read().decode().strip())
            break
    except (urllib.error.URLError, OSError):
        if time.monotonic() > deadline:
            sys.exit("server not healthy within 60 s")
        time.sleep(0.1)
with ShmKV(dsv41_flash(num_blocks=64, layers=2)) as kv, \
        Client(f"tcp://127.0.0.1:{port}", timeout_s=30, client_name="ops-checks") as c:
    kv.fill_random(0)
    reg = c.register(**kv.register_kwargs())
    d = chunk_digests(np.arange(4 * 256), 256)
    ids = block_ids_for(reg, 4)
    assert c.store(reg, d, ids).ok.all()
    hit = c.lookup(reg, d)
    assert hit.hit_chunks == 4, hit
    assert c.retrieve(reg, d, ids).ok.all()
    c.release(hit.lease_id)
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        open(out, "wb").write(r.read())
    c.unregister(reg)
PYEOF

echo "ops-checks: promtool check metrics"
if ! promtool check metrics <"$WORK/metrics.txt" >"$WORK/promtool.out" 2>&1 \
        || [ -s "$WORK/promtool.out" ]; then
    cat "$WORK/promtool.out" >&2
    fail "promtool check metrics reported problems"
fi

echo "ops-checks: promtool check rules / config"
promtool check rules deploy/lmcache-alerts.yml || fail "alert rules"
promtool check config deploy/prometheus.yml || fail "scrape config"

echo "ops-checks: names used by the dashboard and the alerts exist"
"$PY" - "$WORK/metrics.txt" deploy/grafana-dashboard.json deploy/lmcache-alerts.yml <<'PYEOF' \
    || fail "dashboard/alerts refer to unknown metrics"
import json, re, sys
from prometheus_client.parser import text_string_to_metric_families
scrape = open(sys.argv[1]).read()
known = set()
for fam in text_string_to_metric_families(scrape):
    known.add(fam.name)
    known.update(s.name for s in fam.samples)
    if fam.type == "counter":  # a counter with no labelled sample yet still has a name
        known.add(fam.name + "_total")
    if fam.type == "summary":  # likewise a summary's series before its first sample
        known.update((fam.name + "_sum", fam.name + "_count"))
json.load(open(sys.argv[2]))  # the dashboard is valid JSON
used = set()
for path in sys.argv[2:]:
    used.update(re.findall(r"\blmcache_[a-z0-9_]+", open(path).read()))
unknown = sorted(u for u in used if u not in known)
if unknown:
    sys.exit(f"unknown metric names: {unknown}")
print(f"{len(used)} metric names checked")
PYEOF

echo "ops-checks: SIGTERM exits 0"
kill -TERM "$SERVER_PID"
status=0
wait "$SERVER_PID" || status=$?
SERVER_PID=""
[ "$status" = 0 ] || fail "server exited with $status on SIGTERM"
grep -q "shutdown complete" "$WORK/server.log" || fail "no 'shutdown complete' log line"

echo "ops-checks: systemd-analyze verify"
LMCACHE_BIN="$(dirname "$PY")/lmcache"
[ -x "$LMCACHE_BIN" ] || fail "$LMCACHE_BIN not found (is the package installed in the venv?)"
sed "s#^ExecStart=[^ ]*#ExecStart=$LMCACHE_BIN#" deploy/lmcache-server.service \
    >"$WORK/lmcache-server.service"
verify_rc=0
systemd-analyze verify "$WORK/lmcache-server.service" >"$WORK/verify.out" 2>&1 || verify_rc=$?
# No filter: the unit uses no key newer than systemd 252, so any output is a problem.
problems="$(grep -v '^\s*$' "$WORK/verify.out" || true)"
if [ "$verify_rc" != 0 ] || [ -n "$problems" ]; then
    cat "$WORK/verify.out" >&2
    fail "systemd-analyze verify (rc $verify_rc)"
fi

echo "ops-checks: OK (repository $ROOT)"
