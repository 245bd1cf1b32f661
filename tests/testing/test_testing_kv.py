"""The test helpers' random KV contents: what byte-exact tests rely on.

Byte-exact tests and the rank benchmark fill KV caches with :func:`fill_random_bytes`
in several processes and compare pages across them, so the same seed must give the
same bytes, a different seed different bytes, and sizes that are not a multiple of the
8-byte words drawn (or of the slice) must be filled to the last byte.
"""

from __future__ import annotations

import numpy as np
import pytest

from lmc_server.testing import ShmKV, simple_model
from lmc_server.testing.kv import fill_random_bytes


@pytest.mark.parametrize("n", [1, 7, 8, 9, (8 << 20) + 3, (3 << 23) + 5])
def test_same_seed_same_bytes_to_the_last_one(n: int) -> None:
    a, b, c = (np.zeros(n, np.uint8) for _ in range(3))
    fill_random_bytes([a], 5)
    fill_random_bytes([b], 5)
    fill_random_bytes([c], 6)
    assert np.array_equal(a, b)
    if n > 64:
        assert (a != c).mean() > 0.98  # independent streams: ~255/256 of bytes differ
        assert (a[-8:] != 0).any()  # the tail past the last whole word is filled


def test_every_byte_value_appears_and_segments_continue_one_stream() -> None:
    with ShmKV(simple_model(num_blocks=8)) as kv, ShmKV(simple_model(num_blocks=8)) as other:
        kv.fill_random(3)
        other.fill_random(3)
        for s, t in zip(kv.segments, other.segments, strict=True):
            assert np.array_equal(s.array, t.array)
            assert np.bincount(s.array, minlength=256).min() > 0
        if len(kv.segments) > 1:  # a segment does not repeat the one before
            first, second = kv.segments[0].array, kv.segments[1].array
            k = min(len(first), len(second))
            assert not np.array_equal(first[:k], second[:k])
