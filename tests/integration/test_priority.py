"""Priorities between real nodes on 127.0.0.1: an overloaded member serves high before low,
and the low still completes; publishes waiting for room take turns by priority."""

from __future__ import annotations

import asyncio

import pytest
from helpers import burn, deadline, wait_until

import irismesh
from irismesh import Priority, sync
from irismesh.patterns.pubsub import Turns

COST = 0.004  # seconds of CPU each handler run burns


@deadline(30)
async def test_an_overloaded_member_serves_high_before_low_and_low_still_completes(
    keys: irismesh.Keyring,
) -> None:
    handled: list[bytes] = []
    overtaken = 0  # low runs started while a high one had arrived and waited

    async with irismesh.Node("work", keyring=keys) as member:

        @member.on_request
        def handle(payload: bytes) -> bytes:
            nonlocal overtaken
            arrived = member.stats.get("requests_arrived_high", 0)
            if payload.startswith(b"low") and arrived > handled.count(b"high"):
                overtaken += 1
            handled.append(payload[:4] if payload.startswith(b"high") else payload)
            burn(COST)
            return payload

        async with irismesh.Node(keyring=keys, seeds=[member.endpoint]) as client:
            await client.wait_for_members("work", timeout=5)
            await client.request("work", b"warm", timeout=5)
            lows = [
                asyncio.ensure_future(
                    client.request("work", b"low%d" % i, timeout=20, priority=Priority.LOW)
                )
                for i in range(150)
            ]
            await wait_until(
                lambda: member.stats.get("requests_waiting", 0) >= 100,
                10,
                "a queue of low-priority requests at the member",
            )
            highs = [
                asyncio.ensure_future(
                    client.request("work", b"high%d" % i, timeout=20, priority=Priority.HIGH)
                )
                for i in range(5)
            ]
            assert [await h for h in highs] == [b"high%d" % i for i in range(5)]
            # Once a high one had arrived, no low one started before it (the lower class's
            # share, one start in SHARE_EVERY, is not due within five).
            assert overtaken == 0, handled
            assert [await low for low in lows] == [b"low%d" % i for i in range(150)]
            stats = member.stats
            assert stats["requests_admitted_high"] == 5
            assert stats["requests_admitted_low"] == 150
            assert stats["requests_arrived_low"] == 150


@deadline(30)
async def test_a_priority_out_of_range_is_a_configuration_error(keys: irismesh.Keyring) -> None:
    async with irismesh.Node("work", keyring=keys) as member:
        member.on_request(lambda payload: payload)
        async with irismesh.Node(keyring=keys, seeds=[member.endpoint]) as client:
            await client.wait_for_members("work", timeout=5)
            with pytest.raises(irismesh.ConfigurationError, match="priority"):
                await client.request("work", b"x", priority=8)
            with pytest.raises(irismesh.ConfigurationError, match="priority"):
                await client.publish("t", b"x", priority="high")  # type: ignore[arg-type]


def test_the_sync_api_takes_a_priority(keys: irismesh.Keyring) -> None:
    with sync.Node("work", keyring=keys) as member:
        member.on_request(lambda payload: b"re:" + payload)
        with sync.Node(keyring=keys, seeds=[member.endpoint]) as client:
            client.wait_for_members("work", timeout=5)
            assert client.request("work", b"x", priority=Priority.HIGH) == b"re:x"
            assert client.publish("nobody.listens", b"x", priority=Priority.LOW) == 0


@deadline(30)
async def test_publishes_blocked_by_a_slow_subscriber_go_out_by_priority(
    keys: irismesh.Keyring,
) -> None:
    window = 32
    config = irismesh.CoreConfig(pubsub_window=window)
    sub_node = await irismesh.Node(keyring=keys, config=config).start()
    pub = irismesh.Node(keyring=keys, seeds=[sub_node.endpoint])
    async with sub_node, pub:
        sub = sub_node.subscribe("jobs", maxsize=window)
        await pub.wait_for_subscribers("jobs", 1, timeout=5)
        for i in range(window):  # the subscriber's whole window: the next ones wait
            await pub.publish("jobs", b"%d" % i, timeout=5)
        waiting = []
        for name, priority in [
            (b"first", Priority.NORMAL),  # it waits for room first, holding the turn
            (b"low", Priority.LOW),
            (b"normal", Priority.NORMAL),
            (b"high", Priority.HIGH),
        ]:
            task = pub.publish("jobs", name, timeout=10, priority=priority)
            waiting.append(asyncio.ensure_future(task))
            await asyncio.sleep(0.01)
        assert not any(task.done() for task in waiting)
        got = [(await sub.get(timeout=5)).payload for _ in range(window + 4)]
        await asyncio.gather(*waiting)
        assert got[:window] == [b"%d" % i for i in range(window)]
        assert got[window:] == [b"first", b"high", b"normal", b"low"]


@deadline(30)
async def test_publishes_waiting_for_room_take_turns_by_priority() -> None:
    turns = Turns()
    await turns.acquire(Priority.LOW)  # a low publish waits for room, holding the turn
    order: list[str] = []

    async def publish(name: str, priority: int) -> None:
        await turns.acquire(priority)
        order.append(name)
        turns.release()

    assert turns.must_wait(Priority.LOW)
    assert not turns.must_wait(Priority.NORMAL)  # a higher one may try at once
    tasks = [
        asyncio.ensure_future(publish(name, priority))
        for name, priority in [("n1", 0), ("h1", 1), ("l1", -1), ("n2", 0), ("h2", 1)]
    ]
    gone = asyncio.ensure_future(publish("cancelled", 2))
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.sleep(0)
    assert turns.must_wait(Priority.HIGH)
    turns.release()
    await asyncio.gather(*tasks)
    assert order == ["h1", "h2", "n1", "n2", "l1"]
    assert turns.holder is None
