"""``lmcache bench interference``: the server's copies beside a computing engine.

vLLM's GPUs are never idle while the server copies, so this benchmark measures both
sides at once, with three processes on one GPU, as in production:

- an *engine* (:mod:`.engine`) keeping the GPU busy (``gemm``, ``hbm`` or
  ``decode``) and counting its own throughput;
- a *worker* (:mod:`.worker`) holding the DeepSeek-V4.1 preset's KV in GPU
  memory and driving the server with store loops, load loops (lookup, retrieve,
  release) or both, ``inflight`` requests of each kind in flight;
- the server, ``lmcache server --backend cuda`` as users run it (a separate process),
  one per copy mode measured.

Per (engine kind, copy mode, op, requests in flight) a row gives the server's GB/s on
the busy GPU and, measured in the same run with the engine paused, on the idle GPU; the
engine's throughput alone (the mean of a window before and one after the points of that
kind) and beside the server, and ``engine_loss`` = 1 - beside / alone; the p50 and p99
time of one request (for loads: lookup + retrieve + release). The baseline every
number is held against is the engine process's own side-stream copy of the same bytes
(``copy_mode`` ``own``: contiguous ``cudaMemcpyAsync`` between its device memory and
pinned host memory), measured beside the same engine in the same run.

Every load loop ends with a byte check: the destination blocks were overwritten with a
sentinel before the loop and must equal the source afterwards.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import click
import numpy as np

from lmc_server.bench.common import (
    DEFAULT_CHUNK_SIZE,
    GeometryArgs,
    Report,
    format_table,
    progress,
)
from lmc_server.bench.jsonproc import JsonLineProcess
from lmc_server.bench.options import copy_modes_opt, ints, names, opt
from lmc_server.bench.servers import server_flags
from lmc_server.testing.process import ServerProcess

ENGINE_KINDS = ("gemm", "hbm", "decode")
OPS = ("store", "retrieve", "both")


@dataclass(frozen=True)
class InterferenceConfig:
    engines: tuple[str, ...] = opt(
        ("gemm", "hbm"),
        "Engine workloads beside the server: gemm (bf16 8192^3 matmuls), hbm "
        "(1 GiB device copies), decode (a CUDA graph of small kernels).",
        parse=names(ENGINE_KINDS, "--engines"),
    )
    #: Server copy modes; ``staging:N`` also sets ``--cuda-staging-mb N``.
    copy_modes: tuple[str, ...] = copy_modes_opt(
        "Server copy modes, comma-separated (one server each); staging:N also sets "
        "--cuda-staging-mb N."
    )
    ops: tuple[str, ...] = opt(
        OPS,
        "Server loops: store, retrieve (lookup + retrieve + release), both.",
        parse=names(OPS, "--ops"),
    )
    chunks: tuple[int, ...] = opt((64,), "Chunks per request.", parse=ints)
    inflight: tuple[int, ...] = opt(
        (1, 2), "Requests of each kind kept in flight, comma-separated.", parse=ints
    )
    seconds: float = opt(1.5, "Length of each measured window.", type=click.FloatRange(min=0.2))
    warm_s: float = 0.5
    own_copy: bool = opt(True, "Also measure the engine's own side-stream copy of the same bytes.")
    geometry: GeometryArgs = GeometryArgs()
    l1_size_gb: float = opt(4.0, "Server pool size.", type=click.FloatRange(min=0.5))
    separate: bool = True
    #: Block ids of a request: ``consecutive`` or ``random`` (``Regions.block_order``).
    block_order: str = opt(
        "consecutive",
        "Block ids of a request: consecutive (a fresh engine) or a random "
        "permutation (an engine's block pool after churn).",
        type=click.Choice(["consecutive", "random"]),
    )
    device: int = opt(0, "cuda device.", type=click.IntRange(0))
    seed: int = 0
    chunk_size: int = DEFAULT_CHUNK_SIZE
    show_progress: bool = True


def _loss(alone: float, busy: float) -> float:
    return 1.0 - busy / alone if alone > 0 else float("nan")


def _op_figures(res: dict[str, Any], op: str) -> dict[str, Any]:
    kinds = ("store", "retrieve") if op == "both" else (op,)
    gbps = sum(res[k]["gbps"] for k in kinds)
    lat = res["retrieve" if op != "store" else "store"]
    return {
        "server_gbps": gbps,
        "store_gbps": res["store"]["gbps"] if "store" in res else float("nan"),
        "retrieve_gbps": res["retrieve"]["gbps"] if "retrieve" in res else float("nan"),
        "p50_ms": lat["p50_ms"],
        "p99_ms": lat["p99_ms"],
        "requests": sum(res[k]["requests"] for k in kinds),
        "failed_chunks": sum(res[k]["failed_chunks"] for k in kinds),
        "mismatched_bytes": res.get("retrieve", {}).get("mismatched_bytes", 0),
        "short_chunks": res.get("retrieve", {}).get("short_chunks", 0),
        # where a request's time went inside the server: op -> phase -> mean ms
        "server_ms": res.get("server_ms", {}),
    }


class _Run:
    """One engine process for the whole run; servers and workers per copy mode."""

    def __init__(self, cfg: InterferenceConfig, report: Report, bar: Any) -> None:
        self.cfg = cfg
        self.report = report
        self.bar = bar
        self.engine = JsonLineProcess(
            "lmc_server.bench.interference.engine", "engine", {"device": cfg.device}
        )
        report.config["gpu"] = self.engine.recv(300)["gpu"]
        self.load_timeout_s = 60 + 4 * (cfg.seconds + 2 * cfg.warm_s)
        self.request_bytes: dict[str, int] = {}

    def close(self) -> None:
        self.engine.close()

    def _load(
        self, worker: JsonLineProcess, op: str, n: int, k: int, seconds: float
    ) -> dict[str, Any]:
        return worker.call(
            {"cmd": "load", "op": op, "chunks": n, "inflight": k, "seconds": seconds},
            self.load_timeout_s,
        )

    def mode(self, mode: str, first: bool) -> None:
        cfg = self.cfg
        with ServerProcess(
            server_flags(cfg.chunk_size, cfg.separate, copy_mode=mode),
            backend="cuda",
            l1_size_gb=cfg.l1_size_gb,
        ) as srv:
            worker = JsonLineProcess(
                "lmc_server.bench.interference.worker",
                "worker",
                {
                    "endpoint": srv.endpoint,
                    "device": cfg.device,
                    "max_chunks": max(cfg.chunks),
                    "chunk_size": cfg.chunk_size,
                    "geometry": cfg.geometry.__dict__,
                    "separate": cfg.separate,
                    "seed": cfg.seed,
                    "block_order": cfg.block_order,
                },
            )
            try:
                self._mode_points(worker, mode, first)
            except (RuntimeError, TimeoutError) as e:
                raise RuntimeError(f"{e}\nserver log (last lines):\n{srv.log()[-3000:]}") from None
            finally:
                worker.close()

    def _mode_points(self, worker: JsonLineProcess, mode: str, first: bool) -> None:
        """The idle figures of every point, then every engine kind's busy ones."""
        cfg = self.cfg
        info = worker.recv(300)
        self.report.config.setdefault("chunk_bytes", info["chunk_bytes"])
        self.report.config.setdefault("arch", info["arch"])
        self.request_bytes = {"store": info["store_bytes"], "retrieve": info["retrieve_bytes"]}
        # the retrieves' source batch and every store in flight hold pool space at once
        need = (2 * max(cfg.inflight) + 1) * info["store_bytes"]
        if need > cfg.l1_size_gb * (1 << 30):
            raise RuntimeError(
                f"{max(cfg.inflight)} requests of {max(cfg.chunks)} chunks in flight need "
                f"{need / (1 << 30):.1f} GiB of pool at once; --l1-size-gb is "
                f"{cfg.l1_size_gb:g} (a Llama-like 64-chunk request is 2 GiB: use 12)"
            )
        self.engine.call({"cmd": "pause"}, 60)
        for op in cfg.ops:  # first requests pay kernel loads and buffer allocations
            self._load(worker, op, max(cfg.chunks), max(cfg.inflight), cfg.warm_s)
        idle = {
            (op, n, k): _op_figures(self._load(worker, op, n, k, cfg.seconds), op)
            for op in cfg.ops
            for n in cfg.chunks
            for k in cfg.inflight
        }
        for kind in cfg.engines:
            self._kind(worker, kind, mode, idle, own=first and cfg.own_copy)
            self.engine.call({"cmd": "pause"}, 60)

    def _kind(
        self,
        worker: JsonLineProcess,
        kind: str,
        mode: str,
        idle: dict[tuple[str, int, int], dict[str, Any]],
        own: bool,
    ) -> None:
        cfg = self.cfg
        unit = self.engine.call({"cmd": "kind", "kind": kind}, 300)["unit"]
        measure = {"cmd": "measure", "seconds": cfg.seconds}
        timeout = 60 + 2 * cfg.seconds
        before = self.engine.call(measure, timeout)["throughput"]
        points = []
        for op in cfg.ops:
            for n in cfg.chunks:
                for k in cfg.inflight:
                    worker.send(
                        {
                            "cmd": "load",
                            "op": op,
                            "chunks": n,
                            "inflight": k,
                            "seconds": cfg.seconds + 2 * cfg.warm_s,
                        }
                    )
                    time.sleep(cfg.warm_s)
                    busy = self.engine.call(measure, timeout)["throughput"]
                    res = _op_figures(worker.recv(self.load_timeout_s), op)
                    points.append((op, n, k, busy, res))
                    self.bar.update(1)
        own_rows = []
        if own:
            for op, direction in (("store", "d2h"), ("retrieve", "h2d")):
                nbytes = self.request_bytes[op]
                self.engine.call({"cmd": "own_copy", "direction": direction, "bytes": nbytes}, 120)
                time.sleep(cfg.warm_s)
                busy = self.engine.call(measure, timeout)["throughput"]
                got = self.engine.call({"cmd": "stop_copy"}, 120)
                own_rows.append((op, busy, got["own_gbps"], nbytes))
        after = self.engine.call(measure, timeout)["throughput"]
        alone = (before + after) / 2
        for op, n, k, busy, res in points:
            i = idle[(op, n, k)]
            self.report.rows.append(
                {
                    "engine": kind,
                    "unit": unit,
                    "copy_mode": mode,
                    "op": op,
                    "chunks": n,
                    "inflight": k,
                    **res,
                    "idle_server_gbps": i["server_gbps"],
                    "idle_p50_ms": i["p50_ms"],
                    "idle_p99_ms": i["p99_ms"],
                    "busy_over_idle": res["server_gbps"] / i["server_gbps"]
                    if i["server_gbps"] > 0
                    else float("nan"),
                    "engine_alone": alone,
                    "engine_busy": busy,
                    "engine_loss": _loss(alone, busy),
                    "engine_drift": _loss(before, after),
                    "idle_mismatched_bytes": i["mismatched_bytes"],
                    "idle_failed_chunks": i["failed_chunks"],
                }
            )
        for op, busy, gbps, nbytes in own_rows:
            self.report.rows.append(
                {
                    "engine": kind,
                    "unit": unit,
                    "copy_mode": "own",
                    "op": op,
                    "chunks": max(cfg.chunks),
                    "inflight": 1,
                    "bytes": nbytes,
                    "server_gbps": gbps,
                    "engine_alone": alone,
                    "engine_busy": busy,
                    "engine_loss": _loss(alone, busy),
                    "engine_drift": _loss(before, after),
                    "mismatched_bytes": 0,
                    "failed_chunks": 0,
                }
            )


