"""Request traces in the Mooncake format, turned into chunk digests.

One JSON object per line: ``timestamp`` (ms; used only to order requests),
``input_length`` (tokens) and ``hash_ids`` (one id per 512-token block of the input;
equal ids mean a reusable prefix). A 512-token block becomes two 256-token chunks, and
only full chunks are cacheable (as on the server), so a request has
``min(input_length // 256, 2 * len(hash_ids))`` chunks. Chunk ``k``'s payload is its
block's hash id (8 bytes, little endian) and its half (one byte); digests are chained
with :func:`lmc_server.client.digests.hash_chain`, so the digest of chunk ``k`` names
the whole prefix up to it, exactly as a client's would.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

from lmc_server.cache.keys import DIGEST_BYTES
from lmc_server.client.digests import hash_chain

BLOCK_TOKENS = 512
CHUNK_TOKENS = 256
CHUNKS_PER_BLOCK = BLOCK_TOKENS // CHUNK_TOKENS


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: int
    input_tokens: int
    digests: bytes

    @property
    def n_chunks(self) -> int:
        return len(self.digests) // DIGEST_BYTES


def _payloads(hash_ids: list[int], n_chunks: int) -> Iterator[bytes]:
    for k in range(n_chunks):
        yield int(hash_ids[k // CHUNKS_PER_BLOCK]).to_bytes(8, "little", signed=True) + bytes(
            [k % CHUNKS_PER_BLOCK]
        )


def load_trace(path: str, limit: int | None = None) -> list[TraceRequest]:
    """The first ``limit`` requests of the file (all if ``None``), ordered by timestamp
    (stable, so requests with equal timestamps keep their file order)."""
    out: list[TraceRequest] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and len(out) >= limit:
                break
            try:
                rec = json.loads(line)
                ids = [int(h) for h in rec["hash_ids"]]
                tokens = int(rec["input_length"])
                ts = int(rec.get("timestamp", 0))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a trace record ({e})") from None
            n = min(tokens // CHUNK_TOKENS, CHUNKS_PER_BLOCK * len(ids))
            out.append(TraceRequest(ts, tokens, hash_chain(_payloads(ids, n))))
    out.sort(key=lambda r: r.timestamp_ms)
    return out


def chunk_ids(requests: list[TraceRequest]) -> tuple[list[list[int]], int]:
    """Each request's chunks as small ints (equal digest, equal int); and how many
    distinct chunks the trace has."""
    ids: dict[bytes, int] = {}
    out = []
    for r in requests:
        d = r.digests
        out.append(
            [
                ids.setdefault(d[i : i + DIGEST_BYTES], len(ids))
                for i in range(0, len(d), DIGEST_BYTES)
            ]
        )
    return out, len(ids)
