"""Every example runs as its README says (one command) and prints what it promises.

(examples/failover.py is run by tests/e2e/test_failover.py.)
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from helpers import run_example


def test_kv_cluster_reads_back_every_key_from_any_replica() -> None:
    report = json.loads(run_example("kv_cluster.py", "--json", "--keys", "30").stdout)
    assert report["keys"] == 30
    assert report["wrong"] == 0
    served = report["gets_served_by"]
    assert sum(served.values()) == 30
    assert set(served) <= {"r1", "r2", "r3"}
    assert report["missing_key"] == "KeyError: 'missing'"


def test_kv_cluster_human_output() -> None:
    out = run_example("kv_cluster.py", "--keys", "5").stdout
    assert out.startswith("3 replicas up; setting 5 keys\n")
    assert "read 5 keys back, 0 wrong" in out
    assert "GET of a missing key raised RemoteError (KeyError: 'missing')" in out


def test_join_leave_watcher_sees_every_change() -> None:
    result = run_example("join_leave.py")
    lines = result.stdout.splitlines()
    changes = [re.sub(r"^\[\s*[\d.]+ s\] ", "", line).split()[:3] for line in lines[:8]]
    assert changes == [
        ["+", "n1", "joined"],
        ["+", "n2", "joined"],
        ["+", "n3", "joined"],
        ["n2", "gets", "SIGTERM"],
        ["-", "n2", "left"],
        ["n3", "gets", "SIGKILL"],
        ["-", "n3", "left"],
        ["+", "n4", "joined"],
    ], result.stdout
    assert lines[7].endswith("members: n1, n4")
    assert lines[-1] == "members now: n1, n4"
    clean = float(re.search(r"clean close was seen after ([\d.]+) ms", result.stdout)[1])  # type: ignore[index]
    killed = float(re.search(r"SIGKILL was noticed after ([\d.]+) ms", result.stdout)[1])  # type: ignore[index]
    assert clean < 500, "a clean close is seen at once (the member says goodbye)"
    # A SIGKILLed member's connections close (milliseconds); silence would take about 1 s.
    assert killed < 3000, "a SIGKILLed member is noticed within the heartbeat timeout"


@pytest.mark.slow
def test_a_gigabyte_goes_through_a_tunnel_intact_with_flat_memory() -> None:
    report = json.loads(run_example("tunnel_file.py", "--size", "1G", "--json", timeout=240).stdout)
    assert report["bytes"] == 1 << 30
    assert report["verified"] is True
    # Flat: a gigabyte passed, and neither side held more than a few windows of it.
    assert report["sender_peak_rss_mb"] < 150, report
    assert report["member_peak_rss_mb"] < 150, report
    print(
        f"\ntunnel: 1 GiB at {report['mb_per_s']} MB/s, peak RSS sender "
        f"{report['sender_peak_rss_mb']} MB, member {report['member_peak_rss_mb']} MB"
    )


def test_a_file_through_a_tunnel_is_verified(tmp_path: Path) -> None:
    source = tmp_path / "data.bin"
    source.write_bytes(os.urandom(3 << 20) + b"tail")
    out = run_example("tunnel_file.py", "--file", str(source)).stdout
    assert "SHA-256 verified" in out


def test_a_killed_member_resets_the_tunnel_promptly() -> None:
    out = run_example("tunnel_file.py", "--size", "1G", "--kill-after", "20M", "--json").stdout
    report = json.loads(out.splitlines()[-1])
    assert report["killed_member"] is True
    assert report["reset_after_s"] < 2.0


@pytest.mark.slow
def test_the_demo_runs_every_pattern_and_its_report_agrees(tmp_path: Path) -> None:
    out = run_example("demo.py", "--out", str(tmp_path / "run"), timeout=600).stdout
    assert "0 failed" in out
    assert "1000 received, 0 out of order" in out
    assert "SHA-256 verified" in out
    assert "report agrees with the client's counters" in out
    assert re.search(r"tunnel to worker w[12] in", out)  # the worker by its name
    report = tmp_path / "run" / "report"
    # Every node by its name; w3's may come from its peers' records only (it is SIGKILLed,
    # usually before its first spool flush).
    summary = json.loads((report / "summary.json").read_text())
    assert sorted(summary["names"].values()) == ["client", "w1", "w2", "w3"]
    page = (report / "index.html").read_text()
    assert "deaths<b>1: w3</b>" in page
    shown = re.findall(r"<span title='([0-9a-f]{32})'>([^<]*)</span>", page)
    assert shown
    assert {label for _, label in shown} <= {"client", "w1", "w2", "w3"}


def test_news_feed_reader_gets_every_story_current_without_gap_or_repeat() -> None:
    report = json.loads(run_example("news_feed.py", "--json", "--stories", "30").stdout)
    assert report["ok"], report
    assert report["missing_stories"] == 0
    assert report["reread"] >= 30  # each story's latest version came from the memory first


def test_job_queue_loses_no_job_across_kills_of_its_dispatcher_and_of_every_worker() -> None:
    # The example gives up on its own before the test would end it: a failure then shows its
    # report (the jobs it lost) and its progress lines, not only a timeout.
    out = run_example("job_queue.py", "--json", "--jobs", "1000", "--seconds", "40", timeout=110)
    report = json.loads(out.stdout)
    assert report["ok"], report
    assert report["handled"] == 1000
    assert report["lost"] == []
    # Only jobs in hand when a process died run twice: at most what the dispatcher hands out
    # at once (64), for each of the three SIGKILLs.
    assert report["ran_twice"] <= 3 * 64, report


def test_federation_crosses_two_meshes_and_hides_what_is_not_exported() -> None:
    out = run_example("federation.py").stdout
    assert "west asked east's db: 'east has k1'" in out
    assert "through a tunnel to east's db and back: in order, intact" in out
    assert "west read east's prices in order: 1.08 1.09 1.07" in out
    assert "payroll is not exported: west cannot reach it (NoResponders)" in out


def test_priorities_urgent_work_overtakes_background_work_and_none_is_lost() -> None:
    report = json.loads(run_example("priorities.py", "--json", "--background", "300").stdout)
    assert report["ok"], report
    assert report["background"] == 300
    assert report["member_admitted_high"] == 20
    assert report["urgent_max_ms"] < report["background_median_ms"], report
