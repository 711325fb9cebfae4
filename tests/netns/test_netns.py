"""Multi-host behaviour in network namespaces: discovery, crashes, stalls, loss, partitions.

Each test builds its own lab (netlab.py): six namespaces on a bridge that lives in a seventh,
a pure client `c` and five members `n1`..`n5` of the cluster "work", each node a process of
meshnode.py bound to its namespace's address. The client sends requests from its own
namespace while faults are injected; every request must get its own reply. Figures go through
the `report` fixture (printed, and listed in the terminal summary).

Needs root and `ip netns` (skipped otherwise); the loss test needs `nft` or `iptables` and the
partition test `nft` (Debian packages nftables and iptables), else they skip saying so.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable
from typing import Any

import pytest
from netlab import Lab, LabError, MeshProcess

pytestmark = pytest.mark.netns

MEMBERS = ("n1", "n2", "n3", "n4", "n5")
EVERYONE = ("c", *MEMBERS)
Report = Callable[[str], None]

# The load every fault is injected under: 16 requests in flight from the client, members take
# 10 ms per request (so a few are always in flight on each), each request may take 5 s.
LOAD = {"workers": 16, "pause": 0.005, "timeout": 5.0}
HANDLER_DELAY = 0.010


def full_mesh(names: Iterable[str] = EVERYONE) -> dict[str, tuple[list[str], list[str]]]:
    """Every node sees every member but itself (the client is a member of nothing)."""
    return {n: ([m for m in MEMBERS if m != n], []) for n in names}


def start_mesh(lab: Lab, discovery: str = "survey") -> float:
    """Start the client and the five members; return seconds until every node saw them all."""
    started = time.monotonic()
    lab.start(EVERYONE, discovery=discovery, clients=["c"], delay=HANDLER_DELAY)
    at = lab.wait_all(full_mesh(), timeout=15)
    return max(at.values()) - started


def wait_progress(
    node: MeshProcess, what: str, predicate: Callable[[dict[str, Any]], bool], timeout: float
) -> dict[str, Any]:
    """Poll the node's load progress every 20 ms until `predicate` holds, or fail."""
    deadline = time.monotonic() + timeout
    while True:
        progress = node.call("load_progress")
        if predicate(progress):
            return progress
        if time.monotonic() > deadline:
            pytest.fail(f"{node.name}: timed out after {timeout} s waiting for {what}: {progress}")
        time.sleep(0.02)


def load_served_by(lab: Lab, victim: str, count: int) -> tuple[MeshProcess, MeshProcess]:
    """Start the mesh and the client's load; wait until `victim` has served `count` of its
    requests. Returns (the client, the victim)."""
    start_mesh(lab)
    client = lab.nodes["c"]
    client.call("load_start", **LOAD)
    what = f"{victim} to serve {count} requests"
    wait_progress(client, what, lambda p: served(p, victim) >= count, 10)
    return client, lab.nodes[victim]


def report_load(report: Report, result: dict[str, Any]) -> None:
    report("load: " + load_line(result))
    report(f"requests lost: {result['failed'] + result['wrong']} (target 0)")


def served(progress: dict[str, Any], name: str) -> int:
    return int(progress["served_by"].get(name, 0))


def peers_down(stats: dict[str, Any]) -> dict[str, int]:
    return {k: int(v) for k, v in stats.items() if k.startswith("peers_down") and v}


def all_stats(lab: Lab) -> dict[str, dict[str, Any]]:
    return {
        name: node.call("stats") for name, node in lab.nodes.items() if node.proc.poll() is None
    }


def load_line(result: dict[str, Any]) -> str:
    return (
        f"{result['sent']} requests ({result['rps']:.0f}/s), {result['replied']} ok, "
        f"{result['failed']} failed, {result['wrong']} wrong, {result['late']} past deadline; "
        f"latency p50 {result['p50_ms']:.1f} ms, p99 {result['p99_ms']:.1f} ms, "
        f"max {result['max_elapsed'] * 1000:.0f} ms; "
        f"served by {dict(sorted(result['served_by'].items()))}"
    )


def assert_no_loss(result: dict[str, Any]) -> None:
    assert result["hung_workers"] == 0, result
    assert result["failed"] == 0, result["failures"]
    assert result["wrong"] == 0, result["wrong_replies"]
    assert result["replied"] == result["sent"], result
    assert result["late"] == 0, result


# ------------------------------------------------------------------------------- 1 discovery


