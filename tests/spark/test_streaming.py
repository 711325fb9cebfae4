"""The live view: spool files landing atomically update windowed aggregates, late records
within the watermark count, later ones are dropped; the landing delay is printed."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import pytest

pytest.importorskip("pyspark", reason="PySpark not installed: pip install -e '.[spark]'")

import numpy as np
from pyspark.sql import SparkSession

from irismesh.spark_telemetry.streaming import LiveView, start_live_view
from irismesh.telemetry.schema import Record
from irismesh.telemetry.spool import SpoolWriter

BASE = 1_700_000_000.0  # a multiple of 10: windows start at BASE + 10 k


def ok(ts: float, latency: int, weight: int = 1, cluster: str = "db") -> Record:
    return Record(ts, "c1", "request", "reqrep", cluster, "m1", latency, 64, "ok", weight)


def test_files_update_the_windows_and_late_records_follow_the_watermark(
    spark: SparkSession, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    writer = SpoolWriter(spool, "c1", capacity=10_000)
    live = start_live_view(
        spark, spool, window="10 seconds", watermark="30 seconds", checkpoint=tmp_path / "ckpt"
    )
    delays: list[float] = []

    def land(records: list[Record], until: tuple[float, int]) -> None:
        """Write one spool file atomically; wait until window `until[0]` has `until[1]` events."""
        for record in records:
            writer.append(record)
        landed = time.monotonic()
        writer.rotate()

        def done(view: LiveView) -> bool:
            row = view.get(until[0], "db", "reqrep")
            return row is not None and row.events == until[1]

        assert live.view.wait_for(done, timeout=60), live.view.rows()
        row = live.view.get(until[0], "db", "reqrep")
        assert row is not None
        delays.append(row.arrived - landed)

    try:
        # 1. Window [BASE, BASE+10): 60 records, ten of them sampled (weight 3), one failure,
        #    a malformed record (dropped by the decoder) and a temporary file (never listed).
        latencies = [100 + 7 * i for i in range(60)]
        first = [
            ok(BASE + i / 10, lat, weight=3 if i % 6 == 0 else 1) for i, lat in enumerate(latencies)
        ]
        first.append(Record(BASE + 1, "c1", "request", "reqrep", "db", "m1", 9, 1, "timeout"))
        writer.append(("not a ts", "c1", "request"))  # type: ignore[arg-type]
        (spool / ".c1-99999999.msgpack.tmp").write_bytes(b"\x91\x01")
        land(first, until=(BASE, 60 + 10 * 2 + 1))
        row = live.view.get(BASE, "db", "reqrep")
        assert row is not None
        assert (row.ok, row.failed) == (80, 1)
        exact = [int(np.quantile(latencies, q, method="inverted_cdf")) for q in (0.5, 0.95, 0.99)]
        assert [row.p50_us, row.p95_us, row.p99_us] == exact
        # 2. Event time jumps to BASE+100: the watermark becomes BASE+70 after this batch.
        land([ok(BASE + 100 + i / 10, 200) for i in range(10)], until=(BASE + 100, 10))
        # Spark runs a batch without data to move the watermark on (and evict old windows).
        assert live.wait_for_watermark(BASE + 70, timeout=60), live.query.lastProgress
        # 3. Late records: 7 within the watermark (BASE+75, a window never seen before) and
        #    5 beyond it (BASE+2: window [BASE, BASE+10) is closed), plus 3 for the newest window.
        late = [ok(BASE + 75, 300) for _ in range(7)] + [ok(BASE + 2, 300) for _ in range(5)]
        land(late + [ok(BASE + 101, 200) for _ in range(3)], until=(BASE + 100, 13))
        within = live.view.get(BASE + 70, "db", "reqrep")
        assert within is not None
        assert within.events == 7
        closed = live.view.get(BASE, "db", "reqrep")
        assert closed is not None
        assert closed.events == 81  # unchanged: the 5 records past the watermark were dropped
    finally:
        writer.close()
        live.stop()
    print(
        f"\nspool file landing -> live view: {', '.join(f'{d:.2f}' for d in delays)} s"
        f" (median {statistics.median(delays):.2f} s; the first includes the query's start)"
    )
