"""The Spark report on big spools: 10 and 100 million synthetic records, with DuckDB beside it.

    python bench/report_scale.py                       # 10 M and 100 M records
    python bench/report_scale.py --sizes 1,10 --keep   # keep the Parquet for another run

For each size the bench writes zstd Parquet partitioned by date and hour, as the compactor
does, straight from numpy (the mesh of `spark_telemetry.synthetic.MeshShape`: clients calling
db and cache, publishing to feeds.news, a cluster without members, joins at the start and a
db member's death half way, gauges every 5 s; one hour of traffic). Going through the spool
writer would take longer than the report itself at 100 M; `bench/telemetry.py` times that path.

Then it runs `python -m irismesh.spark_telemetry report --parquet ... --quiet` on `local[*]`,
as an operator would, and samples the resident memory of that process and its JVM every 0.2 s:
wall time (JVM start included) and the peak RSS of the driver (Python + JVM; in local mode the
executors are threads of that JVM). Last, DuckDB (`pip install duckdb`: the bench's, not the
package's) runs the same aggregations in SQL on the same Parquet, as a reference, in a process of
its own whose peak RSS is sampled the same way.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _harness as harness
import numpy as np
import psutil
import pyarrow as pa

from irismesh.spark_telemetry.compact import add_partitions, write_partitioned
from irismesh.spark_telemetry.synthetic import MeshShape
from irismesh.telemetry.schema import arrow_schema

progress = functools.partial(harness.progress, clock=True)  # long steps: say when

MILLION = 1_000_000
CHUNK = 4_000_000  # records per generated table: about 0.5 GB of numpy at a time
START = 1_700_000_000.0
DURATION = 3600.0


def strings(values: list[str], index: np.ndarray, missing: np.ndarray | None = None) -> pa.Array:
    """`values[index]` as a string column (null where `missing`), built without Python loops."""
    indices = pa.array(index.astype(np.int32), pa.int32(), mask=missing)
    return pa.DictionaryArray.from_arrays(indices, pa.array(values)).cast(pa.string())


def call_tables(total: int, shape: MeshShape, rng: np.random.Generator) -> Iterator[pa.Table]:
    """Caller and member records, about `total` in all, in time order."""
    clients = shape.clients
    members = shape.members["db"] + shape.members["cache"] + shape.members["feeds.news"]
    nodes = clients + members
    # target: 0 db, 1 cache, 2 feeds.news (publish + deliver), 3 gone (no responders)
    clusters = ["db", "cache", "feeds.news", "gone"]
    done = 0
    while done < total:
        calls = min(CHUNK, total - done) // 2  # two records per call, gone's one aside
        t0 = START + DURATION * done / total
        t1 = START + DURATION * (done + 2 * calls) / total
        ts = np.sort(rng.uniform(t0, t1, calls))
        client = rng.integers(0, len(clients), calls)
        target = rng.choice(4, calls, p=[0.55, 0.3, 0.14, 0.01])
        member = np.where(
            target == 0,
            len(clients) + rng.integers(0, 3, calls),
            np.where(
                target == 1,
                len(clients) + 3 + rng.integers(0, 2, calls),
                len(clients) + 5 + rng.integers(0, 2, calls),
            ),
        )
        service = (rng.lognormal(0.0, 0.35, calls) * np.where(target == 0, 450, 85)).astype(
            np.int64
        )
        roll = rng.random(calls)
        outcome = np.where(target == 3, 3, np.where(roll < 0.01, 1, np.where(roll < 0.015, 2, 0)))
        size = rng.integers(16, 2048, calls)
        caller_kind = np.where(target == 2, 1, 0)  # request, publish
        member_kind = np.where(target == 2, 3, 2)  # serve, deliver
        latency = np.where(outcome == 1, 1_000_000, service + 120)
        second = target != 3
        n2 = int(second.sum())
        table = pa.table(
            {
                "ts": np.concatenate([ts, ts[second] + service[second] / 1e6]),
                "node": strings(nodes, np.concatenate([client, member[second]])),
                "kind": strings(
                    ["request", "publish", "serve", "deliver"],
                    np.concatenate([caller_kind, member_kind[second]]),
                ),
                "pattern": strings(
                    ["reqrep", "pubsub"], np.concatenate([caller_kind, caller_kind[second]])
                ),
                "cluster": strings(clusters, np.concatenate([target, target[second]])),
                "peer": strings(
                    nodes,
                    np.concatenate([member, client[second]]),
                    np.concatenate([target == 3, np.zeros(n2, dtype=bool)]),
                ),
                "latency_us": pa.array(np.concatenate([latency, service[second]])),
                "size": pa.array(np.concatenate([size, size[second]])),
                "outcome": strings(
                    ["ok", "timeout", "remote_error", "no_responders"],
                    np.concatenate([outcome, outcome[second]]),
                ),
                "weight": pa.array(np.ones(calls + n2, dtype=np.int64)),
                "name": pa.nulls(calls + n2, pa.string()),
                "value": pa.nulls(calls + n2, pa.float64()),
            }
        )
        # The schema's other columns (names: on gauges and membership records) stay empty.
        schema = arrow_schema()
        for field in schema:
            if field.name not in table.column_names:
                table = table.append_column(field.name, pa.nulls(table.num_rows, field.type))
        yield table.select(schema.names).cast(schema)
        done += calls + n2


def side_records(shape: MeshShape) -> pa.Table:
    """Joins at the start, a db member's death half way, gauges every 5 s."""
    rows: list[dict[str, Any]] = []
    for cluster in ("db", "cache", "idle"):
        for member in shape.members[cluster]:
            for observer in shape.clients:
                rows.append(
                    {
                        "ts": START + 0.5,
                        "node": observer,
                        "kind": "membership",
                        "peer": member,
                        "name": "join",
                    }
                )
    for observer in shape.clients:
        rows.append(
            {
                "ts": START + DURATION / 2,
                "node": observer,
                "kind": "membership",
                "peer": shape.members["db"][2],
                "name": "dead",
            }
        )
    for node in shape.nodes:
        for t in np.arange(START, START + DURATION, 5.0):
            rows.append(
                {"ts": float(t), "node": node, "kind": "gauge", "name": "in_flight", "value": 8.0}
            )
    defaults = {
        "pattern": "",
        "cluster": None,
        "latency_us": None,
        "size": None,
        "outcome": "",
        "weight": 1,
        "name": None,
        "value": None,
        "peer": None,
    }
    return pa.Table.from_pylist([defaults | row for row in rows], schema=arrow_schema())


