"""Each batch job against an independent pandas computation on the same records.

The records travel the real path (SpoolWriter -> spool files -> pyarrow compaction -> Parquet
-> Spark) while the reference reads the list they were generated from, so the comparison
also covers the writer, the decoder, the compactor and the explicit schema.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("pyspark", reason="PySpark not installed: pip install -e '.[spark]'")

import functools
import math

import telemetry_reference as reference
from pyspark.sql import SparkSession
from telemetry_data import NODE_A, NODE_B, NODE_C, START, Dataset

from irismesh.spark_telemetry.jobs import BUCKETED, JOBS, fairness, throughput
from irismesh.spark_telemetry.report import KEYS, run_jobs
from irismesh.telemetry.schema import spark_schema


def test_spark_runs_sql_in_ansi_mode(spark: SparkSession) -> None:
    # What makes the NULL-rate checks below meaningful: x / 0 would raise, not give NULL.
    assert spark.conf.get("spark.sql.ansi.enabled") == "true"


@pytest.mark.parametrize("name", list(JOBS))
def test_job_agrees_with_pandas(name: str, results: Any, dataset: Dataset) -> None:
    compute = reference.REFERENCES[name]
    if name in BUCKETED:
        compute = functools.partial(compute, bucket=results.meta["bucket_seconds"])
    expected = compute(dataset.frame)
    assert len(expected) > 0, "the data set must exercise every job"
    reference.assert_same(results.tables[name], expected, KEYS[name])


def row(results: Any, job: str, **match: Any) -> dict[str, Any]:
    frame = results.tables[job]
    for key, value in match.items():
        frame = frame[frame[key] == value]
    assert len(frame) == 1, f"{job} {match}: {len(frame)} rows"
    return dict(frame.iloc[0])


def test_fairness_figures_by_hand(results: Any) -> None:
    fair = row(results, "fairness", cluster="fair")
    assert (fair["members"], fair["requests"]) == (3, 4)  # C joined but served nothing
    assert fair["jain_index"] == pytest.approx(16 / 30)
    assert fair["max_over_mean"] == pytest.approx(2.25)
    solo = row(results, "fairness", cluster="solo")
    assert (solo["jain_index"], solo["max_over_mean"]) == (1.0, 1.0)
    load = results.tables["member_load"]
    fair_load = load[load["cluster"] == "fair"].set_index("member")["requests"].to_dict()
    assert fair_load == {NODE_A: 3, NODE_B: 1, NODE_C: 0}


def test_a_cluster_without_requests_gets_null_ratios_not_an_error(results: Any) -> None:
    quiet = row(results, "fairness", cluster="quiet")
    assert (quiet["members"], quiet["requests"]) == (2, 0)
    assert math.isnan(quiet["jain_index"])
    assert math.isnan(quiet["max_over_mean"])
    errors = row(results, "errors", cluster="quiet")
    assert errors["calls"] == 0
    assert math.isnan(errors["error_rate"])
    assert math.isnan(errors["timeout_rate"])
    assert "quiet" not in set(results.tables["throughput"]["cluster"])
    churn = results.tables["churn"]
    assert set(churn[churn["cluster"] == "quiet"]["event"]) == {"join", "dead"}


def test_a_cluster_without_members(results: Any) -> None:
    void = row(results, "errors", cluster="void")
    assert (void["calls"], void["no_responders"], void["error_rate"]) == (2, 1, 1.0)
    assert void["overloaded"] == 1  # the caller's throttle turned the second away
    assert "void" not in set(results.tables["fairness"]["cluster"])


def test_sampled_records_count_by_weight(results: Any) -> None:
    fair = row(results, "errors", cluster="fair")
    assert (fair["calls"], fair["ok"], fair["timeouts"]) == (4, 3, 1)  # weight 3 + 1
    assert (fair["drops"], fair["errors"]) == (7, 1)
    assert fair["timeout_rate"] == pytest.approx(0.25)
    totals = results.tables["totals"]
    assert totals["events"].sum() > totals["records"].sum()  # the synthetic traffic is sampled


def test_throughput_puts_late_records_in_their_own_bucket(dataset: Dataset) -> None:
    rate = throughput(dataset.df, bucket=60).toPandas()
    solo = rate[rate["cluster"] == "solo"].sort_values("time")
    minutes = [m.timestamp() for m in solo["time"].dt.tz_localize("UTC")]
    first = (START + 6) // 60 * 60
    assert minutes == [first - 7200, first, first + 60]
    assert list(solo["events"]) == [1, 2, 1]
    assert list(solo["per_second"]) == pytest.approx([1 / 60, 2 / 60, 1 / 60])


def test_the_bucket_fits_the_span(results: Any) -> None:
    # Ten minutes of traffic and one record 2 h early: 2 h 10 min over at most 300 points.
    assert results.meta["bucket_seconds"] == 30
    assert results.meta["bucket_chosen"] is True
    times = results.tables["throughput"]["time"]
    assert all(t.second % 30 == 0 and t.microsecond == 0 for t in times)


def test_membership_without_a_cluster_counts_for_the_clusters_its_member_serves(
    results: Any,
) -> None:
    events = results.tables["events"]
    dead = events[(events["event"] == "dead") & (events["peer"] == NODE_A)]
    assert sorted(dead["cluster"]) == ["fair", "quiet"]  # A served both
    left = events[events["event"] == "leave"]
    assert list(left["cluster"]) == [None]  # a pure client serves no cluster
    churn = results.tables["churn"]
    assert not churn[churn["cluster"] == "fair"].query("event == 'dead'").empty


def test_drops_by_reason(results: Any) -> None:
    drops = results.tables["drops"].set_index(["kind", "reason"])
    assert drops.loc[("drop", "queue_full"), "events"] == 7
    assert drops.loc[("drop", "slow_consumer"), "events"] == 2
    assert drops.loc[("error", "bad_frame"), "cluster"] == "fair"


def test_every_job_runs_on_no_records(spark: SparkSession) -> None:
    empty = spark.createDataFrame([], spark_schema())
    out = run_jobs(empty, cache=False)
    rows = {name: len(frame) for name, frame in out.tables.items()}
    assert rows == dict.fromkeys(JOBS, 0) | {"overview": 1}
    assert out.tables["overview"].iloc[0]["records"] == 0
    assert out.meta["bucket_seconds"] == 1


def test_jobs_are_pure_and_take_extra_columns(dataset: Dataset) -> None:
    # The compacted frame carries date and hour too; a job must neither need nor mind them.
    df = dataset.df
    assert {"date", "hour"} <= set(df.columns)
    before = df.columns
    fairness(df)
    throughput(df, bucket=30).count()
    assert df.columns == before
