"""The benchmarks as a user runs them, through their shared harness (bench/_harness.py).

A benchmark refuses irismesh's pure Python core, since a stale compiled build falls back to it
silently and its figures would mislead; `--allow-pure` measures it on purpose. And a benchmark's
JSON document, which other tools read (bench/builds_ab.py, bench/tracing_cost.py), keeps its
shape. Each run is a subprocess started from a scratch directory, without the IRISMESH_
variables of the test run, every process on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def run_bench(cwd: Path, script: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("IRISMESH_")}
    return subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=cwd,
        env={**clean, **env},
        check=False,
    )


def test_a_benchmark_refuses_the_pure_core(tmp_path: Path) -> None:
    done = run_bench(tmp_path, "fuzz.py", "-n", "10", IRISMESH_PURE="1")
    assert done.returncode == 2, done.stderr
    assert "irismesh runs its pure Python core (IRISMESH_PURE is set)" in done.stderr
    assert "--allow-pure" in done.stderr
    assert "cases/s" not in done.stdout  # it measured nothing


def test_allow_pure_measures_the_pure_core(tmp_path: Path) -> None:
    done = run_bench(tmp_path, "fuzz.py", "-n", "200", "--allow-pure", IRISMESH_PURE="1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("200 cases in ")


def test_tunnel_checks_every_byte_and_writes_its_document(tmp_path: Path) -> None:
    out = tmp_path / "tunnel.json"
    argv = ["--size", "1M", "--blocks", "64K", "--only", "raw,mesh", "--json", str(out)]
    done = run_bench(tmp_path, "tunnel.py", *argv, "--allow-pure")
    assert done.returncode == 0, done.stderr
    document = json.loads(out.read_text())
    assert list(document) == [
        *("facts", "settings", "results", "ratios", "skipped", "failed", "failures"),
        "elapsed_s",
    ]
    assert document["settings"]["systems"] == ["raw", "mesh"]
    assert document["failed"] == {}
    assert document["skipped"] == {}
    for system in ("raw", "mesh"):
        case = document["results"][system][str(64 << 10)]
        assert case["verified"], case["problems"]
        assert (case["bytes"], case["blocks"]) == (1 << 20, 16)
        assert case["receiver"]["checksum"] == case["sender"]["expected"]
        # The harness sampled both children over the stream: RSS and CPU from start to end.
        assert set(case["memory"]) == {"sender", "receiver"}
        assert case["memory"]["receiver"]["samples"] >= 2
        assert case["memory"]["receiver"]["peak_mb"] > 0
    assert set(document["ratios"]) == {"mesh/raw"}
