"""One SparkSession for every Spark test, and the synthetic data sets they share.

A local session costs about 5 s to start here, so it is made once per test run (scope
"session") and stopped at the end. Tests skip with the reason when Java or PySpark is missing.
The suite runs with --import-mode=importlib, which puts no test directory on sys.path, so this
directory goes there for `telemetry_reference` (the pandas computations the jobs are checked
against) and `telemetry_data` (the shared records).
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from standalone_cluster import StandaloneRun
    from telemetry_data import Dataset


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    if shutil.which("java") is None:
        pytest.skip("Java not found on PATH: Spark needs a JRE 17 (apt-get install openjdk-17-jre)")
    pytest.importorskip("pyspark", reason="PySpark not installed: pip install -e '.[spark]'")
    from irismesh.spark_telemetry.session import make_session

    session = make_session("local[2]", app_name="irismesh-tests", shuffle_partitions=1)
    yield session
    session.stop()


@pytest.fixture(scope="session")
def dataset(spark: SparkSession, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dataset]:
    """Synthetic mesh traffic (sampled, with late records) plus edge_records(), end to end:
    spool files written by SpoolWriter, compacted with pyarrow, read by Spark."""
    import telemetry_reference as reference
    from telemetry_data import START, Dataset, edge_records

    from irismesh.spark_telemetry.compact import compact, read_compacted
    from irismesh.spark_telemetry.synthetic import generate, write_spool

    records = [r for chunk in generate(1500, start=START, sample_every=3, late=0.05) for r in chunk]
    records += edge_records()
    base = tmp_path_factory.mktemp("dataset")
    spool, parquet = base / "spool", base / "parquet"
    write_spool(spool, iter([records]), max_bytes=64 * 1024)
    result = compact(spool, parquet, done="keep")
    assert result.records == len(records)
    df = read_compacted(spark, parquet).cache()
    yield Dataset(
        records=records, frame=reference.frame(records), df=df, parquet=parquet, spool=spool
    )
    df.unpersist()


@pytest.fixture(scope="session")
def results(dataset: Dataset) -> Any:
    """Every job run once on the shared data set (report.run_jobs), for several test modules."""
    from irismesh.spark_telemetry.report import run_jobs

    return run_jobs(dataset.df, cache=False)


@pytest.fixture(scope="session")
def standalone_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneRun]:
    """A standalone cluster and one report on it, running in the background (see the module)."""
    from standalone_cluster import StandaloneRun

    run = StandaloneRun(tmp_path_factory.mktemp("standalone"))
    run.start()
    try:
        yield run
    finally:
        run.stop()


@pytest.fixture(scope="session", autouse=True)
def _standalone_starts_first(request: pytest.FixtureRequest) -> None:
    # The cluster takes longer to come up than the local tests take to run: when the
    # standalone test is selected, start it before anything else so the two overlap.
    if any("standalone_run" in item.fixturenames for item in request.session.items):
        request.getfixturevalue("standalone_run")
