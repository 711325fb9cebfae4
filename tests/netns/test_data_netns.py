"""Replicated data across a partition: 20 nodes in 20 namespaces, split 10 | 10, each side
incrementing one counter and changing one set; within two seconds of the heal every node reads
the exact total and the set as its add-wins rule says.

Needs root, `ip netns` and `nft` (skipped otherwise), like the other namespace tests.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from netlab import Lab, LabError, built_lab, unavailable

pytestmark = pytest.mark.netns

NAMES = tuple(f"d{i}" for i in range(1, 21))
SIDE_A, SIDE_B = NAMES[:10], NAMES[10:]
KEYS = {"counter": "quota.split", "set": "sessions.split"}
INCREMENTS = 25  # per node: the total is 500
Report = Callable[[str], None]


@pytest.fixture
def big_lab(tmp_path: Path, keyfile: Path) -> Iterator[Lab]:
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    if shutil.which("nft") is None:
        pytest.skip("`nft` is not installed (Debian: apt-get install -y nftables)")
    with built_lab(NAMES, tmp_path, keyfile) as built:
        yield built


def everyone_sees(names: tuple[str, ...]) -> dict[str, tuple[list[str], list[str]]]:
    return {n: ([m for m in names if m != n], []) for n in names}


def split_seen() -> dict[str, tuple[list[str], list[str]]]:
    expect = {}
    for side, other in ((SIDE_A, SIDE_B), (SIDE_B, SIDE_A)):
        for name in side:
            expect[name] = ([m for m in side if m != name], list(other))
    return expect


@pytest.mark.timeout(240)
def test_a_partition_of_twenty_heals_to_the_exact_total(big_lab: Lab, report: Report) -> None:
    lab = big_lab
    lab.start(NAMES, discovery="survey", timeout=90)
    lab.wait_all(everyone_sees(NAMES), timeout=60)
    # Everyone holds both keys and knows the 19 other holders; "both" is in the set.
    asked = {n: lab.nodes[n].send("data", holders=19, **KEYS) for n in NAMES}
    for name, ident in asked.items():
        assert lab.nodes[name].reply(ident, 40)["ok"], name
    assert lab.nodes["d1"].call("data", add=["both"], **KEYS)["ok"]
    deadline = time.monotonic() + 10
    while not all(lab.nodes[n].call("data", **KEYS)["set"] == ["both"] for n in NAMES):
        assert time.monotonic() < deadline, "the first add did not reach every node"
        time.sleep(0.1)

    try:
        lab.partition(SIDE_A, SIDE_B)
    except LabError as exc:
        pytest.skip(f"cannot partition the bridge with nft: {exc}")
    lab.wait_all(split_seen(), timeout=30)
    # Each side: every node increments; side A removes "both" while side B adds it again.
    changes = {n: lab.nodes[n].send("data", increments=INCREMENTS, **KEYS) for n in NAMES}
    for name, ident in changes.items():
        assert lab.nodes[name].reply(ident, 20)["ok"], name
    assert lab.nodes["d1"].call("data", remove=["both"], add=["a-only"], **KEYS)["ok"]
    assert lab.nodes["d11"].call("data", add=["both", "b-only"], **KEYS)["ok"]
    deadline = time.monotonic() + 10
    while True:  # each side reaches its own half
        during = {n: lab.nodes[n].call("data", **KEYS) for n in ("d1", "d20")}
        if during["d1"]["counter"] == during["d20"]["counter"] == INCREMENTS * 10:
            break
        assert time.monotonic() < deadline, f"a side did not reach its half: {during}"
        time.sleep(0.1)

    healed_at = time.monotonic()
    lab.heal()
    total, expected_set = INCREMENTS * len(NAMES), ["a-only", "b-only", "both"]
    # Each node watches its own values and answers when it first read both (its own clock:
    # the namespaces share this machine's monotonic clock).
    asked = {
        n: lab.nodes[n].send(
            "data", until_counter=total, until_set=expected_set, timeout=20, **KEYS
        )
        for n in NAMES
    }
    reached: dict[str, float] = {}
    for name, ident in asked.items():
        answer = lab.nodes[name].reply(ident, 30)
        if answer.get("ok"):
            reached[name] = float(answer["at"])
    rejoined = lab.wait_all(everyone_sees(NAMES), timeout=60)
    whole_at = max(rejoined.values())
    missing = sorted(set(NAMES) - set(reached))
    report(
        f"data across a 10|10 partition: during it d1 read {during['d1']['counter']} and "
        f"d20 {during['d20']['counter']}; membership whole {whole_at - healed_at:.2f} s after "
        f"the heal; every node read {total} and {expected_set} "
        + (
            f"{max(reached.values()) - healed_at:.2f} s after the heal"
            if not missing
            else f"except {missing}"
        )
    )
    assert not missing, f"not converged: {missing}"
    assert max(reached.values()) - healed_at < 2.0
