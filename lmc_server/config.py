"""Server configuration: values only; :meth:`Config.check` validates, nothing else.

Precedence (highest first): command-line flags, ``LMCACHE_*`` environment variables,
the TOML file given with ``--config``, the defaults below. The CLI resolves the first
three with click; this module defines the fields, their defaults and the checks that
need the machine (memory), and loads TOML files strictly (unknown keys refused).
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, fields
from typing import Any

from lmc_server.cache.eviction import POLICIES
from lmc_server.net import host_problem, is_loopback, tcp_endpoint
from lmc_server.protocol.codec import DEFAULT_MAX_FRAME_BYTES

GIB = 1 << 30
MIB = 1 << 20
#: Memory left to the system when the pool size is checked against the machine.
SYSTEM_RESERVE_BYTES = 2 * GIB
BACKENDS = ("auto", "cuda", "cpu", "null")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
CUDA_COPY_MODES = ("auto", "staging", "mapped", "dma")
#: Default metrics port: outside the 9100-9999 range Prometheus allocates to exporters
#: (node_exporter 9100, DCGM exporter 9400, ...), and clear of Prometheus itself (9090),
#: Pushgateway/Alertmanager (9091/9093), vLLM and Triton (8000-8002), 8080 and Grafana.
METRICS_PORT = 8555


class ConfigError(ValueError):
    """A setting is invalid; the message says which and what is allowed."""


def physical_memory_bytes() -> int:
    """Total RAM of this machine (or of this cgroup, if that is smaller)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            raw = f.read().strip()
        if raw != "max":
            total = min(total, int(raw))
    except (OSError, ValueError):
        pass
    return total


