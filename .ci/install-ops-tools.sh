#!/usr/bin/env bash
# Installs the outside commands that tests and .ci/ops-checks.sh run (Debian packages):
# promtool (prometheus), systemd-analyze (systemd) and openssl. .ci/run calls it before
# pytest: under CI=true a test whose command is missing fails, rather than skips
# (marker needs_tool, tests/conftest.py). Idempotent; a no-op if all are installed.
set -euo pipefail
declare -A package=([promtool]=prometheus [systemd-analyze]=systemd [openssl]=openssl)
missing=()
for cmd in "${!package[@]}"; do
  command -v "$cmd" >/dev/null 2>&1 || missing+=("${package[$cmd]}")
done
if ((${#missing[@]} == 0)); then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
# The prometheus package enables a system service on port 9090; nothing here uses it.
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
  $SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true
fi
promtool --version | head -1
systemd-analyze --version | head -1
