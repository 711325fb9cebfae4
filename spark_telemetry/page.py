"""The report as one self-contained HTML page: headline, verdicts, charts over time, tables.

Everything is inline (CSS, SVG charts), nothing is fetched, and no script runs, so the page
opens the same from a mail attachment as from the report directory. Every figure goes through
`units`; node ids are shown by name when the records carry one, otherwise shortened to 8 hex
digits with the full id on hover. A section with nothing to show says so in words.
"""

from __future__ import annotations

import datetime as dt
import html
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final

import pandas as pd  # type: ignore[import-untyped]

from irismesh.spark_telemetry import charts, units
from irismesh.spark_telemetry.health import Headline, Thresholds, cluster_health

if TYPE_CHECKING:
    from irismesh.spark_telemetry.report import JobResults

__all__ = ["render_page"]

Format = Callable[[Any], str]
_STYLE: Final = """
body { font-family: system-ui, sans-serif; margin: 1.5em 2em; color: #222; max-width: 72em; }
h1 { margin-bottom: 0.2em; } h2 { margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.4em 0 1em; }
th, td { border: 1px solid #ccc; padding: 2px 8px; text-align: right; white-space: nowrap; }
th { background: #f3f3f3; } td.text, th.text { text-align: left; }
.meta, .note { color: #555; font-size: 0.9em; }
.headline { display: flex; flex-wrap: wrap; gap: 0.6em 2.2em; margin: 0.8em 0; }
.headline div { min-width: 8em; } .headline b { display: block; font-size: 1.25em; }
.verdict { font-weight: bold; padding: 0 0.4em; border-radius: 3px; }
.healthy { color: #1a7f37; } .idle { color: #666; }
.errors, .slow, .lost { color: #b42318; } .empty { color: #555; font-style: italic; }
figure.chart { margin: 0.4em 0 1em; } figcaption { font-weight: bold; font-size: 0.95em; }
svg.chart-svg { max-width: 100%; height: auto; }
"""
# Caller-side kinds first, then the member's service time and deliveries.
_KIND_ORDER: Final = ("request", "survey", "broadcast", "tunnel", "publish", "serve", "deliver")
_KIND_TITLES: Final = {
    "request": "Request round trip (caller)",
    "serve": "Service time (member's handler)",
    "deliver": (
        "Publish to delivery per topic scope (publisher's clock to subscriber's: across hosts,"
        " their clock skew is in it)"
    ),
    "tunnel": "Tunnel (open to close)",
    "survey": "Survey round trip",
    "broadcast": "Broadcast",
    "publish": "Publish",
}
_MAX_ROWS: Final = 200  # summary.json and the Parquet tables hold every row
_MAX_LINES: Final = 8  # clusters per chart; the busiest


class _Names:
    """Node id -> what the page shows: the node's name, or the id's first 8 hex digits."""

    def __init__(self, names: Mapping[str, str]) -> None:
        self._names = names

    def label(self, node: Any) -> str:
        if units.is_missing(node):
            return units.MISSING
        return self._names.get(str(node)) or str(node)[:8]

    def cell(self, node: Any) -> str:
        if units.is_missing(node):
            return units.MISSING
        return f"<span title='{html.escape(str(node))}'>{html.escape(self.label(node))}</span>"


def render_page(results: JobResults, *, title: str, thresholds: Thresholds) -> str:
    """The whole page."""
    names = _Names(results.names)
    tables = results.tables
    headline = Headline.of(results, names.label)
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        _headline(headline),
    ]
    corrupt = results.meta.get("corrupt_records") or 0
    if corrupt:
        parts.append(f"<p class='note'>{corrupt:,} corrupt records in the spool were skipped.</p>")
    if "errors" in tables:
        parts += _verdicts(results, thresholds)
    parts += _over_time(results, names)
    parts += _sections(results, names)
    parts.append(_footer(results))
    parts.append("</body></html>")
    return "\n".join(parts)