@pytest.mark.timeout(45)
@pytest.mark.parametrize("discovery", ["mdns", "survey"])
def test_discovery_alone_finds_every_node(lab: Lab, discovery: str, report: Report) -> None:
    """No seeds, one discovery mechanism: every node ends up seeing every member."""
    spawned = time.monotonic()
    nodes = lab.start(EVERYONE, discovery=discovery, clients=["c"])
    last_ready = max(float(node.info["ready"]) for node in nodes.values())
    at = lab.wait_all(full_mesh(), timeout=15)
    full = max(at.values())
    report(
        f"{discovery} alone, {len(EVERYONE)} nodes in {len(EVERYONE)} namespaces: every node "
        f"sees every member {full - spawned:.2f} s after the processes were spawned, "
        f"{max(0.0, full - last_ready):.2f} s after the last node was ready "
        f"(per node, s after spawn: "
        + ", ".join(f"{n} {at[n] - spawned:.2f}" for n in EVERYONE)
        + ")"
    )
    stats = all_stats(lab)
    assert all(not peers_down(s["stats"]) for s in stats.values()), stats
    assert full - last_ready < 10.0


# ------------------------------------------------------------------------------- 2 SIGKILL


@pytest.mark.timeout(45)
def test_sigkill_under_load_loses_no_request(lab: Lab, report: Report) -> None:
    client, victim = load_served_by(lab, "n5", 100)
    # Killed with requests on it: three, so that they cannot all be answered in the moment
    # between this look and the kill.
    on_victim = wait_progress(
        client,
        "three requests in flight on n5",
        lambda p: p["outstanding"].get(victim.node_id, 0) >= 3,
        10,
    )
    in_flight = on_victim["outstanding"][victim.node_id]
    killed_at = time.monotonic()
    victim.signal(signal.SIGKILL)
    gone = lab.wait_all({n: ([], ["n5"]) for n in ("c", "n1", "n2", "n3", "n4")}, timeout=5)
    after = client.call("load_progress")["replied"]
    wait_progress(
        client, "500 more replies after the kill", lambda p: p["replied"] >= after + 500, 10
    )
    result = client.call("load_stop", timeout=15)
    stats = client.call("stats")["stats"]
    detect = {n: (t - killed_at) * 1000 for n, t in gone.items()}
    report(
        f"SIGKILL of n5 with {in_flight} requests in flight on it: dropped from the client's "
        f"routing after {detect['c']:.0f} ms (members: "
        + ", ".join(f"{n} {detect[n]:.0f} ms" for n in ("n1", "n2", "n3", "n4"))
        + f"), by {peers_down(stats)}; {stats.get('requests_resent', 0)} requests resent"
    )
    report_load(report, result)
    assert_no_loss(result)
    assert stats.get("requests_resent", 0) > 0, "nothing was in flight on n5 at the kill"
    assert detect["c"] < 2000, detect
    assert served(result, "n5") > 0


# ------------------------------------------------------------------------------- 3 SIGSTOP


@pytest.mark.timeout(45)
def test_sigstop_for_300ms_is_not_a_death(lab: Lab, report: Report) -> None:
    client, victim = load_served_by(lab, "n3", 50)
    pauses = []
    for _ in range(3):
        before = served(client.call("load_progress"), "n3")
        stopped = time.monotonic()
        victim.signal(signal.SIGSTOP)
        time.sleep(0.3)  # the length of the fault itself
        victim.signal(signal.SIGCONT)
        pauses.append(time.monotonic() - stopped)

        def resumed(progress: dict[str, Any], before: int = before) -> bool:
            return served(progress, "n3") > before + 20  # what waited for it, and new ones

        wait_progress(client, "n3 to serve again", resumed, 8)
    result = client.call("load_stop", timeout=15)
    stats = all_stats(lab)
    downs = {n: peers_down(s["stats"]) for n, s in stats.items() if peers_down(s["stats"])}
    drops = {n: lab.names_of(i for _, i in s["drops"]) for n, s in stats.items() if s["drops"]}
    report(
        f"n3 stopped 3 times for {', '.join(f'{p * 1000:.0f}' for p in pauses)} ms under load: "
        f"peers declared down {downs or 'nowhere'}, member drops seen {drops or 'none'}, "
        f"loop stalls noticed by n3: {stats['n3']['stats'].get('loop_stalls', 0)}"
    )
    report_load(report, result)
    assert not downs, downs
    assert not drops, drops
    assert_no_loss(result)


# ------------------------------------------------------------------------------- 4 loss


