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
(``launch.issue_dma``).
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
    """``copy(dsts, srcs, sizes, stream)``: 1-D copies in stream order, one driver call
    (``prepare`` and ``copy_prepared``: the descriptors built once, then the call);
    ``prepare2d`` / ``copy2d_prepared`` the same for pitched 2-D copies where
    :attr:`two_d` passed its check (``has_2d``), else callers issue those one
    ``cudaMemcpy2DAsync`` each."""

    two_d: Batch2DCopier | None = None

    @property
    def has_2d(self) -> bool:
        return self.two_d is not None

    def prepare2d(
        self,
        dst: np.ndarray,
        dst_pitch: np.ndarray,
        src: np.ndarray,
        src_pitch: np.ndarray,
        width: np.ndarray,
        height: np.ndarray,
    ) -> Prepared2D:
        if self.two_d is None:
            raise TransferError("no checked cuMemcpy3DBatchAsync on this driver")
        return self.two_d.prepare(dst, dst_pitch, src, src_pitch, width, height)

    def copy2d_prepared(self, batch: Prepared2D, stream: int) -> None:
        if self.two_d is None:
            raise TransferError("no checked cuMemcpy3DBatchAsync on this driver")
        self.two_d.copy_prepared(batch, stream)

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._v2 = hasattr(lib, "cuMemcpyBatchAsync_v2")
        self._fn = lib.cuMemcpyBatchAsync_v2 if self._v2 else lib.cuMemcpyBatchAsync
        self._fn.restype = ctypes.c_int
        # declared once, so that a call converts plain ints (no ctypes object per
        # argument per call): dsts, srcs, sizes, count, attrs, attr indices, attr count,
        # (12.8 only: the failure index), stream
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        self._fn.argtypes = [vp, vp, vp, sz, vp, vp, sz, *([] if self._v2 else [vp]), vp]
        self._attr = _MemcpyAttributes(
            CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            _MemLocation(0, 0),
            _MemLocation(0, 0),
            CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE,
        )
        self._first = ctypes.c_size_t(0)
        #: the driver writes the failed copy's index here (12.8 call); never read
        self._fail = ctypes.c_size_t(0)
        self._tail: tuple[int, ...] = (
            ctypes.addressof(self._attr),
            ctypes.addressof(self._first),
            1,
            *(() if self._v2 else (ctypes.addressof(self._fail),)),
        )

    def prepare(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> PreparedBatch:
        """The descriptors of one batch call, built once: a plan issued again (the
        ranks' shared plans, a prefix loaded again) costs only the driver call."""
        return PreparedBatch(dsts, srcs, sizes)

    def copy_prepared(self, batch: PreparedBatch, stream: int) -> None:
        if not batch.n:
            return
        rc = self._fn(batch.dsts_ptr, batch.srcs_ptr, batch.sizes_ptr, batch.n, *self._tail, stream)
        if rc != 0:
            raise TransferError(f"cuMemcpyBatchAsync of {batch.n} copies failed (CUresult {rc})")

    def copy(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        self.copy_prepared(self.prepare(dsts, srcs, sizes), stream)


class PreparedBatch:
    """The three descriptor arrays of one ``cuMemcpyBatchAsync`` call (contiguous
    ``uint64``, held here so their addresses stay valid) and those addresses.
    Read-only once made: the driver only reads them, from any lane's thread."""

    __slots__ = ("n", "_arrays", "dsts_ptr", "srcs_ptr", "sizes_ptr")

    def __init__(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> None:
        arrays = tuple(np.ascontiguousarray(a, dtype=np.uint64) for a in (dsts, srcs, sizes))
        for a in arrays:
            a.flags.writeable = False
        self._arrays = arrays
        self.n = int(arrays[2].size)
        self.dsts_ptr, self.srcs_ptr, self.sizes_ptr = (int(a.ctypes.data) for a in arrays)


#: ``CUDA_MEMCPY3D_BATCH_OP``: two 40-byte operands (``type``, then the pointer member
#: of the union: ``ptr``, ``rowLength``, ``layerHeight``, ``locHint``), the extent
#: (width, height, depth), the source access order and the flags: 112 bytes.
BATCH_OP_3D = np.dtype(
    [
        ("src_type", np.int32),
        ("_p0", np.int32),
        ("src_ptr", np.uint64),
        ("src_row", np.uint64),
        ("src_layer", np.uint64),
        ("src_loc", np.int64),
        ("dst_type", np.int32),
        ("_p1", np.int32),
        ("dst_ptr", np.uint64),
        ("dst_row", np.uint64),
        ("dst_layer", np.uint64),
        ("dst_loc", np.int64),
        ("width", np.uint64),
        ("height", np.uint64),
        ("depth", np.uint64),
        ("order", np.int32),
        ("flags", np.uint32),
    ]
)
assert BATCH_OP_3D.itemsize == 112
CU_MEMCPY_OPERAND_TYPE_POINTER = 1


class Batch2DCopier:
    """``copy(dst, dst_pitch, src, src_pitch, width, height, stream)``: pitched 2-D copies
    (``height`` rows of ``width`` bytes) in stream order, one ``cuMemcpy3DBatchAsync``
    call. The descriptors are one numpy structured array filled column by column, so
    building them costs a few numpy operations whatever their number."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._v2 = hasattr(lib, "cuMemcpy3DBatchAsync_v2")
        self._fn = lib.cuMemcpy3DBatchAsync_v2 if self._v2 else lib.cuMemcpy3DBatchAsync
        self._fn.restype = ctypes.c_int
        # count, ops, (12.8 only: the failure index), flags, stream
        vp = ctypes.c_void_p
        self._fn.argtypes = [
            ctypes.c_size_t,
            vp,
            *([] if self._v2 else [vp]),
            ctypes.c_ulonglong,
            vp,
        ]
        self._fail = ctypes.c_size_t(0)
        self._mid: tuple[int, ...] = () if self._v2 else (ctypes.addressof(self._fail),)

    def prepare(
        self,
        dst: np.ndarray,
        dst_pitch: np.ndarray,
        src: np.ndarray,
        src_pitch: np.ndarray,
        width: np.ndarray,
        height: np.ndarray,
    ) -> Prepared2D:
        """The descriptors of one call, built once (see :meth:`BatchCopier.prepare`)."""
        n = int(width.size)
        ops = np.zeros(n, dtype=BATCH_OP_3D)
        ops["src_type"] = ops["dst_type"] = CU_MEMCPY_OPERAND_TYPE_POINTER
        ops["src_ptr"], ops["src_row"], ops["src_layer"] = src, src_pitch, height
        ops["dst_ptr"], ops["dst_row"], ops["dst_layer"] = dst, dst_pitch, height
        ops["width"], ops["height"], ops["depth"] = width, height, 1
        ops["order"] = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        ops["flags"] = CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
        ops.flags.writeable = False
        return Prepared2D(ops)

    def copy_prepared(self, batch: Prepared2D, stream: int) -> None:
        if not batch.n:
            return
        rc = self._fn(batch.n, batch.ops_ptr, *self._mid, 0, stream)
        if rc != 0:
            raise TransferError(
                f"cuMemcpy3DBatchAsync of {batch.n} 2-D copies failed (CUresult {rc})"
            )

    def copy(
        self,
        dst: np.ndarray,
        dst_pitch: np.ndarray,
        src: np.ndarray,
        src_pitch: np.ndarray,
        width: np.ndarray,
        height: np.ndarray,
        stream: int,
    ) -> None:
        self.copy_prepared(self.prepare(dst, dst_pitch, src, src_pitch, width, height), stream)


class Prepared2D:
    """The operands of one ``cuMemcpy3DBatchAsync`` call (held, read-only) and their
    address."""

    __slots__ = ("n", "ops", "ops_ptr")

    def __init__(self, ops: np.ndarray) -> None:
        self.ops = ops
        self.n = int(ops.size)
        self.ops_ptr = int(ops.ctypes.data)


_lock = threading.Lock()
_checked: dict[int, BatchCopier | None] = {}


def batch_copier(device: int) -> BatchCopier | None:
    """The checked batch copier for ``device``, or ``None`` where it cannot be used."""
    with _lock:
        if device not in _checked:
            _checked[device] = _check(device)
        return _checked[device]


def _pattern(nbytes: int) -> np.ndarray:
    """``nbytes`` of a pattern whose every 4-byte word differs from its neighbours: a
    copy to the wrong offset shows. Made on the host, so the self-checks launch no CuPy
    kernel (the first use of one compiles it: seconds on a cold kernel cache)."""
    words = np.arange(nbytes // 4, dtype=np.uint32) * np.uint32(2654435761)
    return words.view(np.uint8)


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
            src = cupy.asarray(_pattern(4 * n))  # a copy, not a kernel (nothing to compile)
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
    copier.two_d = _check_2d(lib, device)
    log.info(
        "device %d: dma copies go to the driver in batches (cuMemcpyBatchAsync%s%s)",
        device,
        "_v2" if copier._v2 else "",
        ", cuMemcpy3DBatchAsync for 2-D copies" if copier.two_d else "",
    )
    return copier


def _check_2d(lib: ctypes.CDLL, device: int) -> Batch2DCopier | None:
    """A checked 2-D batch copier, or ``None``: pitched copies both ways, byte for byte
    against numpy's reading of the same rows (narrow and wide rows, unequal pitches)."""
    import cupy

    if not (hasattr(lib, "cuMemcpy3DBatchAsync_v2") or hasattr(lib, "cuMemcpy3DBatchAsync")):
        log.info("the CUDA driver has no cuMemcpy3DBatchAsync: 2-D dma copies go one at a time")
        return None
    try:
        copier = Batch2DCopier(lib)
        with cupy.cuda.Device(device):
            stream = cupy.cuda.Stream(non_blocking=True)
            n = 1 << 21
            src = cupy.asarray(_pattern(n))
            back = cupy.zeros_like(src)
            host = cupy.cuda.alloc_pinned_memory(n)
            hv = np.frombuffer(host, dtype=np.uint8, count=n)
            hv[:] = 0
            # (device offset, device pitch, host offset, host pitch, width, height)
            shapes = np.asarray(
                [[0, 4096, 0, 1000, 1000, 7], [65536, 19008, 300000, 40000, 19008, 22]],
                dtype=np.uint64,
            )
            d0, h0, b0 = int(src.data.ptr), int(hv.ctypes.data), int(back.data.ptr)
            dev, dp, hst, hp, w, h = (shapes[:, i] for i in range(6))
            copier.copy(h0 + hst, hp, d0 + dev, dp, w, h, stream.ptr)
            copier.copy(b0 + dev, dp, h0 + hst, hp, w, h, stream.ptr)
            stream.synchronize()
            want, got = src.get(), back.get()
            for do, dpi, ho, hpi, wi, he in shapes.tolist():
                for r in range(he):
                    a, b = do + r * dpi, ho + r * hpi
                    if not (
                        np.array_equal(hv[b : b + wi], want[a : a + wi])
                        and np.array_equal(got[a : a + wi], want[a : a + wi])
                    ):
                        log.warning(
                            "cuMemcpy3DBatchAsync self-check copied wrong bytes: 2-D dma "
                            "copies go one at a time"
                        )
                        return None
    except (OSError, AttributeError, TransferError, cupy.cuda.runtime.CUDARuntimeError) as e:
        log.warning("cuMemcpy3DBatchAsync unusable (%s): 2-D dma copies go one at a time", e)
        return None
    return copier
