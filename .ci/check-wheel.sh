#!/usr/bin/env bash
# The package as a user installs it, run by .ci/run after the test suite:
#   bash .ci/check-wheel.sh
# 1. builds the wheel (what `pip install .` installs) and checks it holds every module of
#    the tree (lmc_server/**/*.py) and the CUDA sources (kernels/ as lmc_server.kernels);
# 2. installs it, without extras, into a fresh venv outside the checkout and, from
#    another directory: bare `lmcache`, `lmcache --help`, `lmcache bench --help` and every
#    `lmcache bench <command> --help`, and a disk-tier trace replay (no extras needed);
# 3. starts the README's server command line there (its own port, the cpu backend and a
#    small pool), runs `lmcache ping`, `lmcache stats` and the README's Python example
#    against it, then stops it with SIGTERM and wants exit 0.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT="$PWD"
PYTHON="${PYTHON:-python3}"
CHECK=check-wheel
# shellcheck source=.ci/server-scratch.sh
. .ci/server-scratch.sh

echo "check-wheel: building the wheel"
"$PYTHON" -m pip wheel -q --no-deps -w "$WORK/dist" "$ROOT" >"$WORK/build.log" 2>&1 \
    || { cat "$WORK/build.log" >&2; fail "pip wheel"; }
WHEEL="$(ls "$WORK"/dist/lmc_server-*.whl)"

echo "check-wheel: the wheel holds every module of the tree"
"$PYTHON" - "$WHEEL" "$ROOT" <<'PYEOF' || fail "modules missing from the wheel"
import sys, zipfile
from pathlib import Path

wheel, root = sys.argv[1], Path(sys.argv[2])
shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("lmc_server/")}
tree = {p.relative_to(root).as_posix() for p in (root / "lmc_server").rglob("*.py")}
tree |= {
    "lmc_server/kernels/" + p.name
    for p in (root / "kernels").iterdir()
    if p.suffix in (".py", ".cu", ".cuh")
}
missing = sorted(tree - shipped)
if missing:
    sys.exit(f"not in {wheel}: {missing}")
print(f"{len(tree)} files checked")
PYEOF

echo "check-wheel: installing it into a fresh venv outside the checkout"
"$PYTHON" -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install -q "$WHEEL" >"$WORK/install.log" 2>&1 \
    || { cat "$WORK/install.log" >&2; fail "pip install of the wheel"; }
mkdir "$WORK/elsewhere"
cd "$WORK/elsewhere"
export PATH="$WORK/venv/bin:$PATH"
unset PYTHONPATH
[ "$(command -v lmcache)" = "$WORK/venv/bin/lmcache" ] || fail "lmcache not on PATH from the venv"
python -c 'import lmc_server, sys; sys.exit(0 if sys.argv[1] not in lmc_server.__file__ else 1)' \
    "$ROOT" || fail "the venv imports lmc_server from the checkout"

echo "check-wheel: help texts"
# Bare `lmcache` lists the commands (and exits 2, click's usage-error status).
lmcache >"$WORK/bare.txt" 2>&1 || true
grep -q "^Commands:" "$WORK/bare.txt" && ! grep -q Traceback "$WORK/bare.txt" \
    || fail "bare lmcache: $(cat "$WORK/bare.txt")"
lmcache --help >/dev/null || fail "lmcache --help"
lmcache bench --help >/dev/null || fail "lmcache bench --help"
COMMANDS="$(python - <<'PYEOF'
import click
from lmc_server.bench.cli import bench

def walk(group: click.Group, path: list[str]) -> None:
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        print(" ".join([*path, name]))
        if isinstance(command, click.Group):
            walk(command, [*path, name])

walk(bench, [])
PYEOF
)"
[ -n "$COMMANDS" ] || fail "no bench commands listed"
while read -r cmd; do
    # shellcheck disable=SC2086
    lmcache bench $cmd --help >/dev/null || fail "lmcache bench $cmd --help"
done <<<"$COMMANDS"
echo "check-wheel: $(wc -l <<<"$COMMANDS") bench commands' help"

echo "check-wheel: a disk-tier trace replay without the extras (no tqdm, no redis)"
python - "$WORK/trace.jsonl" <<'PYEOF'
import json, sys
with open(sys.argv[1], "w") as f:
    for turn in (1, 2):
        for conv in range(3):
            rec = {"timestamp": turn * 1000 + conv, "input_length": 512 * turn,
                   "hash_ids": [1000 * conv + k for k in range(turn)]}
            f.write(json.dumps(rec) + "\n")
PYEOF
lmcache bench l2 --replay "$WORK/trace.jsonl" --replay-tier disk --no-progress \
    >"$WORK/replay.txt" 2>&1 || { cat "$WORK/replay.txt" >&2; fail "bench l2 --replay-tier disk"; }
grep -q "L1 + disk" "$WORK/replay.txt" || fail "bench l2 replay: $(cat "$WORK/replay.txt")"

read -r PORT < <(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
# The README's first command line, on its own port, the cpu backend and a small pool
# (a repeated flag: the last one counts).
SERVER_ARGS="$(grep -o 'lmcache server --chunk-size [^`]*' "$ROOT/README.md" | head -1 | sed 's/^lmcache server //')"
[ -n "$SERVER_ARGS" ] || fail "no 'lmcache server' command line in README.md"
echo "check-wheel: lmcache server $SERVER_ARGS --backend cpu --l1-size-gb 0.25 --port $PORT --metrics-port 0"
# shellcheck disable=SC2086
lmcache server $SERVER_ARGS --backend cpu --l1-size-gb 0.25 --port "$PORT" --metrics-port 0 \
    >"$WORK/server.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 100); do
    lmcache ping --port "$PORT" --timeout-s 0.5 >/dev/null 2>&1 && break
    kill -0 "$SERVER_PID" 2>/dev/null || fail "the server exited"
    sleep 0.1
done
lmcache ping --port "$PORT" || fail "lmcache ping"
lmcache stats --port "$PORT" >"$WORK/stats.txt" || fail "lmcache stats"
grep -q "backend cpu" "$WORK/stats.txt" || fail "lmcache stats: $(cat "$WORK/stats.txt")"

echo "check-wheel: the README's Python example"
awk '/^```python$/ {on = 1; next} /^```$/ {on = 0} on' "$ROOT/README.md" \
    | sed "s#tcp://127.0.0.1:5555#tcp://127.0.0.1:$PORT#" >"$WORK/example.py"
[ -s "$WORK/example.py" ] || fail "no Python example in README.md"
python "$WORK/example.py" >"$WORK/example.out" 2>&1 \
    || { cat "$WORK/example.out" >&2; fail "the README's Python example"; }
sed -n 's/^ *print(.*)  *# \(.*\)$/\1/p' "$WORK/example.py" >"$WORK/example.promised"
diff "$WORK/example.promised" "$WORK/example.out" >&2 \
    || fail "the README's Python example printed other than its comments say"
sed 's/^/  example: /' "$WORK/example.out"

kill -TERM "$SERVER_PID"
status=0
wait "$SERVER_PID" || status=$?
SERVER_PID=""
[ "$status" = 0 ] || fail "server exited with $status on SIGTERM"
echo "check-wheel: OK ($(basename "$WHEEL"))"