def _headline(head: Headline) -> str:
    if head.records == 0:
        return "<p class='empty'>No records: the spool or dataset held nothing to report.</p>"
    items = [
        ("span", head.span_text()),
        ("nodes", units.count(head.nodes)),
        ("clusters", head.clusters_text()),
        ("calls", units.count(head.calls)),
        ("failed", units.percent(head.failed_ratio)),
        ("worst p99", head.worst_p99_text()),
        ("deaths", head.deaths_text()),
    ]
    cells = "".join(
        f"<div>{html.escape(label)}<b>{html.escape(value)}</b></div>" for label, value in items
    )
    return f"<div class='headline'>{cells}</div>"


def _verdicts(results: JobResults, thresholds: Thresholds) -> list[str]:
    rows = cluster_health(results.tables, thresholds)
    out = ["<h2>Clusters</h2>"]
    if rows.empty:
        return [*out, "<p class='empty'>No cluster was named by any record.</p>"]
    body = []
    for row in rows.itertuples(index=False):
        verdicts = " ".join(
            f"<span class='verdict {v.split()[0]}'>{html.escape(v)}</span>" for v in row.verdicts
        )
        body.append(
            "<tr>"
            f"<td class='text'>{html.escape(str(row.cluster))}</td><td class='text'>{verdicts}</td>"
            f"<td>{units.count(row.calls)}</td><td>{units.percent(row.failed_ratio)}</td>"
            f"<td>{units.duration_us(row.p50_us)}</td><td>{units.duration_us(row.p99_us)}</td>"
            f"<td>{units.count(row.members)}</td><td>{units.count(row.lost)}</td></tr>"
        )
    header = (
        "<tr><th class='text'>cluster</th><th class='text'>verdict</th><th>calls</th>"
        "<th>failed</th><th>p50</th><th>p99</th><th>members</th><th>members lost</th></tr>"
    )
    out.append(f"<table>{header}{''.join(body)}</table>")
    out.append(f"<p class='note'>{html.escape(thresholds.describe())}</p>")
    return out


