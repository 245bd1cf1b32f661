"""vLLM v1 KV connector: ``lmc_server.integration.vllm.LMCacheMPConnector``.

vLLM loads the connector by module path (``kv_connector_module_path``). The class is
resolved lazily so that importing this package (or ``lmc_server.integration``) does not
import vLLM or torch; only touching ``LMCacheMPConnector`` does.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LMCacheMPConnector"]


def __getattr__(name: str) -> Any:
    if name == "LMCacheMPConnector":
        from lmc_server.integration.vllm.connector import LMCacheMPConnector

        return LMCacheMPConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
