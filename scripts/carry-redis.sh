#!/usr/bin/env bash
# Packs this machine's redis-server (Debian package) into ./.redis for a machine that has
# none, e.g. the GPU test machine reached through the device tool (carry ".redis").
#   .redis/bin/redis-server   a wrapper: the real binary with its own libraries
#   .redis/bin/redis-cli      the same for redis-cli, if installed (cluster benchmarks)
#   .redis/lib/               the shared libraries they link, except the C runtime (libc,
#                             libm, the loader, libstdc++ and libgcc_s come from the host)
# On the other machine: export PATH=$PWD/.redis/bin:$PATH
# Usage (repository root): bash scripts/carry-redis.sh   (needs redis-server installed:
# .ci/install-redis.sh)
set -euo pipefail
rm -rf .redis && mkdir -p .redis/bin .redis/lib
grep -qx '/.redis/' .git/info/exclude 2>/dev/null || echo '/.redis/' >> .git/info/exclude
carry() {  # $1: a command on PATH; carried as .redis/bin/$1 with its libraries
  local exe name
  exe=$(command -v "$1") name=$1
  cp "$(readlink -f "$exe")" ".redis/lib/$name.bin"
  ldd "$exe" | awk '/=> \// {print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so.*|libm.so.*|ld-linux*|libstdc++.so.*|libgcc_s.so.*|libpthread.so.*|libdl.so.*) ;;
      *) cp -L "$lib" .redis/lib/ ;;
    esac
  done
  cat > ".redis/bin/$name" <<WRAP
#!/bin/sh
here=\$(dirname "\$(readlink -f "\$0")")
LD_LIBRARY_PATH="\$here/../lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "\$here/../lib/$name.bin" "\$@"
WRAP
  chmod +x ".redis/bin/$name" ".redis/lib/$name.bin"
}
carry redis-server
# redis-cli makes the clusters of 'lmcache bench l2 --redis-cluster-nodes N'.
if command -v redis-cli >/dev/null; then carry redis-cli; fi
.redis/bin/redis-server --version
du -sh .redis
