"""Where a worker's KV cache lives, as a registration declares it on the wire.

One msgspec tagged union, :data:`BufferSpec`: a POSIX shared-memory segment for the cpu
engine, by name (:class:`ShmBuffer`) or by descriptor (:class:`ShmFdBuffer`), or a
CUDA IPC handle for the cuda engine (:class:`CudaIpcBuffer`). The protocol carries
them, the client builds them and the transfer engines open them; the cache core never
sees them (it works in offsets into a buffer index), which is why they live here,
below all three, and not in ``cache``. Imports msgspec only.
"""

from __future__ import annotations

import msgspec


class ShmBuffer(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="shm"):
    """A POSIX shared-memory segment standing in for GPU memory (CPU engine).

    ``name`` is the segment name under ``/dev/shm`` (``lmc-`` prefix, no slashes).
    """

    name: str
    size_bytes: int


class ShmFdBuffer(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="shm_fd"):
    """A shared-memory segment whose descriptor the worker handed to the server over
    its descriptor socket (:mod:`lmc_server.transfer.fd_inbox`): descriptor ``index``
    of the message sent with ``token``. The segment has no name anywhere."""

    token: bytes
    index: int
    size_bytes: int


class CudaIpcBuffer(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="cuda_ipc"):
    """A CUDA allocation exported with ``cudaIpcGetMemHandle`` (CUDA engine).

    The handle maps the whole allocation; the buffer is ``size_bytes`` bytes starting
    ``offset`` bytes into it. ``device_uuid`` names the GPU (``GPU-...``) so the server
    finds it whatever its own ``CUDA_VISIBLE_DEVICES`` says.
    """

    handle: bytes
    device_uuid: str
    offset: int
    size_bytes: int


BufferSpec = ShmBuffer | ShmFdBuffer | CudaIpcBuffer
