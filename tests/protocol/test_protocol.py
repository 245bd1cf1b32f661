"""Bad input is a feature: every refusal gets a typed error and the server keeps serving.

Each live test sends something malformed, checks the error code and message, then checks
that another client is still served and that nothing stored earlier was lost. The
server runs in process; ``tests/protocol/test_fuzz.py`` sends random input to a server process.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import numpy as np
import pytest

from lmc_server import PROTOCOL_VERSION
from lmc_server.client import Client, chunk_digests
from lmc_server.protocol import messages as m
from lmc_server.protocol.codec import (
    Limits,
    check_store_events,
    decode_block_ids,
    decode_request,
    encode,
)
from lmc_server.protocol.errors import ErrorCode, ProtocolError
from lmc_server.server.validate import block_ids
from lmc_server.testing import ShmKV, simple_model
from lmc_server.testing.inprocess import ThreadServer, run_server
from lmc_server.testing.kv import block_ids_for

MAX_FRAME = 65536


def test_round_trip_every_request_type() -> None:
    geo = simple_model()
    msgs = [
        m.Hello(req_id=1, protocol_version=1),
        m.Ping(req_id=2),
        m.Stats(req_id=3),
        m.Clear(req_id=4),
        m.Release(req_id=5, lease_id=9),
        m.Register(req_id=6, model="x", kv_dtype="bf16", arch="sm90", groups=geo.groups),
        m.Lookup(req_id=7, registration_id=b"r" * 16, digests=b"d" * 64),
        m.Store(req_id=8, registration_id=b"r" * 16, digests=b"d" * 32, block_ids=[b"\0" * 64]),
        m.Retrieve(req_id=9, registration_id=b"r" * 16, digests=b"", block_ids=[]),
        m.Unregister(req_id=10, registration_id=b"r" * 16),
        m.Store(
            req_id=11,
            registration_id=b"r" * 16,
            digests=b"d" * 32,
            block_ids=[b"\0" * 64],
            events=m.StoreEvents(
                block_size=128,
                token_ids=b"t" * 1024,
                block_hashes=b"h" * 16,
                parent_hashes=bytes(8),
            ),
        ),
        m.Probe(req_id=12, namespace="model=x", digests=b"d" * 64, prefix_ends=b"\1\0\0\0\2\0\0\0"),
    ]
    for msg in msgs:
        assert decode_request([encode(msg)], Limits()) == msg


@pytest.mark.parametrize(
    "frame,code",
    [
        (b"\xc1", ErrorCode.BAD_REQUEST),
        (msgspec.msgpack.encode({"type": "nope", "req_id": 3}), ErrorCode.BAD_REQUEST),
        (msgspec.msgpack.encode({"type": "ping", "req_id": 3, "extra": 1}), ErrorCode.BAD_REQUEST),
        (msgspec.msgpack.encode({"type": "lease", "req_id": 3}), ErrorCode.BAD_REQUEST),
        (
            msgspec.msgpack.encode({"type": "release", "req_id": 3, "lease_id": "x"}),
            ErrorCode.BAD_REQUEST,
        ),
        (msgspec.msgpack.encode([1, 2, 3]), ErrorCode.BAD_REQUEST),
        (b"x" * (MAX_FRAME + 1), ErrorCode.TOO_LARGE),
    ],
)
def test_decoder_refuses_with_typed_errors(frame: bytes, code: ErrorCode) -> None:
    with pytest.raises(ProtocolError) as e:
        decode_request([frame], Limits(max_frame_bytes=MAX_FRAME))
    assert e.value.code == code


@pytest.mark.parametrize(
    "change, message",
    [
        ({"block_size": 0}, "does not divide"),
        ({"block_size": 96}, "does not divide"),
        ({"block_size": 512}, "does not divide"),
        ({"token_ids": b"t" * 2044}, "token_ids is 2044 bytes; 2 chunks need 2048"),
        ({"block_hashes": b"h" * 8}, "block_hashes is 8 bytes; 2 chunks need 32"),
        ({"parent_hashes": b""}, "parent_hashes is 0 bytes; 2 chunks need 16"),
    ],
)
def test_store_events_must_cover_every_chunk(change: dict[str, object], message: str) -> None:
    """A store's event fields: one token per position, one engine hash per block, one
    parent per chunk (wire cost per chunk: 4 x chunk_size + 8 x blocks + 8 bytes)."""
    good = m.StoreEvents(
        block_size=128, token_ids=b"t" * 2048, block_hashes=b"h" * 32, parent_hashes=bytes(16)
    )
    assert check_store_events(good, 2, 256, 1) == 2
    with pytest.raises(ProtocolError) as e:
        check_store_events(msgspec.structs.replace(good, **change), 2, 256, 1)
    assert e.value.code == ErrorCode.BAD_REQUEST and message in e.value.message
    assert e.value.req_id == 1


def test_req_id_is_recovered_from_an_invalid_message() -> None:
    frame = msgspec.msgpack.encode({"type": "ping", "req_id": 42, "bogus": True})
    with pytest.raises(ProtocolError) as e:
        decode_request([frame], Limits())
    assert e.value.req_id == 42 and "bogus" in e.value.message


def test_block_ids_decode_checks_only_the_length() -> None:
    """The sans-IO codec takes any int32 value: bounds need the registration."""
    ok = np.array([0, 5, -1, 7], "<i4").tobytes()
    assert decode_block_ids(ok, 4, "g", 1).tolist() == [0, 5, -1, 7]
    assert decode_block_ids(np.array([1 << 30], "<i4").tobytes(), 1, "g", 1).tolist() == [1 << 30]
    with pytest.raises(ProtocolError, match="expected 2 block ids") as e:
        decode_block_ids(ok, 2, "g", 1)
    assert e.value.code == ErrorCode.BAD_REQUEST and e.value.req_id == 1


def test_block_ids_are_bounds_checked_by_the_server() -> None:
    g = simple_model(num_blocks=8, tokens_per_block=128).groups[0]  # 2 blocks per chunk

    def check(*ids: int) -> dict[int, np.ndarray]:
        msg = m.Retrieve(
            req_id=3,
            registration_id=b"r" * 16,
            digests=b"d" * 32 * 2,
            block_ids=[np.array(ids, "<i4").tobytes()],
        )
        return block_ids([g], [2], msg, 2)

    out = check(0, 5, -1, 7)
    assert out[0].dtype == np.int64 and out[0].tolist() == [[0, 5], [-1, 7]]
    for ids, value in (((0, 1, 2, 8), 8), ((-2, 0, 1, 2), -2), ((3, -7, 9, 1), -7)):
        with pytest.raises(ProtocolError) as e:
            check(*ids)
        assert e.value.code == ErrorCode.BOUNDS and e.value.req_id == 3
        assert e.value.message == f"group 'full': block id {value} out of range -1..7"
    with pytest.raises(ProtocolError, match="expected 4 block ids") as e:
        check(0, 1, 2)
    assert e.value.code == ErrorCode.BAD_REQUEST


@pytest.fixture(scope="module")
def small_frames() -> Iterator[ThreadServer]:
    """The server in process: refusals are its code path, not the process's."""
    with run_server(max_frame_bytes=MAX_FRAME, l1_size_gb=0.25) as ts:
        yield ts


