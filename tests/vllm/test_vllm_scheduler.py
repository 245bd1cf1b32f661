"""LMCacheMPConnector under vLLM 0.33's own scheduler, against a real server, with
every page attention reads checked against the token prefix that produced it
(``engine_sim``). Marker ``vllm``; run in the optional vLLM environment."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmc_server.testing.process import ServerProcess

pytestmark = pytest.mark.vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

SERVER_ARGS = ["--chunk-size", "256", "--separate-object-groups", "--eviction-policy", "LRU"]
MODELS = ["plain", "dsv41"]


@pytest.fixture
def srv() -> Iterator[ServerProcess]:
    with ServerProcess(SERVER_ARGS, l1_size_gb=0.5) as s:
        yield s


@pytest.fixture(scope="module")
def tmp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("model")


def engine(srv: ServerProcess, tmp: Path, model: str, **kw: object):  # type: ignore[no-untyped-def]
    from engine_sim import SimEngine

    return SimEngine(srv.port, tmp, model=model, **kw)  # type: ignore[arg-type]


def prompt(seed: int, n: int) -> list[int]:
    return [1000 + (seed * 7919 + i * 31) % 20000 for i in range(n)]


@pytest.mark.parametrize("model", MODELS)
def test_shared_prefixes_and_partial_hits(srv: ServerProcess, tmp_model: Path,
                                          model: str) -> None:
    e = engine(srv, tmp_model, model)
    try:
        base = prompt(1, 900)
        e.add("a", base, max_tokens=4)
        e.run(["a"])
        # b: same 900 tokens then more; c: only the first 600 shared (a partial hit)
        e.add("b", base + prompt(2, 300), max_tokens=4)
        e.add("c", base[:600] + prompt(3, 200), max_tokens=4)
        e.run(["b", "c"])
        assert not e.failed
        e.assert_no_wrong_bytes()
    finally:
        e.close()
