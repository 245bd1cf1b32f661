"""Frame codec and limits: bytes in, typed messages out (and back), no I/O.

A request that cannot be decoded still gets an answer: :func:`decode_request` raises
:class:`ProtocolError` carrying the ``req_id`` when one can be recovered from the frame,
so the client can match the error to its request.
"""

from __future__ import annotations

import msgspec
import numpy as np

from lmc_server.cache.keys import DIGEST_BYTES
from lmc_server.protocol.errors import ErrorCode, ProtocolError
from lmc_server.protocol.limits import Limits
from lmc_server.protocol.messages import Error, Reply, Request, StoreEvents


class _ReqIdOnly(msgspec.Struct):
    req_id: int = 0


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_req_id_decoder = msgspec.msgpack.Decoder(_ReqIdOnly)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def _recover_req_id(frame: bytes) -> int:
    try:
        rid = _req_id_decoder.decode(frame).req_id
    except (msgspec.DecodeError, msgspec.ValidationError):
        return 0
    return rid if 0 <= rid < 1 << 63 else 0


def decode_request(frames: list[bytes], limits: Limits) -> Request:
    """Decode one request from the frames after the routing identity."""
    if len(frames) != 1:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"expected exactly one frame per message, got {len(frames)}"
        )
    frame = frames[0]
    if len(frame) > limits.max_frame_bytes:
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"frame of {len(frame)} bytes exceeds the limit of {limits.max_frame_bytes} bytes",
            _recover_req_id(frame),
        )
    try:
        msg = _request_decoder.decode(frame)
    except msgspec.ValidationError as e:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"invalid message: {e}", _recover_req_id(frame)
        ) from None
    except msgspec.DecodeError as e:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"undecodable frame: {e}") from None
    if not 0 <= msg.req_id < 1 << 63:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "req_id must be in 0..2**63-1")
    return msg


def decode_reply(frame: bytes) -> Reply:
    try:
        return _reply_decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"undecodable reply: {e}") from None


def error_reply(err: ProtocolError) -> bytes:
    return encode(Error(req_id=err.req_id, code=err.code.value, message=err.message))


def chunk_count(digests: bytes, limits: Limits, req_id: int) -> int:
    """Number of 32-byte digests, checked against the per-request limit."""
    if len(digests) % DIGEST_BYTES:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"digests is {len(digests)} bytes, not a multiple of {DIGEST_BYTES}",
            req_id,
        )
    n = len(digests) // DIGEST_BYTES
    if n > limits.max_chunks_per_request:
        raise ProtocolError(
            ErrorCode.TOO_LARGE,
            f"{n} chunks in one request; at most {limits.max_chunks_per_request}",
            req_id,
        )
    return n


def prefix_ends(raw: bytes, n_chunks: int, req_id: int) -> list[int]:
    """Decode a retrieve's ``prefix_ends`` (empty: one prefix of ``n_chunks``)."""
    if not raw:
        return [n_chunks]
    if len(raw) % 4:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "prefix_ends is not int32 values", req_id)
    ends = np.frombuffer(raw, dtype="<i4").tolist()
    if ends[-1] != n_chunks or ends[0] < 1 or bool((np.diff(ends) <= 0).any()):
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"prefix_ends must ascend strictly from 1 to the chunk count {n_chunks}",
            req_id,
        )
    return ends


def decode_block_ids(raw: bytes, expected: int, group: str, req_id: int) -> np.ndarray:
    """One group's block ids: ``expected`` int32 LE values, as a read-only view of ``raw``.

    Wire-level only: the length must match (BAD_REQUEST otherwise). Whether each id
    names a block of the registration is the server's check
    (:mod:`lmc_server.server.validate`), made before anything is copied.
    """
    if len(raw) != 4 * expected:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"group {group!r}: expected {expected} block ids "
            f"({4 * expected} bytes), got {len(raw)} bytes",
            req_id,
        )
    return np.frombuffer(raw, dtype="<i4")


def check_store_events(ev: StoreEvents, n_chunks: int, chunk_size: int, req_id: int) -> int:
    """Check a store's event fields against its chunk count; the hashes per chunk.

    BAD_REQUEST unless ``block_size`` divides ``chunk_size`` and every field holds
    exactly one entry per token, engine block and chunk (:class:`StoreEvents`).
    """
    if not 0 < ev.block_size <= chunk_size or chunk_size % ev.block_size:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"events: block size {ev.block_size} does not divide the chunk size {chunk_size}",
            req_id,
        )
    per = chunk_size // ev.block_size
    for name, raw, expected in (
        ("token_ids", ev.token_ids, 4 * chunk_size * n_chunks),
        ("block_hashes", ev.block_hashes, 8 * per * n_chunks),
        ("parent_hashes", ev.parent_hashes, 8 * n_chunks),
    ):
        if len(raw) != expected:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"events: {name} is {len(raw)} bytes; {n_chunks} chunks need {expected}",
                req_id,
            )
    return per
