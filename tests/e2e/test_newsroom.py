"""examples/newsroom.py: desks publish, wildcard readers get exactly what matches, in order."""

from __future__ import annotations

import json
import subprocess

from helpers import run_example

READERS = {
    "archive": "feeds.#",
    "sports-app": "feeds.sports.*",
    "corrections": "feeds.#.corrections",
    "front-page": "feeds.*.*",
}


def run_newsroom(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return run_example("newsroom.py", *args, timeout=timeout)


def test_every_reader_gets_exactly_what_matches_its_pattern() -> None:
    result = run_newsroom("--json", "--stories", "30", "--desks", "world,sports,business")
    report = json.loads(result.stdout)
    assert report["ok"] is True
    # 30 stories a desk and a correction after every 3rd story from the 4th on: 9 corrections.
    desks = {d["desk"]: d for d in report["desks"]}
    assert set(desks) == {"world", "sports", "business"}
    for desk in desks.values():
        assert (desk["stories"], desk["corrections"], desk["published"]) == (30, 9, 39)
        assert desk["wrong_reach"] == []
    # A story reaches the archive and the front page (and the sports app, for sports); a
    # correction the archive and the corrections monitor.
    assert desks["world"]["delivered"] == desks["business"]["delivered"] == 30 * 2 + 9 * 2
    assert desks["sports"]["delivered"] == 30 * 3 + 9 * 2
    readers = {r["reader"]: r for r in report["readers"]}
    assert {name: r["pattern"] for name, r in readers.items()} == READERS
    expected = {"archive": 3 * 39, "sports-app": 30, "corrections": 3 * 9, "front-page": 3 * 30}
    for name, reader in readers.items():
        assert reader["expected"] == reader["received"] == expected[name], reader
        for problem in ("missing", "extra", "out_of_order", "missed", "wrong_topic"):
            assert reader[problem] == 0, (name, problem)
        assert reader["ok"] is True
        assert reader["timed_out"] is False
        assert reader["publishers_per_desk"] == 1
    assert readers["sports-app"]["by_desk"] == {"sports": 30}
    assert readers["archive"]["by_desk"] == {"business": 39, "sports": 39, "world": 39}
    assert report["published"] == 3 * 39
    assert report["delivered"] == sum(expected.values())
    assert "4 readers subscribed" in result.stderr  # progress goes to stderr with --json


def test_human_report_shows_both_tables() -> None:
    out = run_newsroom("--stories", "4", "--desks", "sports").stdout
    for part in ("desks", "readers", "archive", "feeds.#.corrections", "front-page"):
        assert part in out
    assert out.count(" ok ") == 4, out  # every reader's status
    assert "every reader got exactly the messages matching its pattern" in out
