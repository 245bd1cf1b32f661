"""The protocol's size limits and their defaults.

Apart from :mod:`.codec` (which enforces them) so that the configuration, which takes
``--max-frame-bytes`` with this default, loads without the codec's numpy: every
``lmcache`` command reads the configuration, even one that only reports a usage error.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Default largest frame accepted, in bytes. A 256-chunk lookup is ~8 KiB; a 4096-chunk
#: store of a 5-group registration is ~0.7 MiB. The zmq socket drops peers that send
#: frames over 4x this (hard limit, no reply possible); between the two the server
#: answers TOO_LARGE.
DEFAULT_MAX_FRAME_BYTES = 16 * 1024 * 1024
MAX_CHUNKS_PER_REQUEST = 16384


@dataclass(frozen=True, slots=True)
class Limits:
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    max_chunks_per_request: int = MAX_CHUNKS_PER_REQUEST
