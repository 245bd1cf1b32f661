"""Worker side of the CUDA backend: export KV tensors over CUDA IPC, order stores.

``export_tensor(t)`` describes the memory of a CUDA tensor as a
:class:`~lmc_server.buffers.CudaIpcBuffer`: the IPC handle of the allocation
that holds it (PyTorch's caching allocator carves tensors out of larger segments, so the
handle names the segment and ``offset`` says where the tensor starts in it), the GPU's
UUID (the server may number GPUs differently) and the tensor's byte extent. One buffer
may hold many layers with padded strides; the registration's layer specs say where.
The tensor must stay alive while the registration exists.

``stream_done(stream)`` is how a worker orders a store after its writes: it records an
event behind them and returns the blocking wait for it, which the worker runs off its
engine thread (the vLLM connector runs it on its link thread) before sending the store.

torch is imported here (and in tests) only; the server never imports this module.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lmc_server.buffers import CudaIpcBuffer

IPC_HANDLE_BYTES = 64


def device_uuid(device: torch.device | int) -> str:
    """``GPU-xxxxxxxx-...`` of a device as this process numbers it."""
    uuid = torch.cuda.get_device_properties(device).uuid
    raw = getattr(uuid, "bytes", None)
    if isinstance(raw, bytes) and len(raw) == 16:
        h = raw.hex()
        return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
    u = str(uuid)
    return u if u.upper().startswith(("GPU-", "MIG-")) else f"GPU-{u}"


def tensor_extent_bytes(t: torch.Tensor) -> int:
    """Bytes from the tensor's first element to the end of its last one."""
    if t.numel() == 0:
        return 0
    if any(s < 0 for s in t.stride()):
        raise ValueError("tensors with negative strides cannot be exported")
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()


def ipc_mem_handle(shared: bytes) -> bytes:
    """The 64-byte ``cudaIpcMemHandle_t`` inside PyTorch's shareable handle.

    Recent PyTorch prefixes the handle with a version byte and a kind byte (``c``: a
    cudaMalloc segment, ``e``: an expandable segment, which is not a cudaMalloc
    allocation and cannot be opened with ``cudaIpcOpenMemHandle``); older releases
    return the bare 64 bytes.
    """
    if len(shared) == IPC_HANDLE_BYTES:
        return shared
    if len(shared) == IPC_HANDLE_BYTES + 2 and shared[1:2] == b"c":
        return shared[2:]
    if len(shared) >= 2 and shared[1:2] == b"e":
        raise ValueError(
            "KV tensors in expandable segments cannot be exported over CUDA "
            "IPC; unset PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
        )
    raise ValueError(f"unrecognised PyTorch IPC handle ({len(shared)} bytes)")


def export_tensor(t: torch.Tensor) -> CudaIpcBuffer:
    """The IPC description of ``t``'s memory (``t`` must live on a CUDA device)."""
    if not t.is_cuda:
        raise ValueError(f"export_tensor needs a CUDA tensor, got one on {t.device}")
    size = tensor_extent_bytes(t)
    if size <= 0:
        raise ValueError("cannot export an empty tensor")
    storage = t.untyped_storage()
    shared = storage._share_cuda_()
    handle, storage_offset_bytes = ipc_mem_handle(bytes(shared[1])), int(shared[3])
    offset = storage_offset_bytes + t.storage_offset() * t.element_size()
    return CudaIpcBuffer(
        handle=handle, device_uuid=device_uuid(t.device), offset=offset, size_bytes=size
    )


def stream_done(stream: torch.cuda.Stream | None = None) -> Callable[[], None]:
    """A callable that blocks (sleeping, not spinning) until the work queued on ``stream``
    (default: current) so far has finished.

    Workers call it on a background thread before sending a store, so the server never
    reads pages the engine is still writing, without blocking the engine's stream or the
    forward pass. This is what the vLLM connector does. (An interprocess event for
    the server to wait on instead was seen on the H200 not to order the server's copy
    after the write in some sequences, so the protocol has none; docs/gpu.md.)
    """
    s = stream if stream is not None else torch.cuda.current_stream()
    ev = torch.cuda.Event(enable_timing=False, blocking=True)
    ev.record(s)
    return ev.synchronize
