"""The benchmark's block regions: consecutive and random block orders agree with what a
retrieve writes."""

from __future__ import annotations

import numpy as np
import pytest

from lmc_server.bench.kvregions import A1, A2, B, Regions
from lmc_server.testing.presets import dsv41_flash


@pytest.mark.parametrize("order", ["consecutive", "random"])
def test_regions_are_disjoint_permutations(order: str) -> None:
    geo = dsv41_flash(num_blocks=3 * 8 * 8, layers=4)
    r = Regions.build(geo, 256, 8, separate=True, block_order=order)
    for g in geo.groups:
        if not g.cached:
            continue
        per = [set(r.ids(k, 8)[g.name].tolist()) for k in (A1, A2, B)]
        n = 8 * r.bpc(g)
        for k, ids in enumerate(per):  # each region: exactly its own block range
            assert ids == set(range(k * n, (k + 1) * n))
        first = r.ids(A1, 8)[g.name]
        if order == "random":
            assert not (np.diff(first) == 1).all()
        else:
            assert (np.diff(first) == 1).all()
        assert np.array_equal(r.ids(A1, 3)[g.name], first[: 3 * r.bpc(g)])  # prefix-stable
    for sec in r.sections():  # what a retrieve writes is drawn from the ids it is given
        ids = set(r.ids(B, 5)[sec.group_name].tolist())
        assert set(r.written_blocks(sec, B, 5)) <= ids


def test_unknown_block_order_refused() -> None:
    with pytest.raises(ValueError, match="block order"):
        Regions.build(dsv41_flash(num_blocks=8, layers=2), 256, 1, True, "sorted")