LOSS_PERCENT = 10
# A longer window (IRISMESH_NETNS_LOSS_SECONDS=60) gives a rate of false deaths.
LOSS_SECONDS = float(os.environ.get("IRISMESH_NETNS_LOSS_SECONDS", "5"))


@pytest.mark.timeout(45 + LOSS_SECONDS)
@pytest.mark.parametrize("both_ways", [False, True], ids=["arriving", "both-ways"])
def test_ten_percent_loss_on_one_host_is_not_a_death(
    loss_tool: str, both_ways: bool, lab: Lab, report: Report
) -> None:
    """n3 loses 10% of the packets it receives (and of those it sends, both-ways) under load."""
    if both_ways and loss_tool != "nft":
        pytest.skip("dropping what a host sends needs `nft` (apt-get install -y nftables)")
    start_mesh(lab)
    client = lab.nodes["c"]
    retrans_before = {n: lab.tcp_retransmits(n) for n in EVERYONE}
    try:
        rule = lab.loss("n3", LOSS_PERCENT, loss_tool, both_ways=both_ways)
    except Exception as exc:  # the tool is there but this kernel refuses the rule
        pytest.skip(f"cannot install a loss rule with {loss_tool}: {exc}")
    client.call("load_start", **LOAD)
    began = time.monotonic()
    while time.monotonic() < began + LOSS_SECONDS:  # the measuring window itself
        assert client.proc.poll() is None, client.stderr_tail()
        time.sleep(0.1)
    result = client.call("load_stop", timeout=15)
    window = time.monotonic() - began
    stats = all_stats(lab)
    retrans = {n: lab.tcp_retransmits(n) - retrans_before[n] for n in EVERYONE}
    downs = {n: peers_down(s["stats"]) for n, s in stats.items() if peers_down(s["stats"])}
    drops = {
        n: [f"{lab.name_of(i)} at {t - began:.2f} s" for t, i in s["drops"]]
        for n, s in stats.items()
        if s["drops"]
    }
    way = "each way" if both_ways else "of arriving packets"
    report(
        f"{LOSS_PERCENT}% loss {way} on n3 ({rule}) for {window:.1f} s under load: "
        f"TCP segments retransmitted: n3 {retrans['n3']}, the others "
        f"{sum(v for n, v in retrans.items() if n != 'n3')}; peers declared down "
        f"{downs or 'nowhere'}; member drops {drops or 'none'}"
    )
    report_load(report, result)
    assert_no_loss(result)  # strict: resends must save every request, deaths or not
    if downs:
        # A known gap of the failure detector, measured here over 60 s windows: 1 false death
        # with 10% loss of arriving packets, 8 with 10% each way. Heartbeats share the TCP
        # stream, and a segment lost twice waits out the retransmission backoff (RTO 204, then
        # 408 ms, ...), past dead_after = 1.0 s. Requests are not lost: they are resent.
        pytest.xfail(f"10% loss made a live member look dead: {downs}, drops {drops}")


# ------------------------------------------------------------------------------- 5 partition


