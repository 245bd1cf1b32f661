"""Stores that wait on an engine event become visible only once their client confirms.

An event also completes when the engine process dies mid-write, so a copy that waited on
one proves nothing by itself. These tests use the null backend (full bookkeeping, no
bytes; the cpu backend takes no events) and a raw socket to play a client that dies
between the store reply and its confirmation.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
import zmq

from lmc_server.cache.geometry import ShmBuffer
from lmc_server.client import Client, Registration, chunk_digests
from lmc_server.protocol import messages as m
from lmc_server.protocol.codec import decode_reply, encode
from lmc_server.testing import dsv41_flash
from lmc_server.testing.kv import block_ids_for
from lmc_server.testing.process import ServerProcess

GEO = dsv41_flash(num_blocks=64)


@pytest.fixture(scope="module")
def null_server() -> Iterator[ServerProcess]:
    with ServerProcess(["--separate-object-groups"], backend="null") as srv:
        yield srv


def register(c: Client) -> Registration:
    bufs = [ShmBuffer(name=f"lmc-null-{i}", size_bytes=s)
            for i, s in enumerate(GEO.buffer_sizes)]
    return c.register(model=GEO.model, kv_dtype=GEO.kv_dtype, arch="sm90", groups=GEO.groups,
                      buffers=bufs, replicated=True, world_size=2)


def test_client_confirms_and_the_chunks_become_visible(null_server: ServerProcess) -> None:
    with Client(null_server.endpoint) as writer, Client(null_server.endpoint) as reader:
        reg, observer = register(writer), register(reader)
        digests = chunk_digests(np.arange(2 * 256) + 5, 256)
        res = writer.store(reg, digests, block_ids_for(reg, 2), wait_event=b"engine-event")
        assert res.ok.all()
        writer.ping()  # the confirm went out before this request
        assert reader.lookup(observer, digests, lease=False).hit_chunks == 2


def test_client_dying_before_it_confirms_leaves_nothing(null_server: ServerProcess) -> None:
    digests = chunk_digests(np.arange(2 * 256) + 9, 256)
    with Client(null_server.endpoint) as reader:
        observer = register(reader)
        before = reader.stats()["l1"]["used_bytes"]
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(null_server.endpoint)

        def call(msg: m._Msg) -> m.Reply:
            s.send(encode(msg))
            assert s.poll(5000)
            return decode_reply(s.recv())

        assert isinstance(call(m.Hello(req_id=1, protocol_version=1)), m.Welcome)
        bufs = [ShmBuffer(name=f"lmc-null-{i}", size_bytes=x)
                for i, x in enumerate(GEO.buffer_sizes)]
        reg = call(m.Register(req_id=2, model=GEO.model, kv_dtype=GEO.kv_dtype, arch="sm90",
                              groups=GEO.groups, buffers=bufs, replicated=True, world_size=2))
        assert isinstance(reg, m.Registered)
        ids = Registration(reg.registration_id, reg.namespace, 256, False,
                           list(reg.object_groups), GEO.groups).encode_block_ids(
            block_ids_for(observer, 2), 2)
        res = call(m.Store(req_id=3, registration_id=reg.registration_id, digests=digests,
                           block_ids=ids, wait_event=b"event"))
        assert isinstance(res, m.StoreResult) and res.confirm_token
        assert reader.lookup(observer, digests, lease=False).hit_chunks == 0, \
            "visible before its confirmation"
        s.close(linger=0)  # gone without confirming
        ctx.term()
        deadline = time.monotonic() + 5
        while reader.stats()["registrations"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert reader.lookup(observer, digests, lease=False).hit_chunks == 0
        report = reader.stats()
        assert report["l1"]["used_bytes"] == before
        assert all(p["writing"] == 0 for p in report["partitions"])


def test_a_confirmation_for_another_connection_is_refused(null_server: ServerProcess) -> None:
    with Client(null_server.endpoint) as writer, Client(null_server.endpoint) as other:
        reg = register(writer)
        digests = chunk_digests(np.arange(256) + 77, 256)
        writer._sock.send(encode(m.Store(  # type: ignore[attr-defined]
            req_id=900, registration_id=reg.registration_id, digests=digests,
            block_ids=reg.encode_block_ids(block_ids_for(reg, 1), 1), wait_event=b"e")))
        assert writer._sock.poll(5000)  # type: ignore[attr-defined]
        res = decode_reply(writer._sock.recv())  # type: ignore[attr-defined]
        assert isinstance(res, m.StoreResult) and res.confirm_token
        stolen = other._call(m.Confirm(req_id=5, token=res.confirm_token), m.Confirmed)  # type: ignore[attr-defined]
        assert not stolen.committed
        mine = writer._call(m.Confirm(req_id=6, token=res.confirm_token), m.Confirmed)  # type: ignore[attr-defined]
        assert mine.committed