def run(cfg: InterferenceConfig) -> Report:
    report = Report(
        "interference",
        {
            "engines": list(cfg.engines),
            "copy_modes": list(cfg.copy_modes),
            "ops": list(cfg.ops),
            "chunks": list(cfg.chunks),
            "inflight": list(cfg.inflight),
            "seconds": cfg.seconds,
            "warm_s": cfg.warm_s,
            "geometry": cfg.geometry.describe(),
            "chunk_size": cfg.chunk_size,
            "separate_object_groups": cfg.separate,
            "l1_size_gb": cfg.l1_size_gb,
            "device": cfg.device,
            "block_order": cfg.block_order,
        },
    )
    points = (
        len(cfg.copy_modes) * len(cfg.engines) * len(cfg.ops) * len(cfg.chunks) * len(cfg.inflight)
    )
    with progress(points, "interference", cfg.show_progress) as bar:
        r = _Run(cfg, report, bar)
        try:
            for i, mode in enumerate(cfg.copy_modes):
                r.mode(mode, first=i == 0)
        finally:
            r.close()
    rows = [x for x in report.rows if x["copy_mode"] != "own"]
    report.summary = {
        "mismatched_bytes": sum(
            x["mismatched_bytes"] + x.get("idle_mismatched_bytes", 0) for x in rows
        ),
        "failed_chunks": sum(x["failed_chunks"] + x.get("idle_failed_chunks", 0) for x in rows),
        "worst_engine_loss": {
            f"{e}/{m}": max(
                x["engine_loss"] for x in rows if x["engine"] == e and x["copy_mode"] == m
            )
            for e in cfg.engines
            for m in cfg.copy_modes
        },
    }
    report.notes += [
        "engine_loss = 1 - engine throughput beside the server / alone (alone: mean of a "
        "window before and after the kind's points; engine_drift is their difference)",
        "copy_mode 'own': the engine process's own side-stream cudaMemcpyAsync of the same "
        "bytes (contiguous, pinned host), the baseline",
        "server GB/s over the wall time of each loop; loads are lookup + retrieve + release",
        f"byte check after every load loop: {report.summary['mismatched_bytes']} mismatched "
        f"bytes, {report.summary['failed_chunks']} failed chunks",
    ]
    return report


