"""A shared-memory client leaves nothing in /dev/shm, even killed -9.

A segment's name is removed as soon as the server has acknowledged the registration
(the server's mapping does not need it), so a client killed with SIGKILL right after
leaves no ``lmc-<pid>-*`` file behind; the server keeps serving, with the killed
client's registration reaped. A segment registered once cannot be registered again
(the name is gone): the client says so before sending, unless the segment keeps its
name.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

from lmc_server.client import Client, chunk_digests
from lmc_server.testing import ShmKV, simple_model
from lmc_server.testing.kv import block_ids_for
from lmc_server.testing.process import ServerProcess

SHM_DIR = "/dev/shm"

CLIENT = """
import sys, time
import numpy as np
from lmc_server.client import Client, chunk_digests
from lmc_server.testing import ShmKV, simple_model
from lmc_server.testing.kv import block_ids_for

kv = ShmKV(simple_model(), keep_names=False)
kv.fill_random(3)
c = Client(sys.argv[1])
reg = c.register(**kv.register_kwargs())
assert c.store(reg, chunk_digests(np.arange(256), 256), block_ids_for(reg, 1)).ok.all()
print("registered", flush=True)
time.sleep(600)
"""


def segments_of(pid: int) -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"lmc-{pid}-"))


@pytest.fixture(scope="module")
def srv() -> Iterator[ServerProcess]:
    with ServerProcess(["--heartbeat-timeout-s", "1"], l1_size_gb=0.25) as s:
        yield s


def test_a_client_killed_after_registering_leaves_nothing(srv: ServerProcess) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", CLIENT, srv.endpoint], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "registered"
        assert segments_of(proc.pid) == []  # the names went with the acknowledgement
        with Client(srv.endpoint) as c:
            assert c.stats().registrations == 1
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    assert segments_of(proc.pid) == []
    with Client(srv.endpoint) as c, ShmKV(simple_model()) as kv:
        deadline = time.monotonic() + 20
        while c.stats().registrations:  # the killed client's registration is reaped
            assert time.monotonic() < deadline, "the killed client was not reaped"
            time.sleep(0.05)
        kv.fill_random(4)  # and the server serves the next client, byte-exact
        reg = c.register(**kv.register_kwargs())
        digests = chunk_digests(np.arange(256) + 1, 256)
        assert c.store(reg, digests, block_ids_for(reg, 1)).ok.all()
        before = kv.pages("full", list(range(16)))
        assert c.retrieve(reg, digests, block_ids_for(reg, 1, first_block=16)).ok.all()
        assert kv.pages("full", list(range(16, 32))) == before


def test_a_segment_is_registered_once_unless_it_keeps_its_name(srv: ServerProcess) -> None:
    with (
        Client(srv.endpoint) as c,
        ShmKV(simple_model(), keep_names=False) as once,
        ShmKV(simple_model(), keep_names=True) as kept,
    ):
        c.register(**once.register_kwargs())
        assert not any(os.path.exists(s.path) for s in once.segments)
        with pytest.raises(ValueError, match="registered already"):
            c.register(**once.register_kwargs())
        kept_paths = [s.path for s in kept.segments]
        for _ in range(2):  # several registrations: the names stay until close
            c.register(**kept.register_kwargs())
            assert all(os.path.exists(p) for p in kept_paths)
        assert c.stats().registrations == 3  # the refusal sent nothing
    assert kept_paths and not any(os.path.exists(p) for p in kept_paths)
