"""Tests that drive LMCacheMPConnector through vLLM's real classes (marker ``vllm``).

They run only where vLLM is importable (the optional environment made by
scripts/make-vllm-env.sh); elsewhere every test here is skipped.
"""

from __future__ import annotations

import importlib.util

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason="vLLM is not installed (see docs/vllm.md)")
    for item in items:
        if item.get_closest_marker("vllm"):
            item.add_marker(skip)
