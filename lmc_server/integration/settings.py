"""The connector's settings, read from vLLM's ``kv_connector_extra_config``.

Every key is documented in docs/vllm.md. Unknown ``lmcache.mp.*`` keys are refused (a
typo must not silently fall back to a default); keys outside the prefix belong to
others and are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmc_server.client import tcp_endpoint

PREFIX = "lmcache.mp."
#: The longest a request may wait in the scheduler for L2 chunks (``l2_wait_s``): a
#: prefetch that takes longer is slower than recomputing most prompts.
MAX_L2_WAIT_S = 5.0
#: The longest ``lookup_wait_s`` and ``idle_load_wait_s``: the scheduler thread, or a
#: worker in a step without a forward pass, waits this long at most per step.
MAX_LOOKUP_WAIT_S = 0.1


@dataclass(frozen=True)
class ConnectorSettings:
    host: str = "127.0.0.1"
    port: int = 5555
    timeout_s: float = 30.0
    arch: str = ""
    model: str = ""
    store: bool = True
    load: bool = True
    store_rank: int = 0
    store_generated: bool = True
    fence_timeout_s: float = 60.0
    shutdown_timeout_s: float = 30.0
    max_inflight: int = 16
    l2_wait_s: float = 0.05
    kv_events: bool = False
    lookup_wait_s: float = 0.005
    idle_load_wait_s: float = 0.01

    @property
    def endpoint(self) -> str:
        """``tcp://HOST:PORT``; ``::1`` and ``[::1]`` both give ``tcp://[::1]:PORT``."""
        return tcp_endpoint(self.host, self.port)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        known = {f: getattr(cls, f) for f in cls.__dataclass_fields__}
        values: dict[str, Any] = {}
        for key, raw in (extra or {}).items():
            if not key.startswith(PREFIX):
                continue
            name = key[len(PREFIX) :].replace(".", "_")
            if name not in known:
                raise ValueError(
                    f"unknown connector setting {key!r}; known: "
                    f"{', '.join(PREFIX + k for k in sorted(known))}"
                )
            default = known[name]
            values[name] = _convert(key, raw, type(default))
        s = cls(**values)
        if not 0 < s.port < 65536:
            raise ValueError(f"{PREFIX}port {s.port} out of range 1..65535")
        if s.timeout_s <= 0 or s.fence_timeout_s <= 0 or s.shutdown_timeout_s <= 0:
            raise ValueError(
                f"{PREFIX}timeout_s, fence_timeout_s and shutdown_timeout_s must be positive"
            )
        if not 1 <= s.max_inflight <= 64:
            raise ValueError(
                f"{PREFIX}max_inflight {s.max_inflight} out of range 1..64 "
                "(the server refuses more than 64 per connection by default)"
            )
        if not 0.0 <= s.l2_wait_s <= MAX_L2_WAIT_S:
            raise ValueError(
                f"{PREFIX}l2_wait_s {s.l2_wait_s} out of range "
                f"0..{MAX_L2_WAIT_S} (seconds a request may wait for chunks "
                "the server brings in from L2; 0: never wait)"
            )
        if not 0.0 <= s.idle_load_wait_s <= MAX_LOOKUP_WAIT_S:
            raise ValueError(
                f"{PREFIX}idle_load_wait_s {s.idle_load_wait_s} out of range "
                f"0..{MAX_LOOKUP_WAIT_S} (seconds a step without a forward "
                "pass waits for its loads; 0: never wait)"
            )
        if not 0.0 <= s.lookup_wait_s <= MAX_LOOKUP_WAIT_S:
            raise ValueError(
                f"{PREFIX}lookup_wait_s {s.lookup_wait_s} out of range "
                f"0..{MAX_LOOKUP_WAIT_S} (seconds the scheduler thread may "
                "wait for lookup answers per step; 0: never wait)"
            )
        return s


def _convert(key: str, raw: Any, kind: type) -> Any:
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{key}: expected a boolean, got {raw!r}")
    try:
        return kind(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{key}: expected {kind.__name__}, got {raw!r}") from None