@pytest.mark.timeout(60)
def test_partition_and_heal(nft: str, lab: Lab, report: Report) -> None:
    """{c, n1, n2} | {n3, n4, n5}: each side serves itself; after the heal all meet again."""
    side_a, side_b = ("c", "n1", "n2"), ("n3", "n4", "n5")
    start_mesh(lab)
    client, far_client = lab.nodes["c"], lab.nodes["n5"]  # one caller on each side
    client.call("load_start", **LOAD)
    far_client.call("load_start", **LOAD)
    for caller in (client, far_client):
        wait_progress(caller, "200 replies", lambda p: p["replied"] >= 200, 10)
    split_at = time.monotonic()
    try:
        lab.partition(side_a, side_b)
    except LabError as exc:  # nft is there but this kernel has no bridge family
        pytest.skip(f"cannot partition the bridge with nft: {exc}")
    # Issued at the moment of the split, with a deadline shorter than failure detection:
    # those that went to the far side must fail at their deadline, not later.
    probes = {
        caller.name: caller.send("probe", count=20, timeout=0.3) for caller in (client, far_client)
    }
    expect: dict[str, tuple[list[str], list[str]]] = {}
    for side, other in ((side_a, side_b), (side_b, side_a)):
        for name in side:
            expect[name] = ([m for m in side if m != name and m in MEMBERS], list(other))
    split_seen = lab.wait_all(expect, timeout=10)
    probe_results = {
        name: lab.nodes[name].reply(ident, 5)["results"] for name, ident in probes.items()
    }
    at_split = {c.name: c.call("load_progress") for c in (client, far_client)}
    # Both sides keep serving with the members they reach.
    wait_progress(
        client, "side A serving", lambda p: p["replied"] >= at_split["c"]["replied"] + 300, 10
    )
    wait_progress(
        far_client, "side B serving", lambda p: p["replied"] >= at_split["n5"]["replied"] + 300, 10
    )
    during = {c.name: c.call("load_progress") for c in (client, far_client)}
    healed_at = time.monotonic()
    lab.heal()
    rejoined = lab.wait_all(full_mesh(), timeout=20)
    results = {c.name: c.call("load_stop", timeout=15) for c in (client, far_client)}

    detect = {n: (t - split_at) * 1000 for n, t in split_seen.items()}
    converge = max(rejoined.values()) - healed_at
    report(
        "partition {c,n1,n2} | {n3,n4,n5}: far members dropped after "
        + ", ".join(f"{n} {detect[n]:.0f} ms" for n in EVERYONE)
    )
    for name, outcomes in probe_results.items():
        ok = sum(1 for o in outcomes if o["outcome"] == "ok")
        timed_out = [o for o in outcomes if o["outcome"] != "ok"]
        longest = max(o["elapsed"] for o in outcomes) * 1000
        report(
            f"{name}: 20 requests with a 300 ms deadline issued at the split: {ok} answered, "
            f"{len(timed_out)} failed ({sorted({o['outcome'] for o in timed_out})}), "
            f"longest wait {longest:.0f} ms"
        )
    far = {"c": side_b, "n5": side_a}
    crossed = {}
    for name in ("c", "n5"):
        after = {m: served(during[name], m) - served(at_split[name], m) for m in MEMBERS}
        crossed[name] = {m: k for m, k in after.items() if m in far[name] and k}
        report(
            f"{name} during the split (after detection): replies by {after}; "
            f"load over the whole run: " + load_line(results[name])
        )
    report(f"membership converged {converge:.2f} s after the heal")
    report(
        "requests lost: "
        + ", ".join(f"{n} {r['failed'] + r['wrong']}" for n, r in results.items())
        + " (target 0)"
    )
    for name, outcomes in probe_results.items():
        for o in outcomes:
            assert o["elapsed"] < 0.3 + 0.1, f"{name}: a probe waited past its deadline: {o}"
            assert o["outcome"] in ("ok", "RequestTimeout"), (name, o)
    assert not crossed["c"], f"replies crossed the partition: {crossed}"
    assert not crossed["n5"], f"replies crossed the partition: {crossed}"
    for result in results.values():
        assert_no_loss(result)
    assert converge < 15, converge


# ------------------------------------------------------------------- 5b long partition, mDNS


LONG = os.environ.get("IRISMESH_NETNS_LONG") == "1"


@pytest.mark.timeout(150)
@pytest.mark.skipif(not LONG, reason="takes about 70 s: set IRISMESH_NETNS_LONG=1 to run it")
def test_long_partition_heals_with_mdns_alone(nft: str, lab: Lab, report: Report) -> None:
    """A 30 s split of a mesh that only has mDNS (no seeds, no survey), then the heal."""
    side_a, side_b = ("c", "n1", "n2"), ("n3", "n4", "n5")
    start_mesh(lab, discovery="mdns")
    split_at = time.monotonic()
    try:
        lab.partition(side_a, side_b)
    except LabError as exc:
        pytest.skip(f"cannot partition the bridge with nft: {exc}")
    expect: dict[str, tuple[list[str], list[str]]] = {}
    for side, other in ((side_a, side_b), (side_b, side_a)):
        for name in side:
            expect[name] = ([m for m in side if m != name and m in MEMBERS], list(other))
    lab.wait_all(expect, timeout=10)
    while time.monotonic() < split_at + 30:  # the length of the fault itself
        time.sleep(0.1)
    healed_at = time.monotonic()
    lab.heal()
    try:
        rejoined = lab.wait_all(full_mesh(), timeout=30)
    except LabError as exc:
        report(f"mdns alone, 30 s partition: NOT merged 30 s after the heal ({exc})")
        # Measured twice here (a 10 s split merges in about 4 s): the endpoints of the far
        # side are forgotten after forget_after_failures failed dials, and nothing
        # rediscovers them (survey re-asks every few seconds and merges in about 2 s).
        pytest.xfail(f"an mdns-only mesh stays split after a 30 s partition: {exc}")
    report(f"mdns alone, 30 s partition: merged {max(rejoined.values()) - healed_at:.2f} s after")
