"""`mesh telemetry report` as a user runs it: the mistakes it refuses before Spark starts (one
line, exit status 2) and, marked slow, one real report over a synthetic spool directory."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import MESH, assert_usage_errors, run_all

from irismesh import cli


def test_telemetry_report_explains_itself(capsys: pytest.CaptureFixture[str]) -> None:
    top = subprocess.run([*MESH, "--help"], capture_output=True, text=True, check=True)
    assert "\n    telemetry" in top.stdout
    assert "mesh telemetry report --spool DIR --out DIR" in top.stdout
    for argv in (["telemetry", "--help"], ["telemetry", "report", "--help"]):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        assert exit_.value.code == 0
        text = capsys.readouterr().out
        assert "mesh telemetry report --spool" in text.partition("examples:")[2], argv
    with pytest.raises(SystemExit):
        cli.main(["telemetry", "report", "--help"])
    text = capsys.readouterr().out
    for option in ("--spool DIR", "--out DIR", "--master URL", "--json"):
        assert option in text


def test_telemetry_report_refuses_a_missing_spool_or_java_in_one_line(tmp_path: Path) -> None:
    spool, out = tmp_path / "spool", tmp_path / "report"
    spool.mkdir()
    report = ["telemetry", "report", "--spool", str(spool), "--out", str(out)]
    missing = ["telemetry", "report", "--spool", str(tmp_path / "none"), "--out", str(out)]
    # No Java: nothing on PATH (the interpreter is named by its full path) and no JAVA_HOME.
    no_java = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"} | {"PATH": str(tmp_path)}
    if importlib.util.find_spec("pyspark") is None:  # PySpark is the first thing it looks for
        java_case = (report, 2, "not installed: pip install 'irismesh[spark]'")
    else:
        java_case = (report, 2, "Java not found on PATH")
    run_all([(missing, 2, f"spool directory {tmp_path / 'none'} does not exist")], dict(os.environ))
    run_all([java_case], no_java)
    assert not out.exists()  # refused before anything was written


def test_more_telemetry_report_mistakes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same error boundary in-process (`cli.main`), to spare an interpreter per case."""
    spool = tmp_path / "spool"
    spool.mkdir()
    a_file = tmp_path / "file"
    a_file.write_text("not a directory")
    out = str(tmp_path / "report")
    report = ["telemetry", "report"]
    ok = [*report, "--spool", str(spool), "--out", out]  # right so far
    monkeypatch.setenv("JAVA_HOME", str(tmp_path))
    cases: list[tuple[list[str], str]] = [
        (["telemetry"], "required: COMMAND"),
        (["telemetry", "collect"], "the following arguments are required: --out"),
        ([*report, "--spool", str(a_file), "--out", out], "is not a directory"),
        ([*report, "--spool", str(spool), "--out", str(a_file)], "is not a directory"),
        ([*report, "--spool", str(spool)], "required: --out"),
        ([*ok, "--master", "yarn"], "bad Spark master 'yarn'"),
        ([*ok, "--master", "spark://host"], "bad Spark master"),
        ([*ok, "--jobs", "totals,nope"], "unknown job(s) nope"),
        ([*ok, "--top", "0"], "--top: must be at least 1"),
    ]
    if importlib.util.find_spec("pyspark") is not None:
        cases.append((ok, f"JAVA_HOME={tmp_path} has no bin/java"))
    assert_usage_errors(cases, capsys)
    assert not Path(out).exists()


@pytest.mark.slow
def test_telemetry_report_writes_the_report(tmp_path: Path) -> None:
    """One real run, on one job: Spark takes seconds to start, the jobs more."""
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("Java not found on PATH: Spark needs a JRE 17 (apt-get install openjdk-17-jre)")
    pytest.importorskip("pyspark", reason="PySpark not installed: pip install -e '.[spark]'")
    spool, out = tmp_path / "spool", tmp_path / "report"
    synth = [sys.executable, "-m", "irismesh.spark_telemetry", "synth", "--spool", str(spool)]
    subprocess.run([*synth, "--calls", "300"], check=True, capture_output=True, timeout=60)
    before = sorted(p.name for p in spool.iterdir())
    result = subprocess.run(
        [*MESH, "telemetry", "report", "--spool", str(spool), "--out", str(out), "--master",
         "local[1]", "--jobs", "totals", "--quick-jvm", "--json"],
        capture_output=True, text=True, timeout=110, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    report = json.loads(result.stdout)
    assert report["out"] == str(out.resolve())
    assert report["meta"]["master"] == "local[1]"
    assert report["meta"]["spool_files"] == len(before) > 0
    assert Path(report["index_html"]).read_text().startswith("<!doctype html>")
    summary = json.loads(Path(report["summary_json"]).read_text())
    assert set(summary["tables"]) == {"totals"}
    assert sorted(p.name for p in spool.iterdir()) == before  # the spool is only read
