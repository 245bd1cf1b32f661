"""Which concurrent activity makes ``cuMemcpyBatchAsync`` refuse a batch (CUresult 1)?

A DP run on the H200 (``lmcache bench ranks --mode dp``, 8 engines) saw the first stores
of eight engines refused while the server's 32 GB pool was still being pinned in the
background. This runs 256-copy batches
(D2H and H2D, 93-418 KB each) from one thread while another (a) does nothing, (b) keeps
allocating pinned host memory (``cudaHostAlloc``, as the pool's pinning thread does),
(c) keeps registering host memory (``cudaHostRegister``), (d) issues batches of its own;
it prints how many batch calls the driver refused in each case and checks the bytes.

Usage (GPU machine): python scripts/gpu-batch-race.py [--seconds 3]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import threading
import time

import cupy
import numpy as np

from lmc_server.transfer.base import TransferError
from lmc_server.transfer.cuda.batch import batch_copier


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    copier = batch_copier(0)
    assert copier is not None, "no batch copier on this driver"
    rng = np.random.default_rng(0)
    sizes = rng.integers(93_000, 418_000, 256).astype(np.uint64)
    offs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.uint64)
    total = int(sizes.sum())
    dev = cupy.random.randint(0, 255, total, dtype=cupy.uint8)
    host = cupy.cuda.alloc_pinned_memory(total)
    host_ptr = ctypes.addressof(ctypes.c_char.from_buffer(host))
    stream = cupy.cuda.Stream(non_blocking=True)

    def run(name: str, disturb: object) -> None:
        stop = threading.Event()
        refused = [0, 0]
        calls = [0]

        def disturber() -> None:
            cupy.cuda.Device(0).use()
            while not stop.is_set():
                disturb(refused)  # type: ignore[operator]

        t = threading.Thread(target=disturber, daemon=True)
        t.start()
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline:
            for d2h in (True, False):
                try:
                    if d2h:
                        copier.copy(host_ptr + offs, int(dev.data.ptr) + offs, sizes, stream.ptr)
                    else:
                        copier.copy(int(dev.data.ptr) + offs, host_ptr + offs, sizes, stream.ptr)
                except TransferError:
                    refused[0] += 1
                calls[0] += 1
            stream.synchronize()
        stop.set()
        t.join()
        got = np.frombuffer(host, dtype=np.uint8, count=total)
        ok = np.array_equal(got, dev.get())
        print(
            f"{name:28s} batch calls {calls[0]:6d}  refused {refused[0]:5d}  "
            f"disturber refused {refused[1]:5d}  bytes {'ok' if ok else 'WRONG'}",
            flush=True,
        )

    def idle(_: list[int]) -> None:
        time.sleep(0.01)

    def host_alloc(_: list[int]) -> None:
        m = cupy.cuda.alloc_pinned_memory(256 << 20)
        del m

    def host_register(_: list[int]) -> None:
        mm = mmap.mmap(-1, 256 << 20)
        buf = ctypes.c_char.from_buffer(mm)
        ptr = ctypes.addressof(buf)
        cupy.cuda.runtime.hostRegister(ptr, 256 << 20, 1)
        cupy.cuda.runtime.hostUnregister(ptr)
        del buf
        mm.close()

    dev2 = cupy.zeros(total, dtype=cupy.uint8)
    host2 = cupy.cuda.alloc_pinned_memory(total)
    host2_ptr = ctypes.addressof(ctypes.c_char.from_buffer(host2))
    stream2 = cupy.cuda.Stream(non_blocking=True)

    def other_batches(refused: list[int]) -> None:
        try:
            copier.copy(host2_ptr + offs, int(dev2.data.ptr) + offs, sizes, stream2.ptr)
        except TransferError:
            refused[1] += 1
        stream2.synchronize()

    run("(a) nothing beside", idle)
    run("(b) cudaHostAlloc beside", host_alloc)
    run("(c) cudaHostRegister beside", host_register)
    run("(d) batches on a 2nd thread", other_batches)


if __name__ == "__main__":
    main()
