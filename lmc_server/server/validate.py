"""Checks of a data request against its registration, before anything is copied.

The codec (:mod:`lmc_server.protocol.codec`) checks what the wire alone can tell:
frame sizes, digest and block-id lengths. What needs the registration is here: one
block-id list per group, none for a scratch group, and every id in
``-1 .. num_blocks - 1`` (``-1``: a block the request skips, nothing is copied for
it). Every check raises :class:`ProtocolError`; the request is then refused whole.

:class:`CheckedIds` remembers the last few distinct block-id lists it checked: the
tensor-parallel ranks of one engine send the same ids at once, and each after the first
gets the arrays the first one's check made (read-only) instead of decoding and checking
them again. A list is the same only byte for byte, against the same group geometry
(cached or not, block count, blocks per chunk), so a reused answer is the one a fresh
check would give.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from lmc_server.cache.geometry import GroupSpec
from lmc_server.cache.group_ids import GroupIds
from lmc_server.protocol import messages as m
from lmc_server.protocol.codec import decode_block_ids
from lmc_server.protocol.errors import ErrorCode, ProtocolError


def block_ids(
    groups: Sequence[GroupSpec], blocks_per_chunk: Sequence[int], msg: m.Store | m.Retrieve, n: int
) -> dict[int, np.ndarray]:
    """Group index -> its block ids as an ``(n chunks, blocks per chunk)`` int64 array,
    for every cached group of a registration (its ``groups`` and ``blocks_per_chunk``),
    as a :class:`~lmc_server.cache.group_ids.GroupIds` that says whether any id is -1.

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
    holes = False
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
            holes = holes or lo < 0
        arr = ids.astype(np.int64).reshape(n, bpc)
        arr.flags.writeable = False
        out[gi] = arr
    return GroupIds(out, holes)


class CheckedIds:
    """:func:`block_ids` with the answers of the last ``size`` distinct lists kept
    (module docstring). Loop thread only."""

    def __init__(self, size: int = 16) -> None:
        self.size = size
        self._known: OrderedDict[tuple[object, ...], dict[int, np.ndarray]] = OrderedDict()
        #: answers reused (tests, diagnostics)
        self.reused = 0

    def check(
        self,
        groups: Sequence[GroupSpec],
        blocks_per_chunk: Sequence[int],
        msg: m.Store | m.Retrieve,
        n: int,
    ) -> dict[int, np.ndarray]:
        key = (
            n,
            tuple(blocks_per_chunk),
            tuple([g.num_blocks if g.cached else -1 for g in groups]),
            tuple(msg.block_ids),
        )
        out = self._known.get(key)
        if out is not None:
            self._known.move_to_end(key)
            self.reused += 1
            return out
        out = block_ids(groups, blocks_per_chunk, msg, n)  # raises before it is kept
        self._known[key] = out
        if len(self._known) > self.size:
            self._known.popitem(last=False)
        return out
