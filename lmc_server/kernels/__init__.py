"""CUDA kernel sources (``*.cu``), package data of ``lmc_server.kernels``.

Read through :mod:`importlib.resources`, so one lookup serves a wheel install, an
editable install and a source tree on ``PYTHONPATH`` alike; reading needs no CuPy.
The cuda transfer engine compiles them with ``cupy.RawModule``.
"""

from importlib import resources


def source_text(name: str) -> str:
    """The text of the kernel source ``name`` (e.g. ``"copy_pages.cu"``) shipped here.

    Raises ``FileNotFoundError`` when the package was built without its ``*.cu`` data.
    """
    return resources.files(__name__).joinpath(name).read_text(encoding="utf-8")
