"""The report: HTML with PNG charts, summary.json that round-trips the job results, a terminal
summary; and the command line's cheap paths (no Spark needed)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark", reason="PySpark not installed: pip install -e '.[spark]'")

from rich.console import Console

from irismesh.spark_telemetry import cli
from irismesh.spark_telemetry.jobs import JOBS
from irismesh.spark_telemetry.report import print_summary, table_rows, write_report
from irismesh.spark_telemetry.synthetic import generate, write_spool

PNG = b"\x89PNG\r\n\x1a\n"


def test_the_report_page_charts_and_summary(results: Any, tmp_path: Path) -> None:
    results.meta["spool"] = "<test & data>"
    page = write_report(results, tmp_path)
    html = page.read_text()
    for chart in ("throughput", "latency", "errors", "fairness", "churn"):
        png = tmp_path / f"{chart}.png"
        assert png.read_bytes().startswith(PNG)
        assert f"src='{chart}.png'" in html
    assert "&lt;test &amp; data&gt;" in html  # escaped, not injected
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["tables"]) == set(JOBS)
    for name, frame in results.tables.items():
        assert summary["tables"][name] == json.loads(json.dumps(table_rows(frame)))

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
    assert "nope" in capsys.readouterr().out
    code = cli.main(["report", "--parquet", str(tmp_path / "missing"), "--out", "y"])
    assert code == 2
    assert "no compacted dataset" in capsys.readouterr().out


def test_compact_from_the_command_line(tmp_path: Path) -> None:
    spool, out = tmp_path / "spool", tmp_path / "out"
    written = write_spool(spool, generate(200, seed=3))
    run = subprocess.run(
        [sys.executable, "-m", "irismesh.spark_telemetry", "compact", "--spool", str(spool),
         "--out", str(out), "--delete"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert f"{written:,} records (0 corrupt)" in run.stdout
    assert list(spool.iterdir()) == []
    assert list(out.glob("date=*/hour=*/*.parquet"))


def test_cluster_summary_shows_the_busiest_call_kind() -> None:
    """Two broadcasts must not stand for a cluster that served thousands of requests."""
    import pandas as pd

    from irismesh.spark_telemetry.report import _cluster_table

    tables = {
        "errors": pd.DataFrame(
            [{"cluster": "work", "calls": 3202, "error_rate": 0.0, "timeout_rate": 0.0}]
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
    table = _cluster_table(tables)
    cells = [list(column.cells) for column in table.columns]
    row = [column[0] for column in cells]
    assert "250" in row[4].replace(",", "")
    assert "4000" in row[5].replace(",", "")
