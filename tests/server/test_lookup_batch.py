"""The batched lookup (``lookup_batch``): many requests' lookups in one message.

Through a real server process: each lookup of a batch is answered exactly as a single
``lookup`` of the same digests, with a lease of its own (released alone, and pinning its
chunks against eviction like a single lookup's); every refusal leaves no lease behind
and the server (and the refused connection) serving on.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest

from lmc_server.client import Client, Registration, ServerError, chunk_digests
from lmc_server.protocol import messages as m
from lmc_server.protocol.codec import encode
from lmc_server.testing import ShmKV, simple_model
from lmc_server.testing.kv import assert_same_pages, block_ids_for
from lmc_server.testing.process import ServerProcess

CHUNK = 256
#: pool slots of one object (1 MiB slabs, objects of 4 layers x 1 KiB x 256 tokens)
SLOTS = 8


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(
        ["--chunk-size", str(CHUNK), "--slab-size-mb", "1"], l1_size_gb=SLOTS / 1024
    ) as srv:
        yield srv


@pytest.fixture
def setup(server: ServerProcess) -> Iterator[tuple[Client, Registration, ShmKV]]:
    with Client(server.endpoint) as c, ShmKV(simple_model(layers=4, bytes_per_token=1024)) as kv:
        kv.fill_random(5)
        c.clear()
        yield c, c.register(**kv.register_kwargs()), kv


def prompt(tag: int, n_chunks: int) -> bytes:
    return chunk_digests(np.arange(n_chunks * CHUNK) + 100_000 * tag, CHUNK)


def still_serving(c: Client, reg: Registration, kv: ShmKV) -> None:
    """The connection that was refused, and a new one, look up and load byte-exactly."""
    a = prompt(9, 1)
    ids = block_ids_for(reg, 1, first_block=3)
    assert c.store(reg, a, ids).ok.all()
    [ans] = c.lookup_batch(reg, [a])
    assert ans.hit_chunks == 1 and ans.lease_id
    assert c.release(ans.lease_id)
    with Client(c.endpoint) as other, ShmKV(simple_model(layers=4, bytes_per_token=1024)) as dst:
        dst.fill(0)
        reg_dst = other.register(**dst.register_kwargs())
        assert other.lookup_batch(reg_dst, [a])[0].hit_chunks == 1
        assert other.retrieve(reg_dst, a, ids).ok.all()
        assert_same_pages(reg, kv, ids, dst, ids, 1)


def test_a_batch_answers_what_single_lookups_answer_each_with_its_own_lease(
    setup: tuple[Client, Registration, ShmKV],
) -> None:
    c, reg, kv = setup
    a, b, miss = prompt(1, 3), prompt(2, 2), prompt(3, 1)
    assert c.store(reg, a[:64], block_ids_for(reg, 2)).ok.all()  # a: chunks 0, 1
    assert c.store(reg, b[:32], block_ids_for(reg, 1, first_block=40)).ok.all()
    prefixes = [a, b, miss, a[:32], a]
    singles = [c.lookup(reg, p, lease=False) for p in prefixes]
    before = c.stats()
    answers = c.lookup_batch(reg, prefixes)
    assert [x.hit_chunks for x in answers] == [x.hit_chunks for x in singles] == [2, 1, 0, 1, 2]
    assert all(x.l2_pending_chunks == 0 for x in answers)
    leases = [x.lease_id for x in answers]
    assert leases[2] == 0 and answers[2].lease_ttl_s == 0.0
    held = [lid for lid in leases if lid]
    assert len(set(held)) == 4 and all(x.lease_ttl_s > 0 for x in answers if x.lease_id)
    after = c.stats()
    assert after.leases - before.leases == 4
    assert after.counters.lookups - before.counters.lookups == 5  # each one a lookup
    assert after.counters.leases_taken - before.counters.leases_taken == 4
    assert (
        after.counters.requests.get("lookup_batch:ok", 0)
        - before.counters.requests.get("lookup_batch:ok", 0)
        == 1
    )
    # each lease goes back alone, exactly once
    assert c.release(held[0]) and not c.release(held[0])
    assert c.stats().leases == after.leases - 1
    for lid in held[1:]:
        assert c.release(lid)
    assert c.stats().leases == before.leases
    # without leases, and an empty batch
    assert [x.lease_id for x in c.lookup_batch(reg, prefixes, lease=False)] == [0] * 5
    assert c.lookup_batch(reg, []) == []
    assert c.stats().leases == before.leases


def test_a_batch_lease_pins_its_chunks_against_eviction(
    setup: tuple[Client, Registration, ShmKV],
) -> None:
    c, reg, kv = setup
    ids = block_ids_for(reg, 1)
    kept, dropped = prompt(10, 1), prompt(11, 1)
    assert c.store(reg, kept, ids).ok.all() and c.store(reg, dropped, ids).ok.all()
    first, second = c.lookup_batch(reg, [kept, dropped])
    assert first.lease_id and second.lease_id
    assert c.release(second.lease_id)
    for i in range(2 * SLOTS):  # fill the pool twice over: every unpinned object goes
        c.store(reg, prompt(20 + i, 1), ids)
    hits = c.lookup_batch(reg, [kept, dropped], lease=False)
    assert [x.hit_chunks for x in hits] == [1, 0]
    assert c.release(first.lease_id)


def raw(c: Client, reg: Registration, **fields: object) -> m.Reply:
    """A ``lookup_batch`` frame built by hand (fields the client would never send)."""
    msg = {
        "type": "lookup_batch",
        "req_id": 77,
        "registration_id": reg.registration_id,
        "digests": prompt(4, 2),
    } | fields
    c.send_raw([msgspec.msgpack.encode(msg)])
    return c.recv_reply(10)


def test_malformed_batches_are_refused_without_a_lease_and_the_server_serves_on(
    setup: tuple[Client, Registration, ShmKV],
) -> None:
    c, reg, kv = setup
    two = prompt(4, 2)
    assert c.store(reg, two, block_ids_for(reg, 2)).ok.all()
    ends = {
        "descending": np.array([2, 1], "<i4").tobytes(),
        "short": np.array([1], "<i4").tobytes(),
        "zero-length prefix": np.array([0, 2], "<i4").tobytes(),
        "past the digests": np.array([1, 3], "<i4").tobytes(),
        "not int32": b"\x01\x00\x00",
    }
    cases: list[tuple[dict[str, object], str, str]] = [
        ({"prefix_ends": e}, "bad_request", "prefix_ends") for e in ends.values()
    ]
    cases += [
        (
            {"digests": two[:40], "prefix_ends": np.array([1], "<i4").tobytes()},
            "bad_request",
            "not a multiple of 32",
        ),
        ({"salt": b"x" * 300}, "bad_request", "salt"),
        ({"lease_ids": b""}, "bad_request", "invalid message"),  # an unknown field
        ({"prefix_ends": [1, 2]}, "bad_request", "invalid message"),  # wrong type
        ({"registration_id": b"r" * 16}, "unknown_registration", "no such registration"),
    ]
    assert c.welcome is not None
    over = c.welcome.max_chunks_per_request + 1
    cases.append(({"digests": bytes(32 * over)}, "too_large", "chunks in one request"))
    before = c.stats()
    for fields, code, text in cases:
        reply = raw(c, reg, **fields)
        assert isinstance(reply, m.Error), (fields, reply)
        assert reply.code == code and text in reply.message and reply.req_id == 77, reply
    after = c.stats()
    assert after.leases == before.leases  # nothing pinned by any refused batch
    assert after.counters.leases_taken == before.counters.leases_taken
    assert after.counters.lookups == before.counters.lookups
    # the client refuses what it cannot send (a prefix of no chunks) the same way
    with pytest.raises(ServerError) as e:
        c.lookup_batch(reg, [two, b""])
    assert e.value.code == "bad_request" and "prefix_ends" in e.value.message
    # a well-formed frame with the same fields is answered on the same connection
    good = raw(c, reg, prefix_ends=np.array([1, 2], "<i4").tobytes(), lease=False)
    assert isinstance(good, m.LookupBatchResult)
    assert np.frombuffer(good.hit_chunks, "<i4").tolist() == [1, 1]  # chunk 0, chunk 1
    still_serving(c, reg, kv)


def test_an_oversized_batch_frame_is_refused_and_the_server_serves_on(
    setup: tuple[Client, Registration, ShmKV],
) -> None:
    c, reg, kv = setup
    assert c.welcome is not None
    limit = c.welcome.max_frame_bytes
    frame = encode(
        m.LookupBatch(
            req_id=78, registration_id=reg.registration_id, digests=bytes(32 * (limit // 32 + 1))
        )
    )
    c.send_raw([frame])
    reply = c.recv_reply(10)
    assert isinstance(reply, m.Error) and reply.code == "too_large" and reply.req_id == 78
    still_serving(c, reg, kv)


# -- the connector's link -------------------------------------------------------------------


def test_the_link_sends_a_step_of_lookups_in_as_few_requests_as_the_limits_allow() -> None:
    """600 lookups of 2 chunks against a server of 64 KiB frames (at most 1,024 chunks
    per request from the link): 2 ``lookup_batch`` requests, each answer the one of its
    own prefix, a lease each; a prefix of no chunks is answered at once; a refused
    batch fails its lookups and the link serves on."""
    from lmc_server.integration.link.link import ServerLink

    with (
        ServerProcess(
            ["--chunk-size", str(CHUNK), "--max-frame-bytes", "65536"], l1_size_gb=0.25
        ) as srv,
        ShmKV(simple_model(layers=1, bytes_per_token=16)) as kv,
        Client(srv.endpoint) as c,
    ):
        kv.fill_random(1)
        reg = c.register(**kv.register_kwargs())
        prefixes = [prompt(100 + i, 2) for i in range(600)]
        for i in range(0, 600, 3):  # every third prompt: chunk 0 stored
            assert c.store(reg, prefixes[i][:32], block_ids_for(reg, 1)).ok.all()
        link = ServerLink(srv.endpoint, timeout_s=10)
        try:
            link.register(**kv.register_kwargs(buffers=[]))
            before = c.stats().counters.requests.get("lookup_batch:ok", 0)
            pending = link.lookup_batch([*prefixes, b""])
            answers = [p.result(10) for p in pending]
            assert [a.hit_chunks for a in answers] == [
                1 if i % 3 == 0 else 0 for i in range(600)
            ] + [0]
            assert all(bool(a.lease_id) == bool(a.hit_chunks) for a in answers)
            assert c.stats().counters.requests["lookup_batch:ok"] - before == 2
            assert c.stats().leases == 200
            for a in answers:
                if a.lease_id:
                    link.release(a.lease_id)
            # one prefix over the frame limit (not 4x over it: then zmq drops the
            # peer without a reply): refused, its lookup fails alone
            [bad] = link.lookup_batch([bytes(32 * 2100)])
            with pytest.raises(ServerError) as e:
                bad.result(10)
            assert e.value.code == "too_large"
            assert link.lookup(prefixes[0]).result(10).hit_chunks == 1
        finally:
            link.close(unregister_timeout_s=2)
        deadline = time.monotonic() + 10
        while c.stats().leases and time.monotonic() < deadline:
            time.sleep(0.05)  # releases are sent without waiting
        assert c.stats().leases == 0


def part_of(n_lookups: int) -> list[int]:
    """The part (request) of each of ``n_lookups`` lookups of 2 chunks, by the link's
    rule: 16 chunks, then twice as many per part, at most 128."""
    out, size, part, left = [], 8, 0, 8
    for _ in range(n_lookups):
        if not left:
            part, size = part + 1, min(64, 2 * size)
            left = size
        out.append(part)
        left -= 1
    return out


def test_the_link_hashes_a_step_of_lookups_on_its_own_thread_in_parts() -> None:
    """``lookup_hashed``: the caller's thread hands 600 lookups of 2 chunks over
    without hashing (``digests`` runs on the link's thread, once per lookup); they go
    out in ``lookup_batch`` requests of 16 chunks, then twice as many each up to 128
    (``LOOKUP_FIRST_PART_CHUNKS``, ``LOOKUP_PART_CHUNKS``), each answer the one of its
    own prefix; a lookup of no chunks is answered at once; a
    ``digests`` that raises fails the lookups of its part only, and the link serves on."""
    import threading

    from lmc_server.integration.link.link import ServerLink

    with (
        ServerProcess(["--chunk-size", str(CHUNK)], l1_size_gb=0.25) as srv,
        ShmKV(simple_model(layers=1, bytes_per_token=16)) as kv,
        Client(srv.endpoint) as c,
    ):
        kv.fill_random(1)
        reg = c.register(**kv.register_kwargs())
        prefixes = [prompt(300 + i, 2) for i in range(600)]
        for i in range(0, 600, 3):  # every third prompt: chunk 0 stored
            assert c.store(reg, prefixes[i][:32], block_ids_for(reg, 1)).ok.all()
        link = ServerLink(srv.endpoint, timeout_s=10)
        hashed_on: list[tuple[int, int]] = []

        def digests(i: int) -> bytes:
            hashed_on.append((i, threading.get_ident()))
            return prefixes[i]

        try:
            link.register(**kv.register_kwargs(buffers=[]))
            before = c.stats().counters.requests.get("lookup_batch:ok", 0)
            pending = link.lookup_hashed([2] * 600 + [0], digests)
            answers = [p.result(10) for p in pending]
            assert [a.hit_chunks for a in answers] == [
                1 if i % 3 == 0 else 0 for i in range(600)
            ] + [0]
            assert sorted(i for i, _ in hashed_on) == list(range(600))
            assert {t for _, t in hashed_on} == {link._thread.ident}
            sent = c.stats().counters.requests["lookup_batch:ok"] - before
            assert sent == part_of(600)[-1] + 1 == 12
            for a in answers:
                if a.lease_id:
                    link.release(a.lease_id)

            def fails_at_700(i: int) -> bytes:
                if i == 700:
                    raise ValueError("no hashes")
                return prefixes[i % 600]

            pending = link.lookup_hashed([2] * 800, fails_at_700)
            parts = part_of(800)
            for i, p in enumerate(pending):
                if parts[i] == parts[700]:
                    assert isinstance(p.exception(10), ValueError)
                else:
                    answer = p.result(10)
                    assert answer.hit_chunks == (1 if i % 600 % 3 == 0 else 0)
                    if answer.lease_id:
                        link.release(answer.lease_id)
            assert link.lookup(prefixes[0]).result(10).hit_chunks == 1
        finally:
            link.close(unregister_timeout_s=2)
        deadline = time.monotonic() + 10
        while c.stats().leases and time.monotonic() < deadline:
            time.sleep(0.05)  # releases are sent without waiting
        assert c.stats().leases == 0


def test_a_lookup_batch_is_answered_once_and_calls_back_once() -> None:
    """The connector's answers of one batch (``plans.LookupBatch``): not done, then all
    done together; the first ``set`` counts; a callback added before the answers runs
    once when they come, one added after runs at once; an error fails every lookup."""
    from lmc_server.integration.plans import LookupAnswer, LookupBatch

    batch = LookupBatch()
    first, second = batch.answer(0), batch.answer(1)
    assert not first.done()
    with pytest.raises(TimeoutError):
        first.exception(0.01)
    seen: list[object] = []
    first.add_done_callback(seen.append)
    batch.set([LookupAnswer(2, 5, 30.0), LookupAnswer(0, 0, 0.0)])
    batch.set(error=ConnectionError("late"))  # ignored: already answered
    assert seen == [first] and first.done() and second.done()
    assert first.result(0) == LookupAnswer(2, 5, 30.0) and second.exception() is None
    assert second.result().hit_chunks == 0
    second.add_done_callback(seen.append)
    assert seen == [first, second]
    failed = LookupBatch()
    failed.set(error=ConnectionError("lost"))
    assert isinstance(failed.answer(0).exception(), ConnectionError)
    with pytest.raises(ConnectionError):
        failed.answer(1).result()


def test_a_lookup_batch_is_answered_part_by_part() -> None:
    """The answers of a step's lookups (``plans.LookupBatch`` of a known size) come a
    part at a time: each lookup is readable by index (``get``) once its part is set,
    the others stay unanswered; an error for one part fails that part only; a lookup
    answered keeps its answer; an error for the whole batch fails only those not
    answered; a callback waits for its own lookup."""
    from lmc_server.integration.plans import LookupAnswer, LookupBatch

    batch = LookupBatch(5)
    assert [batch.get(i) for i in range(5)] == [None] * 5 and len(batch) == 5
    seen: list[object] = []
    batch.add_done_callback(3, lambda p: seen.append(p.result().hit_chunks))
    batch.set([LookupAnswer(1, 11, 30.0), LookupAnswer(2, 12, 30.0)], at=[0, 2])
    assert batch.get(0) == LookupAnswer(1, 11, 30.0) and batch.get(1) is None
    assert not batch.wait(1, 0.01) and batch.wait(2, 0)
    assert seen == []
    batch.set(error=ValueError("part"), at=[1])
    assert isinstance(batch.get(1), ValueError) and isinstance(batch[1].exception(), ValueError)
    batch.set([LookupAnswer(0, 0, 0.0)], at=[0])  # answered before: kept
    assert batch.get(0) == LookupAnswer(1, 11, 30.0)
    batch.set([LookupAnswer(2, 14, 30.0)], at=[3])
    assert seen == [2]
    batch.set(error=ConnectionError("closed"))
    assert isinstance(batch.get(4), ConnectionError)
    assert batch[2].result(0).lease_id == 12 and batch[3].result(0).lease_id == 14
