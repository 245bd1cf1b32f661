"""The connector's settings, read from vLLM's ``kv_connector_extra_config``.

Every key is declared once, as a field of :class:`ConnectorSettings` made with
:func:`~lmc_server.declare.setting` (type, default, range), and documented in
docs/vllm.md (``tests/cli/test_settings_once.py`` holds the table to the defaults). Unknown
``lmcache.mp.*`` keys are refused (a typo must not silently fall back to a default);
keys outside the prefix belong to others and are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmc_server.client import tcp_endpoint
from lmc_server.declare import Declared, declarations, outside, setting
from lmc_server.net import DEFAULT_HOST, DEFAULT_PORT

PREFIX = "lmcache.mp."
#: The longest a request may wait in the scheduler for L2 chunks (``l2_wait_s``): a
#: prefetch that takes longer is slower than recomputing most prompts.
MAX_L2_WAIT_S = 5.0
#: The longest ``lookup_wait_s`` and ``idle_load_wait_s``: the scheduler thread, or a
#: worker in a step without a forward pass, waits this long at most per step.
MAX_LOOKUP_WAIT_S = 0.1
#: The most stores and retrieves in flight on one connection that a server with its
#: default ``--max-inflight-per-client`` accepts.
MAX_INFLIGHT = 64


@dataclass(frozen=True)
class ConnectorSettings:
    """Every connector setting, declared once: the key is ``lmcache.mp.`` and the
    field's name; the type, default and range refuse a bad value (:meth:`from_extra`)."""

    host: str = setting(DEFAULT_HOST, "server address (IPv6 allowed)")
    port: int = setting(DEFAULT_PORT, "server port", low=1, high=65535)
    timeout_s: float = setting(
        30.0,
        "per-request timeout to the server (a busy server is retried within it)",
        low=0,
        low_open=True,
    )
    arch: str = setting("", "GPU architecture in the namespace (sm90, sm100; cpu without CUDA)")
    model: str = setting("", "model name in the namespace (vLLM's model name)")
    store: bool = setting(True, "store KV of computed chunks")
    load: bool = setting(True, "look up and load cached prefixes")
    store_rank: int = setting(0, "the rank that stores replicated (MLA) KV")
    store_generated: bool = setting(
        True, "also store whole chunks of generated tokens; false: prompt chunks only"
    )
    fence_timeout_s: float = setting(
        60.0, "longest wait for a store at a fence", low=0, low_open=True
    )
    shutdown_timeout_s: float = setting(
        30.0, "longest wait for stores and loads in flight at shutdown", low=0, low_open=True
    )
    max_inflight: int = setting(
        16,
        "stores and retrieves a worker keeps in flight on its connection",
        low=1,
        high=MAX_INFLIGHT,
        note=f"the server refuses more than {MAX_INFLIGHT} per connection by default",
    )
    l2_wait_s: float = setting(
        0.05,
        "longest a request waits in the scheduler for chunks a server brings into L1 from L2",
        low=0,
        high=MAX_L2_WAIT_S,
        note="seconds a request may wait for chunks the server brings in from L2; 0: never wait",
    )
    kv_events: bool = setting(
        False, "stores carry what the server's KV-event subscribers (routers) need"
    )
    lookup_wait_s: float = setting(
        0.005,
        "longest the scheduler thread waits for lookup answers in one engine step",
        low=0,
        high=MAX_LOOKUP_WAIT_S,
        note="seconds the scheduler thread may wait for lookup answers per step; 0: never wait",
    )
    idle_load_wait_s: float = setting(
        0.01,
        "longest a step without a forward pass waits for the loads it started",
        low=0,
        high=MAX_LOOKUP_WAIT_S,
        note="seconds a step without a forward pass waits for its loads; 0: never wait",
    )

    @property
    def endpoint(self) -> str:
        """``tcp://HOST:PORT``; ``::1`` and ``[::1]`` both give ``tcp://[::1]:PORT``."""
        return tcp_endpoint(self.host, self.port)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        """The settings of vLLM's ``kv_connector_extra_config``: each ``lmcache.mp.*``
        value converted to its declared type and held to its declared range."""
        known = {d.name: d for d in declarations(cls)}
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
            values[name] = _convert(key, raw, known[name].kind)
        s = cls(**values)
        for d in known.values():
            value = getattr(s, d.name)
            if d.kind in (int, float) and outside(d, value):
                raise ValueError(_refusal(d, value))
        return s


def _refusal(d: Declared, value: float) -> str:
    """``lmcache.mp.port 0 out of range 1..65535``, with the range's reason where it has
    one; a setting that must only be positive is named with all such settings."""
    st = d.setting
    if _positive(d):  # the timeouts
        named = [e.name for e in declarations(ConnectorSettings) if _positive(e)]
        return f"{PREFIX}{', '.join(named[:-1])} and {named[-1]} must be positive"
    bounds = f"{st.low}..{st.high}" if None not in (st.low, st.high) else d.range_text()
    note = f" ({st.note})" if st.note else ""
    return f"{PREFIX}{d.name} {value} out of range {bounds}{note}"


def _positive(d: Declared) -> bool:
    s = d.setting
    return s.low == 0 and s.low_open and s.high is None


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
