"""Error codes carried by :class:`lmc_server.protocol.messages.Error` replies."""

from __future__ import annotations

from enum import StrEnum

from lmc_server.errors import LmcError


class ErrorCode(StrEnum):
    """Why a request was refused. Every refusal leaves the server serving others."""

    BAD_REQUEST = "bad_request"  # malformed frame, unknown type or field, wrong types
    TOO_LARGE = "too_large"  # frame or request over a documented limit
    VERSION = "version"  # protocol version not supported
    HANDSHAKE = "handshake"  # request before hello
    UNKNOWN_REGISTRATION = "unknown_registration"  # not registered by this connection
    GEOMETRY = "geometry"  # registration refused: chunk size, formats, bounds
    ARCH = "arch"  # record format or device architecture not allowed
    BOUNDS = "bounds"  # block id out of the registered range
    TRANSFER = "transfer"  # mapping or copy failed
    BUSY = "busy"  # ask again later: too many in flight, or the L1 pool not prepared yet
    LOOKUP_ONLY = "lookup_only"  # store/retrieve on a registration without buffers
    SHUTTING_DOWN = "shutting_down"  # the server is draining
    INTERNAL = "internal"  # a bug; logged with a traceback on the server


class ProtocolError(LmcError):
    """A request that must be answered with an :class:`ErrorCode` and a message."""

    def __init__(self, code: ErrorCode, message: str, req_id: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.req_id = req_id
