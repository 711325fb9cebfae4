"""The report's charts as inline SVG, drawn with matplotlib (no display, no files, no network).

Each chart is an `<svg>` element to paste into the page. matplotlib names the elements of a
drawing with ids (clip paths, marker shapes) that would collide between two drawings on one
page, so every id and every reference to one gets the chart's own prefix. Data points are
drawn as markers inside groups whose id holds `-series-` (bars: `-bar-`), so a test in a
browser can count what a chart shows; event marks are groups whose id holds `-event-`.

Time charts share one x-axis range (the report's span, bucket-aligned), so a death marked on
the throughput chart sits at the same x as on every latency chart below it.
"""

from __future__ import annotations

import datetime as dt
import io
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["EVENT_STYLE", "Mark", "Series", "palette", "shares_chart", "time_chart"]

# join, graceful leave, death, ejection: what an operator looks for next to a change in latency.
EVENT_STYLE: Final = {
    "join": {"color": "#2ca02c", "linestyle": ":", "linewidth": 1.0},
    "leave": {"color": "#1f77b4", "linestyle": "--", "linewidth": 1.2},
    "dead": {"color": "#d62728", "linestyle": "-", "linewidth": 1.6},
    # A caller took a member out of a cluster's rotation (outlier ejection), and back in.
    "ejected": {"color": "#9467bd", "linestyle": "-.", "linewidth": 1.4},
    "readmitted": {"color": "#9467bd", "linestyle": ":", "linewidth": 1.0},
}
_RC: Final[Any] = {  # matplotlib types its keys as one long Literal
    "svg.fonttype": "none",  # text as text: small, selectable, the page's own font
    "svg.hashsalt": "irismesh",  # the same drawing gives the same bytes
    "font.size": 9,
    "axes.spines.top": False,
    "axes.spines.right": False,
}
_COLORS: Final = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
    "#d62728",
)
_ID: Final = re.compile(r'\bid="([^"]+)"')
_URL: Final = re.compile(r"url\(#([^)]+)\)")
_HREF: Final = re.compile(r'href="#([^"]+)"')
_METADATA: Final = re.compile(r"<metadata>.*?</metadata>", re.S)


@dataclass(frozen=True, slots=True, kw_only=True)
class Series:
    """One line: a label, bucket starts (UTC) and values (None or NaN break the line)."""

    label: str
    times: Sequence[dt.datetime]
    values: Sequence[float | None]
    color: str
    dashed: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Mark:
    """A membership event on the time axis."""

    time: dt.datetime
    event: str
    label: str


def palette(names: Sequence[str]) -> dict[str, str]:
    """A stable colour per name (sorted), so a cluster has one colour on every chart."""
    return {name: _COLORS[i % len(_COLORS)] for i, name in enumerate(sorted(names))}


def time_chart(
    prefix: str,
    series: Sequence[Series],
    *,
    span: tuple[dt.datetime, dt.datetime],
    marks: Sequence[Mark] = (),
    ylabel: str,
    yformat: Callable[[float], str],
    log_if_wide: bool = False,
) -> str:
    """Lines over time with event marks; an inline `<svg>` whose ids start with `prefix`."""
    from matplotlib import dates as mdates
    from matplotlib import rc_context
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, NullFormatter

    with rc_context(_RC):
        fig = Figure(figsize=(9.6, 3.2))
        ax: Any = fig.subplots()  # matplotlib's stubs take no datetimes on a date axis
        low, high = float("inf"), 0.0
        for number, line in enumerate(series):
            values = [float("nan") if v is None else float(v) for v in line.values]
            markers = 3 if len(values) > 1 else 6
            (artist,) = ax.plot(
                list(line.times),
                values,
                color=line.color,
                linestyle="--" if line.dashed else "-",
                linewidth=1.2,
                marker="o",
                markersize=markers,
                label=line.label,
            )
            artist.set_gid(f"series-{number}")
            positive = [v for v in values if v == v and v > 0]
            if positive:
                low, high = min(low, min(positive)), max(high, max(positive))
        _draw_marks(ax, marks)
        ax.set_xlim(span[0], span[1])
        locator = mdates.AutoDateLocator(tz=dt.UTC)  # type: ignore[no-untyped-call]
        ax.xaxis.set_major_locator(locator)
        concise = mdates.ConciseDateFormatter(locator, tz=dt.UTC)  # type: ignore[no-untyped-call]
        ax.xaxis.set_major_formatter(concise)
        ax.set_xlabel("time (UTC)")
        if log_if_wide and high > 0 and high / low > 30:
            ax.set_yscale("log")
            ax.yaxis.set_minor_formatter(NullFormatter())
        else:
            ax.set_ylim(bottom=0, top=max(high * 1.1, 1e-9))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: yformat(v)))
        ax.set_ylabel(ylabel)
        ax.grid(True, color="#e5e5e5", linewidth=0.6)
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
        # Fixed margins, not tight_layout: every time chart's plot area has the same left and
        # right edges, so a mark at one time sits at one x down the page.
        fig.subplots_adjust(left=0.08, right=0.83, top=0.96, bottom=0.16)
        return _svg(fig, prefix, tight=False)