COLUMNS = (
    "engine|engine; copy_mode|copy; op|op; chunks|chunks|d; inflight|infl|d; "
    "server_gbps|GB/s busy|.1f; idle_server_gbps|GB/s idle|.1f; "
    "engine_alone|engine alone|.0f; engine_busy|beside|.0f; loss_pct|loss %|.1f; "
    "p50_ms|p50 ms|.2f; p99_ms|p99 ms|.2f; mismatched_bytes|mismatch B|d; "
    "failed_chunks|failed|d"
)


def table(report: Report) -> str:
    rows = [{**r, "loss_pct": 100 * r["engine_loss"]} for r in report.rows]
    return format_table(rows, COLUMNS)


def plot(report: Report, path: str) -> None:
    from lmc_server.bench.common import plot_figure, save_figure

    fig, ax = plot_figure()
    rows = report.rows
    fig.set_size_inches(max(8.0, 0.22 * len(rows)), 5.0)
    labels = [f"{r['engine']} {r['copy_mode']} {r['op']} x{r['inflight']}" for r in rows]
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["server_gbps"] for r in rows], 0.4, label="GB/s beside the engine")
    ax.bar(
        x + 0.2,
        [r.get("idle_server_gbps", float("nan")) for r in rows],
        0.4,
        label="GB/s, idle GPU",
        alpha=0.6,
    )
    ax.set_ylabel("GB/s")
    ax.set_xticks(x, labels, fontsize=6, rotation=90)
    ax2 = ax.twinx()
    ax2.plot(x, [100 * r["engine_loss"] for r in rows], "kx", label="engine loss %")
    ax2.set_ylabel("engine loss %")
    ax.set_title(f"lmcache bench interference ({report.config.get('gpu', '')})")
    ax.legend(fontsize=7, loc="upper left")
    ax2.legend(fontsize=7, loc="upper right")
    save_figure(fig, path)
