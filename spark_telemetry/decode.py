"""Spool files to Arrow: the one decoder behind compaction and the streaming job.

Spark has no msgpack reader, so both paths decode in Python: the compactor in its own process,
the streaming job inside `mapInArrow` on the executors. Both call `decode_to_table`, so a record
is valid or corrupt by the same rule everywhere: `irismesh.telemetry.schema.check_record`.

Checking each record in Python costs more than decoding it, so the check is done a column at
a time: the set of exact Python types in each column (one C-level pass) must be allowed for
that field, required columns must hold no None, weights must be at least 1 and every `ts`
finite. Only when a column fails does the batch fall back to checking record by record, which
drops and counts exactly the records `check_record` refuses. Arrow's own conversion cannot be
the check: it silently truncates 1.5 to 1 in an int64 column and takes bytes for strings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]

from irismesh.telemetry.schema import FIELDS, arrow_schema, check_record
from irismesh.telemetry.spool import decode_spool, gc_paused

__all__ = ["Decoded", "decode_to_table", "rows_to_table"]

SCHEMA: Final = arrow_schema()
_ALLOWED: Final[dict[str, frozenset[type]]] = {
    "float64": frozenset({float, int}),
    "int64": frozenset({int}),
    "int32": frozenset({int}),
    "string": frozenset({str}),
}
_WEIGHT: Final = [f.name for f in FIELDS].index("weight")
_TS: Final = [f.name for f in FIELDS].index("ts")


@dataclass(frozen=True, slots=True, kw_only=True)
class Decoded:
    """A table of valid records (schema.arrow_schema()) and how many records were corrupt."""

    table: Any  # pa.Table
    corrupt: int


def decode_to_table(data: bytes) -> Decoded:
    """Decode one spool file's bytes."""
    contents = decode_spool(data)
    with gc_paused():  # see gc_paused: the columns are a million more small objects
        table, refused = rows_to_table(contents.rows)
    return Decoded(table=table, corrupt=contents.corrupt + refused)


def rows_to_table(rows: Sequence[Sequence[Any]]) -> tuple[Any, int]:
    """Rows in FIELDS order to a pa.Table, and the number of rows refused as malformed."""
    if not rows:
        return SCHEMA.empty_table(), 0
    columns = _columns_if_valid(rows)
    if columns is not None:
        return pa.Table.from_arrays(columns, schema=SCHEMA), 0
    good = [record for record in map(check_record, rows) if record is not None]
    refused = len(rows) - len(good)
    if not good:
        return SCHEMA.empty_table(), refused
    columns = _columns_if_valid(good)
    assert columns is not None, "records that passed check_record must convert"
    return pa.Table.from_arrays(columns, schema=SCHEMA), refused


def _columns_if_valid(rows: Sequence[Sequence[Any]]) -> list[Any] | None:
    """Arrow arrays of the rows' columns, or None if any value breaks the schema."""
    width = len(FIELDS)
    if min(map(len, rows)) < width:
        return None
    columns = list(zip(*rows, strict=False))[:width]
    arrays = []
    for field, column in zip(FIELDS, columns, strict=True):
        kinds = set(map(type, column))
        has_null = type(None) in kinds
        if has_null and not field.nullable:
            return None
        if kinds - _ALLOWED[field.type] - {type(None)}:
            return None
        try:
            array = pa.array(column, type=SCHEMA.field(field.name).type)
        except (OverflowError, pa.ArrowException):  # an integer beyond int64
            return None
        arrays.append(array)
    if pc.min(arrays[_WEIGHT]).as_py() < 1 or not pc.all(pc.is_finite(arrays[_TS])).as_py():
        return None
    return arrays
