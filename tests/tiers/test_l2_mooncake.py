"""The L2 tier on Mooncake Store: the adapter contract and server A -> L2 -> server B.

Needs the ``mooncake-transfer-engine-non-cuda`` package (the default wheel links the
CUDA driver and cannot load on CPU-only hosts) and ``libibverbs1``; not in the test
extra (a 100 MB wheel). Opt-in with ``LMC_MOONCAKE_TESTS=1``: Mooncake's master (HTTP
metadata server, metrics) and its client's transfer-engine RPC listen on every
interface whatever their host options say, and these tests are kept to loopback-only
services by default. See docs/l2.md.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmc_server.client import chunk_digests
from lmc_server.testing.process import ServerProcess, free_port
from lmc_server.tiers.backend import L2Backend

_REASON = ""
if os.environ.get("LMC_MOONCAKE_TESTS") != "1":
    _REASON = "opt-in (LMC_MOONCAKE_TESTS=1): Mooncake's master and client listen on all interfaces"
elif importlib.util.find_spec("mooncake") is None:
    _REASON = "mooncake-transfer-engine-non-cuda is not installed"
pytestmark = pytest.mark.skipif(bool(_REASON), reason=_REASON)


def _master_exe() -> str | None:
    near = Path(sys.executable).with_name("mooncake_master")
    return str(near) if near.exists() else shutil.which("mooncake_master")


@pytest.fixture
def mooncake_url() -> Iterator[str]:
    exe = _master_exe()
    assert exe is not None, "mooncake_master not found"
    rpc, meta, metrics = free_port(), free_port(), free_port()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [
                exe,
                "-rpc_port",
                str(rpc),
                "-rpc_address",
                "127.0.0.1",
                "-enable_http_metadata_server=true",
                "-http_metadata_server_host",
                "127.0.0.1",
                "-http_metadata_server_port",
                str(meta),
                "-metrics_port",
                str(metrics),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            t0 = time.monotonic()
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{meta}/metadata?key=x", timeout=1)
                    break
                except urllib.error.HTTPError:
                    break  # answering (404 for an unknown key)
                except OSError:
                    if time.monotonic() - t0 > 20 or proc.poll() is not None:
                        log.seek(0)
                        raise RuntimeError(log.read().decode(errors="replace")) from None
                    time.sleep(0.1)
            yield (
                f"mooncake://127.0.0.1:{rpc}?metadata=http://127.0.0.1:{meta}/metadata"
                f"&segment_mb=128&buffer_mb=64"
            )
        finally:
            proc.kill()
            proc.wait()


def test_adapter_contract(mooncake_url: str) -> None:
    from lmc_server.tiers.mooncake_backend import MooncakeBackend

    async def run(b: L2Backend) -> None:
        await b.connect()
        items = [(bytes([i]) * 53, os.urandom(1000 + i)) for i in range(5)]
        await b.put_many(items)
        got = await b.get_many([k for k, _ in items] + [b"absent" * 9])
        assert got[:5] == [v for _, v in items] and got[5] is None
        await b.put_many([(items[0][0], b"overwritten" * 10)])
        assert await b.get_many([items[0][0]]) == [b"overwritten" * 10]
        await b.close()

    asyncio.run(run(MooncakeBackend(mooncake_url)))


def test_store_on_server_a_retrieve_on_server_b_byte_exact(mooncake_url: str) -> None:
    from test_l2_redis import (  # type: ignore[import-not-found]  # a sibling test module
        ARGS,
        CHUNK,
        Worker,
        l2_stats,
        retrieve_exact,
        tokens,
        wait_for,
        wait_written,
    )

    n = 4
    digests = chunk_digests(tokens(1, n), CHUNK)
    env = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    with (
        ServerProcess(
            [*ARGS, "--l2", mooncake_url, "--l2-timeout-s", "5"], l1_size_gb=0.25, env=env
        ) as a,
        ServerProcess(
            [*ARGS, "--l2", mooncake_url, "--l2-timeout-s", "5"], l1_size_gb=0.25, env=env
        ) as b,
    ):
        wa, wb = Worker(a.endpoint, seed=11), Worker(b.endpoint, seed=0)
        try:
            wait_for(lambda: l2_stats(wa.client).state == "up", "A connected", 30)
            wait_for(lambda: l2_stats(wb.client).state == "up", "B connected", 30)
            ids = wa.store(digests, block_seed=2)
            wait_written(wa.client, 2 * n)
            retrieve_exact(wb, wa, ids, digests, n)
            assert l2_stats(wb.client).hits >= n
        finally:
            wa.close()
            wb.close()