def _draw_marks(ax: Any, marks: Sequence[Mark]) -> None:
    seen: set[str] = set()
    labelled = 0
    for number, mark in enumerate(sorted(marks, key=lambda m: m.time)):
        style = EVENT_STYLE.get(mark.event, {"color": "#999999", "linestyle": ":"})
        legend = mark.event if mark.event not in seen else "_nolegend_"
        seen.add(mark.event)
        line = ax.axvline(mark.time, label=legend, alpha=0.8, **style)
        line.set_gid(f"event-{number}")
        if mark.event != "join" and labelled < 12:  # joins crowd the start of every run
            labelled += 1
            ax.annotate(
                f"{mark.event} {mark.label}",
                xy=(mark.time, 1.0),
                xycoords=("data", "axes fraction"),
                rotation=90,
                va="top",
                ha="right",
                fontsize="x-small",
                color=style["color"],
            )


def shares_chart(prefix: str, clusters: Sequence[tuple[str, Sequence[tuple[str, float]]]]) -> str:
    """One bar per cluster split into its members' shares of requests; inline `<svg>`."""
    from matplotlib import rc_context
    from matplotlib.figure import Figure
    from matplotlib.ticker import PercentFormatter

    with rc_context(_RC):
        fig = Figure(figsize=(9.6, 0.6 + 0.45 * len(clusters)))
        ax = fig.subplots()
        number = 0
        for row, (_cluster, members) in enumerate(clusters):
            left = 0.0
            for index, (member, share) in enumerate(members):
                (bar,) = ax.barh(
                    row, share, left=left, color=_COLORS[index % len(_COLORS)], edgecolor="white"
                )
                bar.set_gid(f"bar-{number}")
                number += 1
                if share >= 0.08:
                    ax.text(
                        left + share / 2,
                        row,
                        member,
                        ha="center",
                        va="center",
                        fontsize="x-small",
                        color="white",
                    )
                left += share
        ax.set_yticks(range(len(clusters)), [cluster for cluster, _ in clusters])
        ax.invert_yaxis()
        ax.set_xlim(0, 1)
        ax.xaxis.set_major_formatter(PercentFormatter(1.0))
        ax.set_xlabel("share of the cluster's requests, one segment per member")
        return _svg(fig, prefix)


def _svg(fig: Any, prefix: str, *, tight: bool = True) -> str:
    if tight:
        fig.tight_layout()
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", metadata={"Date": None})
    text = buffer.getvalue()
    text = text[text.index("<svg") :]  # no XML prolog or DOCTYPE inside HTML
    text = _METADATA.sub("", text)
    text = _ID.sub(lambda m: f'id="{prefix}-{m.group(1)}"', text)
    text = _URL.sub(lambda m: f"url(#{prefix}-{m.group(1)})", text)
    text = _HREF.sub(lambda m: f'href="#{prefix}-{m.group(1)}"', text)
    return text.replace("<svg ", '<svg class="chart-svg" role="img" ', 1)
