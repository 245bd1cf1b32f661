"""Checks of a data request against its registration, before anything is copied.

The codec (:mod:`lmc_server.protocol.codec`) checks what the wire alone can tell:
frame sizes, digest and block-id lengths. What needs the registration is here: one
block-id list per group, none for a scratch group, and every id in
``-1 .. num_blocks - 1`` (``-1``: the engine has no block there, nothing is copied for
it). Every check raises :class:`ProtocolError`; the request is then refused whole.
"""

from __future__ import annotations

import numpy as np

from lmc_server.protocol import messages as m
from lmc_server.protocol.codec import decode_block_ids
from lmc_server.protocol.errors import ErrorCode, ProtocolError
from lmc_server.server.sessions import Registration


def block_ids(reg: Registration, msg: m.Store | m.Retrieve, n: int) -> dict[int, np.ndarray]:
    """Group index -> its block ids as an ``(n chunks, blocks per chunk)`` int64 array,
    for every cached group of ``reg``; each id checked by :func:`check_bounds`."""
    groups = reg.groups
    if len(msg.block_ids) != len(groups):
        raise ProtocolError(ErrorCode.BAD_REQUEST,
                            f"block_ids has {len(msg.block_ids)} entries; the "
                            f"registration has {len(groups)} groups", msg.req_id)
    out: dict[int, np.ndarray] = {}
    for gi, (g, raw) in enumerate(zip(groups, msg.block_ids, strict=True)):
        if not g.cached:
            if raw:
                raise ProtocolError(ErrorCode.BAD_REQUEST,
                                    f"group {g.name!r} is scratch and never cached; "
                                    f"send no block ids for it", msg.req_id)
            continue
        bpc = reg.blocks_per_chunk[gi]
        ids = decode_block_ids(raw, n * bpc, g.name, msg.req_id)
        check_bounds(ids, g.num_blocks, g.name, msg.req_id)
        out[gi] = ids.astype(np.int64).reshape(n, bpc)
    return out


def check_bounds(ids: np.ndarray, num_blocks: int, group: str, req_id: int) -> None:
    """Raise BOUNDS unless every id is in ``-1 .. num_blocks - 1``."""
    if not len(ids):
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < -1 or hi >= num_blocks:
        bad = lo if lo < -1 else hi
        raise ProtocolError(ErrorCode.BOUNDS,
                            f"group {group!r}: block id {bad} out of range "
                            f"-1..{num_blocks - 1}", req_id)
