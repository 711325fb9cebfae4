"""The operator's report: every batch job's results as an HTML page with charts, and a summary.

`run_jobs` runs each job of `jobs.JOBS` on one DataFrame of records and brings the (small)
results to the driver as pandas frames, with each job's wall time. `write_report` turns them
into `index.html` (tables and PNG charts drawn with matplotlib's Agg backend, so no display is
needed) and `summary.json` (every table's rows, sorted, for scripts and for tests that compare
a run on a standalone cluster with a local one). `print_summary` prints the headline figures
with rich. `build_report` does all three.
"""

from __future__ import annotations

import html
import json
import math
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import pandas as pd  # type: ignore[import-untyped]
from rich.console import Console
from rich.table import Table

from irismesh.spark_telemetry.jobs import JOBS, top_talkers

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["JobResults", "build_report", "print_summary", "run_jobs", "table_rows", "write_report"]

# Columns that identify a row of each job's output: results are sorted by them.
KEYS: Final[dict[str, list[str]]] = {
    "totals": ["kind", "outcome"],
    "throughput": ["cluster", "pattern", "minute"],
    "latency": ["cluster", "pattern", "kind"],
    "errors": ["cluster"],
    "fairness": ["cluster"],
    "member_load": ["cluster", "member"],
    "churn": ["cluster", "minute", "event"],
    "top_talkers": [],  # already in rank order
    "gauges": ["name"],
}


@dataclass(slots=True, kw_only=True)
class JobResults:
    """Each job's result as a pandas frame, and how long each job took."""

    tables: dict[str, pd.DataFrame]
    seconds: dict[str, float]
    meta: dict[str, Any] = field(default_factory=dict)


def run_jobs(
    records: DataFrame,
    *,
    top: int = 10,
    cache: bool = False,
    only: Iterable[str] | None = None,
) -> JobResults:
    """Run every job (or those named in `only`) on `records`; results sorted by their keys.

    Caching is off by default: on compacted Parquet, each job reading only the columns it
    needs measured faster than building an in-memory cache of every column first (1 M
    records: 8 s for all jobs uncached, 14 s to build the cache alone).
    """
    names = list(JOBS) if only is None else list(only)
    unknown = set(names) - set(JOBS)
    if unknown:
        raise ValueError(f"unknown jobs {sorted(unknown)}; known: {', '.join(JOBS)}")
    if cache:
        records = records.cache()
    tables: dict[str, pd.DataFrame] = {}
    seconds: dict[str, float] = {}
    try:
        for name in names:
            job = JOBS[name]
            started = time.perf_counter()
            result = top_talkers(records, limit=top) if name == "top_talkers" else job(records)
            frame: pd.DataFrame = result.toPandas()
            seconds[name] = time.perf_counter() - started
            if KEYS[name]:
                frame = frame.sort_values(KEYS[name], na_position="first", kind="stable")
            tables[name] = frame.reset_index(drop=True)
    finally:
        if cache:
            records.unpersist()
    return JobResults(tables=tables, seconds=seconds)


