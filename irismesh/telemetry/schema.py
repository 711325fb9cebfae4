"""The telemetry record: one schema for the node's spool writer, the compactor and Spark.

A record is one event seen by one node, stored as a positional msgpack array in the order of
`FIELDS` (about 60 bytes). Positional arrays keep the node's recording cost to building one
tuple; the names live here and, once per file, in the spool file's header (see
`irismesh.telemetry.spool`), so a reader can map the columns of an older or newer writer by
name.

    field       type     null  meaning
    ts          float64  no    epoch seconds when the event ended (UTC)
    node        string   no    hex id of the node that recorded it
    kind        string   no    one of `Kind`: request, serve, publish, ... (open set: unknown
                               kinds from newer nodes are kept, not rejected)
    pattern     string   no    one of `Pattern`, or "" for membership and gauges
    cluster     string   yes   the cluster addressed (the topic for pub/sub)
    peer        string   yes   hex id of the other node (e.g. the member that served a request)
    latency_us  int64    yes   caller round trip (request), member service time (serve) or
                               publish-to-deliver (deliver); null when not timed (tallies)
    size        int64    yes   payload bytes
    outcome     string   no    one of `Outcome`, or "" when the kind has no outcome
    weight      int64    no    events this record stands for (1 unless sampled)
    name        string   yes   membership event, gauge name or drop reason
    value       float64  yes   gauge value
    node_name   string   yes   the recording node's name (`Node(name=...)`), on its gauge,
                               drop and membership records; null on per-message records,
                               which it would only lengthen
    peer_name   string   yes   the peer's name, on membership records

Counting always sums `weight`, never rows: a node that records one request in ten writes
weight=10, and every count, rate and throughput stays an estimate of the true total.

Fields are only ever appended, nullable, after the first `BASE_FIELDS` (which every writer has
written): a record of an older writer that ends before them reads as null there, so old spools
still load. Names are labels for people; `node` and `peer` stay the identities.

Compacted Parquet adds two partition columns derived from `ts` in UTC: `date` (string,
YYYY-MM-DD) and `hour` (int32, 0-23).

pyarrow and pyspark are imported only inside `arrow_schema()` and `spark_schema()`, so the
node imports this module without either installed.
"""

from __future__ import annotations

import enum
import math
from typing import TYPE_CHECKING, Any, Final, NamedTuple

if TYPE_CHECKING:
    from pyspark.sql.types import StructType

__all__ = [
    "BASE_FIELDS",
    "CALL_KINDS",
    "FIELDS",
    "FIELD_NAMES",
    "PARTITION_FIELDS",
    "Field",
    "Kind",
    "MembershipEvent",
    "Outcome",
    "Pattern",
    "Record",
    "arrow_schema",
    "check_record",
    "spark_schema",
]


class Kind(enum.StrEnum):
    """What a record describes."""

    REQUEST = "request"  # caller side: one request's round trip, with its outcome
    SERVE = "serve"  # member side: one handler run (service time)
    PUBLISH = "publish"
    DELIVER = "deliver"
    BROADCAST = "broadcast"
    TUNNEL = "tunnel"
    SURVEY = "survey"
    ERROR = "error"  # an error not tied to one call (bad frame, failed handshake, ...)
    DROP = "drop"  # a message dropped; `name` says why
    MEMBERSHIP = "membership"  # `name` is a MembershipEvent, `peer` the member concerned
    GAUGE = "gauge"  # `name` is the gauge, `value` its reading


class Pattern(enum.StrEnum):
    REQREP = "reqrep"
    PUBSUB = "pubsub"
    BROADCAST = "broadcast"
    TUNNEL = "tunnel"
    SURVEY = "survey"
    NONE = ""  # membership and gauges


class Outcome(enum.StrEnum):
    OK = "ok"
    TIMEOUT = "timeout"
    REMOTE_ERROR = "remote_error"
    NO_RESPONDERS = "no_responders"
    DROPPED = "dropped"
    CLOSED = "closed"
    TOO_LARGE = "too_large"
    OVERLOADED = "overloaded"  # turned away unrun: by a member, or by the caller's throttle
    NONE = ""  # kinds without an outcome (membership, gauge, deliver, ...)


class MembershipEvent(enum.StrEnum):
    JOIN = "join"
    SUSPECT = "suspect"
    ALIVE = "alive"
    DEAD = "dead"
    LEAVE = "leave"
    # A caller took the member out of `cluster`'s rotation (outlier ejection), or back in.
    EJECTED = "ejected"
    READMITTED = "readmitted"


# The caller-side kinds: one record per operation a node started. Throughput, error rates and
# top talkers count these and not serve/deliver, which would count one operation twice.
CALL_KINDS: Final = (Kind.REQUEST, Kind.PUBLISH, Kind.BROADCAST, Kind.TUNNEL, Kind.SURVEY)


