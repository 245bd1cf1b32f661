"""The package list, found in the tree (pyproject.toml holds everything else).

Every folder of ``lmc_server`` with an ``__init__.py`` is a package, found by setuptools'
``find_packages``, so a new subpackage ships without a hand-kept list. ``kernels/`` (the
CUDA sources, top level in the tree) ships as ``lmc_server.kernels``; pyproject.toml maps
that name to the folder and adds its ``*.cu``/``*.cuh`` files. ``.ci/check-wheel.sh``
checks the built wheel against the tree.
"""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["lmc_server", "lmc_server.*"]), "lmc_server.kernels"])
