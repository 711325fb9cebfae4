"""Deadlines and overload between real nodes on 127.0.0.1: budgets travel, handlers whose
caller gave up stop, work that cannot finish in time never starts, blocking handlers leave the
event loop free."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from helpers import burn, deadline, wait_until

import irismesh
from irismesh import sync


@deadline(30)
async def test_a_handler_whose_caller_timed_out_is_cancelled(keys: irismesh.Keyring) -> None:
    seen: list[str] = []
    async with irismesh.Node("db", keyring=keys) as member:

        @member.on_request
        async def slow(payload: bytes) -> bytes:
            seen.append("started")
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise
            return b"too late"

        async with irismesh.Node(keyring=keys, seeds=[member.endpoint]) as client:
            await client.wait_for_members("db", timeout=5)
            began = time.monotonic()
            try:
                await client.request("db", b"x", timeout=0.2)
                raise AssertionError("the request cannot succeed")
            except irismesh.RequestTimeout:
                pass
            assert time.monotonic() - began < 1.0
            await wait_until(lambda: "cancelled" in seen, 2.0, "the handler's cancellation")
            # Its deadline passed there as the caller's CANCEL came: either stops it, once.
            stats = member.stats
            cancelled = stats.get("requests_deadline_cancelled", 0)
            assert cancelled + stats.get("requests_cancelled", 0) == 1


@deadline(30)
async def test_a_handler_whose_caller_gave_up_is_cancelled(keys: irismesh.Keyring) -> None:
    started = asyncio.Event()
    cancelled = asyncio.Event()
    async with irismesh.Node("db", keyring=keys) as member:

        @member.on_request
        async def slow(payload: bytes) -> bytes:
            started.set()
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                cancelled.set()
                raise
            return b"too late"

        async with irismesh.Node(keyring=keys, seeds=[member.endpoint]) as client:
            await client.wait_for_members("db", timeout=5)
            call = asyncio.ensure_future(client.request("db", b"x", timeout=10))
            await asyncio.wait_for(started.wait(), 5)
            call.cancel()
            await asyncio.wait_for(cancelled.wait(), 2)  # long before the 10 s deadline
            assert member.stats["requests_cancelled"] == 1
            assert client.stats["cancels_sent"] == 1


@deadline(30)
async def test_a_request_whose_budget_is_spent_waiting_never_starts(keys: irismesh.Keyring) -> None:
    started_with: list[float] = []
    async with irismesh.Node("db", keyring=keys) as member:

        @member.on_request
        def compute(payload: bytes) -> bytes:
            left = irismesh.time_left()
            assert left is not None
            started_with.append(left)
            burn(0.02)
            return payload

        async with irismesh.Node(keyring=keys, seeds=[member.endpoint]) as client:
            await client.wait_for_members("db", timeout=5)
            # 100 x 20 ms of CPU offered at once, with 0.2 s to answer each.
            results = await asyncio.gather(
                *(client.request("db", b"%d" % i, timeout=0.2) for i in range(100)),
                return_exceptions=True,
            )
    outcomes = Counter(type(r).__name__ for r in results)
    assert set(outcomes) <= {"bytes", "Overloaded", "RequestTimeout"}, outcomes
    ran = len(started_with)
    assert 0 < ran < 100
    assert min(started_with) > 0  # nothing started after its caller's deadline
    shed = sum(v for k, v in member.stats.items() if k.startswith("requests_shed_"))
    assert ran + shed == 100, (ran, dict(member.stats))  # each ran or was shed, counted
    assert outcomes["Overloaded"] > 0  # turned away early, not left to time out


@deadline(30)
async def test_a_chain_of_calls_shares_one_budget(keys: irismesh.Keyring) -> None:
    async with irismesh.Node("c", keyring=keys) as c:

        @c.on_request
        def budget(payload: bytes) -> bytes:
            return repr(irismesh.time_left()).encode()

        async with irismesh.Node("b", keyring=keys, seeds=[c.endpoint]) as b:

            @b.on_request
            async def forward(payload: bytes) -> bytes:
                await asyncio.sleep(0.05)  # B spends some of the budget itself
                return await b.request("c", payload)  # no timeout given: inherited

            async with irismesh.Node(keyring=keys, seeds=[c.endpoint]) as a:
                await a.wait_for_members("b", timeout=5)
                await b.wait_for_members("c", timeout=5)
                seen = float(await a.request("b", b"x", timeout=0.3))
    assert 0 < seen < 0.3 - 0.05 + 0.005  # B spent 50 ms; budgets round up to 1 ms


@deadline(30)
async def test_a_blocking_handler_leaves_the_node_answering(keys: irismesh.Keyring) -> None:
    async with irismesh.Node("fast", keyring=keys) as fast:
        fast.on_request(lambda payload: payload)
        async with irismesh.Node(
            "slow", keyring=keys, seeds=[fast.endpoint], handler_threads=4
        ) as member:

            @member.on_request(blocking=True)
            def sleepy(payload: bytes) -> bytes:
                time.sleep(0.05)  # blocking I/O, say
                return payload

            async with irismesh.Node(keyring=keys, seeds=[fast.endpoint]) as client:
                await client.wait_for_members("slow", timeout=5)
                await member.wait_for_members("fast", timeout=5)
                load = asyncio.gather(
                    *(client.request("slow", b"%d" % i, timeout=10) for i in range(100))
                )
                await wait_until(lambda: member.stats["handlers_running"] >= 4, 5.0, "a busy pool")
                # The member's loop is free: its own call to another cluster is quick.
                latencies = []
                states = set()
                while not load.done():
                    began = time.monotonic()
                    assert await member.request("fast", b"ping", timeout=1) == b"ping"
                    latencies.append(time.monotonic() - began)
                    states |= {p.state for p in client.peers() if p.linked}
                    await asyncio.sleep(0.02)
                replies = await load
    assert sorted(replies) == sorted(b"%d" % i for i in range(100))
    assert latencies
    assert max(latencies) < 0.2, latencies
    assert states == {"alive"}  # never suspected
    assert member.stats["handler_limit"] <= 4


def test_a_sync_nodes_handler_reads_its_deadline_in_its_thread(keys: irismesh.Keyring) -> None:
    with sync.Node("db", keyring=keys, handler_threads=2) as member:

        @member.on_request
        def budget(payload: bytes) -> bytes:
            return repr(irismesh.time_left()).encode()

        with sync.Node(keyring=keys, seeds=[member.endpoint]) as client:
            client.wait_for_members("db", timeout=5)
            seen = float(client.request("db", b"x", timeout=0.3))
    assert 0 < seen <= 0.301
