"""The report: one self-contained HTML page with inline SVG charts, summary.json that
round-trips the job results, Parquet tables, a terminal summary; bad input; and the command
line's cheap paths (no Spark needed)."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark", reason="PySpark not installed: pip install -e '.[spark]'")

import pandas as pd
from rich.console import Console

from irismesh.spark_telemetry import cli
from irismesh.spark_telemetry.jobs import JOBS
from irismesh.spark_telemetry.report import (
    JobResults,
    print_summary,
    run_jobs,
    table_rows,
    write_report,
)
from irismesh.spark_telemetry.synthetic import generate, write_spool

from telemetry_data import NODE_A  # isort: skip  # tests/spark, put on sys.path by conftest

SCIENTIFIC = re.compile(r"\d\.?\d*e[+-]\d+", re.IGNORECASE)


def visible_text(page: str) -> str:
    """What a reader sees: tags, styles and SVG path data removed."""
    page = re.sub(
        r"<style.*?</style>|<defs>.*?</defs>|<metadata>.*?</metadata>", "", page, flags=re.S
    )
    return re.sub(r"<[^>]+>", " ", page)


def test_the_report_page_charts_and_summary(results: Any, tmp_path: Path) -> None:
    results.meta["spool"] = "<test & data>"
    page = write_report(results, tmp_path)
    html = page.read_text()
    assert list(tmp_path.glob("*.png")) == []  # one file: the charts are inline
    assert not re.search(r"""(src|href)=["']?(https?:|//|[\w./-]+\.(png|svg|js|css))""", html)
    for chart in ("throughput", "latency-request", "latency-serve", "latency-deliver", "load"):
        assert f"data-chart='{chart}'" in html
    assert html.count("<svg") >= 5
    assert "&lt;test &amp; data&gt;" in html  # escaped, not injected
    text = visible_text(html)
    assert not SCIENTIFIC.search(text), SCIENTIFIC.search(text)
    for figure in ("Verdicts:", "lost members", "healthy", "idle", "2023-11-14T", " ms", "KiB"):
        assert figure in text, figure
    assert "none (a pure client)" in text  # a leave by a node that serves no cluster
    assert "slow_consumer" in text  # drops by reason
    assert "queue_full" in text
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["tables"]) == set(JOBS)
    for name, frame in results.tables.items():
        assert summary["tables"][name] == json.loads(json.dumps(table_rows(frame)))
        assert len(pd.read_parquet(tmp_path / "tables" / f"{name}.parquet")) == len(frame)

    console = Console(record=True, width=140, file=io.StringIO())
    print_summary(results, console)
    text = console.export_text()
    for cluster in ("db", "cache", "fair", "solo", "quiet", "void"):
        assert cluster in text
    assert "Top talkers" in text


def test_the_cli_knows_every_job() -> None:
    assert tuple(JOBS) == cli.JOB_NAMES


