"""A shared-memory client leaves nothing in /dev/shm, even killed -9, and its segments
register any number of times (several clients, a restarted server).

Segments are nameless and handed to the server by descriptor
(:mod:`lmc_server.client.shm`), so a client killed with SIGKILL after registering, or
while its registration waits on a stalled server, leaves nothing behind, and neither
does a server killed before it mapped them; the server keeps serving, the killed
client's registration reaped, and the segments register with the next server.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

from lmc_server.buffers import ShmBuffer
from lmc_server.client import Client, chunk_digests
from lmc_server.client.shm import ShmSegment
from lmc_server.testing import ShmKV, simple_model
from lmc_server.testing.kv import block_ids_for
from lmc_server.testing.poll import wait_for
from lmc_server.testing.process import ServerProcess

SHM_DIR = "/dev/shm"

CLIENT = """
import sys, time
import numpy as np
from lmc_server.client import Client, chunk_digests
from lmc_server.testing import ShmKV, simple_model
from lmc_server.testing.kv import block_ids_for

kv = ShmKV(simple_model())
kv.fill_random(3)
c = Client(sys.argv[1])
if sys.argv[2] == "store":
    reg = c.register(**kv.register_kwargs())
    assert c.store(reg, chunk_digests(np.arange(256), 256), block_ids_for(reg, 1)).ok.all()
    print("registered", flush=True)
else:  # connected; told to register once the server is stopped: it waits on it
    print("connected", flush=True)
    sys.stdin.readline()
    c.timeout_s = 600
    c.register(**kv.register_kwargs())
time.sleep(600)
"""


def segments_of(pid: int) -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"lmc-{pid}-"))


def wait_reaped(endpoint: str) -> None:
    with Client(endpoint) as c:
        wait_for(lambda: not c.stats().registrations, "the killed client reaped")


def serves_byte_exact(endpoint: str, seed: int) -> None:
    with Client(endpoint) as c, ShmKV(simple_model()) as kv:
        kv.fill_random(seed)
        reg = c.register(**kv.register_kwargs())
        digests = chunk_digests(np.arange(256) + seed, 256)
        assert c.store(reg, digests, block_ids_for(reg, 1)).ok.all()
        before = kv.pages("full", list(range(16)))
        assert c.retrieve(reg, digests, block_ids_for(reg, 1, first_block=16)).ok.all()
        assert kv.pages("full", list(range(16, 32))) == before


@pytest.fixture(scope="module")
def srv() -> Iterator[ServerProcess]:
    with ServerProcess(["--heartbeat-timeout-s", "1"], l1_size_gb=0.25) as s:
        yield s


def start_client(endpoint: str, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CLIENT, endpoint, mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def stop_client(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait()
    for f in (proc.stdin, proc.stdout):
        if f is not None:
            f.close()


def test_a_client_killed_after_registering_leaves_nothing(srv: ServerProcess) -> None:
    proc = start_client(srv.endpoint, "store")
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "registered"
        assert segments_of(proc.pid) == []  # its segments have no name, ever
        with Client(srv.endpoint) as c:
            assert c.stats().registrations == 1
    finally:
        stop_client(proc)
    assert segments_of(proc.pid) == []
    wait_reaped(srv.endpoint)
    serves_byte_exact(srv.endpoint, 4)  # and the server serves the next client


def test_a_client_killed_while_its_registration_waits_leaves_nothing(
    srv: ServerProcess,
) -> None:
    """The client dies while the server is stopped, before any answer."""
    assert srv.proc is not None
    proc = start_client(srv.endpoint, "wait")
    assert proc.stdin is not None and proc.stdout is not None
    assert proc.stdout.readline().strip() == "connected"
    srv.proc.send_signal(signal.SIGSTOP)
    try:
        try:
            proc.stdin.write("register\n")
            proc.stdin.flush()
            time.sleep(0.5)  # the hand-over waits on the stopped server
            assert segments_of(proc.pid) == []
        finally:
            stop_client(proc)
    finally:
        srv.proc.send_signal(signal.SIGCONT)
    assert segments_of(proc.pid) == []
    wait_reaped(srv.endpoint)
    serves_byte_exact(srv.endpoint, 5)


def test_a_server_killed_before_opening_leaves_nothing() -> None:
    """The server dies with the registration unanswered: the client times out, and
    the segments register with the next server."""
    s = ServerProcess(l1_size_gb=0.25).start()
    with ShmKV(simple_model()) as kv:
        kv.fill_random(6)
        with Client(s.endpoint, timeout_s=1.0) as c:
            assert s.proc is not None
            s.proc.send_signal(signal.SIGSTOP)
            try:
                with pytest.raises(TimeoutError):
                    c.register(**kv.register_kwargs())
                assert segments_of(os.getpid()) == []
            finally:
                s.kill()
        with ServerProcess(port=s.port, l1_size_gb=0.25) as again, Client(again.endpoint) as c:
            reg = c.register(**kv.register_kwargs())
            digests = chunk_digests(np.arange(256) + 6, 256)
            assert c.store(reg, digests, block_ids_for(reg, 1)).ok.all()
            before = kv.pages("full", list(range(16)))
            assert c.retrieve(reg, digests, block_ids_for(reg, 1, first_block=16)).ok.all()
            assert kv.pages("full", list(range(16, 32))) == before
    assert segments_of(os.getpid()) == []


def test_a_segment_registers_again_after_a_server_restart() -> None:
    """Several registrations of one segment, before and after a restart on the same
    port; bytes stored through the first server's mapping are the segment's bytes,
    and the second server's loads land in the same memory."""
    with ShmKV(simple_model()) as kv:
        kv.fill_random(7)
        first = ServerProcess(l1_size_gb=0.25).start()
        try:
            with Client(first.endpoint) as a, Client(first.endpoint) as b:
                a.register(**kv.register_kwargs())
                b.register(**kv.register_kwargs())  # another client, the same segments
                assert a.stats().registrations == 2
                assert segments_of(os.getpid()) == []
        finally:
            first.kill()
        with ServerProcess(port=first.port, l1_size_gb=0.25) as again, Client(again.endpoint) as c:
            reg = c.register(**kv.register_kwargs())
            digests = chunk_digests(np.arange(256) + 7, 256)
            assert c.store(reg, digests, block_ids_for(reg, 1)).ok.all()
            before = kv.pages("full", list(range(16)))
            kv.fill(0)
            assert c.retrieve(reg, digests, block_ids_for(reg, 1)).ok.all()
            assert kv.pages("full", list(range(16))) == before
            assert segments_of(os.getpid()) == []
    assert segments_of(os.getpid()) == []


