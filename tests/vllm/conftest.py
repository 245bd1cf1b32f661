"""Tests that drive LMCacheMPConnector through vLLM's real classes (marker ``vllm``).

They run only where vLLM is importable (the optional environment made by
scripts/make-vllm-env.sh); elsewhere every test here is skipped. This folder, being on
pytest's import path, looks like a namespace package named ``vllm``; only a regular
package (one with an origin file) counts as vLLM being installed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
from sim_common import SERVER_ARGS

from lmc_server.testing.process import ServerProcess


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.origin not in (None, "namespace"):
        return
    skip = pytest.mark.skip(reason="vLLM is not installed (see docs/vllm.md)")
    for item in items:
        if item.get_closest_marker("vllm"):
            item.add_marker(skip)


@pytest.fixture
def srv() -> Iterator[ServerProcess]:
    """A CPU-engine server process, as the scheduler-driven tests use it."""
    with ServerProcess(SERVER_ARGS, l1_size_gb=0.5) as s:
        yield s


@pytest.fixture(scope="module")
def tmp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("model")