def test_bad_arguments_are_refused_before_spark_starts(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = cli.main(["report", "--parquet", str(tmp_path), "--out", "y", "--jobs", "fair,nope"])
    assert code == 2
    assert "nope" in capsys.readouterr().err
    code = cli.main(["report", "--parquet", str(tmp_path / "missing"), "--out", "y"])
    assert code == 2
    assert "no compacted dataset" in capsys.readouterr().err
    code = cli.main(["report", "--spool", str(tmp_path / "missing"), "--out", "y"])
    assert code == 2
    assert capsys.readouterr().err.count("\n") == 1  # one line
    with pytest.raises(SystemExit):
        cli.main(["report", "--parquet", str(tmp_path), "--out", "y", "--bucket", "soon"])
    assert "bad bucket 'soon'" in capsys.readouterr().err


def test_without_the_spark_extra_the_report_says_what_to_install(tmp_path: Path) -> None:
    blocked = (
        "import sys; sys.modules['pyarrow'] = sys.modules['pyspark'] = None; "
        "from irismesh.spark_telemetry.cli import main; "
        f"sys.exit(main(['report', '--spool', {str(tmp_path)!r}, '--out', {str(tmp_path)!r}]))"
    )
    run = subprocess.run(
        [sys.executable, "-c", blocked], capture_output=True, text=True, timeout=60, check=False
    )
    assert run.returncode == 2
    assert run.stderr == (
        "spark_telemetry report: pyspark and pyarrow not installed: pip install 'irismesh[spark]'\n"
    )


def _report_of(spark: Any, records: list[Any], tmp_path: Path, garbage: bytes = b"") -> Any:
    """A spool of `records` (and a garbage file) through compaction to a written report."""
    from irismesh.spark_telemetry.compact import compact, read_compacted

    spool = tmp_path / "spool"
    write_spool(spool, iter([records]))
    if garbage:
        (spool / f"{'ab' * 16}-000001.msgpack").write_bytes(garbage)
    result = compact(spool, tmp_path / "parquet", done="keep")
    results = run_jobs(read_compacted(spark, tmp_path / "parquet"))
    results.meta["corrupt_records"] = result.corrupt
    return results, write_report(results, tmp_path / "report").read_text()


def test_an_empty_spool_gives_a_page_that_says_so(spark: Any, tmp_path: Path) -> None:
    results, html = _report_of(spark, [], tmp_path)
    assert "No records: the spool or dataset held nothing to report." in html
    assert "<svg" not in html  # no empty charts
    assert "No calls were recorded, so none failed." in html
    print_summary(results, Console(file=io.StringIO()))


def test_one_record_and_a_corrupt_file(spark: Any, tmp_path: Path) -> None:
    from irismesh.telemetry.schema import Record

    one = Record(1_700_000_000.5, "aa" * 16, "request", "reqrep", "db", "bb" * 16, 250, 10, "ok")
    results, html = _report_of(spark, [one], tmp_path, garbage=b"\x93not msgpack at all")
    assert results.meta["bucket_seconds"] == 1
    corrupt = results.meta["corrupt_records"]
    assert corrupt > 0
    assert f"{corrupt:,} corrupt records in the spool were skipped" in html
    assert "data-chart='throughput'" in html
    assert "250 us" in html
    assert "<span title='" + "bb" * 16 + "'>bbbbbbbb</span>" in html  # short id, full on hover


def test_compact_from_the_command_line(tmp_path: Path) -> None:
    spool, out = tmp_path / "spool", tmp_path / "out"
    written = write_spool(spool, generate(200, seed=3))
    run = subprocess.run(
        [sys.executable, "-m", "irismesh.spark_telemetry", "compact", "--spool", str(spool),
         "--out", str(out), "--delete"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"{written:,} records (0 corrupt)" in run.stdout
    assert list(spool.iterdir()) == []
    assert list(out.glob("date=*/hour=*/*.parquet"))


def test_cluster_summary_shows_the_busiest_call_kind() -> None:
    """Two broadcasts must not stand for a cluster that served thousands of requests."""
    from irismesh.spark_telemetry.health import Thresholds
    from irismesh.spark_telemetry.report import _cluster_table

    tables = {
        "errors": pd.DataFrame(
            [
                {
                    "cluster": "work",
                    "calls": 3202,
                    "failed": 0,
                    "error_rate": 0.0,
                    "timeout_rate": 0.0,
                }
            ]
        ),
        "latency": pd.DataFrame(
            [
                {"cluster": "work", "kind": "broadcast", "events": 2, "p50_us": 800, "p99_us": 900},
                {
                    "cluster": "work",
                    "kind": "request",
                    "events": 3200,
                    "p50_us": 250,
                    "p99_us": 4000,
                },
                {"cluster": "work", "kind": "serve", "events": 3200, "p50_us": 50, "p99_us": 90},
            ]
        ),
    }
    table = _cluster_table(tables, Thresholds())
    cells = [list(column.cells) for column in table.columns]
    row = [column[0] for column in cells]
    assert (row[3], row[4]) == ("250 us", "4.00 ms")
    assert row[6] == "healthy"


def test_node_names_replace_ids_when_records_carry_them(results: Any, tmp_path: Path) -> None:
    named = JobResults(
        tables=results.tables, seconds={}, meta=dict(results.meta), names={NODE_A: "db-1"}
    )
    html = write_report(named, tmp_path).read_text()
    assert f"<span title='{NODE_A}'>db-1</span>" in html


def test_a_kind_whose_every_latency_is_zero_is_not_measured(tmp_path: Path) -> None:
    """Publish records carry 0 us (nothing is timed): no chart of zeros, no 0 us p99."""
    start = pd.Timestamp("2026-11-25 12:00:00")
    times = [start + pd.Timedelta(seconds=s) for s in range(3)]
    zero = {"samples": 1, "events": 1, "p50_us": 0, "p99_us": 0}
    latency_time = pd.DataFrame(
        [{"cluster": "orders", "kind": "publish", "time": t, **zero} for t in times]
        + [{"cluster": "work", "kind": "request", "time": t, **zero, "p99_us": 900} for t in times]
    )
    latency = pd.DataFrame(
        [
            {"cluster": "orders", "pattern": "pubsub", "kind": "publish", "samples": 3,
             "events": 3, "mean_us": 0.0, "p50_us": 0, "p95_us": 0, "p99_us": 0, "max_us": 0},
            {"cluster": "work", "pattern": "reqrep", "kind": "request", "samples": 3,
             "events": 3, "mean_us": 600.0, "p50_us": 0, "p95_us": 900, "p99_us": 900,
             "max_us": 900},
        ]
    )  # fmt: skip
    meta = {"first_ts": start.timestamp(), "last_ts": start.timestamp() + 2, "bucket_seconds": 1}
    results = JobResults(
        tables={"latency": latency, "latency_time": latency_time}, seconds={}, meta=meta
    )
    html = write_report(results, tmp_path).read_text()
    assert "data-chart='latency-request'" in html
    assert "data-chart='latency-publish'" not in html
    assert "No latency measured for publish" in html
    row = html[html.index("<td class='text'>orders</td>") :].split("</tr>")[0]
    assert "0 us" not in row
