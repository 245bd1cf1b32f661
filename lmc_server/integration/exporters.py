"""How a worker describes the memory behind its KV tensors to the server.

A KV tensor is a view into a larger backing allocation that often holds many layers.
An exporter maps a tensor to the :class:`~lmc_server.buffers.BufferSpec` of
that whole allocation plus the allocation's base address, so layers become
``(buffer, offset)`` pairs and one allocation is registered once however many layers
share it.

* :class:`CudaExporter`: CUDA tensors, exported as IPC handles
  (:mod:`lmc_server.client.cuda`, imported lazily).
* :class:`ShmExporter`: CPU tensors that are views of POSIX shared-memory segments
  (the CPU engine: tests and CPU-only hosts). The process that allocates the KV cache
  registers each segment with :func:`register_shm_segment`; a tensor outside every
  registered segment is refused, since the server could not reach it. A segment closed
  without being unregistered is dropped at the next export: a new mapping may sit at
  its old addresses, and a tensor there must be found in its own segment, not named
  by the closed one (seen in one process running vLLM engines one after another).

Tensors are typed ``Any`` so this module imports without torch.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Protocol

from lmc_server.buffers import BufferSpec
from lmc_server.client.shm import ShmSegment


@dataclass(frozen=True, slots=True)
class ExportedBuffer:
    """A backing allocation: its registration spec and base address in this process."""

    spec: BufferSpec
    base_ptr: int
    size_bytes: int


class TensorExporter(Protocol):
    def export(self, tensor: Any) -> ExportedBuffer: ...


_segments: dict[int, ShmSegment] = {}
_segments_lock = threading.Lock()


def register_shm_segment(segment: ShmSegment) -> None:
    """Make tensors viewing ``segment`` exportable (keep it open while they are used)."""
    with _segments_lock:
        _segments[int(segment.array.ctypes.data)] = segment


def unregister_shm_segment(segment: ShmSegment) -> None:
    with _segments_lock:
        _segments.pop(int(segment.array.ctypes.data), None)


class ShmExporter:
    """CPU tensors backed by registered shared-memory segments."""

    def export(self, tensor: Any) -> ExportedBuffer:
        if getattr(tensor, "is_cuda", False):
            raise ValueError("ShmExporter got a CUDA tensor; use the cuda exporter")
        ptr = int(tensor.data_ptr())
        with _segments_lock:
            for base, seg in list(_segments.items()):
                if seg.closed:  # closed, never unregistered: its range may be reused now
                    del _segments[base]
                elif base <= ptr < base + seg.size_bytes:
                    return ExportedBuffer(seg.spec, base, seg.size_bytes)
        raise ValueError(
            f"tensor at 0x{ptr:x} is not inside a registered shared-memory "
            "segment; allocate CPU KV caches with register_shm_segment()"
        )


class CudaExporter:
    """CUDA tensors: the whole caching-allocator storage behind a tensor, via IPC."""

    def export(self, tensor: Any) -> ExportedBuffer:
        import torch

        from lmc_server.client.cuda import export_tensor

        storage = tensor.untyped_storage()
        whole = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
        spec = export_tensor(whole)
        return ExportedBuffer(spec, int(storage.data_ptr()), int(storage.nbytes()))


def exporter_for(tensor: Any) -> TensorExporter:
    return CudaExporter() if getattr(tensor, "is_cuda", False) else ShmExporter()
