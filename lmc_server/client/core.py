"""The values the client API speaks in, and the socket setup both transports share.

:class:`Registration` (with its block-id encoding), :class:`ChunkResult`,
:class:`ServerError` and :class:`CurveKeys` are what callers hold; what each request
sends and how its reply is read lives in :mod:`lmc_server.client.requests`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lmc_server.cache.geometry import GroupSpec, blocks_per_chunk
from lmc_server.cache.status import SUCCESS, ChunkStatus
from lmc_server.errors import LmcError
from lmc_server.protocol import messages as m

BlockIds = Mapping[str, np.ndarray | Sequence[int]]


@dataclass(frozen=True)
class CurveKeys:
    """zmq CURVE keys of a client: the server's public key and this client's key pair
    (z85 bytes, as ``zmq.auth.load_certificate`` returns them)."""

    server_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def load(cls, server_cert: str, client_secret_cert: str) -> CurveKeys:
        import zmq.auth

        server_public, _ = zmq.auth.load_certificate(server_cert)
        public, secret = zmq.auth.load_certificate(client_secret_cert)
        if not secret:
            raise ValueError(f"{client_secret_cert} holds no secret key")
        return cls(server_public, public, secret)


#: Client-side heartbeats let a client notice a dead server (and the server a dead
#: client) even while no request is in flight.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 4000


def configure_socket(sock: Any, curve: CurveKeys | None) -> None:
    """Options every client DEALER socket gets: no linger, heartbeats, IPv6 (dual-stack,
    so ``tcp://[::1]:P`` and names resolving to IPv6 connect), CURVE if given."""
    import zmq

    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IPV6, 1)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    if curve is not None:
        sock.curve_serverkey = curve.server_public
        sock.curve_publickey = curve.public
        sock.curve_secretkey = curve.secret


class ServerError(LmcError):
    """The server refused a request; ``code`` is an :class:`ErrorCode` value."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Registration:
    """A registration as the client sees it; pass it to lookup/store/retrieve."""

    registration_id: bytes
    namespace: str
    chunk_size: int
    lookup_only: bool
    object_groups: list[m.ObjectGroupInfo]
    groups: list[GroupSpec]

    @property
    def chunk_bytes(self) -> int:
        """Bytes one chunk occupies in L1 across object groups."""
        return sum(og.object_bytes for og in self.object_groups)

    def blocks_per_chunk(self, group: str | GroupSpec) -> int:
        g = group if isinstance(group, GroupSpec) else self.group(group)
        return blocks_per_chunk(g, self.chunk_size)

    def group(self, name: str) -> GroupSpec:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"no group {name!r} in this registration")

    def encode_block_ids(self, block_ids: BlockIds, n_chunks: int) -> list[bytes]:
        """Per registered group, ``n_chunks * blocks_per_chunk`` int32 ids (scratch: none).

        ``block_ids`` maps cached group names to ids in chunk order; ``-1`` marks a
        block the engine does not have (store) or already holds (retrieve).
        """
        out = []
        unknown = set(block_ids) - {g.name for g in self.groups}
        if unknown:
            raise KeyError(f"unknown groups {sorted(unknown)}")
        for g in self.groups:
            if not g.cached:
                out.append(b"")
                continue
            if g.name not in block_ids:
                raise KeyError(f"block ids for group {g.name!r} are missing")
            ids = np.asarray(block_ids[g.name], dtype="<i4").reshape(-1)
            want = n_chunks * self.blocks_per_chunk(g)
            if ids.size != want:
                raise ValueError(
                    f"group {g.name!r}: {ids.size} block ids for {n_chunks} chunks; expected {want}"
                )
            out.append(ids.tobytes())
        return out


#: Whether each status byte counts as success, read by status (0-255): a table read per
#: chunk, against ``np.isin``'s sort and search (about 30 us for a reply, 2-core VM),
#: which a caller pays on every reply it checks.
_SUCCEEDED = np.zeros(256, dtype=bool)
_SUCCEEDED[[int(s) for s in SUCCESS]] = True
_SUCCEEDED.flags.writeable = False


@dataclass(frozen=True)
class ChunkResult:
    """Per-chunk outcome of a store or retrieve, per object group."""

    statuses: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def n_chunks(self) -> int:
        return len(next(iter(self.statuses.values()))) if self.statuses else 0

    @property
    def ok(self) -> np.ndarray:
        """Chunks whose every object group succeeded (or had nothing to do)."""
        out: np.ndarray | None = None
        for st in self.statuses.values():
            good = _SUCCEEDED[st]  # a new array: one table read per status byte
            out = good if out is None else np.logical_and(out, good, out=out)
        return np.ones(0, dtype=bool) if out is None else out

    @property
    def ok_prefix(self) -> int:
        """Number of leading chunks that succeeded."""
        bad = np.flatnonzero(~self.ok)
        return int(bad[0]) if bad.size else self.n_chunks

    @property
    def failed_chunks(self) -> list[int]:
        return np.flatnonzero(~self.ok).tolist()

    def count(self, status: ChunkStatus) -> int:
        return int(sum((st == status).sum() for st in self.statuses.values()))
