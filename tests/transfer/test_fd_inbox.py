"""The cpu engine's descriptor socket: what it takes, what it refuses, and that a
registration maps exactly the descriptors handed over with its token.

Refusals answer the peer (``error: ...``) and the inbox keeps serving; a registration
naming a token that was taken, never sent, or sent to another server is refused with a
``transfer`` error while the server keeps serving other clients byte-exact.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest

from lmc_server.buffers import ShmFdBuffer
from lmc_server.client import Client, ServerError, chunk_digests
from lmc_server.client import shm as client_shm
from lmc_server.testing import ShmKV, simple_model
from lmc_server.testing.kv import block_ids_for
from lmc_server.testing.process import ServerProcess
from lmc_server.transfer import fd_inbox
from lmc_server.transfer.fd_inbox import FdInbox, FdInboxError


def send(inbox_name: str, data: bytes, fds: list[int]) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(5)
        s.connect("\0" + inbox_name)
        socket.send_fds(s, [data], fds)
        return s.recv(256)


def sealed_memfd(size: int) -> int:
    fd = os.memfd_create("lmc-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


@pytest.fixture
def inbox() -> Iterator[FdInbox]:
    box = FdInbox(ttl_s=0.3)
    try:
        yield box
    finally:
        box.close()


def test_the_token_size_is_the_clients() -> None:
    assert client_shm.TOKEN_BYTES == fd_inbox.TOKEN_BYTES


def test_descriptors_are_taken_once(inbox: FdInbox) -> None:
    fd = sealed_memfd(4096)
    token = secrets.token_bytes(fd_inbox.TOKEN_BYTES)
    try:
        assert send(inbox.name, token, [fd]) == b"ok"
        assert send(inbox.name, token, [fd]) == b"error: token in use"
    finally:
        os.close(fd)
    (got,) = inbox.take(token)
    try:
        assert os.fstat(got).st_size == 4096  # the same file, through another descriptor
    finally:
        os.close(got)
    with pytest.raises(FdInboxError, match="no descriptors under this token"):
        inbox.take(token)
    assert inbox.pending_fds == 0


def test_malformed_messages_are_refused_and_the_inbox_serves_on(inbox: FdInbox) -> None:
    fd = sealed_memfd(4096)
    try:
        assert send(inbox.name, b"short", [fd]).startswith(b"error: one message of 16 bytes")
        assert send(inbox.name, secrets.token_bytes(16), []).startswith(b"error: one message")
        too_many = [fd] * (fd_inbox.MAX_FDS_PER_MESSAGE + 1)
        assert send(inbox.name, secrets.token_bytes(16), too_many).startswith(b"error:")
        assert inbox.pending_fds == 0
        assert send(inbox.name, secrets.token_bytes(16), [fd]) == b"ok"
        assert inbox.pending_fds == 1
    finally:
        os.close(fd)


def test_descriptors_never_claimed_are_closed(inbox: FdInbox) -> None:
    fd = sealed_memfd(4096)
    try:
        assert send(inbox.name, secrets.token_bytes(16), [fd]) == b"ok"
    finally:
        os.close(fd)
    deadline = time.monotonic() + 5
    while inbox.pending_fds:  # expired on the inbox's own clock, without a take
        assert time.monotonic() < deadline, "an unclaimed descriptor was kept"
        time.sleep(0.05)


def test_a_peer_of_another_user_and_group_is_refused(inbox: FdInbox) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to run a peer under another uid")
    fd = sealed_memfd(4096)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the peer: nobody
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            os.write(w, send(inbox.name, secrets.token_bytes(16), [fd]))
        except BaseException as e:
            os.write(w, repr(e).encode())
        finally:
            os._exit(0)
    os.close(w)
    try:
        answer = os.read(r, 256)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
        os.close(fd)
    assert answer == b"error: descriptors are taken from the server's own user or group only"
    assert inbox.pending_fds == 0


@pytest.fixture(scope="module")
def srv() -> Iterator[ServerProcess]:
    with ServerProcess(l1_size_gb=0.25) as s:
        yield s


def serves_byte_exact(endpoint: str, seed: int) -> None:
    with Client(endpoint) as c, ShmKV(simple_model()) as kv:
        kv.fill_random(seed)
        reg = c.register(**kv.register_kwargs())
        digests = chunk_digests(np.arange(256) + seed, 256)
        assert c.store(reg, digests, block_ids_for(reg, 1)).ok.all()
        before = kv.pages("full", list(range(16)))
        assert c.retrieve(reg, digests, block_ids_for(reg, 1, first_block=16)).ok.all()
        assert kv.pages("full", list(range(16, 32))) == before


def test_a_token_registers_once(srv: ServerProcess) -> None:
    """A second registration naming the descriptors of the first (another client that
    saw the message, say) is refused: they were taken."""
    with Client(srv.endpoint) as c, ShmKV(simple_model()) as kv:
        assert c.welcome is not None and c.welcome.fd_socket
        passed = client_shm.handed_over(kv.buffers, c.welcome.fd_socket, 5.0)
        assert all(isinstance(b, ShmFdBuffer) for b in passed)
        kwargs = kv.register_kwargs(buffers=passed)
        with Client(srv.endpoint) as first:
            first.register(**kwargs)  # descriptors by token are sent as they are
        with pytest.raises(ServerError) as err:
            c.register(**kwargs)
        assert err.value.code == "transfer"
        assert "no descriptors under this token" in str(err.value)
    serves_byte_exact(srv.endpoint, 11)


def test_a_segment_not_sealed_is_refused(srv: ServerProcess) -> None:
    """A descriptor that could shrink under the mapping (SIGBUS in the server) is not
    mapped."""
    geo = simple_model()
    fds = []
    for size in geo.buffer_sizes:
        fd = os.memfd_create("lmc-unsealed")
        os.ftruncate(fd, size)
        fds.append(fd)
    try:
        with Client(srv.endpoint) as c, ShmKV(geo) as kv:
            assert c.welcome is not None
            token = secrets.token_bytes(16)
            assert send(c.welcome.fd_socket, token, fds) == b"ok"
            bufs = [
                ShmFdBuffer(token=token, index=i, size_bytes=s)
                for i, s in enumerate(geo.buffer_sizes)
            ]
            with pytest.raises(ServerError, match="F_SEAL_SHRINK") as err:
                c.register(**kv.register_kwargs(buffers=bufs))
            assert err.value.code == "transfer"
    finally:
        for fd in fds:
            os.close(fd)
    serves_byte_exact(srv.endpoint, 12)


def test_a_descriptor_index_not_sent_is_refused(srv: ServerProcess) -> None:
    with Client(srv.endpoint) as c, ShmKV(simple_model()) as kv:
        assert c.welcome is not None
        passed = client_shm.handed_over(kv.buffers, c.welcome.fd_socket, 5.0)
        assert isinstance(passed[0], ShmFdBuffer)
        bad = [ShmFdBuffer(token=passed[0].token, index=99, size_bytes=passed[0].size_bytes)]
        with pytest.raises(ServerError, match="descriptor 99 not sent") as err:
            c.register(**kv.register_kwargs(buffers=bad + passed[1:]))
        assert err.value.code == "transfer"
    serves_byte_exact(srv.endpoint, 13)
