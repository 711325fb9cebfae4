"""Whether things are well: the report's headline and a plain verdict per cluster.

Both are read off the jobs' (small) result tables on the driver, with pandas. The verdicts
follow `Thresholds`, whose `describe()` is printed under the verdict table, so a reader knows
exactly why a cluster is called slow.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import pandas as pd  # type: ignore[import-untyped]

from irismesh.spark_telemetry import units

if TYPE_CHECKING:
    from irismesh.spark_telemetry.report import JobResults

__all__ = ["Headline", "Thresholds", "cluster_health"]

# Round trips that stand for a cluster's latency, busiest first; a tunnel's life is no
# round trip, a publish waits for no answer, and a member's service time is not what its
# callers wait for.
_ROUND_TRIPS: Final = ("request", "survey", "broadcast")


@dataclass(frozen=True, slots=True, kw_only=True)
class Thresholds:
    """When a cluster is not called healthy."""

    failed_ratio: float = 0.01
    p99_us: float = 100_000.0

    def describe(self) -> str:
        return (
            f"Verdicts: errors when more than {units.percent(self.failed_ratio, digits=1)} of a "
            f"cluster's calls failed; slow when the p99 of its busiest round trip (requests, "
            f"usually) is above {units.duration_us(self.p99_us)}; lost members when a member "
            "was declared dead; idle when it had no calls; healthy otherwise."
        )


def _round_trip_latency(tables: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    """Per cluster, the latency row of its busiest caller-side round trip kind."""
    latency = tables.get("latency", pd.DataFrame())
    if latency.empty:
        return pd.DataFrame(columns=["p50_us", "p99_us"])
    calls = latency[latency["kind"].isin(_ROUND_TRIPS)].sort_values("events", ascending=False)
    return calls.groupby("cluster").first()


def _dead_members(tables: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    """(cluster, peer) of every member seen declared dead."""
    events = tables.get("events", pd.DataFrame())
    if events.empty:
        return pd.DataFrame(columns=["cluster", "peer"])
    return events[events["event"] == "dead"][["cluster", "peer"]].drop_duplicates()


def cluster_health(tables: Mapping[str, pd.DataFrame], thresholds: Thresholds) -> pd.DataFrame:
    """One row per cluster: calls, failed_ratio, p50_us, p99_us, members, lost, verdicts."""
    errors = tables.get("errors", pd.DataFrame())
    if errors.empty:
        return pd.DataFrame()
    latency = _round_trip_latency(tables)
    fair = tables.get("fairness", pd.DataFrame())
    members = dict(zip(fair["cluster"], fair["members"], strict=True)) if not fair.empty else {}
    lost = _dead_members(tables).groupby("cluster")["peer"].nunique().to_dict()
    rows = []
    for row in errors.itertuples(index=False):
        cluster = row.cluster
        p50 = latency.loc[cluster, "p50_us"] if cluster in latency.index else None
        p99 = latency.loc[cluster, "p99_us"] if cluster in latency.index else None
        verdicts = []
        if lost.get(cluster, 0):
            verdicts.append("lost members")
        if row.calls and row.failed / row.calls > thresholds.failed_ratio:
            verdicts.append("errors")
        if p99 is not None and not units.is_missing(p99) and p99 > thresholds.p99_us:
            verdicts.append("slow")
        if not verdicts:
            verdicts.append("healthy" if row.calls else "idle")
        rows.append(
            {
                "cluster": cluster,
                "calls": row.calls,
                "failed_ratio": row.error_rate,
                "p50_us": p50,
                "p99_us": p99,
                "members": members.get(cluster),
                "lost": lost.get(cluster, 0),
                "verdicts": verdicts,
            }
        )
    return pd.DataFrame(rows)


@dataclass(frozen=True, slots=True, kw_only=True)
class Headline:
    """The figures at the top of the page and of the terminal summary."""

    records: int
    first_ts: float | None
    last_ts: float | None
    nodes: int | None
    clusters: int | None
    topics: int
    calls: int
    failed: int
    worst_p99_us: float | None
    worst_where: str
    deaths: list[str]

    @classmethod
    def of(cls, results: JobResults, label: Callable[[Any], str]) -> Headline:
        tables = results.tables
        overview = tables.get("overview", pd.DataFrame())
        first = overview.iloc[0] if not overview.empty else None
        totals = tables.get("totals", pd.DataFrame())
        errors = tables.get("errors", pd.DataFrame())

        def total(column: str, fallback: pd.DataFrame) -> int:
            if first is not None:
                return int(first[column])
            return int(fallback[column].sum()) if column in fallback.columns else 0

        latency = tables.get("latency", pd.DataFrame())
        round_trips = latency[latency["kind"].isin(_ROUND_TRIPS)] if not latency.empty else latency
        worst, where = None, ""
        if not round_trips.empty:
            top = round_trips.sort_values("p99_us", ascending=False).iloc[0]
            worst, where = float(top["p99_us"]), f"{top['kind']}s to {top['cluster']}"
        topics = set()
        rate = tables.get("throughput", pd.DataFrame())
        if not rate.empty:
            topics = set(rate.loc[rate["pattern"] == "pubsub", "cluster"])
        named = set(errors["cluster"]) if not errors.empty else set()
        clusters = len(named - topics) if not errors.empty else None
        dead = _dead_members(tables)
        return cls(
            records=total("records", totals),
            first_ts=results.meta.get("first_ts", first["first_ts"] if first is not None else None),
            last_ts=results.meta.get("last_ts", first["last_ts"] if first is not None else None),
            nodes=int(first["nodes"]) if first is not None else None,
            clusters=clusters,
            topics=len(named & topics),
            calls=total("calls", errors),
            failed=total("failed", errors),
            worst_p99_us=worst,
            worst_where=where,
            deaths=sorted({label(peer) for peer in dead["peer"]}),
        )

    def clusters_text(self) -> str:
        if self.clusters is None:
            return units.MISSING
        topics = f" + {self.topics} topic{'s' * (self.topics != 1)}" if self.topics else ""
        return units.count(self.clusters) + topics

    @property
    def failed_ratio(self) -> float | None:
        return self.failed / self.calls if self.calls else None

    def span_text(self) -> str:
        if self.first_ts is None or self.last_ts is None or units.is_missing(self.first_ts):
            return units.MISSING
        length = units.duration_s(self.last_ts - self.first_ts)
        return f"{units.timestamp(self.first_ts)} to {units.timestamp(self.last_ts)} ({length})"

    def worst_p99_text(self) -> str:
        if self.worst_p99_us is None:
            return units.MISSING
        return f"{units.duration_us(self.worst_p99_us)} ({self.worst_where})"

    def deaths_text(self) -> str:
        if not self.deaths:
            return "none"
        shown = ", ".join(self.deaths[:5])
        more = f" and {len(self.deaths) - 5} more" if len(self.deaths) > 5 else ""
        return f"{len(self.deaths)}: {shown}{more}"