class Record(NamedTuple):
    """One telemetry record; a tuple in `FIELDS` order, so msgpack packs it as an array."""

    ts: float
    node: str
    kind: str
    pattern: str = ""
    cluster: str | None = None
    peer: str | None = None
    latency_us: int | None = None
    size: int | None = None
    outcome: str = ""
    weight: int = 1
    name: str | None = None
    value: float | None = None
    node_name: str | None = None
    peer_name: str | None = None


class Field(NamedTuple):
    """One column: name, logical type ("float64", "int64", "int32", "string"), nullability.

    A named tuple, as `Record` is: a dataclass would cost `import irismesh` its methods
    compiled from source."""

    name: str
    type: str
    nullable: bool


FIELDS: Final = (
    Field(name="ts", type="float64", nullable=False),
    Field(name="node", type="string", nullable=False),
    Field(name="kind", type="string", nullable=False),
    Field(name="pattern", type="string", nullable=False),
    Field(name="cluster", type="string", nullable=True),
    Field(name="peer", type="string", nullable=True),
    Field(name="latency_us", type="int64", nullable=True),
    Field(name="size", type="int64", nullable=True),
    Field(name="outcome", type="string", nullable=False),
    Field(name="weight", type="int64", nullable=False),
    Field(name="name", type="string", nullable=True),
    Field(name="value", type="float64", nullable=True),
    Field(name="node_name", type="string", nullable=True),
    Field(name="peer_name", type="string", nullable=True),
)
FIELD_NAMES: Final = tuple(f.name for f in FIELDS)
BASE_FIELDS: Final = 12  # ts ... value: the fields of the first writers; the rest may be absent
PARTITION_FIELDS: Final = (
    Field(name="date", type="string", nullable=False),
    Field(name="hour", type="int32", nullable=False),
)

# Python types a decoded msgpack value may have, per logical type. bool is an int subclass
# and is refused explicitly in check_record.
_PY_TYPES: Final[dict[str, tuple[type, ...]]] = {
    "float64": (float, int),
    "int64": (int,),
    "int32": (int,),
    "string": (str,),
}
_CHECKS: Final = tuple((_PY_TYPES[f.type], f.nullable) for f in FIELDS)
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def check_record(row: Any) -> Record | None:
    """The record `row` (a decoded array in FIELDS order) holds, or None if it is malformed.

    Only structure, types, a finite `ts` and a positive `weight` are checked; values such as
    kinds and outcomes are an open set, so that records from newer nodes survive. Extra
    trailing items (fields a newer writer appended) are ignored; fields appended after the
    first BASE_FIELDS may be missing (an older writer's record) and read as None; any other
    missing field makes the record malformed.
    """
    if not isinstance(row, list | tuple) or len(row) < BASE_FIELDS:
        return None
    if len(row) < len(FIELDS):
        row = (*row, *(None,) * (len(FIELDS) - len(row)))
    for item, (types, nullable) in zip(row, _CHECKS, strict=False):
        if item is None:
            if not nullable:
                return None
        elif (
            not isinstance(item, types)
            or isinstance(item, bool)
            or (isinstance(item, int) and not _INT64_MIN <= item <= _INT64_MAX)
        ):
            return None
    if row[9] < 1:  # weight: a record stands for at least one event
        return None
    ts = float(row[0])
    if not math.isfinite(ts):  # NaN has no hour to be partitioned by
        return None
    return Record(ts, *row[1 : len(FIELDS)])


def arrow_schema(*, partitions: bool = False) -> Any:
    """The pyarrow schema of the records (plus `date` and `hour` when `partitions`)."""
    import pyarrow as pa  # type: ignore[import-untyped]  # lazy: the node does not need it

    types = {
        "float64": pa.float64(),
        "int64": pa.int64(),
        "int32": pa.int32(),
        "string": pa.string(),
    }
    fields = FIELDS + PARTITION_FIELDS if partitions else FIELDS
    return pa.schema([pa.field(f.name, types[f.type], nullable=f.nullable) for f in fields])


def spark_schema(*, partitions: bool = False) -> StructType:
    """The Spark StructType of the records (plus `date` and `hour` when `partitions`)."""
    from pyspark.sql import types as st  # lazy: the node does not need pyspark

    types: dict[str, st.DataType] = {
        "float64": st.DoubleType(),
        "int64": st.LongType(),
        "int32": st.IntegerType(),
        "string": st.StringType(),
    }
    fields = FIELDS + PARTITION_FIELDS if partitions else FIELDS
    return st.StructType([st.StructField(f.name, types[f.type], f.nullable) for f in fields])