@pytest.fixture(scope="module")
def stored(small_frames: ThreadServer) -> Iterator[tuple[Client, object, bytes, ShmKV]]:
    """A victim client with one stored chunk that must survive every bad input."""
    with Client(small_frames.endpoint) as c, ShmKV(simple_model()) as kv:
        kv.fill_random(1)
        reg = c.register(**kv.register_kwargs())
        digests = chunk_digests(np.arange(256), 256)
        assert c.store(reg, digests, block_ids_for(reg, 1)).ok.all()
        yield c, reg, digests, kv


def still_serving(stored: tuple[Client, object, bytes, ShmKV]) -> None:
    c, reg, digests, _ = stored
    assert c.ping().server_version
    assert c.lookup(reg, digests, lease=False).hit_chunks == 1  # type: ignore[arg-type]


BAD_FRAMES = [
    ([b"\xc1\xc1\xc1"], "bad_request"),
    ([msgspec.msgpack.encode({"type": "store", "req_id": 5})], "bad_request"),
    ([msgspec.msgpack.encode({"type": "ping", "req_id": 6, "x": 1})], "bad_request"),
    ([encode(m.Ping(req_id=7)), b"second frame"], "bad_request"),
    ([b"\x00" * (MAX_FRAME + 10)], "too_large"),
    ([msgspec.msgpack.encode({"type": "ping", "req_id": -1})], "bad_request"),
]


