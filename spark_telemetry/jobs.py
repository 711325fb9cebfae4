"""The batch jobs: pure functions from a DataFrame of records to a DataFrame of results.

Every job takes a DataFrame with (at least) the columns of `irismesh.telemetry.schema.FIELDS`,
whether read from compacted Parquet, built from Arrow in a test, or a stream's micro-batch,
and returns a new DataFrame; none of them reads, writes, caches or collects. Rules they share:

- Counts sum `weight`, never rows, so sampled records (weight > 1) count as the events they
  stand for. Only percentiles cannot honour weights (`percentile_approx` has no weight
  argument); they are exact for the sample, which is what uniform sampling within a cluster
  and pattern calls for. Means are weighted.
- Operations are counted once, on the caller's side (`CALL_KINDS`: request, publish,
  broadcast, tunnel, survey); serve and deliver records describe the same operations from the
  member's side and feed latency (service time) and membership only.
- Spark 4 runs SQL in ANSI mode, where x / 0 raises: every ratio uses `try_divide`, so a
  cluster with no calls gets NULL rates, not an error and not a made-up 0.
- Sums of squares are taken in double: a long would overflow, and ANSI mode raises on that too.
- Time buckets are `bucket` seconds wide, aligned on the epoch, from `ts` in UTC (the
  session's time zone, see session.py); column `time` holds each bucket's start. The report
  chooses the width from the span of the data (`units.choose_bucket`).
- Membership records name no cluster when the node recording them does not know it (SWIM is
  mesh-wide): such a record counts for every cluster its peer is seen serving (as the peer of a
  request, the recorder of a serve, the peer of a membership record that names a cluster), and
  for cluster NULL when the peer serves none (a pure client).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from irismesh.telemetry.schema import CALL_KINDS, Kind, Outcome

__all__ = [
    "BUCKETED",
    "JOBS",
    "drops_by_reason",
    "error_rates",
    "fairness",
    "gauge_summary",
    "latency_over_time",
    "latency_percentiles",
    "member_clusters",
    "member_load",
    "membership_churn",
    "membership_events",
    "overview",
    "throughput",
    "top_talkers",
    "totals",
]

PERCENTILES: Final = (0.5, 0.95, 0.99)
_CALLS: Final = [str(kind) for kind in CALL_KINDS]


def _is_call() -> Column:
    return F.col("kind").isin(_CALLS)


def _weight_if(condition: Column) -> Column:
    """Sum of weights of the rows where `condition` holds; 0 (not NULL) when there are none."""
    return F.sum(F.when(condition, F.col("weight")).otherwise(F.lit(0)))


def _bucket(seconds: int) -> Column:
    """The start of the `seconds`-wide bucket holding `ts`, as a UTC timestamp."""
    if seconds < 1:
        raise ValueError(f"a time bucket is at least 1 second wide, not {seconds}")
    return F.timestamp_seconds(F.floor(F.col("ts") / F.lit(seconds)) * F.lit(seconds))


def overview(records: DataFrame) -> DataFrame:
    """One row: records, events, recording nodes, first and last ts, calls and failed calls.

    Columns: records, events, nodes, first_ts, last_ts, calls, failed.
    """
    call = _is_call()
    return records.agg(
        F.count(F.lit(1)).alias("records"),
        F.coalesce(F.sum("weight"), F.lit(0)).alias("events"),
        F.countDistinct("node").alias("nodes"),
        F.min("ts").alias("first_ts"),
        F.max("ts").alias("last_ts"),
        F.coalesce(_weight_if(call), F.lit(0)).alias("calls"),
        F.coalesce(_weight_if(call & (F.col("outcome") != str(Outcome.OK))), F.lit(0)).alias(
            "failed"
        ),
    )


def throughput(records: DataFrame, *, bucket: int = 60) -> DataFrame:
    """Calls per cluster, pattern and time bucket: events, ok, bytes, and events per second.

    Columns: cluster, pattern, time (bucket start, UTC), events, ok, bytes, per_second.
    """
    calls = records.where(_is_call())
    return (
        calls.groupBy("cluster", "pattern", _bucket(bucket).alias("time"))
        .agg(
            F.sum("weight").alias("events"),
            _weight_if(F.col("outcome") == str(Outcome.OK)).alias("ok"),
            F.sum(F.coalesce(F.col("size"), F.lit(0)) * F.col("weight")).alias("bytes"),
        )
        .withColumn("per_second", F.col("events") / F.lit(float(bucket)))
    )


def latency_over_time(records: DataFrame, *, bucket: int = 60, accuracy: int = 1000) -> DataFrame:
    """p50 and p99 latency of successful calls, serves and deliveries per time bucket.

    Columns: cluster, kind, time (bucket start, UTC), samples, events, p50_us, p99_us. The
    accuracy is lower than `latency_percentiles`' (1/1000 of the rank): hundreds of buckets
    each hold a sketch, and a line on a chart needs no more.
    """
    quantiles = F.percentile_approx(F.col("latency_us"), [0.5, 0.99], accuracy)
    return (
        _timed(records)
        .groupBy("cluster", "kind", _bucket(bucket).alias("time"))
        .agg(
            F.count(F.lit(1)).alias("samples"),
            F.sum("weight").alias("events"),
            quantiles.alias("q"),
        )
        .select(
            "cluster",
            "kind",
            "time",
            "samples",
            "events",
            *quantile_columns("p50_us", "p99_us"),
        )
    )


def quantile_columns(*names: str) -> list[Column]:
    """The quantiles an aggregation put in the array column "q" (`percentile_approx` of a
    list of ranks), one column each, named in the order of the ranks."""
    return [F.col("q")[i].alias(name) for i, name in enumerate(names)]


def _timed(records: DataFrame) -> DataFrame:
    """Successful calls, serves and deliveries that carry a latency."""
    return records.where(
        F.col("kind").isin([*_CALLS, str(Kind.SERVE), str(Kind.DELIVER)])
        & (F.col("outcome") == str(Outcome.OK))
        & F.col("latency_us").isNotNull()
    )


def latency_percentiles(records: DataFrame, *, accuracy: int = 10_000) -> DataFrame:
    """Latency of successful calls (round trip), serves (service time) and deliveries.

    Columns: cluster, pattern, kind, samples (records), events (weighted), mean_us (weighted),
    p50_us, p95_us, p99_us, max_us. Failed calls are left out: a timeout's latency is the
    caller's deadline, not the service's.
    """
    timed = _timed(records)
    quantiles = F.percentile_approx(F.col("latency_us"), list(PERCENTILES), accuracy)
    return (
        timed.groupBy("cluster", "pattern", "kind")
        .agg(
            F.count(F.lit(1)).alias("samples"),
            F.sum("weight").alias("events"),
            F.try_divide(
                F.sum(F.col("latency_us").cast("double") * F.col("weight")), F.sum("weight")
            ).alias("mean_us"),
            quantiles.alias("q"),
            F.max("latency_us").alias("max_us"),
        )
        .select(
            "cluster",
            "pattern",
            "kind",
            "samples",
            "events",
            "mean_us",
            *quantile_columns("p50_us", "p95_us", "p99_us"),
            "max_us",
        )
    )


def error_rates(records: DataFrame) -> DataFrame:
    """Calls, failures by outcome, drops and errors per cluster, with error and timeout rates.

    Columns: cluster, calls, ok, failed, timeouts, remote_errors, no_responders, overloaded, drops,
    errors, error_rate, timeout_rate. Every cluster named by any record appears, so a cluster
    seen only in membership records has calls = 0 and NULL rates.
    """
    call = _is_call()
    outcome = F.col("outcome")
    return (
        records.where(F.col("cluster").isNotNull())
        .groupBy("cluster")
        .agg(
            _weight_if(call).alias("calls"),
            _weight_if(call & (outcome == str(Outcome.OK))).alias("ok"),
            _weight_if(call & (outcome != str(Outcome.OK))).alias("failed"),
            _weight_if(call & (outcome == str(Outcome.TIMEOUT))).alias("timeouts"),
            _weight_if(call & (outcome == str(Outcome.REMOTE_ERROR))).alias("remote_errors"),
            _weight_if(call & (outcome == str(Outcome.NO_RESPONDERS))).alias("no_responders"),
            _weight_if(call & (outcome == str(Outcome.OVERLOADED))).alias("overloaded"),
            _weight_if(F.col("kind") == str(Kind.DROP)).alias("drops"),
            _weight_if(F.col("kind") == str(Kind.ERROR)).alias("errors"),
        )
        .withColumn("error_rate", F.try_divide(F.col("failed"), F.col("calls")))
        .withColumn("timeout_rate", F.try_divide(F.col("timeouts"), F.col("calls")))
    )


def drops_by_reason(records: DataFrame) -> DataFrame:
    """Drops and errors not tied to a call, by kind, reason (`name`) and cluster.

    Columns: kind (drop or error), reason, cluster, events (weighted), records, nodes
    (distinct recorders), first_ts, last_ts.
    """
    return (
        records.where(F.col("kind").isin(str(Kind.DROP), str(Kind.ERROR)))
        .groupBy("kind", F.col("name").alias("reason"), "cluster")
        .agg(
            F.sum("weight").alias("events"),
            F.count(F.lit(1)).alias("records"),
            F.countDistinct("node").alias("nodes"),
            F.min("ts").alias("first_ts"),
            F.max("ts").alias("last_ts"),
        )
    )


def member_clusters(records: DataFrame) -> DataFrame:
    """Each (member, cluster) seen: a request's peer, a serve's recorder, a membership peer."""
    kind = F.col("kind")
    member = (
        F.when(kind == str(Kind.REQUEST), F.col("peer"))
        .when(kind == str(Kind.SERVE), F.col("node"))
        .when(kind == str(Kind.MEMBERSHIP), F.col("peer"))
    )
    return (
        records.where(F.col("cluster").isNotNull())
        .select(member.alias("member"), "cluster")
        .where(F.col("member").isNotNull())
        .distinct()
    )


def _membership(records: DataFrame) -> DataFrame:
    """Membership records, those without a cluster once per cluster their peer serves."""
    changes = records.where(F.col("kind") == str(Kind.MEMBERSHIP)).select(
        "ts", "node", "peer", "name", "weight", "cluster"
    )
    known = changes.where(F.col("cluster").isNotNull())
    unknown = changes.where(F.col("cluster").isNull()).drop("cluster")
    clusters = F.broadcast(member_clusters(records))  # a few rows per member
    resolved = unknown.join(clusters, unknown["peer"] == clusters["member"], "left")
    return known.unionByName(resolved.drop("member"))


def member_load(records: DataFrame) -> DataFrame:
    """Requests dispatched to each member of each cluster, including members that got none.

    A cluster's members are every node seen serving it: as the peer of a request, as the
    recorder of a serve, or as the peer of a membership record. A member's load is the
    weighted count of caller-side request records naming it as peer, whatever the outcome
    (a request that timed out on it was still sent to it).
    Columns: cluster, member, requests, share (NULL when the cluster had no requests).
    """
    # One projection and one aggregation: each record names at most one member (a request's
    # peer, a serve's recorder, a membership record's peer) and adds its weight as load only
    # when it is a request. Unions and joins would cost a shuffle each.
    kind = F.col("kind")
    member = (
        F.when(kind == str(Kind.REQUEST), F.col("peer"))
        .when(kind == str(Kind.SERVE), F.col("node"))
        .when(kind == str(Kind.MEMBERSHIP), F.col("peer"))
    )
    load = F.when(kind == str(Kind.REQUEST), F.col("weight")).otherwise(F.lit(0))
    per_member = (
        records.where(F.col("cluster").isNotNull())
        .select("cluster", member.alias("member"), load.alias("load"))
        .where(F.col("member").isNotNull())
        .groupBy("cluster", "member")
        .agg(F.sum("load").alias("requests"))
    )
    total = F.sum("requests").over(Window.partitionBy("cluster"))
    return per_member.withColumn("share", F.try_divide(F.col("requests").cast("double"), total))


def fairness(records: DataFrame) -> DataFrame:
    """How evenly each cluster's requests spread over its members.

    Columns: cluster, members, requests, min_requests, max_requests, jain_index, max_over_mean.
    Jain's index (sum x)^2 / (n * sum x^2) is 1 when every member got the same load and 1/n
    when one member got all of it; max_over_mean is the busiest member's load over the mean
    (1 is perfect, n is the worst). Both are NULL for a cluster without requests.
    """
    x = F.col("requests").cast("double")
    return (
        member_load(records)
        .groupBy("cluster")
        .agg(
            F.count(F.lit(1)).alias("members"),
            F.sum("requests").alias("requests"),
            F.min("requests").alias("min_requests"),
            F.max("requests").alias("max_requests"),
            F.sum(x).alias("_s"),
            F.sum(x * x).alias("_s2"),
        )
        .withColumn(
            "jain_index",
            F.try_divide(F.col("_s") * F.col("_s"), F.col("members") * F.col("_s2")),
        )
        .withColumn(
            "max_over_mean",
            F.try_divide(F.col("max_requests") * F.col("members"), F.col("_s")),
        )
        .drop("_s", "_s2")
    )


def membership_churn(records: DataFrame, *, bucket: int = 60) -> DataFrame:
    """Membership changes per cluster, time bucket and event (join, suspect, alive, dead, leave;
    ejected and readmitted: a caller took the member out of the cluster's rotation, and back).

    Columns: cluster, time, event, observations (weighted records: every node that saw a
    change records it), peers (distinct members concerned), observers (distinct recorders).
    """
    return (
        _membership(records)
        .groupBy("cluster", _bucket(bucket).alias("time"), F.col("name").alias("event"))
        .agg(
            F.sum("weight").alias("observations"),
            F.countDistinct("peer").alias("peers"),
            F.countDistinct("node").alias("observers"),
        )
    )


def membership_events(records: DataFrame, *, bucket: int = 60) -> DataFrame:
    """Each member's membership changes, once per cluster, event and time bucket.

    Every observer records the same change: this is one row for all of them, at the first
    observation, for marks on a time axis. Columns: cluster, peer, event, time (bucket start),
    first_ts, last_ts, observers.
    """
    return (
        _membership(records)
        .groupBy("cluster", "peer", F.col("name").alias("event"), _bucket(bucket).alias("time"))
        .agg(
            F.min("ts").alias("first_ts"),
            F.max("ts").alias("last_ts"),
            F.countDistinct("node").alias("observers"),
        )
    )


def top_talkers(records: DataFrame, *, limit: int = 10) -> DataFrame:
    """The nodes that started the most calls, busiest first.

    Columns: node, calls, bytes, failed, clusters (distinct clusters called).
    Ties break by bytes, then node id, so the order is deterministic.
    """
    return (
        records.where(_is_call())
        .groupBy("node")
        .agg(
            F.sum("weight").alias("calls"),
            F.sum(F.coalesce(F.col("size"), F.lit(0)) * F.col("weight")).alias("bytes"),
            _weight_if(F.col("outcome") != str(Outcome.OK)).alias("failed"),
            F.countDistinct("cluster").alias("clusters"),
        )
        .orderBy(F.col("calls").desc(), F.col("bytes").desc(), F.col("node").asc())
        .limit(limit)
    )


def totals(records: DataFrame) -> DataFrame:
    """Records and weighted events per kind and outcome: the figures to check against counters.

    Columns: kind, outcome, records, events, first_ts, last_ts.
    """
    return records.groupBy("kind", "outcome").agg(
        F.count(F.lit(1)).alias("records"),
        F.sum("weight").alias("events"),
        F.min("ts").alias("first_ts"),
        F.max("ts").alias("last_ts"),
    )


def gauge_summary(records: DataFrame) -> DataFrame:
    """Per gauge name: nodes reporting, readings, mean, max, and the sum of each node's latest.

    Columns: name, nodes, readings, mean, max, latest_total.
    """
    gauges = records.where((F.col("kind") == str(Kind.GAUGE)) & F.col("value").isNotNull())
    per_node = gauges.groupBy("name", "node").agg(
        F.count(F.lit(1)).alias("readings"),
        F.sum("value").alias("_sum"),
        F.max("value").alias("_max"),
        F.max_by("value", "ts").alias("_latest"),
    )
    return per_node.groupBy("name").agg(
        F.count(F.lit(1)).alias("nodes"),
        F.sum("readings").alias("readings"),
        F.try_divide(F.sum("_sum"), F.sum("readings")).alias("mean"),
        F.max("_max").alias("max"),
        F.sum("_latest").alias("latest_total"),
    )


# Name -> job with its default arguments, in report order.
JOBS: Final[dict[str, Callable[[DataFrame], DataFrame]]] = {
    "overview": overview,
    "totals": totals,
    "throughput": throughput,
    "latency": latency_percentiles,
    "latency_time": latency_over_time,
    "errors": error_rates,
    "drops": drops_by_reason,
    "fairness": fairness,
    "member_load": member_load,
    "churn": membership_churn,
    "events": membership_events,
    "top_talkers": top_talkers,
    "gauges": gauge_summary,
}
# The jobs that take a `bucket` (seconds) argument.
BUCKETED: Final = frozenset({"throughput", "latency_time", "churn", "events"})
