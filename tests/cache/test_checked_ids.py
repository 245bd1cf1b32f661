"""Block ids checked once for identical requests, never reused across geometries."""

from __future__ import annotations

import numpy as np
import pytest

from lmc_server.cache.geometry import blocks_per_chunk
from lmc_server.protocol import messages as m
from lmc_server.protocol.errors import ErrorCode, ProtocolError
from lmc_server.server.validate import CheckedIds
from lmc_server.testing.presets import dsv41_flash


def _request(groups: list, n: int, first: int) -> m.Retrieve:
    raw = [
        (np.arange(n * blocks_per_chunk(g, 256), dtype="<i4") + first).tobytes()
        if g.cached
        else b""
        for g in groups
    ]
    return m.Retrieve(req_id=1, registration_id=b"r" * 16, digests=b"d" * 32 * n, block_ids=raw)


def test_identical_lists_share_one_checked_answer() -> None:
    groups = list(dsv41_flash(num_blocks=64).groups)
    bpc = [blocks_per_chunk(g, 256) for g in groups]
    ids = CheckedIds()
    a = ids.check(groups, bpc, _request(groups, 2, 0), 2)
    b = ids.check(list(groups), bpc, _request(groups, 2, 0), 2)
    assert a is b and ids.reused == 1
    assert all(not v.flags.writeable for v in a.values())
    c = ids.check(groups, bpc, _request(groups, 2, 1), 2)
    assert c is not a and ids.reused == 1
    assert all(np.array_equal(c[g], a[g] + 1) for g in a)


def test_the_same_bytes_are_checked_again_for_a_smaller_geometry() -> None:
    big = list(dsv41_flash(num_blocks=64).groups)
    small = list(dsv41_flash(num_blocks=8).groups)
    bpc = [blocks_per_chunk(g, 256) for g in big]
    ids = CheckedIds()
    ids.check(big, bpc, _request(big, 2, 0), 2)
    with pytest.raises(ProtocolError) as e:
        ids.check(small, bpc, _request(big, 2, 0), 2)
    assert e.value.code is ErrorCode.BOUNDS
    with pytest.raises(ProtocolError):  # a refusal is not remembered as an answer
        ids.check(small, bpc, _request(big, 2, 0), 2)


def test_checked_ids_say_whether_any_id_is_minus_one_as_a_scan_would() -> None:
    from lmc_server.cache.group_ids import GroupIds, no_holes

    groups = list(dsv41_flash(num_blocks=64).groups)
    bpc = [blocks_per_chunk(g, 256) for g in groups]
    whole = CheckedIds().check(groups, bpc, _request(groups, 2, 0), 2)
    holed = _request(groups, 2, 0)
    gi = next(i for i, g in enumerate(groups) if g.cached)
    first = np.frombuffer(holed.block_ids[gi], dtype="<i4").copy()
    first[3] = -1
    holed.block_ids[gi] = first.tobytes()
    holes = CheckedIds().check(groups, bpc, holed, 2)
    for ids, want in ((whole, True), (holes, False)):
        assert isinstance(ids, GroupIds)
        assert no_holes(ids) is want
        assert no_holes(dict(ids)) is want  # a plain mapping is scanned: the same answer
