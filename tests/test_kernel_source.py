"""The CUDA kernel sources are found and read as package data, without CuPy."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lmc_server.kernels import source_text


def test_copy_kernels_source_names_both_entry_points() -> None:
    text = source_text("copy_pages.cu")
    assert 'extern "C" __global__ void gather_units(' in text
    assert 'extern "C" __global__ void scatter_units(' in text


def test_source_is_read_without_importing_cupy() -> None:
    code = (
        "import sys\n"
        "from lmc_server.kernels import source_text\n"
        "text = source_text('copy_pages.cu')\n"
        "assert 'gather_units' in text\n"
        "assert 'cupy' not in sys.modules, 'reading the kernel source imported cupy'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_unknown_source_is_refused() -> None:
    with pytest.raises(FileNotFoundError):
        source_text("no_such_kernel.cu")
