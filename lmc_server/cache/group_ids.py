"""A request's block ids per engine group, as the core reads them.

Every store and retrieve hands the core ``group_ids``: engine group index -> its
``(chunks, blocks_per_chunk)`` block ids, bounds-checked to ``-1 .. num_blocks - 1``
(``-1``: the engine no longer has that block). Most requests have no -1 at all, and the
core then plans them without per-section availability arrays; whether a request has any
is known to the check that made its arrays, which hands them over as a
:class:`GroupIds` (any other mapping is scanned).
"""

from __future__ import annotations

import numpy as np


class GroupIds(dict[int, np.ndarray]):
    """A request's block ids per engine group, with whether any of them is -1, known
    from the bounds check that made them (:func:`no_holes` then need not scan them)."""

    __slots__ = ("holes",)

    def __init__(self, ids: dict[int, np.ndarray], holes: bool) -> None:
        super().__init__(ids)
        self.holes = holes


def no_holes(group_ids: dict[int, np.ndarray]) -> bool:
    """No block id of a request is -1: every section of every chunk is given (ids are
    bounds-checked to ``-1 .. num_blocks - 1`` before the core sees them)."""
    if isinstance(group_ids, GroupIds):
        return not group_ids.holes
    return all(not a.size or int(a.min()) >= 0 for a in group_ids.values())
