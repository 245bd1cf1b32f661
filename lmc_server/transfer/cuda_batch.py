"""Many 1-D copies in one driver call: ``cuMemcpyBatchAsync`` (CUDA 12.8 and later).

A DeepSeek-V4.1 request laid out as vLLM lays it out is about a thousand contiguous copies
of 93-418 KB (one per stored block and layer run). Issued one ``cudaMemcpyAsync`` at a
time from Python they cost ~3 us of host time each, which is what bounded copy mode
``dma`` on the H200 (docs/gpu.md); one batch call hands them all to the driver at once.
The copies carry ``CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE``, the driver's hint to
keep them on the copy engines, off the SMs an engine beside the server is using.

The driver is reached with ctypes (``libcuda.so.1``; CuPy does not wrap the call):
``cuMemcpyBatchAsync_v2`` (CUDA 13, no failure index) where the driver has it, else the
12.8 ``cuMemcpyBatchAsync``. :func:`batch_copier` checks the call once per process on
the device with a small copy each way, byte for byte, and returns ``None`` (callers
then issue single copies) if the driver lacks it or anything differs.

On by default in modes ``dma`` and ``auto`` (``CudaEngine(batch_copies=False)`` turns
it off). On the H200 it took 64-chunk stores, two in flight beside a GEMM engine, from
48.9 to 54.2 GB/s (docs/gpu.md). The driver there refused a few batch calls early in a
DP run with CUresult 1 (invalid value) for no cause found (``scripts/gpu-batch-race.py``
reproduces none under concurrent pinning, registering or batching); the engine then
issues the same rows as single copies, which write the same bytes
(``cuda_launch.issue_dma``).
"""

from __future__ import annotations

import ctypes
import logging
import threading

import numpy as np

from lmc_server.transfer.base import TransferError

log = logging.getLogger(__name__)

CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes_v1``."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


class BatchCopier:
    """``copy(dsts, srcs, sizes, stream)``: 1-D copies in stream order, one driver call."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._v2 = hasattr(lib, "cuMemcpyBatchAsync_v2")
        self._fn = lib.cuMemcpyBatchAsync_v2 if self._v2 else lib.cuMemcpyBatchAsync
        self._fn.restype = ctypes.c_int
        self._attr = _MemcpyAttributes(
            CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            _MemLocation(0, 0),
            _MemLocation(0, 0),
            CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE,
        )
        self._first = ctypes.c_size_t(0)

    def copy(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        n = int(sizes.size)
        if n == 0:
            return
        d = np.ascontiguousarray(dsts, dtype=np.uint64)
        s = np.ascontiguousarray(srcs, dtype=np.uint64)
        z = np.ascontiguousarray(sizes, dtype=np.uint64)
        args = [
            ctypes.c_void_p(d.ctypes.data),
            ctypes.c_void_p(s.ctypes.data),
            ctypes.c_void_p(z.ctypes.data),
            ctypes.c_size_t(n),
            ctypes.byref(self._attr),
            ctypes.byref(self._first),
            ctypes.c_size_t(1),
        ]
        if not self._v2:
            fail = ctypes.c_size_t(0)
            args.append(ctypes.byref(fail))
        args.append(ctypes.c_void_p(stream))
        rc = self._fn(*args)
        if rc != 0:
            raise TransferError(f"cuMemcpyBatchAsync of {n} copies failed (CUresult {rc})")


_lock = threading.Lock()
_checked: dict[int, BatchCopier | None] = {}


def batch_copier(device: int) -> BatchCopier | None:
    """The checked batch copier for ``device``, or ``None`` where it cannot be used."""
    with _lock:
        if device not in _checked:
            _checked[device] = _check(device)
        return _checked[device]


def _check(device: int) -> BatchCopier | None:
    import cupy

    try:
        lib = ctypes.CDLL("libcuda.so.1")
        if not (hasattr(lib, "cuMemcpyBatchAsync_v2") or hasattr(lib, "cuMemcpyBatchAsync")):
            log.info(
                "the CUDA driver has no cuMemcpyBatchAsync: dma copies are issued one at a time"
            )
            return None
        copier = BatchCopier(lib)
        with cupy.cuda.Device(device):
            stream = cupy.cuda.Stream(non_blocking=True)
            n = 1 << 20
            src = (cupy.arange(n, dtype=cupy.uint32) * 2654435761).view(cupy.uint8)
            back = cupy.zeros_like(src)
            host = cupy.cuda.alloc_pinned_memory(src.nbytes)
            host_view = np.frombuffer(host, dtype=np.uint8, count=src.nbytes)
            pieces = np.asarray(
                [[0, 1000], [4096, 3 * 65536 + 8], [1 << 21, (1 << 21) - 17]], dtype=np.uint64
            )
            base_d, base_h = int(src.data.ptr), int(host_view.ctypes.data)
            copier.copy(base_h + pieces[:, 0], base_d + pieces[:, 0], pieces[:, 1], stream.ptr)
            copier.copy(
                int(back.data.ptr) + pieces[:, 0], base_h + pieces[:, 0], pieces[:, 1], stream.ptr
            )
            stream.synchronize()
            want, got = src.get(), back.get()
            for off, size in pieces.tolist():
                if not (
                    np.array_equal(host_view[off : off + size], want[off : off + size])
                    and np.array_equal(got[off : off + size], want[off : off + size])
                ):
                    log.warning(
                        "cuMemcpyBatchAsync self-check copied wrong bytes: dma copies "
                        "are issued one at a time"
                    )
                    return None
    except (OSError, AttributeError, TransferError, cupy.cuda.runtime.CUDARuntimeError) as e:
        log.warning("cuMemcpyBatchAsync unusable (%s): dma copies are issued one at a time", e)
        return None
    log.info(
        "device %d: dma copies go to the driver in batches (cuMemcpyBatchAsync%s)",
        device,
        "_v2" if copier._v2 else "",
    )
    return copier
