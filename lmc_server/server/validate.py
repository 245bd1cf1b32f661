"""Checks of a data request against its registration, before anything is copied.

The codec (:mod:`lmc_server.protocol.codec`) checks what the wire alone can tell:
frame sizes, digest and block-id lengths. What needs the registration is here: one
block-id list per group, none for a scratch group, and every id in
``-1 .. num_blocks - 1`` (``-1``: a block the request skips, nothing is copied for
it). Every check raises :class:`ProtocolError`; the request is then refused whole.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from lmc_server.cache.geometry import GroupSpec
from lmc_server.protocol import messages as m
from lmc_server.protocol.codec import decode_block_ids
from lmc_server.protocol.errors import ErrorCode, ProtocolError


def block_ids(
    groups: Sequence[GroupSpec], blocks_per_chunk: Sequence[int], msg: m.Store | m.Retrieve, n: int
) -> dict[int, np.ndarray]:
    """Group index -> its block ids as an ``(n chunks, blocks per chunk)`` int64 array,
    for every cached group of a registration (its ``groups`` and ``blocks_per_chunk``).

    Raises BAD_REQUEST for a wrong number of lists or of ids, or ids for a scratch
    group, and BOUNDS for an id outside ``-1 .. num_blocks - 1`` of its group.
    """
    if len(msg.block_ids) != len(groups):
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"block_ids has {len(msg.block_ids)} entries; the "
            f"registration has {len(groups)} groups",
            msg.req_id,
        )
    out: dict[int, np.ndarray] = {}
    for gi, (g, raw) in enumerate(zip(groups, msg.block_ids, strict=True)):
        if not g.cached:
            if raw:
                raise ProtocolError(
                    ErrorCode.BAD_REQUEST,
                    f"group {g.name!r} is scratch and never cached; send no block ids for it",
                    msg.req_id,
                )
            continue
        bpc = blocks_per_chunk[gi]
        ids = decode_block_ids(raw, n * bpc, g.name, msg.req_id)
        if n:  # the bounds, inline: this runs for every group of every data request
            lo, hi = int(ids.min()), int(ids.max())
            if lo < -1 or hi >= g.num_blocks:
                raise ProtocolError(
                    ErrorCode.BOUNDS,
                    f"group {g.name!r}: block id {lo if lo < -1 else hi} "
                    f"out of range -1..{g.num_blocks - 1}",
                    msg.req_id,
                )
        out[gi] = ids.astype(np.int64).reshape(n, bpc)
    return out
