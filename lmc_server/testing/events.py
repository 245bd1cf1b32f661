"""Helpers for tests of the KV-event stream: an engine's prompt, its event fields, replay.

A prompt here is what the connector has: tokens, one engine hash per block (vLLM's,
reduced to 64 bits) and the chunk digests derived from those hashes
(:func:`lmc_server.client.digests.hash_chain` over each chunk's hashes, as
``integration/chunks.py`` derives them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from lmc_server.client.digests import hash_chain
from lmc_server.protocol.kv_events import END_SEQ
from lmc_server.protocol.messages import StoreEvents


@dataclass(frozen=True)
class EnginePrompt:
    """``tokens`` (uint32), ``hashes`` (one per block), ``digests`` (one per chunk)."""

    tokens: np.ndarray
    hashes: list[int]
    digests: bytes
    chunk_size: int
    block_size: int

    @property
    def per(self) -> int:
        return self.chunk_size // self.block_size

    def chunk_hashes(self, k: int) -> list[int]:
        return self.hashes[k * self.per : (k + 1) * self.per]

    def chunk_tokens(self, k: int) -> list[int]:
        return self.tokens[k * self.chunk_size : (k + 1) * self.chunk_size].tolist()

    def parent(self, k: int) -> int | None:
        """The engine hash of the block before chunk ``k`` (None for chunk 0)."""
        return None if k == 0 else self.hashes[k * self.per - 1]

    def events(self, first: int = 0, n: int | None = None) -> StoreEvents:
        """The store's event fields for chunks ``first .. first + n - 1``."""
        n = len(self.digests) // 32 - first if n is None else n
        cs, per = self.chunk_size, self.per
        return StoreEvents(
            block_size=self.block_size,
            token_ids=self.tokens[first * cs : (first + n) * cs].astype("<u4").tobytes(),
            block_hashes=b"".join(
                h.to_bytes(8, "big") for h in self.hashes[first * per : (first + n) * per]
            ),
            parent_hashes=b"".join(
                (self.parent(k) or 0).to_bytes(8, "big") for k in range(first, first + n)
            ),
        )


def engine_prompt(
    n_chunks: int, seed: int, chunk_size: int = 256, block_size: int = 16
) -> EnginePrompt:
    """A random prompt of ``n_chunks`` whole chunks with distinct 64-bit block hashes."""
    rng = np.random.default_rng(seed)
    per = chunk_size // block_size
    tokens = rng.integers(0, 50_000, n_chunks * chunk_size, dtype=np.uint32)
    hashes = [int(h) for h in rng.integers(1, 1 << 63, n_chunks * per, dtype=np.int64)]
    digests = hash_chain(
        b"".join(h.to_bytes(8, "big") for h in hashes[k * per : (k + 1) * per])
        for k in range(n_chunks)
    )
    return EnginePrompt(tokens, hashes, digests, chunk_size, block_size)


def replay(
    ctx: zmq.Context[Any], endpoint: str, start: int, timeout_ms: int = 5000
) -> list[tuple[bytes, int, bytes]]:
    """Every ``(topic, seq, payload)`` from ``start`` that the replay socket at
    ``endpoint`` returns, until its end marker (a DEALER, with the empty delimiter a
    REQ would add)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out: list[tuple[bytes, int, bytes]] = []
        while True:
            if not dealer.poll(timeout_ms):
                raise TimeoutError(f"replay from {endpoint} did not answer")
            empty, topic, seq, payload = dealer.recv_multipart()
            assert empty == b"", "replay answers start with an empty delimiter"
            if seq == END_SEQ:
                assert topic == payload == b""
                return out
            out.append((topic, int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(linger=0)