def write_parquet(millions: float, out: Path) -> int:
    shape = MeshShape(clients=4, seed=0)
    rng = np.random.default_rng(0)
    written = 0
    tables = itertools.chain(
        [side_records(shape)], call_tables(int(millions * MILLION), shape, rng)
    )
    for number, table in enumerate(tables):  # one chunk in memory at a time
        write_partitioned(add_partitions(table), out, f"part-{number:05d}")
        written += table.num_rows
    return written


class PeakRss:
    """Peak resident memory of a process and its children, sampled every 0.2 s."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                tree = [self.process, *self.process.children(recursive=True)]
                self.peak = max(self.peak, sum(p.memory_info().rss for p in tree))
            except psutil.Error:
                pass

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def timed_process(command: list[str], failed: str, hint: str = "") -> tuple[float, int]:
    """Wall time and peak RSS of `command` run to its end; a failure ends the bench."""
    started = time.perf_counter()
    process = subprocess.Popen(command)
    peak = PeakRss(process.pid)
    status = process.wait()
    rss = peak.stop()
    if status != 0:
        raise SystemExit(f"{failed} (exit {status}){hint}")
    return time.perf_counter() - started, rss


def spark_report(parquet: Path, out: Path, master: str) -> tuple[float, int]:
    command = [
        sys.executable,
        "-m",
        "irismesh.spark_telemetry",
        "report",
        "--parquet",
        str(parquet),
        "--out",
        str(out),
        "--master",
        master,
        "--quiet",
    ]
    return timed_process(command, "the report failed")


DUCKDB_QUERIES = {
    "overview": "SELECT count(*), sum(weight), count(DISTINCT node), min(ts), max(ts) FROM r",
    "totals": "SELECT kind, outcome, count(*), sum(weight), min(ts), max(ts) FROM r GROUP BY 1, 2",
    "throughput": "SELECT cluster, pattern, floor(ts / {b}) * {b} AS t, sum(weight),"
    " sum(CASE WHEN outcome = 'ok' THEN weight ELSE 0 END), sum(coalesce(size, 0) * weight)"
    " FROM r WHERE kind IN ('request','publish','broadcast','tunnel','survey') GROUP BY 1, 2, 3",
    "latency": "SELECT cluster, pattern, kind, count(*), sum(weight),"
    " approx_quantile(latency_us, [0.5, 0.95, 0.99]), max(latency_us) FROM r"
    " WHERE outcome = 'ok' AND latency_us IS NOT NULL GROUP BY 1, 2, 3",
    "latency_time": "SELECT cluster, kind, floor(ts / {b}) * {b} AS t, count(*),"
    " approx_quantile(latency_us, [0.5, 0.99]) FROM r"
    " WHERE outcome = 'ok' AND latency_us IS NOT NULL GROUP BY 1, 2, 3",
    "errors": "SELECT cluster, sum(weight) FILTER (kind IN ('request','publish')),"
    " sum(weight) FILTER (kind IN ('request','publish') AND outcome <> 'ok'),"
    " sum(weight) FILTER (outcome = 'timeout') FROM r WHERE cluster IS NOT NULL GROUP BY 1",
    "drops": "SELECT kind, name, cluster, sum(weight) FROM r WHERE kind IN ('drop', 'error')"
    " GROUP BY 1, 2, 3",
    "member_load": "SELECT cluster, CASE WHEN kind = 'serve' THEN node ELSE peer END AS m,"
    " sum(CASE WHEN kind = 'request' THEN weight ELSE 0 END) FROM r"
    " WHERE cluster IS NOT NULL AND kind IN ('request', 'serve', 'membership') GROUP BY 1, 2",
    "churn": "SELECT cluster, floor(ts / {b}) * {b}, name, sum(weight), count(DISTINCT peer)"
    " FROM r WHERE kind = 'membership' GROUP BY 1, 2, 3",
    "top_talkers": "SELECT node, sum(weight) AS c FROM r"
    " WHERE kind IN ('request','publish') GROUP BY 1 ORDER BY c DESC LIMIT 10",
    "gauges": "SELECT name, count(DISTINCT node), count(*), avg(value), max(value) FROM r"
    " WHERE kind = 'gauge' GROUP BY 1",
}


def duckdb_reference(parquet: Path, bucket: int) -> tuple[float, int]:
    """Wall time and peak RSS of DuckDB running every query, in a process of its own."""
    command = [sys.executable, __file__, "--duckdb-only", str(parquet), str(bucket)]
    return timed_process(command, "DuckDB failed", hint=": pip install duckdb")


def run_duckdb(parquet: Path, bucket: int) -> None:
    import duckdb

    con = duckdb.connect()
    files = f"{parquet}/**/*.parquet"
    con.execute(f"CREATE VIEW r AS SELECT * FROM read_parquet('{files}', hive_partitioning=1)")
    for query in DUCKDB_QUERIES.values():
        con.execute(query.format(b=bucket)).fetchall()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="10,100", help="millions of records, comma-separated")
    parser.add_argument("--master", default="local[*]")
    parser.add_argument("--dir", type=Path, default=None, help="where the Parquet goes")
    parser.add_argument("--keep", action="store_true", help="keep (and reuse) the Parquet")
    parser.add_argument(
        "--engines",
        default="spark,duckdb",
        help="spark, duckdb or both (DuckDB needs Spark's"
        " bucket width: without spark it uses 15 s)",
    )
    parser.add_argument("--duckdb-only", nargs=2, help=argparse.SUPPRESS)
    args = harness.parse_args(parser, argv)
    if args.duckdb_only:
        run_duckdb(Path(args.duckdb_only[0]), int(args.duckdb_only[1]))
        return 0
    engines = set(args.engines.split(","))
    base = args.dir or Path(tempfile.gettempdir()) / "irismesh-report-scale"
    rows = []
    for millions in (float(s) for s in args.sizes.split(",")):
        parquet = base / f"parquet-{millions:g}M"
        if not parquet.is_dir():
            progress(f"{millions:g}M: writing synthetic Parquet to {parquet}")
            started = time.perf_counter()
            records = write_parquet(millions, parquet)
            progress(f"  {records:,} records in {time.perf_counter() - started:.0f} s")
        spark_s = spark_rss = duck_s = duck_rss = float("nan")
        bucket = 15
        if "spark" in engines:
            progress(f"{millions:g}M: Spark report on {args.master}")
            out = base / f"report-{millions:g}M"
            spark_s, spark_rss = spark_report(parquet, out, args.master)
            meta = json.loads((out / "summary.json").read_text())["meta"]
            bucket = int(meta["bucket_seconds"])
            progress(f"  {spark_s:.1f} s, peak RSS {spark_rss / 2**30:.2f} GiB")
        if "duckdb" in engines:
            progress(f"{millions:g}M: DuckDB, the same aggregations")
            duck_s, duck_rss = duckdb_reference(parquet, bucket)
            progress(f"  {duck_s:.1f} s, peak RSS {duck_rss / 2**30:.2f} GiB")
        rows.append((millions, spark_s, spark_rss, duck_s, duck_rss))
        if not args.keep:
            shutil.rmtree(parquet)
    print(
        "| records | Spark report (wall, JVM start included) | driver peak RSS (Python + JVM) |"
        " DuckDB, same aggregations | DuckDB peak RSS |"
    )
    print("| --- | --- | --- | --- | --- |")
    for millions, spark_s, spark_rss, duck_s, duck_rss in rows:
        cells = [f"{spark_s:.1f} s", f"{spark_rss / 2**30:.2f} GiB", f"{duck_s:.1f} s",
                 f"{duck_rss / 2**30:.2f} GiB"]  # fmt: skip
        shown = ["-" if cell.startswith("nan") else cell for cell in cells]  # engine not run
        print(f"| {millions:g} M | {' | '.join(shown)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
