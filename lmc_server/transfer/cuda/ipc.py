"""CUDA IPC on the server side: find the worker's GPU, open its buffers, check their size.

A worker exports each KV buffer as ``(IPC handle, device UUID, offset, size)``. The
server and the worker may number GPUs differently (``CUDA_VISIBLE_DEVICES``), so the
device is found by UUID. CUDA lets a process open one allocation's handle only once per
device, and a worker's buffers often share one allocation (PyTorch's caching allocator
carves tensors out of large segments), so opened handles are shared and reference
counted across registrations: :class:`IpcTable`. The size a worker claims is checked
against the allocation's real extent (``cuMemGetAddressRange``), so a registration can
never make the server touch memory outside what the worker exported.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass

import cupy
import numpy as np

from lmc_server.buffers import BufferSpec, CudaIpcBuffer
from lmc_server.transfer.base import BufferMapping, DeviceInfo, TransferError

log = logging.getLogger(__name__)

_IPC_HANDLE_BYTES = 64
_libcuda: ctypes.CDLL | None = None


def normalize_uuid(uuid: str) -> str:
    """``GPU-58a9...`` or ``58a9...`` with or without dashes -> 32 lowercase hex digits."""
    u = uuid.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if u.startswith(prefix):
            u = u[len(prefix) :]
    return u.replace("-", "")


def _driver() -> ctypes.CDLL:
    global _libcuda
    if _libcuda is None:
        _libcuda = ctypes.CDLL("libcuda.so.1")
    return _libcuda


def device_uuid(device: int) -> str:
    """The ``GPU-xxxxxxxx-xxxx-...`` UUID of a device as this process numbers it."""
    raw = cupy.cuda.runtime.getDeviceProperties(device).get("uuid")
    if isinstance(raw, str):
        h = normalize_uuid(raw)
    elif raw is not None and len(bytes(raw)) == 16:
        h = bytes(raw).hex()
    else:  # older CuPy: ask the driver (runtime and driver ordinals agree)
        cu_dev = ctypes.c_int()
        buf = ctypes.create_string_buffer(16)
        if _driver().cuDeviceGet(ctypes.byref(cu_dev), device) or _driver().cuDeviceGetUuid_v2(
            buf, cu_dev
        ):
            raise TransferError(f"cannot read the UUID of device {device}")
        h = buf.raw.hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def arch_of(major: int, minor: int) -> str:
    """Compute capability -> the arch name registrations use (``sm90``, ``sm100``)."""
    if major == 10:
        return "sm100"
    return f"sm{major}{minor}"


def device_info(device: int) -> DeviceInfo:
    props = cupy.cuda.runtime.getDeviceProperties(device)
    name = props["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)
    arch = arch_of(int(props["major"]), int(props["minor"]))
    return DeviceInfo(
        arch=arch,
        description=f"{name} ({device_uuid(device)}, cuda device {device} of this server)",
    )


def find_device(uuid: str) -> int:
    """The server's device number for ``uuid``; raises TransferError if not visible."""
    want = normalize_uuid(uuid)
    for d in range(cupy.cuda.runtime.getDeviceCount()):
        if normalize_uuid(device_uuid(d)) == want:
            return d
    raise TransferError(
        f"GPU {uuid} is not visible to the server (check CUDA_VISIBLE_DEVICES of the server)"
    )


def allocation_range(ptr: int) -> tuple[int, int]:
    """``(base, size)`` of the allocation holding ``ptr`` (current device's context)."""
    base = ctypes.c_uint64()
    size = ctypes.c_size_t()
    rc = _driver().cuMemGetAddressRange_v2(
        ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)
    )
    if rc != 0:
        raise TransferError(f"cuMemGetAddressRange failed with CUDA error {rc}")
    return int(base.value), int(size.value)


@dataclass
class _Opened:
    ptr: int
    base: int
    size: int
    refs: int


