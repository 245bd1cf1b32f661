"""Loading and launching the page copy kernels (``kernels/copy_pages.cu``).

The source ships inside the package (``lmc_server.kernels``), is compiled once per
process by NVRTC through ``cupy.RawModule`` (CuPy caches the binary on disk), and
loaded once per device. :func:`launch` is the thin host wrapper: it checks the
descriptor range and launch shape before every launch; the addresses inside the
descriptors were checked when the plan was built
(:mod:`lmc_server.transfer.cuda_plan`).
"""

from __future__ import annotations

import importlib
import threading
from pathlib import Path

import cupy
import numpy as np

from lmc_server.transfer.base import TransferError

SOURCE = "copy_pages.cu"
DESC_WORDS = 3
DESC_BYTES = DESC_WORDS * 8
MAX_THREADS = 1024

_lock = threading.Lock()
_source: str | None = None
_functions: dict[tuple[int, str], cupy.RawKernel] = {}


def source_file() -> Path:
    """The installed ``lmc_server.kernels`` source, or ``kernels/`` of a source tree.

    A source tree run with ``PYTHONPATH`` (the GPU test machine) has no
    ``lmc_server.kernels`` package: that name exists only once installed.
    """
    try:
        kernels = importlib.import_module("lmc_server.kernels")
    except ImportError:
        return Path(__file__).resolve().parents[2] / "kernels" / SOURCE
    path: Path = kernels.source_path(SOURCE)
    return path


def kernel(device: int, name: str) -> cupy.RawKernel:
    """``gather_pages`` or ``scatter_pages``, loaded on ``device`` (compiled once)."""
    global _source
    key = (device, name)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    with _lock:
        fn = _functions.get(key)
        if fn is None:
            if _source is None:
                _source = source_file().read_text()
            with cupy.cuda.Device(device):
                module = cupy.RawModule(code=_source, options=("-std=c++17",))
                for n in ("gather_pages", "scatter_pages"):
                    _functions[(device, n)] = module.get_function(n)
            fn = _functions[key]
    return fn


def launch(device: int, name: str, desc_ptr: int, desc_capacity: int, first: int, count: int,
           blocks: int, threads: int, stream: cupy.cuda.Stream) -> None:
    """Run ``count`` descriptors starting at row ``first`` of the device descriptor array.

    ``desc_capacity`` is the number of rows the array at ``desc_ptr`` holds.
    """
    if count == 0:
        return
    if not (0 <= first and count > 0 and first + count <= desc_capacity):
        raise TransferError(f"descriptor rows [{first}, {first + count}) outside the "
                            f"{desc_capacity}-row descriptor buffer")
    if not (0 < threads <= MAX_THREADS and threads % 32 == 0 and blocks > 0):
        raise TransferError(f"bad launch shape {blocks} x {threads}")
    if desc_ptr == 0 or desc_ptr % 8:
        raise TransferError("descriptor buffer is not 8-byte aligned")
    fn = kernel(device, name)
    fn((min(blocks, count),), (threads,),
       (np.uint64(desc_ptr + first * DESC_BYTES), np.int64(count)), stream=stream)
