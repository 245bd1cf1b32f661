"""Loading and launching the page copy kernels (``kernels/copy_pages.cu``).

The source ships inside the package (``lmc_server.kernels``), is compiled once per
process by NVRTC through ``cupy.RawModule`` (CuPy caches the binary on disk), and
loaded once per device. :func:`launch` is the thin host wrapper: it checks the unit
range and launch shape before every launch; the addresses the unit rows and block ids
lead to were checked when the plan was built (:mod:`lmc_server.transfer.cuda.plan`).
"""

from __future__ import annotations

import importlib
import threading
from pathlib import Path

import cupy
import numpy as np

from lmc_server.transfer.base import TransferError
from lmc_server.transfer.cuda.units import UNIT_WORDS

SOURCE = "copy_pages.cu"
#: Bytes per unit row (``plan.UNIT_WORDS`` int64 words).
UNIT_BYTES = UNIT_WORDS * 8
MAX_THREADS = 1024
KERNELS = ("gather_units", "scatter_units")

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
        return Path(__file__).resolve().parents[3] / "kernels" / SOURCE
    path: Path = kernels.source_path(SOURCE)
    return path


def kernel(device: int, name: str) -> cupy.RawKernel:
    """``gather_units`` or ``scatter_units``, loaded on ``device`` (compiled once)."""
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
                for n in KERNELS:
                    _functions[(device, n)] = module.get_function(n)
            fn = _functions[key]
    return fn


def launch(
    device: int,
    name: str,
    units_ptr: int,
    ids_ptr: int,
    capacity: int,
    first: int,
    count: int,
    max_layers: int,
    max_blocks: int,
    blocks: int,
    threads: int,
    stream: cupy.cuda.Stream,
) -> None:
    """Copy the pages of unit rows ``[first, first + count)`` of the device unit array.

    ``capacity`` is the number of rows the array at ``units_ptr`` holds; ``ids_ptr`` is
    the device block-id array the rows point into. ``blocks`` is capped at the number
    of page slots the launch walks.
    """
    if count == 0:
        return
    if not (0 <= first and count > 0 and first + count <= capacity):
        raise TransferError(
            f"unit rows [{first}, {first + count}) outside the {capacity}-row unit buffer"
        )
    if not (
        0 < threads <= MAX_THREADS
        and threads % 32 == 0
        and blocks > 0
        and max_layers > 0
        and max_blocks > 0
    ):
        raise TransferError(
            f"bad launch shape {blocks} x {threads} "
            f"({max_layers} layers x {max_blocks} blocks per unit)"
        )
    if units_ptr == 0 or units_ptr % 8 or ids_ptr == 0 or ids_ptr % 8:
        raise TransferError("unit or block-id buffer is not 8-byte aligned")
    fn = kernel(device, name)
    fn(
        (min(blocks, count * max_layers * max_blocks),),
        (threads,),
        (
            np.uint64(units_ptr + first * UNIT_BYTES),
            np.uint64(ids_ptr),
            np.int64(count),
            np.int64(max_layers),
            np.int64(max_blocks),
        ),
        stream=stream,
    )
