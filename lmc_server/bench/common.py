"""What every benchmark shares: the geometry, statistics, machine facts, output.

A benchmark produces a :class:`Report`: a list of result rows (plain dicts), the exact
command, the machine and the date, and notes the reader must see (what was and was not
measured). ``emit`` prints the human table and writes ``--json``; plots are drawn by
each benchmark from the same rows, so the table, the JSON and the picture never disagree.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import click
import numpy as np

from lmc_server import __version__
from lmc_server.bench.options import opt
from lmc_server.config import Config
from lmc_server.protocol.stats import PhaseSum
from lmc_server.testing.presets import KVGeometry, dsv41_flash, llama3_8b

GB = 1e9
#: Tokens per chunk of the servers a benchmark starts unless its config says otherwise:
#: the server's own default (``lmcache server --chunk-size``). Clients then take the
#: chunk size from the server's reply (``Registered.chunk_size``), never a constant.
DEFAULT_CHUNK_SIZE: int = Config.chunk_size


@dataclass(frozen=True)
class GeometryArgs:
    """The preset parameters given on the command line; ``build`` makes a geometry.

    ``model`` picks the preset: ``dsv41`` (DeepSeek-V4.1-Flash, the default) or an
    ordinary Llama-3-8B-like model in the FlashAttention (``llama-flash-attn``) or
    FlashInfer (``llama-flashinfer``) tensor shape; ``layers`` of ``None`` is the
    preset's own count, and the DSV4.1-only fields do not apply to the Llama ones.
    """

    model: str = opt(
        "dsv41",
        "KV preset: dsv41 (DeepSeek-V4.1-Flash), or a Llama-3-8B-like model "
        "(32 layers, 8 KV heads x 128, bf16, 16-token blocks, a KV tensor per layer) "
        "in the FlashAttention ([2, blocks, ...]: K and V planes) or FlashInfer "
        "([blocks, 2, ...]) shape.",
        type=click.Choice(["dsv41", "llama-flash-attn", "llama-flashinfer"]),
    )
    arch: str = opt(
        "sm90",
        "Record format of the preset (584 B/state on sm90, 528 on sm100).",
        type=click.Choice(["sm90", "sm100"]),
    )
    layers: int | None = opt(
        None,
        "Layers of the preset (default: 44 for dsv41, illustrative, the model "
        "card has none; 32 for the Llama-like ones).",
        type=click.IntRange(1, 512),
    )
    sliding_groups: int = opt(
        2, "Sliding-window engine groups the layers are split into.", type=click.IntRange(1, 16)
    )
    kv_source_every: int = opt(
        2, "Every n-th layer has compressed KV and an indexer.", type=click.IntRange(1, 64)
    )
    window_tokens: int = opt(128, "Sliding window in tokens.", type=click.IntRange(1, 1 << 16))
    stride_pad: int = opt(
        0, "Extra bytes between blocks (engines may pad strides).", type=click.IntRange(0, 1 << 20)
    )
    placement: str = opt(
        "block",
        "Where the KV pages sit: block (every layer of a block side by "
        "side, as vLLM lays out DeepSeek-V4) or layer (a tensor per "
        "layer).",
        type=click.Choice(["block", "layer"]),
    )

    def build(self, num_blocks: int) -> KVGeometry:
        if self.model in LLAMA_BACKENDS:
            return llama3_8b(
                arch=self.arch,
                num_blocks=num_blocks,
                layers=self.layers or 32,
                backend=LLAMA_BACKENDS[self.model],
                placement=self.placement,
            )
        if self.model != "dsv41":
            raise ValueError(f"model preset {self.model!r}: expected one of {MODEL_PRESETS}")
        return dsv41_flash(
            arch=self.arch,
            num_blocks=num_blocks,
            layers=self.layers or 44,
            sliding_groups=self.sliding_groups,
            kv_source_every=self.kv_source_every,
            window_tokens=self.window_tokens,
            stride_pad=self.stride_pad,
            placement=self.placement,
        )

    def describe(self) -> str:
        if self.model in LLAMA_BACKENDS:
            return (
                f"Llama-3-8B-like preset: {self.layers or 32} layers, 8 KV heads x 128, bf16, "
                f"16-token blocks, {LLAMA_BACKENDS[self.model]} tensor shape, "
                f"{self.placement}-outermost pages"
            )
        return (
            f"DSV4.1-Flash preset: {self.layers or 44} layers, arch {self.arch}, "
            f"{self.sliding_groups} sliding groups (window {self.window_tokens}), "
            f"kv source every {self.kv_source_every}, {self.placement}-outermost pages"
        )


#: ``--model`` values of the Llama-like preset -> its attention backend's tensor shape
LLAMA_BACKENDS = {"llama-flash-attn": "flash_attn", "llama-flashinfer": "flashinfer"}
MODEL_PRESETS = ("dsv41", *LLAMA_BACKENDS)


def percentiles_us(samples_s: Sequence[float]) -> dict[str, float]:
    """p50 / p99 / mean of round trips, in microseconds."""
    a = np.asarray(samples_s, dtype=np.float64) * 1e6
    if a.size == 0:
        return {"p50_us": float("nan"), "p99_us": float("nan"), "mean_us": float("nan")}
    return {
        "p50_us": float(np.percentile(a, 50)),
        "p99_us": float(np.percentile(a, 99)),
        "mean_us": float(a.mean()),
    }


def machine() -> dict[str, Any]:
    """Facts a reader needs to compare numbers across machines."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    from lmc_server.config import physical_memory_bytes

    return {
        "hostname": platform.node(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_bytes": physical_memory_bytes(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "lmc_server": __version__,
    }


@dataclass
class Report:
    """Rows of one benchmark run plus everything needed to reproduce it."""

    benchmark: str
    config: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    command: str = field(default_factory=lambda: shlex.join(sys.argv))
    date: str = field(
        default_factory=lambda: datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    )
    machine: dict[str, Any] = field(default_factory=machine)

    def to_json(self) -> dict[str, Any]:
        keys = ("benchmark", "command", "date", "machine", "config", "notes", "summary", "rows")
        return {k: getattr(self, k) for k in keys}


def format_table(rows: Iterable[dict[str, Any]], spec: str) -> str:
    """A fixed-width table of the columns ``spec`` names: ``key|header|format`` each
    (no format: as it is), ``;`` between them."""
    columns = [(*c.strip().split("|"), "")[:3] for c in spec.split(";") if c.strip()]
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        line = []
        for key, _, spec in columns:
            v = r.get(key)
            if v is None:
                line.append("-")
            elif isinstance(v, float) and not np.isfinite(v):
                line.append("-")
            else:
                line.append(format(v, spec))
        cells.append(line)
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    out = []
    for n, line in enumerate(cells):
        out.append("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)))
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def emit(report: Report, table: str, json_path: str | None) -> None:
    """Print the header, the table and the notes; write the JSON report if asked."""
    m = report.machine
    click.echo(
        f"lmcache bench {report.benchmark}  ({report.date}, {m['cores']} cores, "
        f"{m['memory_bytes'] / (1 << 30):.0f} GiB, {m['cpu']})"
    )
    click.echo(table)
    for line in report.notes:
        click.echo(f"note: {line}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report.to_json(), f, indent=2, sort_keys=False)
            f.write("\n")
        click.echo(f"wrote {json_path}")


class _NoBar:
    """What :func:`progress` returns where no bar is shown: takes updates, draws nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def progress(total: int, desc: str, enabled: bool) -> Any:
    """A tqdm bar on stderr; none (and no tqdm import) when ``enabled`` is false or
    stderr is no terminal. The commands check for tqdm before they start
    (:func:`lmc_server.bench.options.output_options`)."""
    if not enabled or not sys.stderr.isatty():
        return _NoBar()
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        leave=False,
        file=sys.stderr,
        unit="step",
    )


def plot_figure() -> tuple[Any, Any]:
    """A matplotlib figure on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    return fig, ax


def save_figure(fig: Any, path: str) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    click.echo(f"wrote {path}")


def phase_means(
    before: dict[str, PhaseSum], after: dict[str, PhaseSum]
) -> dict[str, dict[str, float]]:
    """op -> phase -> mean ms per request, over the requests between two snapshots."""
    out: dict[str, dict[str, float]] = {}
    for key, a in after.items():
        b = before.get(key, PhaseSum(count=0, seconds=0.0))
        n = a.count - b.count
        if n > 0:
            op, phase = key.split(":", 1)
            out.setdefault(op, {})[phase] = 1e3 * (a.seconds - b.seconds) / n
    return out