@pytest.mark.parametrize("frames,code", BAD_FRAMES)
def test_malformed_frames_get_errors_and_others_keep_being_served(
    small_frames: ThreadServer,
    stored: tuple[Client, object, bytes, ShmKV],
    frames: list[bytes],
    code: str,
) -> None:
    with Client(small_frames.endpoint) as bad:
        bad.send_raw(frames)
        reply = bad.recv_reply(timeout_s=5)
        assert isinstance(reply, m.Error) and reply.code == code, reply
        assert bad.ping()
    still_serving(stored)


def test_requests_before_hello_are_refused(
    small_frames: ThreadServer, stored: tuple[Client, object, bytes, ShmKV]
) -> None:
    with Client(small_frames.endpoint, hello=False) as c:
        c.send_raw([encode(m.Stats(req_id=3))])
        reply = c.recv_reply(5)
        assert isinstance(reply, m.Error) and reply.code == "handshake" and reply.req_id == 3
        c.send_raw([encode(m.Hello(req_id=4, protocol_version=PROTOCOL_VERSION + 1))])
        reply = c.recv_reply(5)
        assert isinstance(reply, m.Error) and reply.code == "version"
    still_serving(stored)


def test_wrong_digest_length_and_too_many_block_ids(
    small_frames: ThreadServer, stored: tuple[Client, object, bytes, ShmKV]
) -> None:
    c, reg, digests, _ = stored
    with pytest.raises(Exception, match="not a multiple of 32"):
        c._call(
            m.Lookup(
                req_id=50,
                registration_id=reg.registration_id,  # type: ignore[attr-defined]
                digests=b"x" * 31,
            ),
            m.LookupResult,
        )
    with pytest.raises(Exception, match="expected 16 block ids"):
        c._call(
            m.Retrieve(
                req_id=51,
                registration_id=reg.registration_id,  # type: ignore[attr-defined]
                digests=digests,
                block_ids=[b"\0" * 4 * 17],
            ),
            m.RetrieveResult,
        )
    with pytest.raises(Exception, match="registration has 1 groups"):
        c._call(
            m.Retrieve(
                req_id=52,
                registration_id=reg.registration_id,  # type: ignore[attr-defined]
                digests=digests,
                block_ids=[],
            ),
            m.RetrieveResult,
        )
    still_serving(stored)


def test_oversized_registration_is_refused_cleanly(
    small_frames: ThreadServer, stored: tuple[Client, object, bytes, ShmKV]
) -> None:
    geo = simple_model(layers=1500)
    with Client(small_frames.endpoint) as c:
        with pytest.raises(Exception, match="too_large|layers"):
            c.register(model="x", kv_dtype="bf16", arch="sm90", groups=geo.groups)
    still_serving(stored)


def test_out_of_range_block_ids_refused_with_bounds_and_others_served(
    small_frames: ThreadServer, stored: tuple[Client, object, bytes, ShmKV]
) -> None:
    """The server's bounds check (server/validate.py), through the wire: the same code
    and message as the codec gave when it held the check, the request's own req_id, and
    the connection and the other client keep being served."""
    _, _, digests, kv = stored
    with Client(small_frames.endpoint) as c:
        reg = c.register(**kv.register_kwargs())
        g = reg.groups[0]
        n_ids = reg.blocks_per_chunk(g)
        for req_id, bad in ((60, g.num_blocks), (61, -2)):
            ids = np.zeros(n_ids, "<i4")
            ids[-1] = bad
            c.send_raw(
                [
                    encode(
                        m.Retrieve(
                            req_id=req_id,
                            registration_id=reg.registration_id,
                            digests=digests,
                            block_ids=[ids.tobytes()],
                        )
                    )
                ]
            )
            reply = c.recv_reply(timeout_s=5)
            assert isinstance(reply, m.Error) and reply.req_id == req_id, reply
            assert reply.code == "bounds"
            assert reply.message == (
                f"group {g.name!r}: block id {bad} out of range -1..{g.num_blocks - 1}"
            )
        assert c.retrieve(reg, digests, block_ids_for(reg, 1)).ok.all()
    still_serving(stored)
