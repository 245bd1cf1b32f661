"""vLLM's KV-event wire format, as the server publishes it (docs/vllm.md, "KV events").

KV-aware routers (llm-d's KV-cache indexer, Dynamo's KV router, vLLM's production stack)
learn what an engine holds from vLLM's event stream (``--kv-events-config``). The server
publishes its L1 tier in the same format, so an unmodified consumer of vLLM 0.33's
stream decodes it. The layout, as vLLM 0.33 defines it:

* one ZeroMQ PUB message per batch, three frames: topic (UTF-8), sequence number (8
  bytes, big-endian, from 0 at start, one per batch), payload (msgpack);
* the payload is an *array* ``[ts, events]`` (``EventBatch`` is ``array_like``; the
  optional third element, ``data_parallel_rank``, is omitted: it defaults to None);
* each event is a msgpack *map* tagged by ``"type"`` (``BlockStored``, ``BlockRemoved``,
  ``AllBlocksCleared``), fields at their default omitted;
* block hashes are 64-bit unsigned integers (vLLM's ``ExternalBlockHash`` with
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, the form every router reduces hashes to);
* the replay socket is a ROUTER: a request is ``[b"", start_seq]`` (8 bytes big-endian,
  from a DEALER or REQ); the answer is one ``[b"", topic, seq, payload]`` per buffered
  batch from ``start_seq`` on, then ``[b"", b"", END_SEQ, b""]``.

These types are our own declaration of that layout, for encoding: the long integer
lists (tokens, hashes) may hold a :class:`msgspec.Raw` of already-encoded elements
(:func:`uint32_elements`, :func:`uint64_elements`, :func:`raw_array`), built with numpy
for a whole store at once instead of one Python int per token. Decode with vLLM's
classes or a copy of them (the tests do both). Sans-IO: the server's
:mod:`lmc_server.server.events.publisher` owns the sockets.
"""

from __future__ import annotations

import msgspec
import numpy as np

#: ``medium`` of objects in the server's L1 pool (vLLM's ``MEDIUM_CPU``).
MEDIUM_CPU = "CPU"
#: The replay socket's end-of-replay sequence number (-1, 8 bytes big-endian signed).
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: Bytes of the sequence-number frame.
SEQ_BYTES = 8


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three events (a map with a ``type`` tag on the wire)."""


class BlockStored(KVCacheEvent):
    """Blocks that became visible. ``token_ids`` are the tokens of every block in
    ``block_hashes`` (``block_size`` each); ``parent_block_hash`` is the block before the
    first one, None at the start of a prompt."""

    block_hashes: list[int] | msgspec.Raw
    parent_block_hash: int | None
    token_ids: list[int] | msgspec.Raw
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    """Blocks that are no longer held in ``medium``."""

    block_hashes: list[int] | msgspec.Raw
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """Everything the publisher held is gone (published at start: the pool is empty)."""


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published message's payload."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


#: Bytes of one :func:`uint32_elements` / :func:`uint64_elements` element.
U32_ELEMENT_BYTES, U64_ELEMENT_BYTES = 5, 9


def uint32_elements(values: np.ndarray) -> bytes:
    """``values`` as msgpack uint32 elements (``0xce`` + 4 bytes big-endian each)."""
    out = np.empty((len(values), U32_ELEMENT_BYTES), dtype=np.uint8)
    out[:, 0] = 0xCE
    out[:, 1:] = values.astype(">u4").view(np.uint8).reshape(-1, 4)
    return out.tobytes()


def uint64_elements(big_endian: bytes) -> bytes:
    """8-byte big-endian values as msgpack uint64 elements (``0xcf`` + the 8 bytes)."""
    out = np.empty((len(big_endian) // 8, U64_ELEMENT_BYTES), dtype=np.uint8)
    out[:, 0] = 0xCF
    out[:, 1:] = np.frombuffer(big_endian, dtype=np.uint8).reshape(-1, 8)
    return out.tobytes()


def raw_array(elements: bytes, n: int) -> msgspec.Raw:
    """A msgpack array of ``n`` already-encoded ``elements``."""
    if n < 16:
        head = bytes([0x90 | n])
    elif n < 1 << 16:
        head = b"\xdc" + n.to_bytes(2, "big")
    else:
        head = b"\xdd" + n.to_bytes(4, "big")
    return msgspec.Raw(head + elements)


def seq_frame(seq: int) -> bytes:
    """The sequence-number frame of batch ``seq``."""
    return seq.to_bytes(SEQ_BYTES, "big")


__all__ = [
    "END_SEQ",
    "MEDIUM_CPU",
    "SEQ_BYTES",
    "U32_ELEMENT_BYTES",
    "U64_ELEMENT_BYTES",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVCacheEvent",
    "KVEventBatch",
    "encode_batch",
    "raw_array",
    "seq_frame",
    "uint32_elements",
    "uint64_elements",
]
