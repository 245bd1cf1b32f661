"""Retrieves resolved once: what identical retrieves of tensor-parallel ranks share.

The ranks of one engine send the same retrieve at once (the same digests, block ids
and prefix ends, each from its own registration of one geometry). Resolving one (its
block ids checked into arrays, :mod:`lmc_server.server.validate`; its digests turned
into index keys; its prefix ends checked) gives the same answer for each of them, so
:class:`ResolvedRetrieves` keeps the answers of the last few distinct retrieves and
hands them to the identical ones that follow; the index plans them once too
(:class:`~lmc_server.cache.retrieve.RetrievePlans`, keyed by the same tuple).

A retrieve is identical when everything its resolution reads is the same: the
registration's layout (the interned object, held by the entry so that its ``id``
cannot be reused), namespace and block-id geometry, and the request's digests, salt,
block-id lists and prefix ends, byte for byte. Only requests that resolved without a
refusal are kept, so a kept answer is the one a fresh resolution would give. Loop
thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from lmc_server.cache.layout import RegistrationLayout
from lmc_server.protocol import messages as m
from lmc_server.server.sessions import RegisteredCache


@dataclass(frozen=True, slots=True, eq=False)
class Resolved:
    """One retrieve's resolution (read-only, shared by identical retrieves)."""

    layout: RegistrationLayout
    ids: dict[int, np.ndarray]
    keys: list[bytes]
    ends: list[int]
    #: the request's identity (:meth:`ResolvedRetrieves.key`): the index's plan key too
    key: tuple[object, ...]


class ResolvedRetrieves:
    """The resolutions of the last ``size`` distinct retrieves (module docstring)."""

    def __init__(self, size: int = 16) -> None:
        self.size = size
        self._known: OrderedDict[tuple[object, ...], Resolved] = OrderedDict()
        #: resolutions reused (tests, diagnostics)
        self.reused = 0

    @staticmethod
    def key(reg: RegisteredCache, msg: m.Retrieve) -> tuple[object, ...]:
        view = reg.view
        return (
            "retrieve",
            id(view.layout),
            view.ns_prefix,
            reg.ids_geometry,
            msg.digests,
            msg.salt,
            tuple(msg.block_ids),
            tuple(msg.prefix_ends),
        )

    def get(self, key: tuple[object, ...], reg: RegisteredCache) -> Resolved | None:
        known = self._known.get(key)
        if known is None or known.layout is not reg.view.layout:
            return None
        self._known.move_to_end(key)
        self.reused += 1
        return known

    def put(self, resolved: Resolved) -> None:
        self._known[resolved.key] = resolved
        self._known.move_to_end(resolved.key)
        while len(self._known) > self.size:
            self._known.popitem(last=False)
