"""`python -m irismesh.spark_telemetry`: compact, report, live view, synthetic data, delay.

    python -m irismesh.spark_telemetry compact --spool DIR --out DIR [--keep | --delete]
    python -m irismesh.spark_telemetry report (--spool DIR | --parquet DIR) --out DIR
                                              [--master spark://host:port] [--top N]
                                              [--bucket 10s]
    python -m irismesh.spark_telemetry live --spool DIR [--window 10] [--duration S]
    python -m irismesh.spark_telemetry synth --spool DIR [--calls N] [--sample-every K]
    python -m irismesh.spark_telemetry delay [--files N]

`mesh telemetry ...` calls `main` with the same arguments. Spark is imported only by the
subcommands that need it, so `compact` and `synth` start in well under a second. Failures the
user can act on (the `spark` extra or Java missing, a missing spool, Spark failing, a file that
cannot be read or written) are one line on stderr and exit status 1 or 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from irismesh.spark_telemetry.streaming import LiveView

__all__ = ["build_parser", "main"]

# Kept here rather than imported from jobs.py, which imports pyspark; a test checks they agree.
JOB_NAMES = (
    "overview",
    "totals",
    "throughput",
    "latency",
    "latency_time",
    "errors",
    "drops",
    "fairness",
    "member_load",
    "churn",
    "events",
    "top_talkers",
    "gauges",
)
# What each subcommand imports: the `spark` extra's packages.
_NEEDS = {
    "compact": ("pyarrow",),
    "report": ("pyspark", "pyarrow", "pandas", "matplotlib"),
    "live": ("pyspark", "pyarrow", "pandas"),
    "delay": ("pyspark", "pyarrow", "pandas"),
    "synth": ("numpy",),
}
USAGE, FAILED = 2, 1


class CommandFailed(Exception):
    """A failure to report in one line, with the exit status."""

    def __init__(self, message: str, status: int = FAILED) -> None:
        super().__init__(message)
        self.status = status


def _bucket(text: str) -> int:
    from irismesh.spark_telemetry.units import parse_bucket

    try:
        return parse_bucket(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m irismesh.spark_telemetry",
        description="Telemetry analysis for irismesh: spool files -> Parquet -> Spark jobs.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    compact = sub.add_parser("compact", help="spool files -> Parquet partitioned by date/hour")
    compact.add_argument("--spool", required=True, type=Path, help="spool directory")
    compact.add_argument("--out", required=True, type=Path, help="Parquet dataset directory")
    done = compact.add_mutually_exclusive_group()
    done.add_argument("--keep", action="store_true", help="leave the spool files in place")
    done.add_argument("--delete", action="store_true", help="delete spool files once written")
    compact.add_argument("--batch-records", type=int, default=1_000_000)

    report = sub.add_parser("report", help="run the jobs; write index.html and summary.json")
    source = report.add_mutually_exclusive_group(required=True)
    source.add_argument("--spool", type=Path, help="spool directory (read, never modified)")
    source.add_argument("--parquet", type=Path, help="an already compacted dataset")
    report.add_argument("--out", required=True, type=Path, help="report directory")
    report.add_argument("--master", default="local[*]", help="local[*] or spark://host:port")
    report.add_argument("--top", type=int, default=10, help="top talkers to list")
    report.add_argument(
        "--bucket",
        type=_bucket,
        default=None,
        help="width of a point over time (1s, 30s, 5min, 1h); default: chosen from the span",
    )
    report.add_argument("--quiet", action="store_true", help="no terminal summary")
    report.add_argument(
        "--quick-jvm",
        action="store_true",
        help="JVM flags for a fast start on small data (tests) instead of throughput",
    )
    report.add_argument(
        "--jobs", help="comma-separated subset of: " + ", ".join(JOB_NAMES), default=None
    )

    live = sub.add_parser("live", help="streaming view over a spool directory")
    live.add_argument("--spool", required=True, type=Path)
    live.add_argument("--window", type=int, default=10, help="window, seconds")
    live.add_argument("--watermark", type=int, default=30, help="watermark, seconds")
    live.add_argument("--duration", type=float, default=0.0, help="stop after S s (0: Ctrl-C)")
    live.add_argument("--master", default="local[*]")

    synth = sub.add_parser("synth", help="write synthetic spool files (demo, benchmarks)")
    synth.add_argument("--spool", required=True, type=Path)
    synth.add_argument("--calls", type=int, default=100_000)
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--sample-every", type=int, default=1)
    synth.add_argument("--duration", type=float, default=600.0, help="seconds of traffic")

    delay = sub.add_parser("delay", help="measure spool file landing -> live view delay")
    delay.add_argument("--files", type=int, default=10)
    delay.add_argument("--records", type=int, default=1000)
    delay.add_argument("--master", default="local[*]")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command: str = args.command
    run = {"compact": _compact, "report": _report, "live": _live, "synth": _synth}
    try:
        _require(command)
        return run.get(command, _delay)(args)
    except CommandFailed as exc:
        _fail(command, str(exc))
        return exc.status
    except OSError as exc:  # a spool or report file that cannot be read or written
        _fail(command, f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": "))
        return FAILED


def _fail(command: str, message: str) -> None:
    # One line, whatever the message holds: scripts read stderr line by line.
    print(f"spark_telemetry {command}: {' '.join(message.split())}", file=sys.stderr, flush=True)


def _require(command: str) -> None:
    """The packages and the Java the command needs, or CommandFailed saying what to do."""
    require(_NEEDS[command])


def require(packages: Sequence[str]) -> None:
    """`packages` importable (the `spark` extra's), and a Java to run Spark when PySpark is
    one of them; else CommandFailed (exit status 2) saying what to do. `mesh telemetry report`
    checks with it too, before it hands over."""
    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    if missing:
        names = " and ".join(missing)
        raise CommandFailed(f"{names} not installed: pip install 'irismesh[spark]'", USAGE)
    if "pyspark" in packages:
        home = os.environ.get("JAVA_HOME")
        if home and not os.access(os.path.join(home, "bin", "java"), os.X_OK):
            raise CommandFailed(f"JAVA_HOME={home} has no bin/java: fix or unset it", USAGE)
        if not home and shutil.which("java") is None:
            raise CommandFailed(
                "Java not found on PATH: Spark needs a JRE 17 or later "
                "(apt-get install openjdk-17-jre-headless), or set JAVA_HOME",
                USAGE,
            )


def spark_failures() -> tuple[type[Exception], ...]:
    """The exceptions by which PySpark says Spark failed (no JVM, a job, the master)."""
    from py4j.protocol import Py4JError  # type: ignore[import-untyped]  # no stubs
    from pyspark.errors import PySparkException

    return (PySparkException, Py4JError)


def _compact(args: argparse.Namespace) -> int:
    from irismesh.spark_telemetry.compact import Done, compact

    if not args.spool.is_dir():
        what = "is not a directory" if args.spool.exists() else "does not exist"
        raise CommandFailed(f"spool directory {args.spool} {what}", USAGE)
    done: Done = "keep" if args.keep else "delete" if args.delete else "move"
    result = compact(args.spool, args.out, done=done, batch_records=args.batch_records)
    print(
        f"compacted {result.files} files, {result.records:,} records ({result.corrupt} corrupt)"
        f" in {result.seconds:.2f} s ({result.records_per_second:,.0f} records/s);"
        f" {result.bytes_in:,} B msgpack -> {result.bytes_out:,} B Parquet"
        f" in {len(result.partitions)} partitions"
    )
    return 0


def _report(args: argparse.Namespace) -> int:
    from irismesh.spark_telemetry.compact import compact, read_compacted
    from irismesh.spark_telemetry.report import build_report
    from irismesh.spark_telemetry.session import (
        JVM_OPTIONS,
        THROUGHPUT_JVM_OPTIONS,
        make_session,
    )

    only = args.jobs.split(",") if args.jobs else None
    unknown = set(only or ()) - set(JOB_NAMES)
    if unknown:
        known = ", ".join(JOB_NAMES)
        raise CommandFailed(f"unknown jobs: {', '.join(sorted(unknown))}; known: {known}", USAGE)
    if args.parquet is not None and not args.parquet.is_dir():
        message = f"no compacted dataset at {args.parquet} (make one with the compact subcommand)"
        raise CommandFailed(message, USAGE)
    if args.spool is not None and not args.spool.is_dir():
        what = "is not a directory" if args.spool.exists() else "does not exist"
        raise CommandFailed(f"spool directory {args.spool} {what}", USAGE)
    if args.out.exists() and not args.out.is_dir():
        raise CommandFailed(f"--out {args.out} exists and is not a directory", USAGE)
    meta: dict[str, object] = {"master": args.master}
    dataset = args.parquet
    if args.spool is not None:
        # The report compacts a private copy and leaves the spool to the real compactor.
        dataset = args.out / "parquet"
        shutil.rmtree(dataset, ignore_errors=True)
        result = compact(args.spool, dataset, done="keep")
        meta.update(spool_files=result.files, corrupt_records=result.corrupt)
    failures = spark_failures()
    try:
        spark = make_session(
            args.master, jvm_options=JVM_OPTIONS if args.quick_jvm else THROUGHPUT_JVM_OPTIONS
        )
    except failures as exc:
        raise CommandFailed(f"Spark did not start: {_first_line(exc)}") from None
    try:
        started = time.perf_counter()
        build_report(
            read_compacted(spark, dataset),
            args.out,
            top=args.top,
            meta=meta,
            quiet=args.quiet,
            only=only,
            bucket=args.bucket,
        )
        if not args.quiet:
            print(f"report: {args.out / 'index.html'} ({time.perf_counter() - started:.1f} s)")
    except failures as exc:
        raise CommandFailed(f"Spark failed: {_first_line(exc)}") from None
    finally:
        spark.stop()
    return 0


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _live(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from irismesh.spark_telemetry.session import make_session
    from irismesh.spark_telemetry.streaming import start_live_view

    spark = make_session(args.master)
    console = Console()
    live = start_live_view(
        spark, args.spool, window=f"{args.window} seconds", watermark=f"{args.watermark} seconds"
    )
    deadline = time.monotonic() + args.duration if args.duration > 0 else float("inf")
    seen = 0
    try:
        while time.monotonic() < deadline:
            live.view.wait_for(partial(_newer, updates=seen), timeout=1.0)
            if live.view.updates == seen:
                continue
            seen = live.view.updates
            table = Table(title=f"live view, update {seen}")
            for column in ("window (UTC)", "cluster", "pattern", "events", "failed", "p50", "p99"):
                table.add_column(column)
            for row in live.view.rows()[-12:]:
                table.add_row(
                    time.strftime("%H:%M:%S", time.gmtime(row.window_start)),
                    str(row.cluster),
                    row.pattern,
                    str(row.events),
                    str(row.failed),
                    str(row.p50_us),
                    str(row.p99_us),
                )
            console.print(table)
    except KeyboardInterrupt:
        pass
    finally:
        live.stop()
        spark.stop()
    return 0


def _newer(view: LiveView, *, updates: int) -> bool:
    return view.updates > updates


def _synth(args: argparse.Namespace) -> int:
    from irismesh.spark_telemetry.synthetic import generate, write_spool

    started = time.perf_counter()
    written = write_spool(
        args.spool,
        generate(
            args.calls, seed=args.seed, sample_every=args.sample_every, duration=args.duration
        ),
    )
    print(f"wrote {written:,} records to {args.spool} in {time.perf_counter() - started:.1f} s")
    return 0


def _delay(args: argparse.Namespace) -> int:
    from irismesh.spark_telemetry.session import make_session
    from irismesh.spark_telemetry.streaming import measure_landing_delay

    spark = make_session(args.master)
    try:
        delays = measure_landing_delay(
            spark,
            files=args.files,
            records_per_file=args.records,
            progress=lambda i, d: print(f"file {i}: {d:.3f} s", flush=True),
        )
    finally:
        spark.stop()
    print(f"median {statistics.median(delays):.3f} s, max {max(delays):.3f} s")
    return 0


if __name__ == "__main__":
    from irismesh._exit import end_process

    end_process(main())
