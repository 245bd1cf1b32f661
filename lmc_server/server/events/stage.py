"""What one commit and one flush of the KV-event publisher carry.

:class:`Stage` holds the connector's event fields of the store being committed, so that
each object the commit makes visible is published with the engine's block hashes and
tokens (in chunk order once the commit ends: a router resolves each block's parent, so
it must hear of the parent first); :class:`Removals` merges a run of removals on one
topic into one ``BlockRemoved``. Apart from :mod:`.events` (the publisher: sockets,
topics, the loop-iteration batches) because this is the encoding of the events, which
changes with vLLM's wire format and not with how they are sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lmc_server.protocol import kv_events as ev
from lmc_server.protocol.messages import StoreEvents


@dataclass
class Stage:
    """The event fields of the store being committed, by key (see :meth:`staged`)."""

    suppress: bool
    chunk_size: int
    per: int = 0
    at: dict[bytes, int] = field(default_factory=dict)
    fields: StoreEvents | None = None
    out: list[tuple[int, bytes, Any]] = field(default_factory=list)
    #: the store's tokens and hashes as encoded msgpack elements, made at first use
    tokens: bytes = b""
    hashes: bytes = b""

    def stored(self, i: int) -> tuple[bytes, ev.BlockStored]:
        """The ``BlockStored`` of chunk ``i`` of a store that carries the connector's
        fields, and its encoded hashes (what a later ``BlockRemoved`` names)."""
        f, per, cs = self.fields, self.per, self.chunk_size
        assert f is not None
        if not self.tokens:  # once per store, vectorized over its chunks
            self.tokens = ev.uint32_elements(np.frombuffer(f.token_ids, dtype="<u4"))
            self.hashes = ev.uint64_elements(f.block_hashes)
        hb, tb = per * ev.U64_ELEMENT_BYTES, cs * ev.U32_ELEMENT_BYTES
        hashes = self.hashes[hb * i : hb * (i + 1)]
        parent = int.from_bytes(f.parent_hashes[8 * i : 8 * i + 8], "big")
        return hashes, ev.BlockStored(
            block_hashes=ev.raw_array(hashes, per),
            parent_block_hash=parent or None,
            token_ids=ev.raw_array(self.tokens[tb * i : tb * (i + 1)], cs),
            block_size=cs // per,
            lora_id=None,
            medium=ev.MEDIUM_CPU,
            lora_name=None,
        )


@dataclass
class Removals:
    """A run of removals on one topic, merged into one ``BlockRemoved`` at flush:
    encoded uint64 elements and their count."""

    medium: str
    parts: list[bytes] = field(default_factory=list)
    n: int = 0

    def event(self) -> ev.BlockRemoved:
        return ev.BlockRemoved(
            block_hashes=ev.raw_array(b"".join(self.parts), self.n), medium=self.medium
        )
