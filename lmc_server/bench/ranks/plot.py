"""``lmcache bench ranks --plot``: GB/s per rank (TP) or per engine (DP), from the report.

Bars per process and direction, with the aggregate and the raw copy of the same run in
the title, so the picture says what the table says.
"""

from __future__ import annotations

import numpy as np

from lmc_server.bench.common import Report, plot_figure, save_figure


def _series(report: Report) -> tuple[str, list[str], list[tuple[str, list[float]]], str]:
    s, raw = report.summary, report.summary.get("raw", {})
    if report.config.get("mode") == "dp":
        alive = [r for r in report.rows if r.get("alive")]
        dp = s["dp"]
        title = (
            f"{dp['engines']} DP engines: store {dp['store_gbps']:.2f}, load "
            f"{dp['load_gbps']:.2f} GB/s (raw {raw.get('d2h_gbps', 0):.2f} / "
            f"{raw.get('h2d_gbps', 0):.2f})"
        )
        return (
            "engine",
            [str(r["engine"]) for r in alive],
            [
                ("store (D2H)", [r["store_gbps"] for r in alive]),
                ("load (H2D)", [r["load_gbps"] for r in alive]),
            ],
            title,
        )
    rows = report.rows
    series = [
        (label, [r.get(key) or 0.0 for r in rows])
        for label, key in (
            ("TP load retrieve", "tp_load_retrieve_gbps"),
            ("phase 2 store", "p2_store_gbps"),
            ("phase 2 retrieve", "p2_retrieve_gbps"),
        )
        if any(r.get(key) is not None for r in rows)
    ]
    tp = s.get("tp_load")
    title = f"{len(rows)} TP ranks" + (
        f": TP load {tp['retrieve_gbps']:.2f} GB/s (raw {raw.get('h2d_gbps', 0):.2f})" if tp else ""
    )
    return "rank", [str(r["rank"]) for r in rows], series, title


def plot(report: Report, path: str) -> None:
    fig, ax = plot_figure()
    what, labels, series, title = _series(report)
    x = np.arange(len(labels))
    width = 0.8 / max(len(series), 1)
    for i, (label, values) in enumerate(series):
        ax.bar(x + (i - (len(series) - 1) / 2) * width, values, width, label=label)
    ax.set_xticks(x, labels)
    ax.set_xlabel(what)
    ax.set_ylabel("GB/s")
    ax.set_title(f"lmcache bench ranks ({report.config['backend']}): {title}", fontsize=8)
    ax.legend(fontsize=7)
    save_figure(fig, path)
