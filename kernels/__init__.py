"""CUDA kernel sources (``*.cu``), shipped inside the package as ``lmc_server.kernels``.

Loaded with ``cupy.RawModule`` by the cuda transfer engine; see
:func:`lmc_server.kernels.source_path`.
"""

from pathlib import Path


def source_path(name: str) -> Path:
    """Path of a kernel source file shipped with the package."""
    return Path(__file__).with_name(name)
