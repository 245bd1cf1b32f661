"""What the scheduler-driven vLLM tests share, importable without vLLM (CI collects them).

``engine`` imports :mod:`engine_sim` (which needs vLLM) only when a test builds one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmc_server.testing.process import ServerProcess

SERVER_ARGS = ["--chunk-size", "256", "--separate-object-groups", "--eviction-policy", "LRU"]


def engine(srv: ServerProcess, tmp: Path, model: str, **kw: Any) -> Any:
    from engine_sim import SimEngine

    return SimEngine(srv.port, tmp, model=model, **kw)


def prompt(seed: int, n: int) -> list[int]:
    return [1000 + (seed * 7919 + i * 31) % 20000 for i in range(n)]
