"""Compaction: every valid record lands once, in the partition of its own ts, with the schema."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("pyspark", reason="PySpark not installed: pip install -e '.[spark]'")

import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
from pyspark.sql import SparkSession
from telemetry_data import Dataset

from irismesh.spark_telemetry.compact import (
    COMPACTED_DIR,
    compact,
    read_compacted,
    read_spool_table,
)
from irismesh.spark_telemetry.report import node_names
from irismesh.telemetry.schema import BASE_FIELDS, FIELD_NAMES, Record, arrow_schema, spark_schema
from irismesh.telemetry.spool import SpoolWriter, complete_files, spool_file_name


def test_spark_reads_back_exactly_the_records_with_the_explicit_schema(
    dataset: Dataset,
) -> None:
    # Spark reads every file column as nullable; names and types are the schema's.
    expected = [(f.name, f.dataType) for f in spark_schema(partitions=True)]
    assert [(f.name, f.dataType) for f in dataset.df.schema] == expected
    back = sorted(tuple(row[name] for name in FIELD_NAMES) for row in dataset.df.collect())
    assert back == sorted(tuple(r) for r in dataset.records)


def test_each_record_lands_in_the_partition_of_its_own_hour(dataset: Dataset) -> None:
    stamps = pd.to_datetime(dataset.frame["ts"], unit="s")
    expected = (
        pd.DataFrame({"date": stamps.dt.strftime("%Y-%m-%d"), "hour": stamps.dt.hour})
        .value_counts()
        .to_dict()
    )
    # The synthetic traffic crosses midnight, and one record is two hours late.
    assert {("2023-11-14", 23), ("2023-11-15", 0), ("2023-11-14", 21)} <= set(expected)
    found = {}
    for path in dataset.parquet.glob("date=*/hour=*"):
        date, hour = path.parent.name.split("=")[1], int(path.name.split("=")[1])
        found[(date, hour)] = ds.dataset(path, format="parquet").count_rows()
    assert found == expected


def write(spool: Path, node: str, records: list[Record]) -> None:
    with SpoolWriter(spool, node) as writer:
        for record in records:
            writer.append(record)


def batch(start: int, n: int) -> list[Record]:
    return [
        Record(1_700_000_000.0 + i, "n1", "gauge", name="g", value=1.0)
        for i in range(start, start + n)
    ]


def test_compaction_is_incremental_and_moves_what_it_compacted(tmp_path: Path) -> None:
    spool, out = tmp_path / "spool", tmp_path / "out"
    write(spool, "n1", batch(0, 10))
    write(spool, "n1", batch(10, 5))
    first = compact(spool, out)
    assert (first.files, first.records, first.corrupt) == (2, 15, 0)
    assert complete_files(spool) == []
    assert len(complete_files(spool / COMPACTED_DIR)) == 2
    assert compact(spool, out).files == 0  # nothing new
    write(spool, "n1", batch(15, 3))
    assert compact(spool, out).records == 3
    assert ds.dataset(out, format="parquet", partitioning="hive").count_rows() == 18


def test_delete_and_keep(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    write(spool, "n1", batch(0, 4))
    assert compact(spool, tmp_path / "kept", done="keep").records == 4
    assert len(complete_files(spool)) == 1
    assert compact(spool, tmp_path / "deleted", done="delete").records == 4
    assert complete_files(spool) == []
    assert not (spool / COMPACTED_DIR).exists()


def test_corrupt_records_are_counted_and_the_rest_kept(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    write(spool, "n1", batch(0, 3))
    good = complete_files(spool)[0].read_bytes()
    (spool / spool_file_name("n2", 0)).write_bytes(good + b"\xc1garbage")
    table, corrupt = read_spool_table(spool)
    assert (table.num_rows, corrupt) == (6, 1)
    result = compact(spool, tmp_path / "out")
    assert (result.records, result.corrupt) == (6, 1)


def test_an_empty_spool_gives_an_empty_frame_with_the_schema(
    spark: SparkSession, tmp_path: Path
) -> None:
    (tmp_path / "spool").mkdir()
    result = compact(tmp_path / "spool", tmp_path / "out")
    assert (result.files, result.records) == (0, 0)
    df = read_compacted(spark, tmp_path / "out")
    assert df.schema.names == spark_schema(partitions=True).names
    assert df.count() == 0


def test_parquet_compacted_before_node_names_loads_and_names_come_from_either_side(
    spark: SparkSession, tmp_path: Path
) -> None:
    old = tmp_path / "old" / "date=2023-11-14" / "hour=22"
    old.mkdir(parents=True)
    gauge = Record(1_700_000_000.0, "aa", "gauge", name="g", value=1.0)
    older_schema = pa.schema(list(arrow_schema())[:BASE_FIELDS])
    table = pa.Table.from_pylist([gauge._asdict()], schema=older_schema)
    pq.write_table(table, old / "part-0.parquet")
    df = read_compacted(spark, tmp_path / "old")
    [row] = df.collect()
    assert (row["node"], row["node_name"], row["peer_name"]) == ("aa", None, None)
    assert node_names(df) == {}
    # "aa" names itself db-1 (and its peers call it by an older name), "cc" was killed before
    # it spooled anything: its name comes from the peers' membership records.
    named = [
        Record(1.0, "aa", "gauge", name="g", value=1.0, node_name="db-1"),
        Record(2.0, "bb", "membership", peer="aa", name="join", node_name="w2", peer_name="x"),
        Record(3.0, "bb", "membership", peer="cc", name="join", node_name="w2", peer_name="w3"),
        Record(4.0, "bb", "request", "reqrep", "db", "cc", 10, 1, "ok"),
    ]
    frame = spark.createDataFrame([tuple(r) for r in named], spark_schema())
    assert node_names(frame) == {"aa": "db-1", "bb": "w2", "cc": "w3"}
