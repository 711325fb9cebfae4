"""The live view: Structured Streaming over the spool directory, windowed percentiles.

Theory of operation
-------------------
Spark has no msgpack reader, and the spool writer should not pay for a second, Spark-readable
copy of every record on the node's hot path. So the stream reads each complete spool file
whole with Spark's `binaryFile` source and decodes it in Python with `mapInArrow`, through the
same decoder the compactor uses (`decode.decode_to_table`): one schema, one validity rule. The
writer's atomic rename is what makes this safe: a file source lists a directory once per
micro-batch and reads each new file exactly once, so a file must be complete when it first
appears, and the hidden temporary names (".<node>-<seq>.msgpack.tmp") are never listed.

`windowed_calls` is the streaming job, a pure DataFrame -> DataFrame function like the batch
jobs: caller-side records grouped by event-time window (from `ts`), cluster and pattern, with
weighted counts and p50/p95/p99 of successful calls' latency (`percentile_approx`). A
watermark bounds the state: a record whose `ts` is within `watermark` of the newest event time
seen still updates its (older) window. The watermark moves at the end of each micro-batch
(Spark runs a batch without data for it), windows it has passed leave the state, and records
for them that arrive afterwards are dropped. That is Spark's guarantee in one direction only:
a late record arriving before the watermark has moved past its window may still count.

The query runs in update mode into a `foreachBatch` sink (the Parquet sink is append-only, and
append mode would hold each window back until the watermark passes it). The sink, `LiveView`,
keeps the latest row of every window in driver memory, stamped with the time it arrived, for a
terminal view or a test to read. `measure_landing_delay` writes probe spool files and measures
the time from each file's rename to its records showing in the view.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from irismesh.spark_telemetry.decode import decode_to_table
from irismesh.spark_telemetry.jobs import quantile_columns
from irismesh.telemetry.schema import CALL_KINDS, Outcome, Record, spark_schema
from irismesh.telemetry.spool import SPOOL_SUFFIX, SpoolWriter

if TYPE_CHECKING:
    from pyspark.sql.streaming.query import StreamingQuery

__all__ = [
    "BINARY_FILE_SCHEMA",
    "LiveQuery",
    "LiveRow",
    "LiveView",
    "decode_batches",
    "measure_landing_delay",
    "spool_stream",
    "start_live_view",
    "windowed_calls",
]

BINARY_FILE_SCHEMA: Final = "path string, modificationTime timestamp, length long, content binary"


def decode_batches(batches: Iterable[Any]) -> Iterator[Any]:
    """mapInArrow function: batches of spool file contents to batches of records.

    Corrupt records are dropped here; the compactor is where they are counted.
    """
    for batch in batches:
        for data in batch.column(0).to_pylist():
            yield from decode_to_table(data).table.to_batches()


def spool_stream(
    spark: SparkSession, spool: str | os.PathLike[str], *, max_files_per_trigger: int | None = None
) -> DataFrame:
    """A streaming DataFrame of the records in complete spool files landing in `spool`."""
    reader = (
        spark.readStream.format("binaryFile")
        .schema(BINARY_FILE_SCHEMA)
        .option("pathGlobFilter", "*" + SPOOL_SUFFIX)
        # The compactor may move a listed file away before the stream reads it.
        .option("ignoreMissingFiles", "true")
    )
    if max_files_per_trigger is not None:
        reader = reader.option("maxFilesPerTrigger", str(max_files_per_trigger))
    raw = reader.load(str(spool))
    return raw.select("content").mapInArrow(decode_batches, spark_schema())


def windowed_calls(
    records: DataFrame, *, window: str = "10 seconds", watermark: str = "30 seconds"
) -> DataFrame:
    """Calls per event-time window, cluster and pattern, with latency percentiles.

    Columns: window_start, window_end (epoch seconds), cluster, pattern, events, ok, failed,
    p50_us, p95_us, p99_us (of successful calls; NULL in a window without one).
    """
    ok = F.col("outcome") == str(Outcome.OK)
    latency = F.when(ok, F.col("latency_us"))
    return (
        records.where(F.col("kind").isin([str(kind) for kind in CALL_KINDS]))
        .withColumn("event_time", F.timestamp_seconds(F.col("ts")))
        .withWatermark("event_time", watermark)
        .groupBy(F.window("event_time", window).alias("w"), "cluster", "pattern")
        .agg(
            F.sum("weight").alias("events"),
            F.sum(F.when(ok, F.col("weight")).otherwise(F.lit(0))).alias("ok"),
            F.sum(F.when(~ok, F.col("weight")).otherwise(F.lit(0))).alias("failed"),
            F.percentile_approx(latency, [0.5, 0.95, 0.99]).alias("q"),
        )
        .select(
            (F.unix_micros(F.col("w.start")) / 1e6).alias("window_start"),
            (F.unix_micros(F.col("w.end")) / 1e6).alias("window_end"),
            "cluster",
            "pattern",
            "events",
            "ok",
            "failed",
            *quantile_columns("p50_us", "p95_us", "p99_us"),
        )
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class LiveRow:
    """The latest figures of one window, cluster and pattern, and when they arrived."""

    window_start: float
    window_end: float
    cluster: str | None
    pattern: str
    events: int
    ok: int
    failed: int
    p50_us: int | None
    p95_us: int | None
    p99_us: int | None
    arrived: float  # time.monotonic() when the micro-batch reached the sink
    batch_id: int

    @property
    def key(self) -> tuple[float, str | None, str]:
        return (self.window_start, self.cluster, self.pattern)


class LiveView:
    """A foreachBatch sink keeping the latest row per window; safe to read from any thread.

    Windows that end more than `retain` seconds before the newest window are forgotten, so
    the view's memory stays bounded however long the stream runs.
    """

    def __init__(self, *, retain: float = 3600.0) -> None:
        self.retain = retain
        self.batches = 0  # micro-batches seen, including those without rows
        self.updates = 0  # micro-batches that changed some window
        self._rows: dict[tuple[float, str | None, str], LiveRow] = {}
        self._changed = threading.Condition()  # an RLock: predicates may call get()

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        rows = batch.collect()
        arrived = time.monotonic()
        with self._changed:
            for row in rows:
                live = LiveRow(**row.asDict(), arrived=arrived, batch_id=batch_id)
                self._rows[live.key] = live
            if self._rows:
                horizon = max(key[0] for key in self._rows) - self.retain
                for key in [key for key, row in self._rows.items() if row.window_end < horizon]:
                    del self._rows[key]
            self.batches += 1
            self.updates += 1 if rows else 0
            self._changed.notify_all()

    def rows(self) -> list[LiveRow]:
        """Every window in view, oldest first."""
        with self._changed:
            return sorted(self._rows.values(), key=lambda r: (r.key[0], str(r.cluster), r.pattern))

    def get(self, window_start: float, cluster: str | None, pattern: str) -> LiveRow | None:
        with self._changed:
            return self._rows.get((window_start, cluster, pattern))

    def wait_for(self, predicate: Callable[[LiveView], bool], timeout: float) -> bool:
        """Block until `predicate(self)` holds (checked after every batch) or `timeout` passes."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate(self):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._changed.wait(remaining)
            return True


