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

These types are our own declaration of that layout (tests decode the stream with an
independent copy, and with vLLM's own classes where vLLM is installed). Sans-IO: the
server's :mod:`lmc_server.server.events` owns the sockets.
"""

from __future__ import annotations

import msgspec

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

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    """Blocks that are no longer held in ``medium``."""

    block_hashes: list[int]
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


def seq_frame(seq: int) -> bytes:
    """The sequence-number frame of batch ``seq``."""
    return seq.to_bytes(SEQ_BYTES, "big")


__all__ = ["END_SEQ", "MEDIUM_CPU", "SEQ_BYTES", "AllBlocksCleared", "BlockRemoved",
           "BlockStored", "KVCacheEvent", "KVEventBatch", "encode_batch", "seq_frame"]
