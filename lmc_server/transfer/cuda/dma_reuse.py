"""Copy-engine plans reused across workers that make the same request.

The tensor-parallel ranks of one engine retrieve the same prefix into the same block ids
at once, and the index hands them one shared copy list
(:class:`~lmc_server.cache.retrieve.RetrievePlans`). Their DMA plans
(:func:`~lmc_server.transfer.cuda.dma_plan.plan_dma`) then differ only in where each
worker's buffers are: every row's pool side is the same, and its device side is the same
offset into the same-sized buffer of another worker. :class:`DmaPlans` plans such a list
once and moves the rows' device addresses to each next worker's buffers, instead of
planning and checking it again (about a quarter of the server's loop per request for
eight ranks on the H200 host).

Why a moved plan is as safe as a fresh one: it is reused only for the very same copy
list (the entry holds it, so its ``id`` cannot be reused) against a region with the same
buffer sizes, the same pool and the same slab addresses, so every check the fresh plan
passed (each page inside its buffer, each object range inside one ready slab) holds for
the moved one; a row's device range lies inside one buffer (checked), so moving it by
that buffer's difference in base address keeps it inside the other worker's buffer of
the same size. Buffers whose address ranges overlap are never moved (planned afresh).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lmc_server.cache.layout import RunCopy
from lmc_server.transfer.cuda.dma_plan import DEV_ADDR, DmaPlan, plan_dma
from lmc_server.transfer.cuda.units import Region


@dataclass(slots=True, eq=False)
class _Entry:
    copies: Sequence[RunCopy]
    sizes: bytes
    slabs: bytes
    ptrs: np.ndarray
    plan: DmaPlan
    #: the buffer each row's device range lies in; None: not movable (overlap)
    row_buffer: np.ndarray | None
    #: the plan moved to each other mapping's buffers, by their addresses
    #: (``buffer_ptrs.tobytes()``; the plan itself under its own)
    by_ptrs: dict[bytes, DmaPlan]


#: Mappings a copy list's moved plans are kept for (a node's ranks, with room).
MOVED_MAX = 64


class DmaPlans:
    """The DMA plans of the last ``size`` copy lists, moved to other workers' buffers
    (each moved plan kept for its mapping's buffer addresses, so that it and how it was
    issued, ``DmaPlan.issues``, serve that worker's next identical request too).

    Driven from the thread that launches copies (the event loop); not thread-safe.
    """

    def __init__(self, size: int = 16) -> None:
        self.size = size
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        #: plans made / reused as they were / moved to another mapping's buffers
        self.planned = self.reused = self.moved = 0

    def plan(self, copies: Sequence[RunCopy], region: Region) -> DmaPlan:
        key = id(copies)
        e = self._entries.get(key)
        if (
            e is not None
            and e.copies is copies
            and e.sizes == region.buffer_sizes.tobytes()
            and e.slabs == region.slab_ptrs.tobytes()
        ):
            self._entries.move_to_end(key)
            ptrs = region.buffer_ptrs.tobytes()
            known = e.by_ptrs.get(ptrs)
            if known is not None:
                self.reused += 1
                return known
            if e.row_buffer is not None:
                self.moved += 1
                rows = e.plan.rows.copy()
                delta = region.buffer_ptrs.astype(np.int64) - e.ptrs
                rows[:, DEV_ADDR] += delta[e.row_buffer]
                rows.flags.writeable = False
                moved = DmaPlan(rows, e.plan.nbytes)
                if len(e.by_ptrs) < MOVED_MAX:
                    e.by_ptrs[ptrs] = moved
                return moved
        plan = plan_dma(copies, region)
        plan.rows.flags.writeable = False
        self.planned += 1
        self._entries[key] = _Entry(
            copies,
            region.buffer_sizes.tobytes(),
            region.slab_ptrs.tobytes(),
            region.buffer_ptrs.astype(np.int64, copy=True),
            plan,
            _row_buffers(plan, region),
            {region.buffer_ptrs.tobytes(): plan},
        )
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return plan


def _row_buffers(plan: DmaPlan, region: Region) -> np.ndarray | None:
    """The buffer each row's device start lies in, or None when the mapping's buffers
    overlap (a row's buffer would then be ambiguous)."""
    ptrs = region.buffer_ptrs.astype(np.int64)
    ends = ptrs + region.buffer_sizes.astype(np.int64)
    order = np.argsort(ptrs, kind="stable")
    if ptrs.size > 1 and (ptrs[order][1:] < ends[order][:-1]).any():
        return None
    dev = plan.rows[:, DEV_ADDR]
    pos = np.searchsorted(ptrs[order], dev, side="right") - 1
    buf = order[np.maximum(pos, 0)]
    assert ((pos >= 0) & (dev >= ptrs[buf]) & (dev < ends[buf])).all(), (
        "a DMA row starts outside every buffer of its mapping"
    )
    buf.flags.writeable = False
    return buf