def table_rows(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """JSON-ready rows: timestamps as ISO strings, NaN as None, numpy scalars as Python."""
    rows: list[dict[str, Any]] = []
    for record in frame.to_dict(orient="records"):
        row: dict[str, Any] = {}
        for key, value in record.items():
            if isinstance(value, pd.Timestamp):
                value = value.isoformat()
            elif hasattr(value, "item"):  # a numpy scalar
                value = value.item()
            if isinstance(value, float) and math.isnan(value):
                value = None
            row[str(key)] = value
        rows.append(row)
    return rows


def write_report(
    results: JobResults, out: str | os.PathLike[str], *, title: str = "irismesh telemetry"
) -> Path:
    """Write index.html, its PNG charts and summary.json into `out`; the HTML page's path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {
        "meta": results.meta,
        "seconds": results.seconds,
        "tables": {name: table_rows(frame) for name, frame in results.tables.items()},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    charts = _draw_charts(results.tables, out)
    page = _html_page(results, charts, title)
    path = out / "index.html"
    path.write_text(page, encoding="utf-8")
    return path


def _draw_charts(tables: Mapping[str, pd.DataFrame], out: Path) -> dict[str, str]:
    """One PNG per chart that has data; section name -> file name."""
    import matplotlib

    matplotlib.use("Agg")  # no display: the report runs on servers and in tests
    import matplotlib.pyplot as plt

    charts: dict[str, str] = {}

    def save(fig: Any, name: str, section: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=90)
        plt.close(fig)
        charts[section] = name

    empty = pd.DataFrame()
    rate = tables.get("throughput", empty)
    if not rate.empty:
        fig, ax = plt.subplots(figsize=(9, 3.6))
        per_cluster = rate.groupby(["minute", "cluster"], dropna=False)["per_second"].sum()
        for cluster, series in per_cluster.unstack("cluster").items():
            ax.plot(series.index, series.to_numpy(), marker=".", label=str(cluster))
        ax.set_ylabel("calls / s")
        ax.set_title("Throughput per cluster (per minute, UTC)")
        ax.legend(fontsize="small")
        save(fig, "throughput.png", "throughput")

    latency = tables.get("latency", empty)
    if not latency.empty:
        fig, ax = plt.subplots(figsize=(9, 3.6))
        labels = [f"{c}/{p}/{k}" for c, p, k in latency[["cluster", "pattern", "kind"]].values]
        x = range(len(labels))
        for offset, column in zip((-0.27, 0.0, 0.27), ("p50_us", "p95_us", "p99_us"), strict=True):
            ax.bar([i + offset for i in x], latency[column], width=0.27, label=column[:-3])
        ax.set_xticks(list(x), labels, rotation=20, ha="right", fontsize="small")
        ax.set_yscale("log")
        ax.set_ylabel("microseconds")
        ax.set_title("Latency of successful calls")
        ax.legend(fontsize="small")
        save(fig, "latency.png", "latency")

    errors = tables.get("errors", empty)
    errors = errors[errors["calls"] > 0] if not errors.empty else errors
    if not errors.empty:
        fig, ax = plt.subplots(figsize=(9, 3.2))
        x = range(len(errors))
        ax.bar([i - 0.2 for i in x], errors["error_rate"] * 100, width=0.4, label="failed")
        ax.bar([i + 0.2 for i in x], errors["timeout_rate"] * 100, width=0.4, label="timeout")
        ax.set_xticks(list(x), [str(c) for c in errors["cluster"]])
        ax.set_ylabel("% of calls")
        ax.set_title("Error and timeout rates")
        ax.legend(fontsize="small")
        save(fig, "errors.png", "errors")

    load = tables.get("member_load", empty)
    load = load[load["share"].notna()] if not load.empty else load
    if not load.empty:
        fig, ax = plt.subplots(figsize=(9, 3.2))
        fair = tables.get("fairness", empty)
        jains = dict(zip(fair["cluster"], fair["jain_index"], strict=True)) if len(fair) else {}
        for row, (cluster, group) in enumerate(load.groupby("cluster")):
            left = 0.0
            for share in sorted(group["share"], reverse=True):
                ax.barh(row, share, left=left, edgecolor="white")
                left += share
            if cluster in jains:
                ax.text(1.01, row, f"Jain {jains[cluster]:.2f}", va="center", fontsize="small")
        ax.set_yticks(range(load["cluster"].nunique()), sorted(load["cluster"].unique()))
        ax.set_xlim(0, 1.15)
        ax.set_xlabel("share of requests, one segment per member")
        ax.set_title("Load balance")
        save(fig, "fairness.png", "fairness")

    churn = tables.get("churn", empty)
    if not churn.empty:
        fig, ax = plt.subplots(figsize=(9, 3.2))
        pivot = churn.pivot_table(
            index="minute", columns="event", values="observations", aggfunc="sum", fill_value=0
        )
        bottom = None
        for event in pivot.columns:
            ax.bar(pivot.index, pivot[event], bottom=bottom, width=0.0005, label=str(event))
            bottom = pivot[event] if bottom is None else bottom + pivot[event]
        ax.set_ylabel("observations")
        ax.set_title("Membership changes per minute")
        ax.legend(fontsize="small")
        save(fig, "churn.png", "churn")
    return charts


_SECTIONS: Final = (
    ("throughput", "Throughput per cluster and minute"),
    ("latency", "Latency (p50 / p95 / p99, microseconds)"),
    ("errors", "Errors and timeouts"),
    ("fairness", "Load-balance fairness"),
    ("member_load", "Requests per member"),
    ("churn", "Membership churn"),
    ("top_talkers", "Top talkers"),
    ("gauges", "Gauges"),
    ("totals", "Records and events by kind and outcome"),
)
_STYLE: Final = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; font-size: 0.85em; margin-bottom: 1em; }
th, td { border: 1px solid #ccc; padding: 2px 8px; text-align: right; }
th { background: #f3f3f3; }
.meta { color: #555; }
"""


def _html_page(results: JobResults, charts: Mapping[str, str], title: str) -> str:
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        "<p class='meta'>",
        html.escape(", ".join(f"{k}: {v}" for k, v in results.meta.items())),
        "</p>",
    ]
    for name, heading in _SECTIONS:
        if name not in results.tables:
            continue
        frame = results.tables[name]
        parts.append(f"<h2>{html.escape(heading)}</h2>")
        if name in charts:
            parts.append(f"<img src='{charts[name]}' alt='{html.escape(heading)}'>")
        if frame.empty:
            parts.append("<p>No data.</p>")
        else:
            rows = frame.head(200)  # the full rows are in summary.json
            parts.append(rows.to_html(index=False, float_format=lambda v: f"{v:,.4g}", na_rep="-"))
        parts.append(f"<p class='meta'>job time {results.seconds.get(name, 0.0):.2f} s</p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def print_summary(results: JobResults, console: Console | None = None) -> None:
    """The headline figures on the terminal: per cluster, then the top talkers."""
    console = console or Console()
    tables = results.tables
    if "totals" in tables:
        totals = tables["totals"]
        records = int(totals["records"].sum()) if not totals.empty else 0
        events = int(totals["events"].sum()) if not totals.empty else 0
        console.print(f"[bold]irismesh telemetry[/]: {records:,} records for {events:,} events")
    for key, value in results.meta.items():
        console.print(f"  {key}: {value}")
    if "errors" in tables:
        console.print(_cluster_table(tables))
    if "top_talkers" in tables:
        talkers = Table(title="Top talkers")
        talkers.add_column("node", no_wrap=True)
        for column in ("calls", "bytes", "failed", "clusters"):
            talkers.add_column(column, justify="right")
        for row in tables["top_talkers"].itertuples(index=False):
            talkers.add_row(
                str(row.node)[:12],
                f"{row.calls:,}",
                f"{row.bytes:,}",
                f"{row.failed:,}",
                str(row.clusters),
            )
        console.print(talkers)
    timing = ", ".join(f"{name} {sec:.2f}s" for name, sec in results.seconds.items())
    console.print(f"[dim]job times: {timing}[/]")


def _cluster_table(tables: Mapping[str, pd.DataFrame]) -> Table:
    """One row per cluster: calls, failure and timeout rates, latency, members, fairness."""
    errors = tables["errors"].set_index("cluster")
    fair = tables.get("fairness", pd.DataFrame({"cluster": []})).set_index("cluster")
    latency = tables.get("latency", pd.DataFrame({"cluster": [], "kind": []}))
    # The caller-side kind with the most events stands for the cluster (requests, usually; not
    # the alphabetically first, which put two broadcasts ahead of thousands of requests).
    calls = latency[latency["kind"] != "serve"]
    if "events" in calls.columns:
        calls = calls.sort_values("events", ascending=False)
    latency = calls.groupby("cluster").first()
    table = Table(title="Clusters")
    table.add_column("cluster", no_wrap=True)
    for column in ("calls", "failed %", "timeout %", "p50 us", "p99 us", "members"):
        table.add_column(column, justify="right")
    table.add_column("Jain", justify="right")
    for cluster in errors.index:
        e = errors.loc[cluster]
        f = fair.loc[cluster] if cluster in fair.index else None
        lat = latency.loc[cluster] if cluster in latency.index else None
        table.add_row(
            str(cluster),
            f"{int(e['calls']):,}",
            _pct(e["error_rate"]),
            _pct(e["timeout_rate"]),
            _num(lat["p50_us"] if lat is not None else None),
            _num(lat["p99_us"] if lat is not None else None),
            _num(f["members"] if f is not None else None),
            _fixed(f["jain_index"] if f is not None else None),
        )
    return table


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _pct(value: Any) -> str:
    return "-" if _missing(value) else f"{100 * float(value):.2f}"


def _num(value: Any) -> str:
    return "-" if _missing(value) else f"{int(value):,}"


def _fixed(value: Any) -> str:
    return "-" if _missing(value) else f"{float(value):.3f}"


def build_report(
    records: DataFrame,
    out: str | os.PathLike[str],
    *,
    top: int = 10,
    meta: Mapping[str, Any] | None = None,
    console: Console | None = None,
    quiet: bool = False,
    only: Iterable[str] | None = None,
) -> JobResults:
    """Run the jobs, write the report into `out` and (unless quiet) print the summary."""
    results = run_jobs(records, top=top, only=only)
    results.meta.update(meta or {})
    write_report(results, out)
    if not quiet:
        print_summary(results, console)
    return results
