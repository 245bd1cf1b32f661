"""The blocking and asyncio clients are one request path over two transports.

Both are driven through the same scenario (:class:`Blocking` runs the asyncio client's
coroutines to completion, so one function drives either), and must

* send byte-identical frames for the same calls, and read identical replies into equal
  values (a recording server on loopback answers with canned replies, so registration
  ids and statuses are the same for both), including the re-hello after a server that
  forgot the session;
* raise the same :class:`ServerError` (code and message) for every refusal of a real
  server, which keeps serving a well-behaved client byte-exactly afterwards;
* refuse bad block ids the same way before anything is sent.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from lmc_server import PROTOCOL_VERSION
from lmc_server.client import Client, ServerError
from lmc_server.client.aio import AsyncClient
from lmc_server.client.digests import chunk_digests
from lmc_server.protocol import messages as m
from lmc_server.protocol.codec import encode
from lmc_server.protocol.stats import Counters, L1Report, StatsReport
from lmc_server.testing.inprocess import ThreadServer, run_server
from lmc_server.testing.kv import ShmKV, assert_same_pages, block_ids_for
from lmc_server.testing.presets import simple_model
from lmc_server.testing.process import free_port

CHUNK = 256
MAX_FRAME = 1 << 20


class Blocking:
    """An :class:`AsyncClient` whose request methods block: each coroutine runs to
    completion on a private event loop, so a scenario written against :class:`Client`
    drives the asyncio client's transport unchanged."""

    def __init__(self, endpoint: str, **kwargs: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.client = self.loop.run_until_complete(AsyncClient.connect(endpoint, **kwargs))

    @property
    def welcome(self) -> m.Welcome | None:
        return self.client.welcome

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.client, name)
        return lambda *a, **kw: self.loop.run_until_complete(method(*a, **kw))

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())
        self.loop.close()


def sync_client(endpoint: str, **kwargs: Any) -> Client:
    return Client(endpoint, **kwargs)


CLIENTS: dict[str, Callable[..., Any]] = {"sync": sync_client, "asyncio": Blocking}


# -- byte-identical requests --------------------------------------------------------------


OBJECT_GROUPS = [m.ObjectGroupInfo(name="kv", object_bytes=4096, groups=["full"])]

#: A small, complete stats report (the reply is typed: every required field present).
STATS = StatsReport(
    version="t",
    backend="cpu",
    chunk_size=CHUNK,
    separate_object_groups=True,
    eviction_policy="LRU",
    uptime_s=1.5,
    l1=L1Report(
        capacity_bytes=1 << 30,
        ready_bytes=1 << 30,
        slab_bytes=1 << 26,
        slabs=16,
        ready_slabs=16,
        free_slabs=16,
        used_bytes=0,
        objects=3,
    ),
    partitions=[],
    sessions=1,
    registrations=1,
    leases=0,
    counters=Counters(lookups=2, requests={"lookup:ok": 2}),
    phases={},
    l2=None,
)


def canned_reply(req: m._Msg) -> m._Msg:
    """A fixed, valid answer to each request type (the same for every client)."""
    rid = req.req_id
    if isinstance(req, m.Hello):
        return m.Welcome(
            req_id=rid,
            protocol_version=PROTOCOL_VERSION,
            server_version="t",
            chunk_size=CHUNK,
            backend="cpu",
            max_frame_bytes=MAX_FRAME,
            max_chunks_per_request=16,
        )
    if isinstance(req, m.Register):
        return m.Registered(
            req_id=rid,
            registration_id=b"R" * 16,
            namespace="ns",
            chunk_size=CHUNK,
            lookup_only=not req.buffers,
            object_groups=OBJECT_GROUPS,
        )
    if isinstance(req, m.Lookup):
        return m.LookupResult(
            req_id=rid,
            hit_chunks=len(req.digests) // 32 - 1,
            lease_id=7 if req.lease else 0,
            lease_ttl_s=2.5 if req.lease else 0.0,
            l2_pending_chunks=1,
        )
    if isinstance(req, m.Store | m.Retrieve):
        n = len(req.digests) // 32
        statuses = [bytes(range(n))]
        return (
            m.StoreResult(req_id=rid, statuses=statuses)
            if isinstance(req, m.Store)
            else m.RetrieveResult(req_id=rid, statuses=statuses)
        )
    if isinstance(req, m.Release):
        return m.Released(req_id=rid, released=req.lease_id == 7)
    if isinstance(req, m.Stats):
        return m.StatsResult(req_id=rid, stats=STATS)
    if isinstance(req, m.Clear):
        return m.Cleared(req_id=rid, evicted=3)
    if isinstance(req, m.Unregister):
        return m.Unregistered(req_id=rid)
    assert isinstance(req, m.Ping), req
    return m.Pong(req_id=rid, server_version="t", ready=True)


