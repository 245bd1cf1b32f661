# Sourced by .ci/check-wheel.sh and .ci/ops-checks.sh after they set CHECK (their name):
# a scratch directory WORK removed at exit, the server they start (SERVER_PID) killed at
# exit if still running, and fail(), which prints the server's log and exits 1.
WORK="$(mktemp -d)"
SERVER_PID=""
cleanup() {
    if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill -KILL "$SERVER_PID" 2>/dev/null || true
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT

fail() {
    echo "$CHECK: FAIL: $*" >&2
    [ -f "$WORK/server.log" ] && sed 's/^/  server: /' "$WORK/server.log" >&2
    exit 1
}
