"""Telemetry benchmark: node-side recording, compaction, each Spark job, the live view's delay.

    python bench/telemetry.py                    # 1 million records, about 2 minutes
    python bench/telemetry.py --sizes 1,10,30    # millions of records; 30 M takes a while
    python bench/telemetry.py --master spark://127.0.0.1:7077 --json out.json

Steps, each printed as it runs:

1. recording: the SpoolWriter's cost per record on the node: `append` (the hot path: a bound
   check and a list append), then `flush` (msgpack packing and the file write, done off the
   request path on the node's timer), beside plain `msgpack.Packer.pack` of the same records
   in the same run (the floor for any msgpack spool).
2. for each size: synthetic mesh records written through one SpoolWriter per node
   (`spark_telemetry.synthetic`), compacted to zstd Parquet with pyarrow (records/s, bytes per
   record on each side), then every job of `jobs.JOBS` timed twice by Spark on that Parquet:
   cold (the first run also warms the JVM up) and warm. No cache: reading only the columns
   each job needs measured faster than building an in-memory cache of all of them first.
   The JVM runs with throughput flags (session.THROUGHPUT_JVM_OPTIONS), not the tests'.
3. the live view: `streaming.measure_landing_delay`, seconds from a spool file's rename to its
   records in the windowed aggregate (median over `--delay-files` files, after a warm-up file).

The machine is shared and has two cores: figures move by tens of percent from run to run, so
compare figures from one run, and look at how each grows with size rather than at one number.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _harness as harness
import msgpack

from irismesh.telemetry.schema import Record
from irismesh.telemetry.spool import SpoolWriter

progress = functools.partial(harness.progress, clock=True)  # long steps: say when

MILLION = 1_000_000


def typical_records(n: int) -> list[Record]:
    node, peer = "ab" * 16, "cd" * 16
    return [
        Record(1_700_000_000.0 + i * 1e-4, node, "request", "reqrep", "db", peer, 250 + i % 977,
               100 + i % 50, "ok", 1)
        for i in range(n)
    ]  # fmt: skip


def bench_recording(n: int, directory: Path) -> dict[str, float]:
    """ns per record of append, of flush (pack + write), and of bare msgpack packing."""
    records = typical_records(n)
    writer = SpoolWriter(directory, "ab" * 16, capacity=n + 1)
    append = writer.append
    started = time.perf_counter_ns()
    for record in records:
        append(record)
    appended = time.perf_counter_ns()
    writer.flush()
    flushed = time.perf_counter_ns()
    writer.close()
    pack = msgpack.Packer(use_bin_type=True).pack
    raw_started = time.perf_counter_ns()
    for record in records:
        pack(record)
    raw = time.perf_counter_ns() - raw_started
    return {
        "records": n,
        "append_ns": (appended - started) / n,
        "flush_ns": (flushed - appended) / n,
        "total_ns": (flushed - started) / n,
        "raw_pack_ns": raw / n,
        "bytes_per_record": writer.bytes_written / n,
        "dropped": writer.dropped,
    }


def bench_size(millions: float, base: Path, spark: Any, *, keep: bool) -> dict[str, Any]:
    from irismesh.spark_telemetry.compact import compact, read_compacted
    from irismesh.spark_telemetry.jobs import JOBS
    from irismesh.spark_telemetry.synthetic import generate, write_spool

    target = int(millions * MILLION)
    spool, parquet = base / f"spool-{millions:g}M", base / f"parquet-{millions:g}M"
    out: dict[str, Any] = {"millions": millions}

    progress(f"{millions:g}M: generating synthetic records through SpoolWriter")
    started = time.perf_counter()
    step = max(target // 10, 1)
    marks = iter(range(step, 10 * step + 1, step))
    mark = [next(marks)]

    def on_chunk(total: int) -> None:
        if total >= mark[0]:
            progress(f"  {total:,} records written")
            mark[0] = next(marks, 1 << 62)

    # About 2.05 records per call (request + serve, publish + 2 deliveries, ...).
    written = write_spool(spool, generate(int(target / 2.05), seed=1), on_chunk=on_chunk)
    out["records"] = written
    out["generate_s"] = time.perf_counter() - started

    progress(f"{millions:g}M: compacting {written:,} records with pyarrow")
    result = compact(
        spool,
        parquet,
        done="keep",
        progress=lambda r: progress(f"  {r.records:,} records compacted"),
    )
    out.update(
        compact_s=result.seconds,
        compact_records_per_s=result.records_per_second,
        spool_bytes_per_record=result.bytes_in / max(result.records, 1),
        parquet_bytes_per_record=result.bytes_out / max(result.records, 1),
        corrupt=result.corrupt,
    )
    progress(
        f"  {result.seconds:.1f} s, {result.records_per_second:,.0f} records/s;"
        f" {out['spool_bytes_per_record']:.0f} B/record msgpack ->"
        f" {out['parquet_bytes_per_record']:.1f} B/record Parquet"
    )
    if not keep:
        shutil.rmtree(spool)

    progress(f"{millions:g}M: Spark jobs on the Parquet data (no cache), cold then warm")
    df = read_compacted(spark, parquet)
    count = df.count()
    assert count == written, (count, written)
    for label in ("cold", "warm"):
        jobs: dict[str, float] = {}
        for name, job in JOBS.items():
            started = time.perf_counter()
            job(df).toPandas()
            jobs[name] = time.perf_counter() - started
            progress(f"  {label} {name}: {jobs[name]:.2f} s")
        out[f"jobs_{label}_s"] = jobs
        out[f"jobs_{label}_total_s"] = sum(jobs.values())
    if not keep:
        shutil.rmtree(parquet)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1", help="comma-separated millions of records")
    parser.add_argument("--master", default="local[*]")
    parser.add_argument("--driver-memory", default="4g")
    parser.add_argument("--recording", type=int, default=MILLION, help="records for step 1")
    parser.add_argument("--delay-files", type=int, default=10)
    parser.add_argument("--delay-records", type=int, default=10_000, help="records per file")
    parser.add_argument("--no-delay", action="store_true", help="skip the streaming step")
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: tmp)")
    parser.add_argument("--keep", action="store_true", help="keep spool and Parquet files")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure here")
    args = harness.parse_args(parser, argv)
    sizes = [float(s) for s in args.sizes.split(",") if s.strip()]

    base = args.dir or Path(tempfile.mkdtemp(prefix="irismesh-bench-telemetry-"))
    base.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "load_before": os.getloadavg()[0]},
        "master": args.master,
    }
    if report["machine"]["load_before"] > 0.5 * (os.cpu_count() or 1):
        progress(f"warning: load average {report['machine']['load_before']:.1f}: figures are noisy")
    try:
        progress(f"recording: {args.recording:,} records through SpoolWriter")
        rec = bench_recording(args.recording, base / "recording")
        report["recording"] = rec
        progress(
            f"  append {rec['append_ns']:.0f} ns, flush {rec['flush_ns']:.0f} ns,"
            f" total {rec['total_ns']:.0f} ns/record; bare msgpack pack {rec['raw_pack_ns']:.0f} ns"
        )
        shutil.rmtree(base / "recording")

        from irismesh.spark_telemetry.session import THROUGHPUT_JVM_OPTIONS, make_session

        progress(f"starting Spark on {args.master}")
        started = time.perf_counter()
        spark = make_session(
            args.master, driver_memory=args.driver_memory, jvm_options=THROUGHPUT_JVM_OPTIONS
        )
        report["session_start_s"] = time.perf_counter() - started
        try:
            report["sizes"] = [bench_size(m, base, spark, keep=args.keep) for m in sizes]
            if not args.no_delay:
                from irismesh.spark_telemetry.streaming import measure_landing_delay

                progress(f"live view: {args.delay_files} files of {args.delay_records:,} records")
                delays = measure_landing_delay(
                    spark,
                    files=args.delay_files,
                    records_per_file=args.delay_records,
                    progress=lambda i, d: progress(f"  file {i}: {d:.2f} s"),
                )
                report["delay_s"] = {
                    "median": statistics.median(delays),
                    "max": max(delays),
                    "all": delays,
                }
        finally:
            spark.stop()
    finally:
        if not args.keep and args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    print_tables(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


def print_tables(report: dict[str, Any]) -> None:
    rec = report["recording"]
    machine = report["machine"]
    print(f"\nmachine: {machine['cpus']} CPUs, load average before {machine['load_before']:.1f}")
    print(f"Spark {report['master']}, session start {report.get('session_start_s', 0):.1f} s\n")
    ratio = rec["total_ns"] / rec["raw_pack_ns"]
    print("node-side recording (SpoolWriter), per record:")
    print(f"  append (hot path)     {rec['append_ns']:8.0f} ns")
    print(f"  flush (pack + write)  {rec['flush_ns']:8.0f} ns")
    print(f"  total                 {rec['total_ns']:8.0f} ns   {ratio:.2f}x bare msgpack pack")
    print(f"  bare msgpack pack     {rec['raw_pack_ns']:8.0f} ns")
    print(f"  on disk               {rec['bytes_per_record']:8.1f} B\n")
    sizes = report.get("sizes", [])
    if sizes:
        print(size_table(sizes))
    if "delay_s" in report:
        d = report["delay_s"]
        print(
            f"\nlive view, spool file landing -> aggregate: median {d['median']:.2f} s,"
            f" max {d['max']:.2f} s over {len(d['all'])} files"
        )


def _cold_warm(size: dict[str, Any], job: str) -> str:
    return f"{size['jobs_cold_s'][job]:.2f} / {size['jobs_warm_s'][job]:.2f}"


def size_table(sizes: list[dict[str, Any]]) -> str:
    first = sizes[0]

    def row(label: str, fmt: str, key: str) -> list[str]:
        return [label, *[format(s[key], fmt) for s in sizes]]

    def growth(label: str, key: str) -> list[str]:
        return [label, *[f"{s[key] / first[key]:.1f}x" for s in sizes]]

    rows = [
        ["", *[f"{s['millions']:g}M" for s in sizes]],
        row("records", ",", "records"),
        row("generate + spool, s", ".1f", "generate_s"),
        row("compact, s", ".1f", "compact_s"),
        row("compact, records/s", ",.0f", "compact_records_per_s"),
        row("Parquet, B/record", ".1f", "parquet_bytes_per_record"),
        *[
            [f"job {n}, s (cold/warm)", *[_cold_warm(s, n) for s in sizes]]
            for n in first["jobs_cold_s"]
        ],
        row("all jobs cold, s", ".1f", "jobs_cold_total_s"),
        row("all jobs warm, s", ".1f", "jobs_warm_total_s"),
    ]
    if len(sizes) > 1:
        rows += [
            growth("growth: records", "records"),
            growth("growth: compact", "compact_s"),
            growth("growth: all jobs warm", "jobs_warm_total_s"),
        ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
