"""Identical retrieves share one resolution, never across namespaces or geometries.

The server resolves a retrieve once (block ids checked, digests turned into keys, prefix
ends) and hands the answer, and the index's plan, to the identical retrieves of
tensor-parallel ranks that follow (:mod:`lmc_server.server.resolved`). These tests send
byte-identical retrieves from registrations where sharing would serve the wrong KV or
skip a refusal: two ranks whose KV is not replicated (a namespace each, other bytes
under the same digests), and a registration with fewer blocks than the one whose
identical request was resolved.
"""

from __future__ import annotations

import numpy as np

from lmc_server.client import Client, ServerError, chunk_digests
from lmc_server.protocol.errors import ErrorCode
from lmc_server.testing import ShmKV
from lmc_server.testing.kv import assert_same_pages, block_ids_for
from lmc_server.testing.presets import dsv41_flash
from lmc_server.testing.process import ServerProcess


def _zero(kv: ShmKV) -> None:
    for s in kv.segments:
        s.array[:] = 0


def test_ranks_with_a_namespace_each_get_their_own_bytes(server: ServerProcess) -> None:
    n = 2
    geo = dsv41_flash(num_blocks=64)
    with (
        Client(server.endpoint) as c0,
        Client(server.endpoint) as c1,
        ShmKV(geo) as kv0,
        ShmKV(geo) as kv1,
        ShmKV(geo) as src0,
        ShmKV(geo) as src1,
    ):
        regs = [
            c.register(**kv.register_kwargs(world_size=2, rank=r, replicated=False))
            for r, (c, kv) in enumerate(((c0, kv0), (c1, kv1)))
        ]
        assert regs[0].namespace != regs[1].namespace
        digests = chunk_digests(np.arange(n * 256) + 5_000_000, 256)
        src_ids = block_ids_for(regs[0], n)
        dst_ids = block_ids_for(regs[0], n, first_block=n * 8)
        for seed, src, kv, c, reg in ((1, src0, kv0, c0, regs[0]), (2, src1, kv1, c1, regs[1])):
            src.fill_random(seed)
            for s, d in zip(src.segments, kv.segments, strict=True):
                d.array[:] = s.array
            assert c.store(reg, digests, src_ids).ok.all()
        for _ in range(3):  # the same wire request from each rank, in turn
            for src, kv, c, reg in ((src0, kv0, c0, regs[0]), (src1, kv1, c1, regs[1])):
                _zero(kv)
                assert c.retrieve(reg, digests, dst_ids).ok.all()
                assert_same_pages(reg, src, src_ids, kv, dst_ids, n)


def test_a_smaller_registration_is_refused_what_a_bigger_one_resolved(
    server: ServerProcess,
) -> None:
    n = 2
    big, small = dsv41_flash(num_blocks=64), dsv41_flash(num_blocks=16)
    with (
        Client(server.endpoint) as cb,
        Client(server.endpoint) as cs,
        ShmKV(big) as kvb,
        ShmKV(small) as kvs,
        ShmKV(big) as src,
    ):
        rb = cb.register(**kvb.register_kwargs(world_size=2, rank=0, replicated=True))
        rs = cs.register(**kvs.register_kwargs(world_size=2, rank=1, replicated=True))
        assert rb.namespace == rs.namespace
        digests = chunk_digests(np.arange(n * 256) + 6_000_000, 256)
        src.fill_random(3)
        for s, d in zip(src.segments, kvb.segments, strict=True):
            d.array[:] = s.array
        src_ids = block_ids_for(rb, n)
        assert cb.store(rb, digests, src_ids).ok.all()
        far = block_ids_for(rb, n, first_block=48)  # past the small one's 16 blocks
        _zero(kvb)
        assert cb.retrieve(rb, digests, far).ok.all()
        assert_same_pages(rb, src, src_ids, kvb, far, n)
        for _ in range(2):  # refused each time, not served from the big one's answer
            try:
                cs.retrieve(rs, digests, far)
            except ServerError as e:
                assert e.code == ErrorCode.BOUNDS.value
            else:
                raise AssertionError("an out-of-range retrieve was served")
        near = block_ids_for(rs, n, first_block=4)
        assert cs.retrieve(rs, digests, near).ok.all()  # the small one is still served
        assert_same_pages(rs, src, src_ids, kvs, near, n)
        _zero(kvb)
        assert cb.retrieve(rb, digests, far).ok.all()  # and so is the big one
        assert_same_pages(rb, src, src_ids, kvb, far, n)
