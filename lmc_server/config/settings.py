"""Every server setting, declared once (:func:`~lmc_server.declare.setting`), and the
checks that relate settings to each other or to the machine.

``Config`` is made of groups: the server's own settings (:class:`ServerSettings`), the
tiers' below L1 (declared in ``lmc_server/tiers/``:
:class:`~lmc_server.tiers.settings.TierSettings`)
and the KV-event publisher's (its own fields). Adding a setting is one field in its
group: its type, default, help and range or choices. The flag, the ``LMCACHE_*``
variable, the TOML key and the range check follow from it; the docs' flag table must
list it (``tests/cli/test_config_docs.py`` fails until it does). Only a check across
settings, or one that needs the machine, is written in :meth:`Config.check`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from lmc_server.cache.eviction.names import POLICY_HELP, SUMMARIES
from lmc_server.declare import ConfigError, check_declared, declarations, setting
from lmc_server.net import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    binds,
    endpoint_host,
    host_problem,
    is_loopback,
    tcp_endpoint,
)
from lmc_server.protocol.limits import DEFAULT_MAX_FRAME_BYTES
from lmc_server.tiers.checks import TIERS
from lmc_server.tiers.settings import TierInputs, TierSettings

GIB = 1 << 30
MIB = 1 << 20
#: Memory left to the system when the pool size is checked against the machine.
SYSTEM_RESERVE_BYTES = 2 * GIB
BACKENDS = ("auto", "cuda", "cpu", "null")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMATS = ("text", "json")
CUDA_COPY_MODES = ("auto", "staging", "mapped", "dma")
#: Default metrics port: outside the 9100-9999 range Prometheus allocates to exporters
#: (node_exporter 9100, DCGM exporter 9400, ...), and clear of Prometheus itself (9090),
#: Pushgateway/Alertmanager (9091/9093), vLLM and Triton (8000-8002), 8080 and Grafana.
METRICS_PORT = 8555


def gib_text(n_bytes: int) -> str:
    """A byte count as logs and the CLI show sizes: ``0.25 GiB``."""
    return f"{n_bytes / GIB:.2f} GiB"


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


def _l1_help() -> str:
    return (
        f"L1 pool size in GiB [default: a quarter of this machine's memory, "
        f"{default_l1_size_gb():.0f} here]."
    )


#: A tier's settings name the settings they need (``needs``; one of them set): what the
#: refusal of one given without them says, the tier in words and what to add.
NEEDS_WORDS = {
    ("l2_url",): ("the L2 tier (--l2), which is not configured", "--l2 redis://HOST:PORT/DB"),
    TIERS: (
        "the tiers below L1 (--l2, --disk-dir), none of which is configured",
        "--l2 URL or --disk-dir PATH",
    ),
}


@dataclass
class ServerSettings:
    """The L1 server's own settings: address, pool, engine, logs, limits, security, in
    the order of ``--help``. Units are in the names."""

    host: str = setting(
        DEFAULT_HOST,
        "Address to listen on (tcp): IPv4, IPv6 (::1 or [::1]) or a name; "
        "loopback only unless CURVE is configured.",
    )
    port: int = setting(DEFAULT_PORT, "TCP port for clients.", low=1, high=65535)
    chunk_size: int = setting(
        256,
        "Tokens per chunk (the caching unit); must be a multiple of every cached "
        "group's tokens per block.",
        low=1,
        high=1 << 20,
    )
    separate_object_groups: bool = setting(
        False,
        "One object per chunk per retention need (full vs each sliding window) "
        "instead of one object per chunk.",
    )
    l1_size_gb: float | None = setting(None, _l1_help, low=0, low_open=True)  # None: machine's
    eviction_policy: str = setting("LRU", POLICY_HELP, choices=list(SUMMARIES), any_case=True)
    backend: str = setting(
        "auto",
        "Transfer engine: cuda (GPU workers), cpu (shared memory), auto (cuda when "
        "a GPU and CuPy are present), or null (moves no bytes; trace-replay benchmarks "
        "only).",
        choices=BACKENDS,
    )
    log_level: str = setting("INFO", "Log level.", choices=LOG_LEVELS, any_case=True)
    log_format: str = setting("text", "Log line format.", choices=LOG_FORMATS)
    log_file: str = setting(  # empty: stderr (the journal under systemd)
        "", "Append logs to this file instead of stderr; SIGHUP reopens it (for logrotate)."
    )
    lease_ttl_s: float = setting(
        30.0, "Seconds a lookup's lease keeps its chunks from eviction.", low=0, low_open=True
    )
    slab_size_mb: int = setting(
        64,
        "Pool slab size in MiB (largest object; unit moved between partitions).",
        low=1,
        high=4096,
    )
    copy_threads: int = setting(
        0, "Copy threads of the cpu engine (0: min(4, cores)).", low=0, high=256
    )
    cuda_copy_mode: str = setting(
        "auto",
        "cuda engine: 'dma' moves pages with the GPU's copy engines alone (no "
        "kernel: nearly free for an engine computing on the same GPU); 'staging' gathers "
        "pages with a short kernel into a staging buffer and moves it in one DMA (fastest "
        "on an idle GPU for page-sized rows); 'auto' takes dma while the GPU runs kernels "
        "(NVML) and, on an idle GPU, for wide blocks (block-outermost pages), staging "
        "otherwise; 'mapped' has a kernel read/write pinned host memory. See "
        "docs/gpu.md.",
        choices=CUDA_COPY_MODES,
    )
    cuda_staging_mb: int = setting(
        32,
        "cuda staging mode: least size in MiB of each of the two staging halves per "
        "copy lane (GPU memory of the worker's device: 4 lanes x 2 halves).",
        low=1,
        high=4096,
    )
    max_frame_bytes: int = setting(
        DEFAULT_MAX_FRAME_BYTES,
        "Largest request frame answered; larger ones get too_large.",
        low=65536,
        high=1 << 30,
    )
    drain_timeout_s: float = setting(
        10.0, "On SIGTERM, how long in-flight copies may take to finish.", low=0
    )
    metrics_port: int = setting(
        METRICS_PORT, "Prometheus /metrics port (0: off).", low=0, high=65535
    )
    metrics_host: str = setting("127.0.0.1", "Address of the metrics endpoint.")
    heartbeat_timeout_s: float = setting(
        4.0,
        "A client whose connection is silent this long (zmq heartbeats) is dropped "
        "and its registrations, mappings and leases reclaimed.",
        low=0.5,
        high=3600,
    )
    max_inflight_per_client: int = setting(
        64, "Concurrent stores and retrieves per connection; more get 'busy'.", low=1, high=65536
    )
    ipc_path: str = setting(
        "", "Also listen on ipc://PATH; its folder is created mode 0700 (0770 with --ipc-group)."
    )
    ipc_group: str = setting("", "Group (the engine's) allowed to use the ipc socket.")
    curve_secret_key_file: str = setting(
        "",
        "zmq CURVE server certificate (from 'lmcache keygen'); required to listen on "
        "a non-loopback address.",
    )
    curve_clients_dir: str = setting(
        "", "Folder of client public certificates allowed to connect with CURVE."
    )
    memory_check: bool = setting(
        True,
        "Refuse an --l1-size-gb larger than this machine's memory (less 2 GiB). Turn "
        "off only where the reported memory understates what the machine really has "
        "(memory that grows on use, as in some VMs).",
    )


@dataclass
class Config(TierSettings, ServerSettings):
    """Every server setting: :class:`ServerSettings`, then the tiers' (``TierSettings``),
    then the KV-event publisher's below (a dataclass lists its last base's fields
    first: this is the order of ``--help``)."""

    kv_events_endpoint: str = setting(
        "",
        "Publish L1 stores and removals for KV-aware routers, in vLLM's KV-event "
        "format, on this ZeroMQ PUB endpoint; as vLLM does, a wildcard (tcp://*:5557) or "
        "ipc:// endpoint is bound, any other connected to (a router's bound SUB). The "
        "stream carries prompt tokens: bound on a non-loopback address it needs CURVE "
        "or --kv-events-allow-remote. See docs/security.md.",
        metavar="ENDPOINT",
    )
    kv_events_replay_endpoint: str = setting(
        "",
        "ROUTER endpoint where subscribers ask for missed batches (vLLM's replay "
        "protocol); always bound, under the same rule as --kv-events-endpoint.",
        metavar="ENDPOINT",
    )
    kv_events_allow_remote: bool = setting(
        False,
        "Let the KV-event endpoints be bound on a non-loopback address without CURVE: "
        "anyone who can reach them reads the prompts' tokens. For a trusted network "
        "whose router cannot speak CURVE.",
    )
    kv_events_topic: str = setting(
        "",
        "Topic prefix; each model publishes on PREFIX<model>. Default kv@<hostname>@ "
        "(llm-d's kv@<pod>@<model>).",
    )
    kv_events_hwm: int = setting(
        100_000,
        "Batches queued per subscriber; past it batches are dropped for everyone "
        "(counted, still replayable), never waited for.",
        low=1,
        high=1 << 24,
        what="KV events high-water mark",
    )
    kv_events_replay_batches: int = setting(10_000, "Batches kept for replay.", low=1, high=1 << 20)

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

    def tier_inputs(self) -> TierInputs:
        """What the tiers below L1 are built with (``l2.setup.make_chain``)."""
        return TierInputs(self, self.chunk_size, self.l1_size_bytes)

    def check(self, memory_bytes: int | None = None) -> None:
        """Raise :class:`ConfigError` naming the first bad setting and what is allowed:
        first each setting against its declaration, then the checks across settings."""
        check_declared(self)
        if self.metrics_port and self.metrics_port == self.port:
            raise ConfigError("metrics port and server port must differ")
        if self.log_file and not os.path.isdir(os.path.dirname(os.path.abspath(self.log_file))):
            raise ConfigError(f"log file {self.log_file!r}: its directory does not exist")
        if self.l1_size_bytes < self.slab_bytes:
            raise ConfigError(
                f"L1 size {self.l1_size_bytes} bytes is smaller than one slab "
                f"({self.slab_size_mb} MiB)"
            )
        self._check_addresses()
        self._check_kv_events()
        self._check_tiers()
        self._check_memory(memory_bytes)

    def _check_addresses(self) -> None:
        if (problem := host_problem(self.host, bind=True)) is not None:
            raise ConfigError(f"host {self.host!r} {problem}")
        if self.metrics_port and (problem := host_problem(self.metrics_host)) is not None:
            raise ConfigError(f"metrics host {self.metrics_host!r} {problem}")
        if bool(self.curve_secret_key_file) != bool(self.curve_clients_dir):
            raise ConfigError(
                "CURVE needs both --curve-secret-key-file and "
                "--curve-clients-dir (see 'lmcache keygen')"
            )
        if self.exposed(self.host):
            raise ConfigError(
                f"refusing to listen on {self.host}: clients could map and read any KV "
                f"they can name. Listen on 127.0.0.1 (the default), use --ipc-path, or "
                f"configure CURVE (--curve-secret-key-file, --curve-clients-dir)"
            )

    def exposed(self, host: str) -> bool:
        """The exposure rule, for every socket the server binds: one bound on a host
        other machines can reach (not loopback: ``*``, ``0.0.0.0``, ``::``, any other
        address) needs CURVE."""
        return not self.curve_secret_key_file and not is_loopback(host)

    def _check_kv_events(self) -> None:
        ends = [e for e in (self.kv_events_endpoint, self.kv_events_replay_endpoint) if e]
        for e in ends:
            if not re.fullmatch(r"(tcp://[A-Za-z0-9.:\-\[\]*]+:\d{1,5}|ipc://\S+)", e):
                raise ConfigError(f"KV events endpoint {e!r}: use tcp://HOST:PORT or ipc://PATH")
        if len(set(ends)) != len(ends) or self.endpoint in ends:
            raise ConfigError(
                "the KV events endpoints must differ from each other and from the server's endpoint"
            )
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ConfigError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        bound = [(self.kv_events_replay_endpoint, "--kv-events-replay-endpoint")]
        if binds(self.kv_events_endpoint):
            bound.append((self.kv_events_endpoint, "--kv-events-endpoint"))
        elif endpoint_host(self.kv_events_endpoint) in ("0.0.0.0", "[::]"):
            raise ConfigError(
                f"--kv-events-endpoint {self.kv_events_endpoint}: an endpoint without a "
                f"wildcard is connected to (vLLM's rule), and 0.0.0.0 names no peer; "
                f"to listen on every address write tcp://*:PORT"
            )
        for endpoint, flag in bound:
            host = endpoint_host(endpoint)
            if host is None or self.kv_events_allow_remote or not self.exposed(host):
                continue
            raise ConfigError(
                f"refusing to bind {flag} {endpoint}: the KV-event stream carries the "
                f"prompts' tokens and anyone who can reach it would read them. Bind it on "
                f"loopback (tcp://127.0.0.1:PORT for the replay endpoint, tcp://[::1]:PORT "
                f"or ipc://PATH for the publisher), connect to the router's address "
                f"instead (tcp://ROUTER:PORT), configure CURVE (--curve-secret-key-file, "
                f"--curve-clients-dir: the event sockets admit the same clients), or pass "
                f"--kv-events-allow-remote"
            )
        if "\x00" in self.kv_events_topic or len(self.kv_events_topic) > 256:
            raise ConfigError("KV events topic: at most 256 characters, no NUL")

    def _check_tiers(self) -> None:
        """The disk and L2 tiers' own checks (the URL, the password, the filesystem); a
        tier's setting changed from its default without the tier is refused (it would
        do nothing, and the user meant something by it)."""
        for needs, (tier, add) in NEEDS_WORDS.items():
            self._check_unused(needs, tier, add)
        if self.l2_url:
            from lmc_server.tiers.checks import check_l2_config
            from lmc_server.tiers.url import L2ConfigError

            try:
                check_l2_config(self, self.backend)
            except L2ConfigError as e:
                raise ConfigError(str(e)) from None
        if self.disk_dir or self.disk_size_gb:
            from lmc_server.tiers.disk.config import DiskConfigError, check_disk_config

            try:
                check_disk_config(self, self.backend)
            except DiskConfigError as e:
                raise ConfigError(str(e)) from None

    def _check_unused(self, needs: tuple[str, ...], tier: str, add: str) -> None:
        """Refuse the settings that need one of ``needs``, changed from their defaults
        while none of ``needs`` is set."""
        if any(getattr(self, name) for name in needs):
            return
        given = [
            d.flag
            for d in declarations(Config)
            if d.setting.needs == needs and getattr(self, d.name) != d.default
        ]
        if given:
            flags = ", ".join(given)
            verb = "is a setting" if len(given) == 1 else "are settings"
            raise ConfigError(f"{flags} {verb} of {tier}: add {add}, or remove {flags}")

    def _check_memory(self, memory_bytes: int | None) -> None:
        if self.backend == "null" or not self.memory_check:
            return  # the null engine allocates no pool memory (trace replays only)
        mem = physical_memory_bytes() if memory_bytes is None else memory_bytes
        usable = mem - SYSTEM_RESERVE_BYTES
        if self.l1_size_bytes > usable:
            raise ConfigError(
                f"L1 size {self.l1_size_bytes / GIB:.1f} GiB does not fit this machine: "
                f"{mem / GIB:.1f} GiB of memory, of which at most {max(usable, 0) / GIB:.1f} "
                f"GiB can be used with {SYSTEM_RESERVE_BYTES // GIB} GiB left for the "
                f"system; lower --l1-size-gb"
            )
