"""Outlier ejection between real nodes on 127.0.0.1: callers stop sending requests to a member
whose handler fails, take it back once it recovers, keep half of a failing cluster in rotation,
and never eject a member for shedding load."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

from helpers import RequestLoad, deadline, wait_until
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

import irismesh
from irismesh._cli.listing import peer_json, peers_table
from irismesh.node import TelemetryConfig
from irismesh.telemetry.prometheus import NodeCollector
from irismesh.telemetry.spool import SpoolReader

WORKERS = 8  # requests each caller keeps in flight


async def start_members(
    keys: irismesh.Keyring, count: int, handled: Counter[int], broken: set[int]
) -> list[irismesh.Node]:
    """`count` members of "db" that count the requests they run; those in `broken` raise."""
    members: list[irismesh.Node] = []
    for i in range(count):
        seeds = [members[0].endpoint] if members else []
        node = await irismesh.Node("db", keyring=keys, seeds=seeds, name=f"m{i}").start()

        def bind(i: int) -> Callable[[bytes], Awaitable[bytes]]:
            async def handle(payload: bytes) -> bytes:
                handled[i] += 1
                if i in broken:
                    raise RuntimeError("broken")
                return payload

            return handle

        node.on_request(bind(i))
        members.append(node)
    return members


def ejected(node: irismesh.Node) -> int:
    return node.stats.get("members_ejected_now", 0)


def metrics(node: irismesh.Node) -> dict[str, float]:
    """The node's Prometheus samples, by name and reason label."""
    registry = CollectorRegistry()
    registry.register(NodeCollector(node))
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            reason = sample.labels.get("reason")
            found[sample.name + (f"/{reason}" if reason else "")] = sample.value
    return found


