"""``--disk-size-gb`` bounds the directory at every moment, whoever writes into it.

Three real servers share one directory and store far more than it holds, at once.
While they do, the test freezes all three (SIGSTOP: nothing changes on disk while it
looks), sums the sizes of the tier's files (values and temporary files, partial ones
too) and lets them go on (SIGCONT), again and again: no sample is above the capacity,
nor is any server's ``used_bytes`` in ``stats``. At the end every stored object was
written or dropped with a reason, and what is on disk is served byte for byte.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
from pathlib import Path

from lmc_server.client import Client, chunk_digests
from lmc_server.testing.process import ServerProcess
from lmc_server.testing.tierworker import (
    CHUNK,
    Worker,
    disk_server,
    disk_stats,
    retrieve_exact,
    tokens,
    wait_for,
)

#: About 11 chunks of the preset (5.4 MB each, two objects): three servers storing
#: 3 x 24 chunks overflow it several times.
CAPACITY_GB = 0.06
SERVERS = 3
PROMPTS = 6  # per server, of 4 chunks


def tier_bytes(directory: Path) -> int:
    """The sizes of the tier's files (fan-out directories: values and temporaries)."""
    total = 0
    base = directory / "lmc2"
    for top, _dirs, files in os.walk(base):
        if Path(top) == base:
            continue
        for name in files:
            try:
                total += os.lstat(os.path.join(top, name)).st_size
            except FileNotFoundError:
                pass
    return total


def is_up(c: Client) -> bool:
    return disk_stats(c).state == "up"


def prefetched(w: Worker, digests: bytes) -> tuple[int] | None:
    """(chunks hit,) once nothing is being fetched any more."""
    x = w.client.lookup(w.reg, digests, lease=False)
    return None if x.l2_pending_chunks else (x.hit_chunks,)


class Sampler(threading.Thread):
    """Freezes the servers, sums the tier's files, thaws them; until stopped."""

    def __init__(self, servers: list[ServerProcess], directory: Path) -> None:
        super().__init__(daemon=True)
        self.pids = [s.proc.pid for s in servers if s.proc is not None]
        self.directory = directory
        self.samples: list[int] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.02):
            for pid in self.pids:
                os.kill(pid, signal.SIGSTOP)
            try:
                self.samples.append(tier_bytes(self.directory))
            finally:
                for pid in self.pids:
                    os.kill(pid, signal.SIGCONT)


def test_servers_sharing_a_directory_never_pass_its_capacity(tmp_path: Path) -> None:
    directory = tmp_path / "disk"
    capacity = int(CAPACITY_GB * (1 << 30))
    servers = [disk_server(directory, size_gb=CAPACITY_GB) for _ in range(SERVERS)]
    for s in servers:
        s.start()
    workers = [Worker(s.endpoint, seed=10 + i) for i, s in enumerate(servers)]
    watchers = [Client(s.endpoint, timeout_s=30) for s in servers]  # the main thread's
    sampler = Sampler(servers, directory)
    try:
        for c in watchers:
            wait_for(functools.partial(is_up, c), "disk tier up")
        stored: list[list[tuple[bytes, dict]]] = [[] for _ in workers]
        errors: list[BaseException] = []

        def store_all(i: int) -> None:
            try:
                for p in range(PROMPTS):
                    d = chunk_digests(tokens(1000 * i + p, 4), CHUNK)
                    stored[i].append((d, workers[i].store(d, block_seed=p)))
            except BaseException as e:  # reported below
                errors.append(e)

        sampler.start()
        threads = [threading.Thread(target=store_all, args=(i,)) for i in range(SERVERS)]
        for t in threads:
            t.start()
        used_seen = 0
        while any(t.is_alive() for t in threads):
            used_seen = max(used_seen, *(disk_stats(c).used_bytes for c in watchers))
        for t in threads:
            t.join()
        assert not errors, errors

        def drained() -> bool:
            return all(
                (st := disk_stats(w.client)).write_queue_objects == 0 and st.writes_in_flight == 0
                for w in workers
            )

        wait_for(drained, "every write queue drained", 60)
        sampler.done.set()
        sampler.join()
        assert len(sampler.samples) >= 5, "too few samples to say anything"
        assert max(sampler.samples) <= capacity, (max(sampler.samples), capacity)
        assert tier_bytes(directory) <= capacity
        for w in workers:
            st = disk_stats(w.client)
            used_seen = max(used_seen, st.used_bytes)
            # Every committed object is written or dropped with a reason.
            assert st.objects_written + sum(st.dropped_writes.values()) == PROMPTS * 4 * 2
            assert not st.errors and not st.invalid
        assert used_seen <= capacity
        assert max(sampler.samples) > capacity // 2  # it was filled, not left empty
        # What is on disk is served exactly: the last prompt of each server, from a
        # fresh server on the same directory.
        with disk_server(directory, size_gb=CAPACITY_GB) as fresh:
            reader = Worker(fresh.endpoint, seed=0)
            try:
                for i, w in enumerate(workers):
                    d, ids = stored[i][-1]
                    r = wait_for(functools.partial(prefetched, reader, d), "prefetch done")[0]
                    if r:
                        retrieve_exact(reader, w, ids, d, r)
                assert not disk_stats(reader.client).invalid
            finally:
                reader.close()
    finally:
        sampler.done.set()
        for w in workers:
            w.close()
        for c in watchers:
            c.close()
        for s in servers:
            s.terminate()
