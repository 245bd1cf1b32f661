"""The checked-in KV cache fixtures are what vLLM and the connector's adapter produce now.

``tests/fixtures/vllm-*.json`` drive the CPU twin in CI and the GPU test on the GPU
machine, where vLLM is not installed. This test regenerates them with
``scripts/vllm-kv-fixture.py`` (vLLM's real spec classes, grouping, allocation plan
and allocation; the connector's ``describe`` and derivation) and requires the files to
be identical, so a change in vLLM or in the adapter cannot leave them stale.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

ROOT = Path(__file__).resolve().parents[2]


def test_fixtures_match_vllm() -> None:
    spec = importlib.util.spec_from_file_location(
        "vllm_kv_fixture", ROOT / "scripts" / "vllm-kv-fixture.py"
    )
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    generated = script.generate()
    assert sorted(generated) == sorted(
        p.stem for p in (ROOT / "tests" / "fixtures").glob("vllm-*.json")
    )
    for name, data in generated.items():
        stored = json.loads((ROOT / "tests" / "fixtures" / f"{name}.json").read_text())
        assert json.loads(json.dumps(data)) == stored, (
            f"{name} is stale: run scripts/vllm-kv-fixture.py (docs/vllm.md)"
        )