@deadline(90)
async def test_a_failing_member_is_routed_around_within_a_second_and_readmitted_once_it_recovers(
    keys: irismesh.Keyring, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    handled: Counter[int] = Counter()
    broken: set[int] = set()
    members = await start_members(keys, 3, handled, broken)
    outliers = irismesh.OutlierConfig(base_ejection=2.0)
    config = irismesh.CoreConfig(outliers=outliers)
    telemetry = TelemetryConfig(spool_dir=spool, gauge_interval=0.5)
    callers = [
        await irismesh.Node(
            keyring=keys,
            seeds=[members[0].endpoint],
            config=config,
            telemetry=telemetry,
        ).start()
        for i in range(2)
    ]
    loads = []
    try:
        for caller in callers:
            assert await caller.wait_for_members("db", 3, timeout=10) == 3
        loads = [RequestLoad(c, "db", workers=WORKERS, timeout=2.0) for c in callers]
        await loads[0].wait_until(
            lambda: min(handled[i] for i in range(3)) > 50, 10, "every member serving"
        )

        broken.add(2)  # its handler raises from now on
        broke = time.monotonic()
        last = [handled[2], broke]  # m2's requests so far, and when the latest came

        def stopped() -> bool:
            if handled[2] != last[0]:
                last[:] = [handled[2], time.monotonic()]
            return time.monotonic() - last[1] >= 0.5 and any(ejected(c) for c in callers)

        await loads[0].wait_until(stopped, 10, "the callers to stop sending m2 requests")
        took = last[1] - broke
        assert took < 1.0, f"m2 still got requests {took:.2f} s after it broke"
        bad = members[2].node_id
        # Each caller judges for itself: one whose balancer had already given m2 little
        # (its estimate counts error replies' latency too) may have had no five in a row.
        ejecting = [c for c in callers if ejected(c)]
        for caller in ejecting:
            assert caller.stats["ejections_errors"] == 1
            [peer] = [p for p in caller.peers() if p.node_id == bad.hex()]
            assert peer.ejected == ("db",)
            assert all(p.ejected == () for p in caller.peers() if p.node_id != bad.hex())
            # `mesh peers` says so, in its table and its JSON.
            assert peer_json(peer, ["db"])["ejected"] == ["db"]
            console = Console(width=200, record=True)
            console.print(peers_table(caller.peers(), {}))
            assert "alive ejected from db" in console.export_text()
        found = metrics(ejecting[0])
        assert found["irismesh_members_ejected_now"] == 1
        assert found["irismesh_members_ejected_total"] == 1
        assert found["irismesh_ejections_total/errors"] == 1

        # The callers' records tell the mesh: any node with db's key (m0 here) reads who
        # keeps m2 out, and `mesh peers` shows "ejected by N callers (db)".
        def told() -> bool:
            return bool(members[0].ejected_by(["db"]).get(bad.hex(), {}).get("db"))

        await loads[0].wait_until(told, 10, "m2's ejection to reach the mesh")
        seen = members[0].ejected_by(["db", "elsewhere"])
        assert set(seen) == {bad.hex()}
        by = seen[bad.hex()]["db"]
        assert set(by) <= {c.node_id.hex() for c in callers}
        [peer] = [p for p in members[0].peers() if p.node_id == bad.hex()]
        assert peer_json(peer, ["db"], seen)["ejected_by"] == {"db": list(by)}
        console = Console(width=200, record=True)
        console.print(peers_table(members[0].peers(), {}, seen))
        noun = "caller" if len(by) == 1 else "callers"
        assert f"alive ejected by {len(by)} {noun} (db)" in console.export_text()

        # Out of rotation: the others take every request, m2 none (a readmission, should
        # the machine stall past the ejection, lets at most a few through until the next).
        await asyncio.sleep(0.2)  # requests sent before the ejection have arrived
        seen, failed = handled[2], sum(load.failures for load in loads)
        served = [load.served for load in loads]
        await loads[0].wait_until(
            lambda: all(load.served > n + 300 for load, n in zip(loads, served, strict=True)),
            10,
            "300 requests served at each caller",
        )
        readmitted = sum(c.stats.get("members_readmitted", 0) for c in callers)
        let_through = readmitted * 2 * WORKERS  # what is in flight as it comes back
        assert handled[2] - seen <= let_through, (handled[2] - seen, readmitted)
        assert sum(load.failures for load in loads) - failed <= let_through

        broken.discard(2)  # recovered
        recovered = time.monotonic()
        before = handled[2]
        await loads[0].wait_until(
            lambda: all(ejected(c) == 0 for c in callers) and handled[2] > before + 50,
            30,
            "m2 readmitted and serving again",
        )
        assert time.monotonic() - recovered < 30
        assert all(c.stats["members_readmitted"] >= 1 for c in ejecting)
        assert all(p.ejected == () for c in callers for p in c.peers())
    finally:
        for load in loads:
            await load.stop()
        await asyncio.gather(*(n.close() for n in (*callers, *members)))

    records = [r for r in SpoolReader(spool) if r.kind == "membership"]
    changes = [(r.name, r.cluster, r.peer) for r in records if r.cluster is not None]
    assert ("ejected", "db", bad.hex()) in changes
    assert ("readmitted", "db", bad.hex()) in changes


@deadline(90)
async def test_with_every_member_failing_the_cap_keeps_half_in_rotation(
    keys: irismesh.Keyring,
) -> None:
    handled: Counter[int] = Counter()
    members = await start_members(keys, 4, handled, broken={0, 1, 2, 3})
    config = irismesh.CoreConfig(outliers=irismesh.OutlierConfig(base_ejection=30.0))
    caller = await irismesh.Node(keyring=keys, seeds=[members[0].endpoint], config=config).start()
    load = None
    try:
        assert await caller.wait_for_members("db", 4, timeout=10) == 4
        load = RequestLoad(caller, "db", workers=WORKERS, stall=60.0)
        most = 0

        def two_out() -> bool:
            nonlocal most
            most = max(most, ejected(caller))
            return ejected(caller) == 2

        await wait_until(two_out, 5, "two of the four members ejected")
        out = {i for i, m in enumerate(members) if m.node_id.hex() in _ejected_ids(caller)}
        assert len(out) == 2
        await asyncio.sleep(0.2)  # requests sent before the ejections have arrived
        seen = dict(handled)
        failed = load.failures
        await wait_until(
            lambda: two_out() and load.failures > failed + 300, 10, "300 more requests"
        )
        assert most == 2  # never more than half of the cluster out
        for i in out:
            assert handled[i] == seen[i], f"m{i} is out of rotation"
        # The other two take every request (which of them, the balancer decides); those
        # in flight at the snapshot ran before it.
        assert sum(handled[i] - seen[i] for i in range(4) if i not in out) >= 300 - WORKERS
        assert caller.stats["ejection_cap_reached"] >= 1
    finally:
        if load is not None:
            await load.stop()
        await asyncio.gather(*(n.close() for n in (caller, *members)))


def _ejected_ids(node: irismesh.Node) -> set[str]:
    return {p.node_id for p in node.peers() if p.ejected}


@deadline(90)
async def test_members_shedding_load_are_not_ejected(keys: irismesh.Keyring) -> None:
    def burn(payload: bytes) -> bytes:
        end = time.perf_counter() + 0.005
        while time.perf_counter() < end:
            pass
        return payload

    first = await irismesh.Node("db", keyring=keys).start()
    second = await irismesh.Node("db", keyring=keys, seeds=[first.endpoint]).start()
    for member in (first, second):
        member.on_request(burn)
    config = irismesh.CoreConfig(outliers=irismesh.OutlierConfig(base_ejection=1.0))
    caller = await irismesh.Node(keyring=keys, seeds=[first.endpoint], config=config).start()
    try:
        assert await caller.wait_for_members("db", 2, timeout=10) == 2
        outcomes: Counter[str] = Counter()

        async def flood() -> None:
            # Far more work than two members can do within each request's budget.
            results = await asyncio.gather(
                *(caller.request("db", b"%d" % i, timeout=0.1) for i in range(100)),
                return_exceptions=True,
            )
            outcomes.update(type(r).__name__ for r in results)

        began = time.monotonic()
        while time.monotonic() - began < 3.0:  # a few of the caller's sweeps
            await flood()
        assert caller.stats["requests_turned_away"] > 0, outcomes
        assert outcomes["Overloaded"] > 0, outcomes
        assert outcomes["RemoteError"] == 0, outcomes
        assert caller.stats.get("members_ejected", 0) == 0, {
            k: v for k, v in caller.stats.items() if "eject" in k or "turned" in k or "timed" in k
        }
    finally:
        await asyncio.gather(*(n.close() for n in (caller, second, first)))
