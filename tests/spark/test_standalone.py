"""The same jobs on a Spark standalone cluster (master and worker on 127.0.0.1, from pyspark's
own jars, `--master spark://...`) give the same results as on the shared local session.

The cluster and the report on it run in the background from the start of the test session
(standalone_cluster.py); this test collects the result, and skips with the reason if the
cluster could not start within 60 s.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("pyspark", reason="PySpark not installed: pip install -e '.[spark]'")

from pyspark.sql import SparkSession
from standalone_cluster import JOBS, StandaloneRun

from irismesh.spark_telemetry.compact import read_compacted
from irismesh.spark_telemetry.report import run_jobs, table_rows


def close(actual: Any, expected: Any) -> bool:
    if isinstance(expected, float) and isinstance(actual, int | float):
        return actual == pytest.approx(expected, rel=1e-9)
    return bool(actual == expected)


def test_jobs_on_a_standalone_cluster_match_local(
    standalone_run: StandaloneRun, spark: SparkSession
) -> None:
    outcome = standalone_run.result()
    if outcome.skip:
        pytest.skip(outcome.skip)
    assert outcome.returncode == 0, outcome.stderr
    print(f"\nreport on {standalone_run.url}: {outcome.seconds:.1f} s")
    summary = json.loads((standalone_run.report / "summary.json").read_text())
    assert summary["meta"]["master"] == standalone_run.url
    local = run_jobs(read_compacted(spark, standalone_run.parquet), only=JOBS, cache=False)
    for job in JOBS:
        remote = summary["tables"][job]
        ours = table_rows(local.tables[job])
        assert len(remote) == len(ours) > 0
        for theirs, mine in zip(remote, ours, strict=True):
            assert theirs.keys() == mine.keys()
            assert all(close(theirs[k], mine[k]) for k in mine), (job, theirs, mine)
    standalone_run.stop()
    assert standalone_run.alive() == []  # master, worker and report all gone