def default_l1_size_gb() -> float:
    """A quarter of this machine's memory, in whole GiB, at least 1."""
    return float(max(1, physical_memory_bytes() // GIB // 4))


@dataclass
class Config:
    """Every server setting. Units are in the names."""

    host: str = "127.0.0.1"
    port: int = 5555
    chunk_size: int = 256
    separate_object_groups: bool = False
    l1_size_gb: float = 0.0  # 0: default_l1_size_gb()
    eviction_policy: str = "LRU"
    backend: str = "auto"
    log_level: str = "INFO"
    log_format: str = "text"
    log_file: str = ""  # empty: stderr (the journal under systemd); reopened on SIGHUP
    lease_ttl_s: float = 30.0
    slab_size_mb: int = 64
    copy_threads: int = 0  # 0: engine default
    cuda_copy_mode: str = "auto"  # auto | staging | mapped | dma (docs/gpu.md)
    cuda_staging_mb: int = 32  # cuda staging mode: least size of each staging half
    pipeline_mb: int = -1  # stores above this are copied in sub-batches; -1: engine default
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    drain_timeout_s: float = 10.0
    metrics_port: int = METRICS_PORT  # 0: no metrics endpoint
    metrics_host: str = "127.0.0.1"
    heartbeat_timeout_s: float = 4.0  # a silent peer is disconnected and reaped after this
    max_inflight_per_client: int = 64  # concurrent store/retrieve per connection
    ipc_path: str = ""  # also listen on ipc://PATH (parent dir created 0700 / 0770)
    ipc_group: str = ""  # group that may use the ipc socket (the engine's)
    curve_secret_key_file: str = ""  # zmq CURVE server certificate (lmcache keygen)
    curve_clients_dir: str = ""  # public certificates of the clients allowed in
    memory_check: bool = True  # refuse an L1 pool larger than this machine's memory
    l2_url: str = ""  # empty: no L2 tier (docs/l2.md); never carries a password
    l2_password_file: str = ""  # else the password comes from LMCACHE_L2_PASSWORD
    l2_write_queue_objects: int = 4096  # objects waiting for L2; past it writes drop
    l2_prefetch_max_chunks: int = 256  # chunks one lookup's prefetch asks L2 for
    l2_timeout_s: float = 2.0  # connect and per-call timeout of the L2 store
    l2_connections: int = 1  # parallel Redis connections for reads, as many for writes
    disk_dir: str = ""  # empty: no disk tier (docs/l2.md, "The disk tier")
    disk_size_gb: float = 0.0  # the disk tier's capacity; required with disk_dir
    kv_events_endpoint: str = ""  # empty: no KV events (docs/operations.md "KV events")
    kv_events_replay_endpoint: str = ""  # empty: no replay socket
    kv_events_topic: str = ""  # topic prefix before the model; empty: kv@<hostname>@
    kv_events_hwm: int = 100_000  # batches queued per subscriber; past it they drop
    kv_events_replay_batches: int = 10_000  # batches kept for replay

    @property
    def endpoint(self) -> str:
        return tcp_endpoint(self.host, self.port)

    @property
    def l1_size_bytes(self) -> int:
        gb = self.l1_size_gb or default_l1_size_gb()
        return int(gb * GIB)

    @property
    def slab_bytes(self) -> int:
        return self.slab_size_mb * MIB

    def check(self, memory_bytes: int | None = None) -> None:
        """Raise :class:`ConfigError` naming the first bad setting and what is allowed."""
        if not 0 < self.port < 65536:
            raise ConfigError(f"port {self.port} is not in 1..65535")
        if not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"metrics port {self.metrics_port} is not in 0..65535")
        if self.metrics_port and self.metrics_port == self.port:
            raise ConfigError("metrics port and server port must differ")
        if self.chunk_size <= 0 or self.chunk_size > 1 << 20:
            raise ConfigError(f"chunk size {self.chunk_size} is not in 1..{1 << 20}")
        if self.eviction_policy.upper() not in POLICIES:
            raise ConfigError(f"eviction policy {self.eviction_policy!r}: choose one of "
                              f"{', '.join(POLICIES)}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend {self.backend!r}: choose one of {', '.join(BACKENDS)}")
        if self.log_level.upper() not in LOG_LEVELS:
            raise ConfigError(f"log level {self.log_level!r}: choose one of "
                              f"{', '.join(LOG_LEVELS)}")
        if self.log_format not in ("text", "json"):
            raise ConfigError(f"log format {self.log_format!r}: choose text or json")
        if self.log_file and not os.path.isdir(os.path.dirname(os.path.abspath(self.log_file))):
            raise ConfigError(f"log file {self.log_file!r}: its directory does not exist")
        if self.cuda_copy_mode not in CUDA_COPY_MODES:
            raise ConfigError(f"cuda copy mode {self.cuda_copy_mode!r}: choose one of "
                              f"{', '.join(CUDA_COPY_MODES)}")
        if self.lease_ttl_s <= 0:
            raise ConfigError("lease TTL must be positive")
        if not 1 <= self.slab_size_mb <= 4096:
            raise ConfigError(f"slab size {self.slab_size_mb} MiB is not in 1..4096")
        if self.l1_size_gb < 0:
            raise ConfigError("L1 size must be positive")
        if self.l1_size_bytes < self.slab_bytes:
            raise ConfigError(f"L1 size {self.l1_size_bytes} bytes is smaller than one slab "
                              f"({self.slab_size_mb} MiB)")
        if self.max_frame_bytes < 64 * 1024:
            raise ConfigError("max frame bytes must be at least 65536")
        if (problem := host_problem(self.host, bind=True)) is not None:
            raise ConfigError(f"host {self.host!r} {problem}")
        if self.metrics_port and (problem := host_problem(self.metrics_host)) is not None:
            raise ConfigError(f"metrics host {self.metrics_host!r} {problem}")
        if not 0.5 <= self.heartbeat_timeout_s <= 3600:
            raise ConfigError("heartbeat timeout must be in 0.5..3600 s")
        if not 1 <= self.max_inflight_per_client <= 65536:
            raise ConfigError("max in-flight requests per client must be in 1..65536")
        if bool(self.curve_secret_key_file) != bool(self.curve_clients_dir):
            raise ConfigError("CURVE needs both --curve-secret-key-file and "
                              "--curve-clients-dir (see 'lmcache keygen')")
        if not self.curve_secret_key_file and not is_loopback(self.host):
            raise ConfigError(
                f"refusing to listen on {self.host}: clients could map and read any KV "
                f"they can name. Listen on 127.0.0.1 (the default), use --ipc-path, or "
                f"configure CURVE (--curve-secret-key-file, --curve-clients-dir)")
        self._check_kv_events()
        if self.l2_url:
            from lmc_server.l2.checks import check_l2_config
            from lmc_server.l2.url import L2ConfigError

            try:
                check_l2_config(self)
            except L2ConfigError as e:
                raise ConfigError(str(e)) from None
        if self.disk_dir or self.disk_size_gb:
            from lmc_server.l2.disk_config import DiskConfigError, check_disk_config

            try:
                check_disk_config(self)
            except DiskConfigError as e:
                raise ConfigError(str(e)) from None
        if self.backend == "null" or not self.memory_check:
            return  # the null engine allocates no pool memory (trace replays only)
        mem = physical_memory_bytes() if memory_bytes is None else memory_bytes
        usable = mem - SYSTEM_RESERVE_BYTES
        if self.l1_size_bytes > usable:
            raise ConfigError(
                f"L1 size {self.l1_size_bytes / GIB:.1f} GiB does not fit this machine: "
                f"{mem / GIB:.1f} GiB of memory, of which at most {max(usable, 0) / GIB:.1f} "
                f"GiB can be used with {SYSTEM_RESERVE_BYTES // GIB} GiB left for the "
                f"system; lower --l1-size-gb")


    def _check_kv_events(self) -> None:
        ends = [e for e in (self.kv_events_endpoint, self.kv_events_replay_endpoint) if e]
        for e in ends:
            if not re.fullmatch(r"(tcp://[A-Za-z0-9.:\-\[\]*]+:\d{1,5}|ipc://\S+)", e):
                raise ConfigError(f"KV events endpoint {e!r}: use tcp://HOST:PORT or "
                                  f"ipc://PATH")
        if len(set(ends)) != len(ends) or self.endpoint in ends:
            raise ConfigError("the KV events endpoints must differ from each other and "
                              "from the server's endpoint")
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ConfigError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        if not 1 <= self.kv_events_hwm <= 1 << 24:
            raise ConfigError(f"KV events high-water mark {self.kv_events_hwm} is not in "
                              f"1..{1 << 24}")
        if not 1 <= self.kv_events_replay_batches <= 1 << 20:
            raise ConfigError(f"KV events replay batches {self.kv_events_replay_batches} "
                              f"is not in 1..{1 << 20}")
        if "\x00" in self.kv_events_topic or len(self.kv_events_topic) > 256:
            raise ConfigError("KV events topic: at most 256 characters, no NUL")


CONFIG_KEYS = frozenset(f.name for f in fields(Config))
#: Settings whose flag is not named like their field: the TOML file takes the flag's name
#: (``l2 = "redis://..."``, as ``--l2``) and the field's (``l2_url``, kept as an alias).
FLAG_NAMES = {"l2": "l2_url"}


def load_toml(path: str) -> dict[str, Any]:
    """Read a TOML config file; keys are flag or field names (``-`` or ``_``), unknown
    refused, a setting named twice (``l2`` and ``l2_url``) refused.

    The file may hold the settings at top level or under a ``[server]`` table; a
    ``[client]`` table beside it (settings of ``lmcache ping`` and ``lmcache stats``, see
    :func:`load_client_toml`) is left to them.
    """
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    if "server" in data and set(data) <= {"server", "client"} and isinstance(
            data["server"], dict):
        data = data["server"]
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name == "client" and isinstance(value, dict):
            continue  # the client commands' table (load_client_toml)
        name = FLAG_NAMES.get(name, name)
        if name not in CONFIG_KEYS:
            raise ConfigError(f"config file {path}: unknown setting {key!r}; known: "
                              f"{', '.join(sorted(CONFIG_KEYS | set(FLAG_NAMES)))}")
        if name in out:
            raise ConfigError(f"config file {path}: {key!r} names a setting given "
                              f"already (as {name!r} or its flag's name)")
        out[name] = value
    return out


#: Settings of the client commands (``ping``, ``stats``) in a ``[client]`` table.
CLIENT_KEYS = frozenset({"host", "port", "timeout_s", "curve_server_key_file",
                         "curve_client_secret_key_file"})


def load_client_toml(path: str) -> dict[str, Any]:
    """Settings for ``lmcache ping``/``stats`` from the server's TOML file.

    ``host`` and ``port`` come from the ``[server]`` table (or the top level), so the
    commands find the server the file configures; a ``[client]`` table adds or overrides
    ``host``, ``port``, ``timeout_s`` and the client's CURVE files (unknown keys refused).
    A server listening on every address (``::``, ``0.0.0.0``) is reached on loopback.
    """
    server = load_toml(path)
    out: dict[str, Any] = {k: server[k] for k in ("host", "port") if k in server}
    if out.get("host") in ("::", "[::]", "0.0.0.0", "*"):
        out["host"] = "::1" if ":" in str(out["host"]) else "127.0.0.1"
    with open(path, "rb") as f:
        client = tomllib.load(f).get("client", {})
    if not isinstance(client, dict):
        raise ConfigError(f"config file {path}: [client] must be a table")
    for key, value in client.items():
        name = key.replace("-", "_")
        if name not in CLIENT_KEYS:
            raise ConfigError(f"config file {path}: unknown [client] setting {key!r}; "
                              f"known: {', '.join(sorted(CLIENT_KEYS))}")
        out[name] = value
    return out
