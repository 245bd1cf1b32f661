"""``lmcache bench startup``: seconds from process start to ping, and to a ready pool.

For each ``--l1-size-gb`` a fresh ``python -m lmc_server server`` is started; the clock
starts just before ``Popen`` (so interpreter start and imports count, as they do for a
user). ``ping_s`` is when the first ping is answered; ``pool_ready_s`` is when the
server reports every slab of the pool prepared (pinned on cuda, populated on cpu),
polled through ``stats`` every 10 ms. Each size is measured ``repeats`` times and the
median reported.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import click
import numpy as np

from lmc_server.bench.common import Report, format_table, progress
from lmc_server.bench.options import BACKENDS, floats, opt
from lmc_server.client.sync import Client
from lmc_server.testing.poll import wait_for
from lmc_server.testing.process import free_port, wait_for_ping

POLL_S = 0.01


@dataclass(frozen=True)
class StartupConfig:
    backend: str = opt("cpu", "Transfer engine of the server.", type=BACKENDS)
    #: ``None`` (resolved at construction): 1 and 16 GiB, and 100 on cuda.
    sizes_gb: tuple[float, ...] = opt(
        None,
        "Pool sizes in GiB, comma-separated [default: 1,16; 1,16,100 on cuda].",
        flag="--l1-size-gb",
        parse=floats,
    )
    repeats: int = opt(3, "Cold starts per size.", type=click.IntRange(1))
    timeout_s: float = 300.0
    show_progress: bool = True

    def __post_init__(self) -> None:
        if self.sizes_gb is None:
            sizes = (1.0, 16.0, 100.0) if self.backend == "cuda" else (1.0, 16.0)
            object.__setattr__(self, "sizes_gb", sizes)


def measure_once(backend: str, l1_size_gb: float, timeout_s: float) -> dict[str, float]:
    """One cold start: seconds to ping and to a fully prepared pool."""
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    args = [
        sys.executable,
        "-m",
        "lmc_server",
        "server",
        "--port",
        str(port),
        "--backend",
        backend,
        "--l1-size-gb",
        str(l1_size_gb),
        "--metrics-port",
        "0",
        "--log-level",
        "WARNING",
    ]
    with tempfile.TemporaryFile() as log:
        t0 = time.monotonic()
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for_ping(endpoint, timeout_s, proc)
            ping_s = time.monotonic() - t0
            with Client(endpoint, timeout_s=timeout_s, client_name="lmcache-bench") as c:
                l1 = wait_for(
                    lambda: (l1 := c.stats().l1).ready_slabs == l1.slabs and l1,
                    "every slab of the pool prepared",
                    timeout_s,
                    POLL_S,
                    TimeoutError,
                )
                ready_s = time.monotonic() - t0
            proc.terminate()
            code = proc.wait(60)
            if code != 0:
                log.seek(0)
                raise RuntimeError(
                    f"server exited with {code}: {log.read().decode(errors='replace')}"
                )
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return {
        "ping_s": ping_s,
        "pool_ready_s": ready_s,
        "slabs": float(l1.slabs),
        "capacity_bytes": float(l1.capacity_bytes),
    }


def run(cfg: StartupConfig) -> Report:
    report = Report(
        "startup", {"backend": cfg.backend, "sizes_gb": list(cfg.sizes_gb), "repeats": cfg.repeats}
    )
    with progress(len(cfg.sizes_gb) * cfg.repeats, "startup", cfg.show_progress) as bar:
        for size in cfg.sizes_gb:
            runs: list[dict[str, Any]] = []
            for _ in range(cfg.repeats):
                runs.append(measure_once(cfg.backend, size, cfg.timeout_s))
                bar.update(1)
            pings = [r["ping_s"] for r in runs]
            ready = [r["pool_ready_s"] for r in runs]
            report.rows.append(
                {
                    "l1_size_gb": size,
                    "slabs": int(runs[0]["slabs"]),
                    "ping_s": float(np.median(pings)),
                    "ping_max_s": max(pings),
                    "pool_ready_s": float(np.median(ready)),
                    "pool_ready_max_s": max(ready),
                    "ready_gib_s": runs[0]["capacity_bytes"] / (1 << 30) / float(np.median(ready)),
                    "runs": runs,
                }
            )
    report.notes.append(
        "times from just before the process is spawned (interpreter start "
        "and imports included); median of "
        f"{cfg.repeats} cold starts; pool ready = every slab "
        f"{'pinned' if cfg.backend == 'cuda' else 'populated'}"
    )
    return report


COLUMNS = (
    "l1_size_gb|L1 GiB|g; slabs|slabs|d; ping_s|ping s|.2f; "
    "ping_max_s|ping max|.2f; pool_ready_s|pool ready s|.2f; "
    "pool_ready_max_s|ready max|.2f; ready_gib_s|GiB/s|.1f"
)


def table(report: Report) -> str:
    return format_table(report.rows, COLUMNS)


def plot(report: Report, path: str) -> None:
    from lmc_server.bench.common import plot_figure, save_figure

    fig, ax = plot_figure()
    x = np.arange(len(report.rows))
    ax.bar(x - 0.2, [r["ping_s"] for r in report.rows], 0.4, label="first ping")
    ax.bar(x + 0.2, [r["pool_ready_s"] for r in report.rows], 0.4, label="pool ready")
    ax.set_xticks(x, [f"{r['l1_size_gb']:g} GiB" for r in report.rows])
    ax.set_ylabel("seconds from process start")
    ax.set_title(f"lmcache bench startup ({report.config['backend']})")
    ax.legend()
    save_figure(fig, path)