class IpcTable:
    """Opened IPC handles per device, shared by every mapping that names them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[tuple[int, bytes], _Opened] = {}

    def acquire(self, device: int, handle: bytes) -> _Opened:
        with self._lock:
            o = self._open.get((device, handle))
            if o is None:
                with cupy.cuda.Device(device):
                    try:
                        ptr = int(cupy.cuda.runtime.ipcOpenMemHandle(handle))
                    except cupy.cuda.runtime.CUDARuntimeError as e:
                        raise TransferError(f"cannot open the CUDA IPC handle: {e}") from None
                    try:
                        base, size = allocation_range(ptr)
                    except TransferError:
                        cupy.cuda.runtime.ipcCloseMemHandle(ptr)
                        raise
                o = _Opened(ptr, base, size, 0)
                self._open[(device, handle)] = o
            o.refs += 1
            return o

    def release(self, device: int, handle: bytes) -> None:
        with self._lock:
            o = self._open.get((device, handle))
            if o is None:
                return
            o.refs -= 1
            if o.refs == 0:
                del self._open[(device, handle)]
                with cupy.cuda.Device(device):
                    try:
                        cupy.cuda.runtime.ipcCloseMemHandle(o.ptr)
                    except cupy.cuda.runtime.CUDARuntimeError as e:
                        log.warning("closing a CUDA IPC mapping failed: %s", e)

    def __len__(self) -> int:
        return len(self._open)


class CudaMapping(BufferMapping):
    """One registration's buffers on one GPU; ``ptrs``/``sizes`` index like the buffers.

    Keeps its IPC handles open until :meth:`close` (idempotent), which the server calls
    on unregister or when the client's session is dropped, after the last copy.
    """

    def __init__(self, table: IpcTable, buffers: list[BufferSpec]) -> None:
        self._table = table
        self._held: list[bytes] = []
        self.device_index = -1
        ptrs, sizes = [], []
        try:
            for i, b in enumerate(buffers):
                if not isinstance(b, CudaIpcBuffer):
                    raise TransferError(
                        "the cuda backend maps CUDA IPC buffers only "
                        f"(buffer {i} is {type(b).__name__})"
                    )
                if len(b.handle) != _IPC_HANDLE_BYTES:
                    raise TransferError(
                        f"buffer {i}: an IPC handle has {_IPC_HANDLE_BYTES} "
                        f"bytes, got {len(b.handle)}"
                    )
                if b.offset < 0 or b.size_bytes <= 0:
                    raise TransferError(f"buffer {i}: offset must be >= 0 and size > 0")
                dev = find_device(b.device_uuid)
                if self.device_index < 0:
                    self.device_index = dev
                elif dev != self.device_index:
                    raise TransferError(
                        "all buffers of one registration must be on one GPU "
                        f"(buffer {i} is on {b.device_uuid})"
                    )
                o = self._table.acquire(dev, b.handle)
                self._held.append(b.handle)
                start = o.ptr + b.offset
                if start + b.size_bytes > o.base + o.size:
                    raise TransferError(
                        f"buffer {i}: bytes [{b.offset}, {b.offset + b.size_bytes}) exceed "
                        f"the exported allocation ({o.base + o.size - o.ptr} bytes from "
                        "the handle's address)"
                    )
                ptrs.append(start)
                sizes.append(b.size_bytes)
            if self.device_index < 0:
                raise TransferError("no buffers to map")
            self.device = device_info(self.device_index)
            log.info(
                "mapped %d buffers (%.2f GiB) on %s",
                len(ptrs),
                sum(sizes) / (1 << 30),
                self.device.description,
            )
        except BaseException:
            self.close()
            raise
        self.ptrs = np.asarray(ptrs, dtype=np.int64)
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.closed = False

    def close(self) -> None:
        held, self._held = self._held, []
        for h in held:
            self._table.release(self.device_index, h)
        self.closed = True