@dataclass(frozen=True, slots=True, kw_only=True)
class LiveQuery:
    """A running live-view query and its sink."""

    query: StreamingQuery
    view: LiveView

    def stop(self) -> None:
        self.query.stop()

    def watermark(self) -> float | None:
        """The event-time watermark (epoch seconds) the last micro-batch ran with, if any."""
        progress: dict[str, Any] = self.query.lastProgress or {}
        stamp = progress.get("eventTime", {}).get("watermark")
        if not isinstance(stamp, str) or not stamp:
            return None
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()

    def wait_for_watermark(self, at_least: float, timeout: float) -> bool:
        """Wait until a micro-batch has run with a watermark of at least `at_least`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            mark = self.watermark()
            if mark is not None and mark >= at_least:
                return True
            time.sleep(0.05)
        return False


def start_live_view(
    spark: SparkSession,
    spool: str | os.PathLike[str],
    *,
    window: str = "10 seconds",
    watermark: str = "30 seconds",
    checkpoint: str | os.PathLike[str] | None = None,
    trigger_seconds: float | None = None,
    view: LiveView | None = None,
) -> LiveQuery:
    """Start the streaming job over `spool` into a LiveView (a temporary checkpoint if None).

    With `trigger_seconds` None a micro-batch starts as soon as the previous one ends and new
    files are listed, which gives the lowest delay on a machine with nothing else to do.
    """
    view = view or LiveView()
    calls = windowed_calls(spool_stream(spark, spool), window=window, watermark=watermark)
    writer = calls.writeStream.outputMode("update").foreachBatch(view)
    if checkpoint is not None:
        writer = writer.option("checkpointLocation", str(checkpoint))
    if trigger_seconds is not None:
        writer = writer.trigger(processingTime=f"{trigger_seconds} seconds")
    return LiveQuery(query=writer.start(), view=view)


def measure_landing_delay(
    spark: SparkSession,
    *,
    files: int = 10,
    records_per_file: int = 1000,
    window_seconds: int = 10,
    timeout: float = 120.0,
    progress: Callable[[int, float], Any] | None = None,
) -> list[float]:
    """Seconds from each probe file's rename to its records in the live view, one per file.

    Runs its own query over a fresh temporary spool directory. One warm-up file goes first
    and is not counted: it pays for the query's start and the first Python worker. Each probe
    file holds `records_per_file` successful requests in a window of its own, so "its records
    are in the view" means that window's row counts all of them.
    """
    delays: list[float] = []
    with tempfile.TemporaryDirectory(prefix="irismesh-delay-") as tmp:
        spool = Path(tmp) / "spool"
        spool.mkdir()
        live = start_live_view(
            spark,
            spool,
            window=f"{window_seconds} seconds",
            checkpoint=Path(tmp) / "checkpoint",
        )
        writer = SpoolWriter(spool, "probe", capacity=records_per_file + 1)
        base = (int(time.time()) // window_seconds) * window_seconds
        try:
            for i in range(files + 1):
                start = float(base + i * window_seconds)
                for j in range(records_per_file):
                    ts = start + window_seconds * j / records_per_file
                    writer.append(
                        Record(ts, "probe", "request", "reqrep", "probe", "m", 100 + j, 64, "ok")
                    )
                landed = time.monotonic()
                writer.rotate()
                key = (start, "probe", "reqrep")

                def arrived(view: LiveView, key: tuple[float, str, str] = key) -> bool:
                    row = view.get(*key)
                    return row is not None and row.events >= records_per_file

                if not live.view.wait_for(arrived, timeout):
                    raise TimeoutError(f"probe file {i} not in the live view after {timeout} s")
                row = live.view.get(*key)
                assert row is not None
                if i > 0:
                    delays.append(row.arrived - landed)
                    if progress is not None:
                        progress(i, delays[-1])
        finally:
            writer.close()
            live.stop()
    return delays