def _span(results: JobResults) -> tuple[dt.datetime, dt.datetime] | None:
    first, last = results.meta.get("first_ts"), results.meta.get("last_ts")
    bucket = results.meta.get("bucket_seconds")
    if first is None or last is None or units.is_missing(first) or not bucket:
        return None
    start = float(first) // bucket * bucket
    end = (float(last) // bucket + 1) * bucket
    return _utc(start), _utc(end)


def _utc(epoch: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(epoch, dt.UTC).replace(tzinfo=None)


def _naive(times: Iterable[Any]) -> list[dt.datetime]:
    return [pd.Timestamp(t).to_pydatetime().replace(tzinfo=None) for t in times]


def _over_time(results: JobResults, names: _Names) -> list[str]:
    tables = results.tables
    if "throughput" not in tables and "latency_time" not in tables:
        return []
    out = ["<h2>Over time</h2>"]
    span = _span(results)
    bucket = int(results.meta.get("bucket_seconds") or 0)
    if span is None:
        return [*out, "<p class='empty'>No records, so nothing to draw over time.</p>"]
    how = "chosen to fit the span" if results.meta.get("bucket_chosen") else "set by --bucket"
    out.append(
        f"<p class='note'>One point per {units.bucket_label(bucket)} bucket ({how}). Vertical "
        "marks: joins (green, dotted), graceful leaves (blue, dashed), deaths (red).</p>"
    )
    marks = _marks(tables.get("events"), names)
    rate = tables.get("throughput")
    latency = tables.get("latency_time")
    # One colour per cluster on every chart, whatever clusters each chart shows.
    seen = [frame["cluster"].fillna("(none)") for frame in (rate, latency) if frame is not None]
    colours = charts.palette(sorted({str(c) for column in seen for c in column}))
    if rate is not None and not rate.empty:
        per = rate.assign(cluster=rate["cluster"].fillna("(none)"))
        per = per.groupby(["cluster", "time"])["per_second"].sum().unstack("cluster")
        full = pd.date_range(per.index.min(), per.index.max(), freq=f"{bucket}s")
        if len(full) <= 5000:  # zero where nothing was called: silence is a value here
            per = per.reindex(full, fill_value=0.0).fillna(0.0)
        busiest = per.sum().sort_values(ascending=False).index[:_MAX_LINES]
        lines = [
            charts.Series(
                label=str(c), times=_naive(per.index), values=list(per[c]), color=colours[str(c)]
            )
            for c in busiest
        ]
        svg = charts.time_chart(
            "throughput", lines, span=span, marks=marks, ylabel="calls / s", yformat=_rate
        )
        out.append(_figure("throughput", "Throughput per cluster (calls per second)", svg))
    elif rate is not None:
        out.append("<p class='empty'>No calls were recorded, so there is no throughput.</p>")
    if latency is not None and not latency.empty:
        kinds = sorted(set(latency["kind"]), key=lambda k: (_order(k), k))
        unmeasured = [kind for kind in kinds if _unmeasured(latency[latency["kind"] == kind])]
        for kind in kinds:
            if kind not in unmeasured:
                chart = _latency_chart(latency[latency["kind"] == kind], kind, span, marks, colours)
                out.append(chart)
        if unmeasured:
            out.append(
                f"<p class='note'>No latency measured for {html.escape(', '.join(unmeasured))}: "
                "every record of that kind carries 0 us.</p>"
            )
    elif latency is not None:
        out.append("<p class='empty'>No successful call carried a latency.</p>")
    return out


def _unmeasured(frame: pd.DataFrame) -> bool:
    """A kind whose every latency is 0: the nodes recorded none (not a zero latency)."""
    column = "max_us" if "max_us" in frame.columns else "p99_us"
    return bool((frame[column].fillna(0) == 0).all())


def _order(kind: str) -> int:
    return _KIND_ORDER.index(kind) if kind in _KIND_ORDER else len(_KIND_ORDER)


def _latency_chart(
    frame: pd.DataFrame,
    kind: str,
    span: tuple[dt.datetime, dt.datetime],
    marks: list[Any],
    colours: Mapping[str, str],
) -> str:
    frame = frame.assign(cluster=frame["cluster"].fillna("(none)"))
    busiest = frame.groupby("cluster")["events"].sum().sort_values(ascending=False)
    lines = []
    for cluster in busiest.index[:_MAX_LINES]:
        rows = frame[frame["cluster"] == cluster].sort_values("time")
        times = _naive(rows["time"])
        colour = colours[str(cluster)]
        lines.append(
            charts.Series(
                label=f"{cluster} p99", times=times, values=list(rows["p99_us"]), color=colour
            )
        )
        lines.append(
            charts.Series(
                label=f"{cluster} p50",
                times=times,
                values=list(rows["p50_us"]),
                color=colour,
                dashed=True,
            )
        )
    svg = charts.time_chart(
        f"latency-{kind}",
        lines,
        span=span,
        marks=marks,
        ylabel="latency",
        yformat=units.duration_us,
        log_if_wide=True,
    )
    title = _KIND_TITLES.get(kind, kind)
    return _figure(f"latency-{kind}", f"Latency: {title}, p99 (solid) and p50 (dashed)", svg)


def _marks(events: pd.DataFrame | None, names: _Names) -> list[charts.Mark]:
    if events is None or events.empty:
        return []
    shown = events[events["event"].isin(list(charts.EVENT_STYLE))]
    shown = shown.sort_values("first_ts").drop_duplicates(["peer", "event", "time"])
    return [
        charts.Mark(
            time=_utc(float(row.first_ts)), event=str(row.event), label=names.label(row.peer)
        )
        for row in shown.itertuples(index=False)
    ]


def _rate(value: float) -> str:
    return units.number(value) + "/s"


def _figure(name: str, caption: str, svg: str) -> str:
    return (
        f"<figure class='chart' data-chart='{html.escape(name)}'>"
        f"<figcaption>{html.escape(caption)}</figcaption>{svg}</figure>"
    )


# ------------------------------------------------------------------------------------ tables


def _sections(results: JobResults, names: _Names) -> list[str]:
    tables = results.tables
    ident, text, when, ms = names.cell, _text, units.timestamp, units.duration_us
    out: list[str] = []

    def section(name: str, heading: str, body: list[str]) -> None:
        if name in tables:
            out.append(f"<h2>{html.escape(heading)}</h2>")
            out.extend(body)

    def table(
        name: str,
        heading: str,
        columns: Mapping[str, tuple[str, Format]],
        *,
        empty: str,
        frame: pd.DataFrame | None = None,
    ) -> None:
        """A section that is one table: of `frame`, else of the job's table `name`."""
        shown = tables.get(name, pd.DataFrame()) if frame is None else frame
        section(name, heading, [_table(shown, columns, empty=empty)])

    events = tables.get("events", pd.DataFrame())
    if not events.empty:
        events = events.sort_values(["first_ts", "event"])
    table(
        "events",
        "Membership events",
        {
            "first_ts": ("first seen", _when_ms),
            "event": ("event", text),
            "peer": ("member", ident),
            "cluster": ("cluster", _cluster),
            "observers": ("observers", units.count),
        },
        empty="No joins, leaves, suspicions or deaths were recorded.",
        frame=events,
    )
    latency = tables.get("latency", pd.DataFrame())
    if not latency.empty:  # 0 us on every record means not measured: show none
        timed = ["mean_us", "p50_us", "p95_us", "p99_us", "max_us"]
        latency = latency.astype(dict.fromkeys(timed, float))
        latency.loc[latency["max_us"] == 0, timed] = float("nan")
    table(
        "latency",
        "Latency of successful calls",
        {
            "cluster": ("cluster", _cluster),
            "kind": ("kind", text),
            "events": ("events", units.count),
            "mean_us": ("mean", ms),
            "p50_us": ("p50", ms),
            "p95_us": ("p95", ms),
            "p99_us": ("p99", ms),
            "max_us": ("max", ms),
        },
        empty="No successful call carried a latency.",
        frame=latency,
    )
    section("errors", "Errors and timeouts", _errors(tables.get("errors", pd.DataFrame())))
    table(
        "drops",
        "Drops and errors by reason",
        {
            "kind": ("kind", text),
            "reason": ("reason", text),
            "cluster": ("cluster", _cluster),
            "events": ("events", units.count),
            "nodes": ("nodes", units.count),
            "first_ts": ("first", when),
            "last_ts": ("last", when),
        },
        empty="Nothing was dropped and no error outside a call was recorded.",
    )
    section("member_load", "Load balance", _load(tables, names))
    table(
        "churn",
        "Membership churn",
        {
            "cluster": ("cluster", _cluster),
            "time": ("bucket start", when),
            "event": ("event", text),
            "observations": ("observations", units.count),
            "peers": ("members", units.count),
            "observers": ("observers", units.count),
        },
        empty="No membership changes were recorded.",
    )
    table(
        "top_talkers",
        "Top talkers",
        {
            "node": ("node", ident),
            "calls": ("calls", units.count),
            "bytes": ("bytes", units.size),
            "failed": ("failed", units.count),
            "clusters": ("clusters", units.count),
        },
        empty="No node made a call.",
    )
    section("gauges", "Gauges", _gauges(tables.get("gauges", pd.DataFrame())))
    table(
        "totals",
        "Records and events by kind and outcome",
        {
            "kind": ("kind", text),
            "outcome": ("outcome", text),
            "records": ("records", units.count),
            "events": ("events", units.count),
            "first_ts": ("first", when),
            "last_ts": ("last", when),
        },
        empty="No records.",
    )
    return out


def _errors(errors: pd.DataFrame) -> list[str]:
    called = errors[errors["calls"] > 0] if not errors.empty else errors
    if called.empty:
        return ["<p class='empty'>No calls were recorded, so none failed.</p>"]
    failed = called[called["failed"] > 0]
    if failed.empty:
        return [
            f"<p class='empty'>No failed calls: all {units.count(called['calls'].sum())} "
            "calls succeeded.</p>"
        ]
    columns: dict[str, tuple[str, Format]] = {
        "cluster": ("cluster", _cluster),
        "calls": ("calls", units.count),
        "failed": ("failed", units.count),
        "error_rate": ("failed %", units.percent),
    }
    for key in ("timeouts", "remote_errors", "no_responders", "overloaded"):
        if failed[key].sum() > 0:  # only the outcomes that happened
            columns[key] = (key.replace("_", " "), units.count)
    columns["timeout_rate"] = ("timeout %", units.percent)
    return [_table(failed, columns, empty="")]


def _load(tables: Mapping[str, pd.DataFrame], names: _Names) -> list[str]:
    load = tables.get("member_load", pd.DataFrame())
    if load.empty:
        return ["<p class='empty'>No cluster had members.</p>"]
    fair = tables.get("fairness", pd.DataFrame())
    jain = dict(zip(fair["cluster"], fair["jain_index"], strict=True)) if not fair.empty else {}
    served = load[load["share"].notna()]
    out = []
    if not served.empty:
        bars = []
        for cluster, group in served.groupby("cluster"):
            group = group.sort_values("share", ascending=False)
            index = jain.get(cluster)
            label = f"{cluster} (Jain {units.number(index)})" if index is not None else cluster
            bars.append(
                (
                    str(label),
                    [
                        (names.label(m), float(s))
                        for m, s in zip(group["member"], group["share"], strict=True)
                    ],
                )
            )
        out.append(
            _figure("load", "Share of requests per member", charts.shares_chart("load", bars))
        )
    out.append(
        "<p class='note'>Jain's index: 1 when every member got the same load, 1/n when one "
        "got all of it.</p>"
    )
    out.append(
        _table(
            load.sort_values(["cluster", "requests"], ascending=[True, False]),
            {
                "cluster": ("cluster", _cluster),
                "member": ("member", names.cell),
                "requests": ("requests", units.count),
                "share": ("share", units.percent),
            },
            empty="",
        )
    )
    return out


def _gauges(gauges: pd.DataFrame) -> list[str]:
    if gauges.empty:
        return ["<p class='empty'>No gauges were recorded.</p>"]
    rows = []
    for row in gauges.itertuples(index=False):
        fmt: Format = units.size if str(row.name).endswith("bytes") else units.number
        rows.append(
            f"<tr><td class='text'>{html.escape(str(row.name))}</td><td>{units.count(row.nodes)}"
            f"</td><td>{units.count(row.readings)}</td><td>{fmt(row.mean)}</td>"
            f"<td>{fmt(row.max)}</td><td>{fmt(row.latest_total)}</td></tr>"
        )
    header = (
        "<tr><th class='text'>gauge</th><th>nodes</th><th>readings</th><th>mean</th>"
        "<th>max</th><th>latest, summed over nodes</th></tr>"
    )
    return [f"<table>{header}{''.join(rows)}</table>"]


def _table(frame: pd.DataFrame, columns: Mapping[str, tuple[str, Format]], *, empty: str) -> str:
    if frame.empty:
        return f"<p class='empty'>{html.escape(empty)}</p>"
    text_columns = {key for key, (_, fmt) in columns.items() if _textual(fmt)}
    head = "".join(
        f"<th class='{'text' if key in text_columns else ''}'>{html.escape(title)}</th>"
        for key, (title, _) in columns.items()
    )
    body = []
    for record in frame.head(_MAX_ROWS).to_dict(orient="records"):
        cells = "".join(
            f"<td class='{'text' if key in text_columns else ''}'>{fmt(record.get(key))}</td>"
            for key, (_, fmt) in columns.items()
        )
        body.append(f"<tr>{cells}</tr>")
    more = len(frame) - _MAX_ROWS
    note = f"<p class='note'>{more:,} more rows in summary.json.</p>" if more > 0 else ""
    return f"<table><tr>{head}</tr>{''.join(body)}</table>{note}"


def _text(value: Any) -> str:
    return units.MISSING if units.is_missing(value) else html.escape(str(value))


def _cluster(value: Any) -> str:
    return "<i>none (a pure client)</i>" if units.is_missing(value) else html.escape(str(value))


def _when_ms(value: Any) -> str:
    return units.timestamp(value, millis=True)


def _textual(fmt: Format) -> bool:
    """Left-aligned: names, kinds, clusters, node ids."""
    return fmt in (_text, _cluster) or isinstance(getattr(fmt, "__self__", None), _Names)


def _footer(results: JobResults) -> str:
    meta = ", ".join(
        f"{key}: {units.count(value) if isinstance(value, int) else value}"
        for key, value in results.meta.items()
        if key not in ("first_ts", "last_ts", "bucket_chosen")
    )
    timing = ", ".join(f"{name} {units.duration_s(sec)}" for name, sec in results.seconds.items())
    return (
        f"<p class='meta'>{html.escape(meta)}</p><p class='meta'>job times: "
        f"{html.escape(timing)}. Every table in full: summary.json and tables/*.parquet beside "
        "this page.</p>"
    )