def test_a_refused_registration_leaves_nothing(srv: ServerProcess) -> None:
    """A registration refused after the server took the descriptors (a size larger than
    the segment): nothing stays, and the server still serves."""
    kv = ShmKV(simple_model())
    try:
        with Client(srv.endpoint) as c:
            kwargs = kv.register_kwargs()
            kwargs["buffers"] = [ShmBuffer(name=kwargs["buffers"][0].name, size_bytes=1 << 40)]
            with pytest.raises(Exception, match="bytes"):
                c.register(**kwargs)
            assert segments_of(os.getpid()) == []
    finally:
        kv.close()
    serves_byte_exact(srv.endpoint, 8)


def test_a_name_the_client_keeps_is_not_removed(srv: ServerProcess) -> None:
    """A segment another program manages, registered by its name: the server maps it
    by name and leaves the name alone."""
    name = f"lmc-{os.getpid()}-external"
    path = os.path.join(SHM_DIR, name)
    geo = simple_model()
    sizes = geo.buffer_sizes
    paths = [f"{path}-{i}" for i in range(len(sizes))]
    try:
        for p, size in zip(paths, sizes, strict=True):
            with open(p, "wb") as f:
                f.truncate(size)
        with ShmKV(geo) as kv, Client(srv.endpoint) as c:
            kwargs = kv.register_kwargs()
            kwargs["buffers"] = [
                ShmBuffer(name=os.path.basename(p), size_bytes=size)
                for p, size in zip(paths, sizes, strict=True)
            ]
            c.register(**kwargs)
            assert all(os.path.exists(p) for p in paths)
    finally:
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)


def test_a_closed_segment_cannot_be_handed_over() -> None:
    seg = ShmSegment(4096)
    seg.close()
    with pytest.raises(ValueError, match="closed"):
        seg.fileno()
