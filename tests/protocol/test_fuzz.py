"""Protocol fuzzing: 100,000+ generated inputs through the decoder and a live dispatcher.

Hypothesis draws ``TEMPLATES_PER_EXAMPLE`` templates per example, each raw bytes, msgpack of
an arbitrary structure, or a near-valid message (a real ``type`` tag with known and unknown
fields holding values of any type), plus a seed. A fast mutator turns each template into
``VARIANTS`` inputs (the template itself, truncations, byte flips, insertions, 0xc1 bytes,
splices, extra frames), because drawing every input from Hypothesis costs milliseconds
each on a small machine. Each input is decoded in process (it must give a typed request
or a ``ProtocolError``, nothing else) and sent to a real server, which must answer every
input with exactly one typed reply and never an ``internal`` error. Afterwards the server
still answers ping and still holds the chunk a bystander stored (and leased, since the
storm sends ``clear``) before the storm.

``LMC_FUZZ_INPUTS`` changes the count (default 100,000).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmc_server import PROTOCOL_VERSION
from lmc_server.client import Client, Registration, chunk_digests
from lmc_server.client.shm import handed_over
from lmc_server.protocol import messages as m
from lmc_server.protocol.codec import Limits, decode_reply, decode_request, encode
from lmc_server.protocol.errors import ErrorCode, ProtocolError
from lmc_server.testing import ShmKV, simple_model
from lmc_server.testing.kv import block_ids_for
from lmc_server.testing.process import ServerProcess

TOTAL_INPUTS = int(os.environ.get("LMC_FUZZ_INPUTS", "100000"))
VARIANTS = 50
#: Templates drawn per Hypothesis example: the engine's own work per example (its
#: bookkeeping, not the drawing) was half the test's CPU at one template per example.
TEMPLATES_PER_EXAMPLE = 10
MAX_FRAME = 1 << 16

TAGS = [
    "hello",
    "register",
    "unregister",
    "lookup",
    "release",
    "store",
    "retrieve",
    "ping",
    "stats",
    "clear",
    "welcome",
    "error",
    "bogus",
]
FIELDS = [
    "req_id",
    "protocol_version",
    "client_name",
    "model",
    "kv_dtype",
    "arch",
    "groups",
    "world_size",
    "rank",
    "replicated",
    "buffers",
    "registration_id",
    "digests",
    "salt",
    "lease",
    "lease_id",
    "block_ids",
    "name",
    "kind",
    "layers",
    "x",
]

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**64), 2**64)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=48)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)


def _encode(obj: object) -> bytes:
    try:
        return msgspec.msgpack.encode(obj)
    except (OverflowError, TypeError):
        return b"\x91\xc0"


near_valid = st.builds(
    lambda tag, fields, rid: _encode({"type": tag, "req_id": rid, **fields}),
    st.sampled_from(TAGS),
    st.dictionaries(st.sampled_from(FIELDS), values, max_size=6),
    st.integers(0, 2**40),
)
arbitrary = values.map(_encode)
raw = st.binary(max_size=256)


def mutants(template: list[bytes], seed: int, n: int) -> list[list[bytes]]:
    """``n`` inputs derived from ``template``; the first is the template itself."""
    rng = random.Random(seed)
    out = [template]
    while len(out) < n:
        f = bytearray(rng.choice(template))
        op = rng.randrange(7)
        if op == 0 and f:
            del f[rng.randrange(len(f)) :]
        elif op == 1 and f:
            for _ in range(rng.randint(1, 4)):
                f[rng.randrange(len(f))] = rng.randrange(256)
        elif op == 2:
            pos = rng.randint(0, len(f))
            f[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        elif op == 3 and f:
            f[rng.randrange(len(f))] = 0xC1
        elif op == 4:
            f += rng.choice(template)
        elif op == 5:
            out.append([bytes(f), bytes(rng.randrange(256) for _ in range(rng.randint(0, 8)))])
            continue
        out.append([bytes(f)])
    return out


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[ServerProcess]:
    with ServerProcess(
        ["--max-frame-bytes", str(MAX_FRAME), "--lease-ttl-s", "3600"], l1_size_gb=0.25
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def bystander(fuzz_server: ServerProcess) -> Iterator[tuple[Client, Registration, bytes]]:
    with Client(fuzz_server.endpoint) as c, ShmKV(simple_model()) as kv:
        kv.fill_random(4)
        reg = c.register(**kv.register_kwargs())
        digests = chunk_digests(np.arange(256) + 7, 256)
        assert c.store(reg, digests, block_ids_for(reg, 1)).ok.all()
        lease = c.lookup(reg, digests)  # pinned: the storm sends clear
        assert lease.hit_chunks == 1
        yield c, reg, digests
        c.release(lease.lease_id)


def test_decoder_and_dispatcher_survive_fuzzing(
    fuzz_server: ServerProcess, bystander: tuple[Client, Registration, bytes]
) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(fuzz_server.endpoint)
    sock.send(encode(m.Hello(req_id=1, protocol_version=PROTOCOL_VERSION)))
    assert sock.poll(5000)
    welcome = decode_reply(sock.recv())
    assert isinstance(welcome, m.Welcome)
    kv = ShmKV(simple_model(num_blocks=32))
    passed = handed_over(kv.buffers, welcome.fd_socket, 10.0)  # as the client does
    sock.send(encode(m.Register(req_id=2, **kv.register_kwargs(buffers=passed))))
    assert sock.poll(5000)
    registered = decode_reply(sock.recv())
    assert isinstance(registered, m.Registered)
    rid = registered.registration_id
    ids = st.lists(st.integers(-3, 40), min_size=16, max_size=16).map(
        lambda xs: np.array(xs, "<i4").tobytes()
    )
    digests = st.binary(min_size=32, max_size=32)
    valid = st.one_of(
        st.builds(
            lambda d, lease: encode(
                m.Lookup(req_id=3, registration_id=rid, digests=d, lease=lease)
            ),
            digests,
            st.booleans(),
        ),
        st.builds(
            lambda d, b: encode(m.Store(req_id=4, registration_id=rid, digests=d, block_ids=[b])),
            digests,
            ids,
        ),
        st.builds(
            lambda d, b: encode(
                m.Retrieve(req_id=5, registration_id=rid, digests=d, block_ids=[b])
            ),
            digests,
            ids,
        ),
        st.builds(lambda x: encode(m.Release(req_id=6, lease_id=x)), st.integers(0, 2**63 - 1)),
    )
    templates = st.lists(st.one_of(valid, near_valid, arbitrary, raw), min_size=1, max_size=2)
    limits = Limits(max_frame_bytes=MAX_FRAME)
    seen = {"inputs": 0, "errors": 0, "ok": 0}
    codes = {c.value for c in ErrorCode} - {ErrorCode.INTERNAL.value}

    @settings(
        max_examples=-(-TOTAL_INPUTS // (VARIANTS * TEMPLATES_PER_EXAMPLE)),
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        st.lists(
            st.tuples(templates, st.integers(0, 2**32)),
            min_size=TEMPLATES_PER_EXAMPLE,
            max_size=TEMPLATES_PER_EXAMPLE,
        )
    )
    def storm(drawn: list[tuple[list[bytes], int]]) -> None:
        inputs = [fs for template, seed in drawn for fs in mutants(template, seed, VARIANTS)]
        for fs in inputs:
            try:
                decode_request(fs, limits)
            except ProtocolError as e:
                assert e.code in (ErrorCode.BAD_REQUEST, ErrorCode.TOO_LARGE)
            sock.send_multipart(fs)
        for _ in inputs:
            assert sock.poll(10_000), "the server stopped answering"
            reply = decode_reply(sock.recv())
            if isinstance(reply, m.Error):
                assert reply.code in codes, reply
                seen["errors"] += 1
            else:
                seen["ok"] += 1
        seen["inputs"] += len(inputs)

    try:
        storm()
    finally:
        sock.close(linger=0)
        ctx.term()
        kv.close()
    assert seen["inputs"] >= TOTAL_INPUTS
    c, reg, mine = bystander
    assert c.ping().server_version
    assert c.lookup(reg, mine, lease=False).hit_chunks == 1
    print(
        f"fuzzed {seen['inputs']} inputs: {seen['errors']} typed errors, {seen['ok']} valid replies"
    )
