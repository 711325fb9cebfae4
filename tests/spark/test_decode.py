"""Spool bytes to Arrow: the column-wise fast path refuses exactly what check_record refuses,
and the Arrow and Spark schemas are the one in irismesh.telemetry.schema."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("pyarrow", reason="pyarrow not installed: pip install -e '.[spark]'")
pytest.importorskip("pyspark", reason="PySpark not installed: pip install -e '.[spark]'")

from hypothesis import given, settings
from hypothesis import strategies as st

from irismesh.spark_telemetry.compact import add_partitions
from irismesh.spark_telemetry.decode import decode_to_table, rows_to_table
from irismesh.telemetry.schema import (
    FIELDS,
    PARTITION_FIELDS,
    Record,
    arrow_schema,
    check_record,
    spark_schema,
)
from irismesh.telemetry.spool import SpoolWriter, complete_files


def test_arrow_and_spark_schemas_are_the_field_table() -> None:
    for schema in (arrow_schema(), spark_schema()):
        assert [f.name for f in schema] == [f.name for f in FIELDS]
        assert [f.nullable for f in schema] == [f.nullable for f in FIELDS]
    with_parts = spark_schema(partitions=True)
    assert [f.name for f in with_parts][-2:] == [f.name for f in PARTITION_FIELDS]
    assert str(arrow_schema(partitions=True).field("hour").type) == "int32"


GOOD = [1_700_000_000.5, "n", "request", "reqrep", "db", "p", 10, 20, "ok", 1, None, None]
BAD_VALUES = {  # field index -> values that break that field's type
    0: ["x", None, True, float("nan"), float("inf")],
    1: [None, 3, b"n"],
    2: [None, 1.5],
    4: [7, b"db"],
    6: [1.5, "9", True, 2**63],
    7: [-(2**63) - 1, 0.0],
    8: [None],
    9: [0, None, 2.0],
    11: ["v", False],
}
breakage = st.sampled_from([(i, v) for i, values in BAD_VALUES.items() for v in values])


@settings(max_examples=60, deadline=None)
@given(
    plan=st.lists(st.none() | breakage, min_size=1, max_size=30),
    extra=st.booleans(),
)
def test_the_fast_path_keeps_exactly_the_records_check_record_keeps(
    plan: list[tuple[int, Any] | None], extra: bool
) -> None:
    rows = []
    for n, change in enumerate(plan):
        row = [*GOOD, "future field"] if extra else list(GOOD)
        row[6] = n
        if change is not None:
            row[change[0]] = change[1]
        rows.append(row)
    table, refused = rows_to_table(rows)
    kept = [r for r in map(check_record, rows) if r is not None]
    assert refused == len(rows) - len(kept)
    assert table.schema == arrow_schema()
    assert [Record(*values.values()) for values in table.to_pylist()] == kept


def test_a_spool_file_decodes_to_its_records(tmp_path: Any) -> None:
    records = [Record(1.0 + i, "n", "gauge", name="g", value=float(i)) for i in range(5)]
    with SpoolWriter(tmp_path, "n") as writer:
        for record in records:
            writer.append(record)
    decoded = decode_to_table(complete_files(tmp_path)[0].read_bytes())
    assert decoded.corrupt == 0
    assert [Record(*r.values()) for r in decoded.table.to_pylist()] == records
    empty = decode_to_table(b"")
    assert (empty.table.num_rows, empty.corrupt) == (0, 0)


def test_partitions_come_from_ts_in_utc() -> None:
    ts = [1_700_006_399.999, 1_700_006_400.0, 1_700_006_400.0 + 3600 * 24, 0.0]
    table = rows_to_table([[t, *GOOD[1:]] for t in ts])[0]
    parted = add_partitions(table)
    assert parted.column("date").to_pylist() == [
        "2023-11-14",
        "2023-11-15",
        "2023-11-16",
        "1970-01-01",
    ]
    assert parted.column("hour").to_pylist() == [23, 0, 0, 0]
