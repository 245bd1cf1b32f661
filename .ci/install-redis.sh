#!/usr/bin/env bash
# Installs redis-server (Debian package) for the L2 tests (tests/tiers/test_l2_*.py), which
# start their own instances on free loopback ports. Under CI=true those tests fail,
# rather than skip, when redis-server is missing. Idempotent; a no-op if installed.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends redis-server
# The package enables a system service on port 6379; the tests do not use it.
if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
  $SUDO systemctl disable --now redis-server >/dev/null 2>&1 || true
fi
redis-server --version
