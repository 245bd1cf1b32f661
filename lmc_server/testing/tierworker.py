"""A worker and the polling a scheduler does, for tests of the tiers below L1.

A :class:`Worker` is a client with its own shared-memory KV cache (the DSV4.1-Flash
preset), registered with one server. :func:`lookup_until` polls like vLLM's scheduler
until a prefetch is done; :func:`retrieve_exact` retrieves what hit and compares it
byte for byte with the pages the storing worker wrote. :func:`l2_server`,
:func:`l2_stats` and :func:`wait_l2_written` start a server on an L2 store and read its
L2 counters, for every test module of the L2 tier; :func:`disk_server`,
:func:`disk_stats`, :func:`wait_disk_written` and :func:`value_files` the same for the
disk tier.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from lmc_server.client import Client, Registration
from lmc_server.protocol.stats import DiskReport, L2Report
from lmc_server.testing.kv import ShmKV, assert_same_pages, block_ids_for
from lmc_server.testing.poll import wait_for
from lmc_server.testing.presets import dsv41_flash
from lmc_server.testing.process import ServerProcess

CHUNK = 256
NUM_BLOCKS = 64
#: The flags of a tier test's server (with ``--l2 URL`` or ``--disk-dir`` added).
BASE_ARGS = ["--chunk-size", str(CHUNK), "--separate-object-groups", "--eviction-policy", "LRU"]


def tokens(seed: int, chunks: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 100_000, chunks * CHUNK)


def _all_written(st: L2Report | DiskReport, objects: int) -> bool:
    """``objects`` written by a tier, and nothing of it queued or being written."""
    return bool(
        st.objects_written >= objects and st.write_queue_objects == 0 and st.writes_in_flight == 0
    )


def l2_server(
    url: str, *extra: str, metrics_port: int = 0, l2_timeout_s: float = 0.5
) -> ServerProcess:
    """A server (0.25 GiB of L1) on the L2 store at ``url``."""
    return ServerProcess(
        [*BASE_ARGS, "--l2-timeout-s", str(l2_timeout_s), "--l2", url, *extra],
        l1_size_gb=0.25,
        metrics_port=metrics_port,
    )


def l2_stats(c: Client) -> L2Report:
    out = c.stats().l2
    assert out is not None, "the server runs without --l2"
    return out


def wait_l2_written(c: Client, objects: int) -> None:
    """Until ``objects`` objects are written to L2 and no write is queued or running."""

    wait_for(lambda: _all_written(l2_stats(c), objects), f"{objects} objects written to L2")


def disk_server(
    directory: Path, *extra: str, size_gb: float = 1.0, metrics_port: int = 0
) -> ServerProcess:
    """A server (0.25 GiB of L1) with the disk tier on ``directory``."""
    return ServerProcess(
        [
            *BASE_ARGS,
            "--l2-timeout-s",
            "0.5",
            "--disk-dir",
            str(directory),
            "--disk-size-gb",
            str(size_gb),
            *extra,
        ],
        l1_size_gb=0.25,
        metrics_port=metrics_port,
    )


def disk_stats(c: Client) -> DiskReport:
    out = c.stats().disk
    assert out is not None, "the server runs without --disk-dir"
    return out


def wait_disk_written(c: Client, objects: int) -> None:
    """Until ``objects`` objects are on disk and no write is queued or running."""

    wait_for(lambda: _all_written(disk_stats(c), objects), f"{objects} objects written to disk")


def value_files(directory: Path) -> list[Path]:
    """The value files under ``directory`` (not the temporaries, which start with a dot)."""
    return [p for p in directory.rglob("*") if p.is_file() and not p.name.startswith(".")]


class Worker:
    """A client with its own shm KV cache, registered with one server."""

    def __init__(
        self, endpoint: str, seed: int, arch: str = "sm90", num_blocks: int = NUM_BLOCKS
    ) -> None:
        self.kv = ShmKV(dsv41_flash(arch=arch, num_blocks=num_blocks))
        self.kv.fill_random(seed) if seed else self.kv.fill(0)
        self.client = Client(endpoint, timeout_s=30, client_name="pytest-tiers")
        self.reg: Registration = self.client.register(**self.kv.register_kwargs())

    def store(self, digests: bytes, block_seed: int) -> dict[str, np.ndarray]:
        n = len(digests) // 32
        ids = block_ids_for(self.reg, n, np.random.default_rng(block_seed))
        res = self.client.store(self.reg, digests, ids)
        assert res.ok.all(), res.statuses
        return ids

    def close(self) -> None:
        self.client.close()
        self.kv.close()


def lookup_until(
    c: Client, reg: Registration, digests: bytes, want: int, timeout_s: float = 20.0
) -> Any:
    """Look up (no lease) until ``want`` chunks hit and nothing is pending; then take
    the lease with one more lookup."""

    def ready() -> bool:
        r = c.lookup(reg, digests, lease=False)
        return r.hit_chunks >= want and r.l2_pending_chunks == 0

    wait_for(ready, f"{want} chunks to hit", timeout_s)
    return c.lookup(reg, digests)


def retrieve_exact(
    dst: Worker, src: Worker, src_ids: dict[str, np.ndarray], digests: bytes, n: int
) -> None:
    """``n`` chunks hit on ``dst`` and come back exactly as ``src`` stored them."""
    look = lookup_until(dst.client, dst.reg, digests, n)
    assert look.hit_chunks >= n and look.lease_id
    dst_ids = block_ids_for(dst.reg, n, np.random.default_rng(1234))
    res = dst.client.retrieve(dst.reg, digests[: n * 32], dst_ids)
    assert res.ok.all() and res.ok_prefix == n
    total = len(digests) // 32
    head = {g: ids[: len(ids) // total * n] for g, ids in src_ids.items()}
    assert_same_pages(dst.reg, src.kv, head, dst.kv, dst_ids, n)
    assert dst.client.release(look.lease_id)
