"""`mesh telemetry report`: the Spark report over a telemetry spool directory.

A thin layer over `python -m irismesh.spark_telemetry report` (its `main` does the work): it
checks what a user can get wrong before Spark starts (the spool directory, the master URL,
PySpark and Java), so that those are one line and exit status 2 rather than a JVM's stack
trace. Spark is imported only when the report runs, so `mesh` itself starts as fast as ever.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from irismesh._cli.base import (
    CommandError,
    Commands,
    UsageError,
    add_command,
    add_directory,
    add_family,
    add_shared_options,
    positive_int,
    print_json,
)
from irismesh._cli.collect import register_collect

_HOST_PORT = r"[^\s:/,\[\]]+:\d{1,5}"
_MASTER = re.compile(rf"local(\[(\*|[1-9]\d*)(,[1-9]\d*)?\])?|spark://{_HOST_PORT}(,{_HOST_PORT})*")


def register(commands: Commands) -> None:
    family = add_family(
        commands,
        "telemetry",
        summary="analyse the telemetry that nodes spool to disk (needs PySpark and Java)",
        description=(
            "Nodes started with a telemetry spool directory (TelemetryConfig(spool_dir=...))\n"
            "write their request, serve and membership records there, and publish them on the\n"
            "reserved topic _mesh.telemetry.<node> for whoever listens. `mesh telemetry\n"
            "collect` writes the whole mesh's records into one spool directory on this machine;\n"
            "`mesh telemetry report` turns a spool directory into an HTML report with Spark."
        ),
        examples=(
            "  mesh telemetry collect --seed tcp://10.0.0.5:7400 --out spool --seconds 60\n"
            "  mesh telemetry report --spool /var/spool/irismesh --out report\n"
            "  mesh telemetry report --spool spool --out report --master spark://10.0.0.5:7077"
        ),
        dest="telemetry_command",
        metavar="COMMAND",
    )
    register_collect(family)
    report = add_command(
        family,
        "report",
        summary="run the Spark jobs over a spool directory and write an HTML report",
        description=(
            "Reads every complete spool file in --spool (the spool is left as it is: the\n"
            "report compacts a private copy to Parquet under OUT/parquet), runs the Spark jobs\n"
            "(totals, throughput, latency, errors, fairness, member load, churn, top talkers,\n"
            "gauges) and writes OUT/index.html with its charts and OUT/summary.json, then\n"
            "prints a summary. Spark starts in a few seconds, on this machine (--master\n"
            "local[*]) or on a standalone cluster (spark://HOST:PORT). Same as\n"
            "`python -m irismesh.spark_telemetry report`. --json prints, instead of the\n"
            "summary, an object: out, index_html, summary_json and meta (master, spool files,\n"
            "corrupt records). Exit status 2 if the spool directory, PySpark or Java is\n"
            "missing; 1 if Spark failed."
        ),
        examples=(
            "  mesh telemetry report --spool /var/spool/irismesh --out report\n"
            "  mesh telemetry report --spool spool --out report --master local[2] --top 5\n"
            "  mesh telemetry report --spool spool --out report --jobs totals,latency --json"
        ),
        run=run_report,
    )
    add_directory(report, "--spool", "spool directory (only read)")
    add_directory(report, "--out", "report directory (made if need be)")
    report.add_argument(
        "--master",
        default="local[*]",
        type=spark_master,
        metavar="URL",
        help="local[*], local[N] or spark://HOST:PORT (default: %(default)s)",
    )
    report.add_argument(
        "--top",
        type=positive_int,
        default=10,
        metavar="N",
        help="top talkers to list (default: %(default)s)",
    )
    report.add_argument(
        "--jobs",
        type=job_names,
        metavar="LIST",
        help="comma-separated subset of the jobs (default: all)",
    )
    report.add_argument(
        "--quick-jvm",
        action="store_true",
        help="JVM flags for a fast start on small data instead of throughput on large data",
    )
    add_shared_options(
        report, json="a JSON object naming the report's files, instead of the summary"
    )


def spark_master(text: str) -> str:
    if not _MASTER.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"bad Spark master {text!r}: expected local[*], local[N] or spark://HOST:PORT"
        )
    return text


def job_names(text: str) -> list[str]:
    from irismesh.spark_telemetry.cli import JOB_NAMES

    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in JOB_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown job(s) {', '.join(unknown) or repr(text)}: choose from {', '.join(JOB_NAMES)}"
        )
    return list(dict.fromkeys(names))


def run_report(args: argparse.Namespace) -> int:
    spool: Path = args.spool
    out: Path = args.out
    if not spool.is_dir():
        what = "is not a directory" if spool.exists() else "does not exist"
        raise UsageError(f"spool directory {spool} {what}")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} exists and is not a directory")
    require_spark()
    from irismesh.spark_telemetry.cli import main as spark_main
    from irismesh.spark_telemetry.cli import spark_failures

    argv = ["report", "--spool", str(spool), "--out", str(out), "--master", args.master]
    argv += ["--top", str(args.top)]
    if args.jobs:
        argv += ["--jobs", ",".join(args.jobs)]
    if args.quick_jvm:
        argv.append("--quick-jvm")
    if args.json:
        argv.append("--quiet")
    failures = spark_failures()
    try:
        status = spark_main(argv)
    except failures as exc:
        lines = str(exc).strip().splitlines()
        raise CommandError(f"Spark failed: {lines[0] if lines else type(exc).__name__}") from None
    except OSError as exc:
        message = f"cannot read the spool or write the report: {exc}"
        raise UsageError(message) from None
    if status != 0:  # arguments it refused: checked above, so not expected
        return status
    if args.json:
        out = out.resolve()
        summary = json.loads((out / "summary.json").read_text())
        print_json(
            {
                "out": str(out),
                "index_html": str(out / "index.html"),
                "summary_json": str(out / "summary.json"),
                "meta": summary.get("meta", {}),
            }
        )
    return 0


def require_spark() -> None:
    """PySpark (with pyarrow) importable and a Java to run it, or one line saying what to do."""
    from irismesh.spark_telemetry import cli as spark_cli

    try:
        spark_cli.require(("pyspark", "pyarrow"))
    except spark_cli.CommandFailed as exc:
        raise UsageError(str(exc)) from None