class RecordingServer:
    """A ROUTER on loopback that records every request frame and answers it with
    :func:`canned_reply`; the first request of the type in ``forget_once`` is answered
    ``handshake`` instead (a server that lost the session)."""

    def __init__(self, forget_once: type[m._Msg] | None = None) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.frames: list[bytes] = []
        self.forget_once = forget_once
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        decoder = msgspec.msgpack.Decoder(m.Request)
        while not self._stop.is_set():
            if not self._sock.poll(20):
                continue
            identity, frame = self._sock.recv_multipart()
            self.frames.append(frame)
            req = decoder.decode(frame)
            if self.forget_once is not None and isinstance(req, self.forget_once):
                self.forget_once = None
                reply: m._Msg = m.Error(
                    req_id=req.req_id, code="handshake", message="send hello first"
                )
            else:
                reply = canned_reply(req)
            self._sock.send_multipart([identity, encode(reply)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._sock.close()
        self._ctx.term()


def every_request(c: Any, kv: ShmKV) -> list[Any]:
    """One of each request, with the optional arguments both ways; returns the values."""
    digests = chunk_digests(np.arange(3 * CHUNK), CHUNK)
    reg = c.register(**kv.register_kwargs(world_size=2, rank=1, replicated=True))
    scheduler = c.register(**kv.register_kwargs(buffers=[]))
    ids = {"full": np.arange(3 * CHUNK // 16, dtype=np.int32)}
    listed = {"full": list(range(3 * CHUNK // 16))}
    return [
        c.ping(),
        c.stats(),
        c.welcome,
        reg,
        scheduler,
        c.lookup(reg, digests),
        c.lookup(scheduler, digests[:64], salt=b"s", lease=False),
        c.release(7),
        c.release(8),
        c.store(reg, digests, ids).statuses,
        c.store(reg, digests, listed, salt=b"s").statuses,
        c.retrieve(reg, digests, ids).statuses,
        c.retrieve(reg, digests, ids, salt=b"s", prefix_ends=[1, 3]).statuses,
        c.clear(),
        c.unregister(scheduler),
    ]


def equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    return bool(a == b)


@pytest.mark.parametrize(
    "forget", [None, m.Lookup, m.Store], ids=["plain", "rehello-lookup", "rehello-store"]
)
def test_both_clients_send_the_same_bytes_and_read_the_same_values(
    forget: type[m._Msg] | None,
) -> None:
    frames: dict[str, list[bytes]] = {}
    values: dict[str, list[Any]] = {}
    with ShmKV(simple_model(layers=1, bytes_per_token=16)) as kv:
        for name, make in CLIENTS.items():
            rec = RecordingServer(forget_once=forget)
            try:
                c = make(rec.endpoint, client_name="twin", timeout_s=10)
                try:
                    values[name] = every_request(c, kv)
                finally:
                    c.close()
            finally:
                rec.close()
            frames[name] = rec.frames
    assert len(frames["sync"]) == 15 + (2 if forget else 0)
    assert frames["sync"] == frames["asyncio"]
    kinds = [type(msgspec.msgpack.decode(f, type=m.Request)).__name__ for f in frames["sync"]]
    if forget is not None:
        # the refused request, a new hello, the same request again (same bytes)
        i = kinds.index(forget.__name__)
        assert kinds[i + 1] == "Hello" and frames["sync"][i] == frames["sync"][i + 2]
    assert all(equal(a, b) for a, b in zip(values["sync"], values["asyncio"], strict=True))
    # the canned replies came through as values, not merely equal between the clients
    v = values["sync"]
    assert v[6].hit_chunks == 1 and v[6].lease_id == 0 and v[5].l2_pending_chunks == 1
    assert v[7:9] == [True, False] and v[13] == 3 and v[14] is None
    assert v[3].registration_id == b"R" * 16 and not v[3].lookup_only and v[4].lookup_only
    assert v[9]["kv"].tolist() == [0, 1, 2]


# -- refusals -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadServer]:
    with run_server(max_frame_bytes=MAX_FRAME, chunk_size=CHUNK, l1_size_gb=0.125) as ts:
        yield ts


def refusal_unknown_registration(c: Any, kv: ShmKV) -> None:
    reg = c.register(**kv.register_kwargs())
    c.unregister(reg)
    c.lookup(reg, chunk_digests(np.arange(CHUNK), CHUNK))


def refusal_unknown_registration_store(c: Any, kv: ShmKV) -> None:
    reg = c.register(**kv.register_kwargs())
    c.unregister(reg)
    c.store(reg, chunk_digests(np.arange(CHUNK), CHUNK), block_ids_for(reg, 1))


def refusal_chunk_size(c: Any, kv: ShmKV) -> None:
    geo = simple_model(tokens_per_block=48, layers=1, bytes_per_token=16)
    c.register(model=geo.model, kv_dtype=geo.kv_dtype, arch=geo.arch, groups=geo.groups)


def refusal_oversized_frame(c: Any, kv: ShmKV) -> None:
    reg = c.register(**kv.register_kwargs(buffers=[]))
    c.lookup(reg, bytes(MAX_FRAME))


def refusal_too_many_chunks(c: Any, kv: ShmKV) -> None:
    reg = c.register(**kv.register_kwargs(buffers=[]))
    over = c.welcome.max_chunks_per_request + 1
    assert 32 * over < MAX_FRAME - 1024, "under the frame limit, over the chunk limit"
    c.lookup(reg, bytes(32 * over))


def refusal_lookup_only(c: Any, kv: ShmKV) -> None:
    reg = c.register(**kv.register_kwargs(buffers=[]))
    c.retrieve(reg, chunk_digests(np.arange(CHUNK), CHUNK), block_ids_for(reg, 1))


def refusal_block_out_of_range(c: Any, kv: ShmKV) -> None:
    reg = c.register(**kv.register_kwargs())
    c.store(
        reg, chunk_digests(np.arange(CHUNK), CHUNK), {"full": np.arange(16, dtype=np.int32) + 60}
    )


def refusal_digest_length(c: Any, kv: ShmKV) -> None:
    reg = c.register(**kv.register_kwargs())
    c.lookup(reg, bytes(33))


def refusal_prefix_ends(c: Any, kv: ShmKV) -> None:
    reg = c.register(**kv.register_kwargs())
    c.retrieve(
        reg, chunk_digests(np.arange(2 * CHUNK), CHUNK), block_ids_for(reg, 2), prefix_ends=[2, 1]
    )


def refusal_model_name(c: Any, kv: ShmKV) -> None:
    c.register(**kv.register_kwargs(model="no spaces allowed"))


#: scenario -> (what it does, the code every client must raise, part of the message)
REFUSALS: dict[str, tuple[Callable[[Any, ShmKV], None], str, str]] = {
    "unregistered-lookup": (
        refusal_unknown_registration,
        "unknown_registration",
        "no such registration",
    ),
    "unregistered-store": (
        refusal_unknown_registration_store,
        "unknown_registration",
        "no such registration",
    ),
    "wrong-chunk-size": (refusal_chunk_size, "geometry", "48"),
    "oversized-frame": (refusal_oversized_frame, "too_large", "frame"),
    "too-many-chunks": (refusal_too_many_chunks, "too_large", "chunks in one request"),
    "lookup-only-retrieve": (refusal_lookup_only, "lookup_only", "lookup-only"),
    "block-out-of-range": (refusal_block_out_of_range, "bounds", "block id 75 out of range"),
    "digest-length": (refusal_digest_length, "bad_request", "not a multiple of 32"),
    "prefix-ends": (refusal_prefix_ends, "bad_request", "prefix_ends must ascend"),
    "model-name": (refusal_model_name, "bad_request", "model and kv_dtype"),
}


def still_serving(endpoint: str) -> None:
    """A fresh client stores and retrieves one chunk, byte-exactly."""
    with (
        Client(endpoint) as c,
        ShmKV(simple_model(layers=1, bytes_per_token=16)) as src,
        ShmKV(simple_model(layers=1, bytes_per_token=16)) as dst,
    ):
        src.fill_random(3)
        dst.fill(0)
        reg_src, reg_dst = c.register(**src.register_kwargs()), c.register(**dst.register_kwargs())
        digests = chunk_digests(np.arange(CHUNK) + 77, CHUNK)
        ids = block_ids_for(reg_src, 1, first_block=5)
        assert c.store(reg_src, digests, ids).ok.all()
        assert c.retrieve(reg_dst, digests, ids).ok.all()
        assert_same_pages(reg_src, src, ids, dst, ids, 1)


@pytest.mark.parametrize("scenario", list(REFUSALS), ids=list(REFUSALS))
def test_both_clients_raise_the_same_error_for_each_refusal(
    server: ThreadServer, scenario: str
) -> None:
    errors: dict[str, ServerError] = {}
    with ShmKV(simple_model(layers=1, bytes_per_token=16)) as kv:
        for name, make in CLIENTS.items():
            c = make(server.endpoint, timeout_s=10)
            try:
                with pytest.raises(ServerError) as info:
                    REFUSALS[scenario][0](c, kv)
                errors[name] = info.value
                assert c.ping().ready, "the refused client's connection stays usable"
            finally:
                c.close()
    sync, aio = errors["sync"], errors["asyncio"]
    assert sync.code == REFUSALS[scenario][1] and REFUSALS[scenario][2] in sync.message, sync
    assert (sync.code, sync.message) == (aio.code, aio.message)
    still_serving(server.endpoint)


@pytest.mark.parametrize(
    "block_ids,error",
    [
        ({"full": np.arange(15, dtype=np.int32)}, ValueError),
        ({}, KeyError),
        ({"full": np.arange(16, dtype=np.int32), "other": [0]}, KeyError),
    ],
)
def test_both_clients_refuse_bad_block_ids_before_sending(
    block_ids: dict[str, Any], error: type[Exception]
) -> None:
    messages = []
    with ShmKV(simple_model(layers=1, bytes_per_token=16)) as kv:
        for make in CLIENTS.values():
            rec = RecordingServer()
            try:
                c = make(rec.endpoint, timeout_s=10)
                try:
                    reg = c.register(**kv.register_kwargs())
                    with pytest.raises(error) as info:
                        c.store(reg, chunk_digests(np.arange(CHUNK), CHUNK), block_ids)
                    messages.append(str(info.value))
                finally:
                    c.close()
            finally:
                rec.close()
            assert len(rec.frames) == 2, "hello and register only: nothing else was sent"
    assert messages[0] == messages[1]


# -- async with -------------------------------------------------------------------------


def test_async_with_says_hello_on_enter_like_the_blocking_client(server: ThreadServer) -> None:
    """``async with AsyncClient(endpoint) as c`` is ``with Client(endpoint) as c``: the
    hello is said on enter (the server refuses every other request before it), the
    connection serves byte-exactly, and it is closed on exit."""

    async def scenario() -> None:
        with (
            ShmKV(simple_model(layers=1, bytes_per_token=16)) as src,
            ShmKV(simple_model(layers=1, bytes_per_token=16)) as dst,
        ):
            src.fill_random(11)
            dst.fill(0)
            async with AsyncClient(server.endpoint, timeout_s=10, client_name="aw") as c:
                assert c.welcome is not None
                reg_src = await c.register(**src.register_kwargs())
                reg_dst = await c.register(**dst.register_kwargs())
                digests = chunk_digests(np.arange(2 * CHUNK) + 5, CHUNK)
                ids = block_ids_for(reg_src, 2, first_block=3)
                assert (await c.store(reg_src, digests, ids)).ok.all()
                assert (await c.lookup(reg_dst, digests, lease=False)).hit_chunks == 2
                assert (await c.retrieve(reg_dst, digests, ids)).ok.all()
                assert_same_pages(reg_src, src, ids, dst, ids, 2)
            with pytest.raises(RuntimeError, match="closed"):
                async with c:
                    pass
            # connect() said hello already; entering does not say it again.
            c2 = await AsyncClient.connect(server.endpoint, timeout_s=10)
            first = c2.welcome
            async with c2:
                assert c2.welcome is first
                assert (await c2.ping()).ready

    asyncio.run(scenario())


def test_async_with_and_no_server_raises_timeout_and_closes() -> None:
    async def scenario() -> AsyncClient:
        c = AsyncClient(f"tcp://127.0.0.1:{free_port()}", timeout_s=0.3)
        with pytest.raises(TimeoutError, match="hello"):
            async with c:
                pass
        return c

    c = asyncio.run(scenario())
    assert c.in_flight == 0 and c._sock.closed


def test_a_result_reads_success_as_every_group_succeeding_for_every_status() -> None:
    """``ok``, ``ok_prefix`` and ``failed_chunks`` agree with ``SUCCESS`` for every status
    byte a reply may carry, in any group and chunk, and for a result with no groups."""
    from lmc_server.cache.status import SUCCESS, ChunkStatus
    from lmc_server.client.core import ChunkResult

    codes = np.array([int(s) for s in ChunkStatus], dtype=np.uint8)
    rng = np.random.default_rng(7)
    for _ in range(50):
        groups = {
            name: np.frombuffer(rng.choice(codes, size=9).tobytes(), dtype=np.uint8)
            for name in ("full", "window", "index")
        }
        res = ChunkResult(groups)
        want = [all(int(g[i]) in SUCCESS for g in groups.values()) for i in range(9)]
        assert res.ok.tolist() == want
        assert res.failed_chunks == [i for i, w in enumerate(want) if not w]
        assert res.ok_prefix == (want.index(False) if False in want else 9)
        assert not groups["full"].flags.writeable  # read, never written
    empty = ChunkResult()
    assert empty.ok.tolist() == [] and empty.ok_prefix == 0 and empty.failed_chunks == []
