"""Publish/subscribe over real sockets on 127.0.0.1: interest, wildcards, order, flow control."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from helpers import deadline, wait_until

import irismesh
from irismesh import CoreConfig

WINDOW = 64


async def start_nodes(keys: irismesh.Keyring, n: int, **options: object) -> list[irismesh.Node]:
    nodes: list[irismesh.Node] = []
    for _ in range(n):
        seeds = [nodes[0].endpoint] if nodes else []
        node = irismesh.Node(keyring=keys, seeds=seeds, telemetry=False, **options)  # type: ignore[arg-type]
        nodes.append(await node.start())
    return nodes


@contextlib.asynccontextmanager
async def started_nodes(
    keys: irismesh.Keyring, n: int, **options: object
) -> AsyncIterator[list[irismesh.Node]]:
    """`start_nodes`, all closed at the end."""
    nodes = await start_nodes(keys, n, **options)
    try:
        yield nodes
    finally:
        await asyncio.gather(*(node.close() for node in nodes))


@deadline(30)
async def test_wildcards_route_each_message_to_the_matching_subscriptions_only(
    keys: irismesh.Keyring,
) -> None:
    async with started_nodes(keys, 3) as (pub, a, b):
        breaking = a.subscribe("feeds.*.breaking")
        everything = b.subscribe("feeds.#")
        corrections = b.subscribe("feeds.#.corrections")
        local = pub.subscribe("feeds.sports.#")
        await pub.wait_for_subscribers("feeds.world.breaking", 2, timeout=5)
        await pub.wait_for_subscribers("feeds.x.corrections", 1, timeout=5)
        assert await pub.publish("feeds.world.breaking", b"1") == 2
        assert await pub.publish("feeds.sports.results.corrections", b"2") == 2  # b + local
        assert await pub.publish("weather.today", b"3") == 0
        assert (await breaking.get(timeout=5)).payload == b"1"
        got = [(await everything.get(timeout=5)).payload for _ in range(2)]
        assert got == [b"1", b"2"]
        message = await corrections.get(timeout=5)
        assert (message.topic, message.payload) == ("feeds.sports.results.corrections", b"2")
        assert message.publisher == pub.node_id.hex()
        assert (await local.get(timeout=5)).payload == b"2"
        for sub in (breaking, everything, corrections, local):
            assert sub.get_nowait() is None  # nothing else, nothing twice
        assert a.stats["messages_unmatched"] == 0


@deadline(30)
async def test_each_publisher_s_messages_arrive_in_order(keys: irismesh.Keyring) -> None:
    async with (
        started_nodes(keys, 3) as (sub_node, p1, p2),
        sub_node.subscribe("orders.#") as sub,
    ):
        for p in (p1, p2):
            await p.wait_for_subscribers("orders.x", 1, timeout=5)

        async def pump(node: irismesh.Node, name: bytes) -> None:
            for i in range(3000):
                await node.publish(f"orders.{i % 5}", name + b":%d" % i)

        seen: dict[bytes, list[int]] = {b"p1": [], b"p2": []}

        async def read() -> None:
            for _ in range(6000):  # the reader keeps up: credit flows back
                message = await sub.get(timeout=5)
                name, number = message.payload.split(b":")
                seen[name].append(int(number))
                assert message.missed == 0

        await asyncio.gather(pump(p1, b"p1"), pump(p2, b"p2"), read())
        assert seen == {b"p1": list(range(3000)), b"p2": list(range(3000))}


@deadline(30)
async def test_a_blocking_subscriber_that_stops_reading_bounds_memory_and_loses_nothing(
    keys: irismesh.Keyring,
) -> None:
    async with started_nodes(keys, 2, config=CoreConfig(pubsub_window=WINDOW)) as (pub, sub_node):
        sub = sub_node.subscribe("load", maxsize=16)
        await pub.wait_for_subscribers("load", 1, timeout=5)
        sent = 0
        slow: irismesh.SlowConsumer | None = None
        while sent < 10 * WINDOW and slow is None:
            try:
                await pub.publish("load", b"%d" % sent, timeout=0.5)
                sent += 1
            except irismesh.SlowConsumer as exc:
                slow = exc
        assert slow is not None
        assert sub_node.node_id.hex() in slow.subscribers
        assert sent == WINDOW  # the window, and not one message more, went out
        await wait_until(lambda: sub.qsize() == WINDOW, 5, "the window to arrive")
        # The reader comes back: everything published arrives, in order, then more flows.
        more = asyncio.ensure_future(
            asyncio.gather(*[pub.publish("load", b"%d" % i) for i in range(sent, 3 * WINDOW)])
        )
        got = [int((await sub.get(timeout=5)).payload) for _ in range(3 * WINDOW)]
        await more
        assert got == list(range(3 * WINDOW))
        assert sub.missed == 0
        assert sub_node.stats.get("dropped_over_credit", 0) == 0


@deadline(30)
async def test_a_drop_oldest_subscriber_never_slows_the_publisher_and_counts_what_it_missed(
    keys: irismesh.Keyring,
) -> None:
    async with started_nodes(keys, 2, config=CoreConfig(pubsub_window=WINDOW)) as (pub, sub_node):
        sub = sub_node.subscribe("ticks", policy="drop_oldest", maxsize=10)
        await pub.wait_for_subscribers("ticks", 1, timeout=5)
        total = 20 * WINDOW
        for i in range(total):
            await pub.publish("ticks", b"%d" % i, timeout=5)
        await wait_until(lambda: sub.received == total, 10, "every tick to arrive")
        assert sub.qsize() == 10
        assert sub.missed == total - 10
        first = await sub.get(timeout=1)
        assert first.missed == total - 10
        assert int(first.payload) == total - 10  # the newest ten are kept
        rest = [int((await sub.get(timeout=1)).payload) for _ in range(9)]
        assert rest == list(range(total - 9, total))
        assert all(m == 0 for m in [sub.get_nowait()] if m is not None)


@deadline(30)
async def test_closing_a_subscription_withdraws_its_interest(keys: irismesh.Keyring) -> None:
    async with started_nodes(keys, 2) as (pub, sub_node):
        async with sub_node.subscribe("a.#") as sub:
            await pub.wait_for_subscribers("a.b", 1, timeout=5)
            assert await pub.publish("a.b", b"x") == 1
            assert (await sub.get(timeout=5)).payload == b"x"
        assert sub.closed
        with pytest.raises(irismesh.Closed):
            await sub.get(timeout=1)
        core = pub._core
        assert core is not None
        await wait_until(lambda: core.subscribers("a.b") == [], 5, "interest to go")
        assert await pub.publish("a.b", b"y") == 0


@deadline(30)
async def test_bad_topics_patterns_and_payloads_are_clear_errors(keys: irismesh.Keyring) -> None:
    only_db = irismesh.Keyring.generate(["db"])
    [node] = await start_nodes(only_db, 1, config=CoreConfig(max_payload=1000))
    try:
        for topic in ["", "a..b", "a.*", "a.#", "has space", "x" * 300]:
            with pytest.raises(irismesh.ConfigurationError):
                await node.publish(topic, b"x")
        for pattern in ["", "a..b", "a*", "x" * 300]:
            with pytest.raises(irismesh.ConfigurationError):
                node.subscribe(pattern)
        with pytest.raises(irismesh.ConfigurationError):
            node.subscribe("a", policy="lossy")  # type: ignore[arg-type]
        with pytest.raises(irismesh.ConfigurationError):
            node.subscribe("a", maxsize=0)
        with pytest.raises(irismesh.NoKey):
            await node.publish("feeds.x", b"no key for feeds")
        with pytest.raises(irismesh.PayloadTooLarge):
            await node.publish("db.x", b"x" * 1001)
        with pytest.raises(TypeError):
            await node.publish("db.x", "text")  # type: ignore[arg-type]
    finally:
        await node.close()
    with pytest.raises(irismesh.Closed):
        await node.publish("db.x", b"x")


@deadline(30)
async def test_closing_the_node_ends_iteration_and_wakes_a_waiting_publisher(
    keys: irismesh.Keyring,
) -> None:
    pub, sub_node = await start_nodes(keys, 2, config=CoreConfig(pubsub_window=WINDOW))
    sub = sub_node.subscribe("t")
    await pub.wait_for_subscribers("t", 1, timeout=5)
    for _ in range(WINDOW):
        await pub.publish("t", b"x")
    blocked = asyncio.ensure_future(pub.publish("t", b"y", timeout=20))
    await wait_until(lambda: sub.qsize() == WINDOW, 5, "the window to arrive")
    assert not blocked.done()
    await sub_node.close()  # the subscriber leaves: the publisher is free at once
    assert await asyncio.wait_for(blocked, 5) == 0
    assert [m async for m in sub] == []  # closed: buffered messages are dropped
    await pub.close()


@deadline(30)
async def test_what_a_node_publishes_just_before_it_closes_still_arrives(
    keys: irismesh.Keyring,
) -> None:
    [sub_node] = await start_nodes(keys, 1)
    try:
        sub = sub_node.subscribe("last.words")
        for count in (1, 500):
            pub = irismesh.Node(keyring=keys, seeds=[sub_node.endpoint], telemetry=False)
            await pub.start()
            await pub.wait_for_subscribers("last.words", 1, timeout=5)
            for i in range(count):
                await pub.publish("last.words", b"%d" % i)
            await pub.close()  # at once: the staged messages go before the goodbye
            got = [int((await sub.get(timeout=5)).payload) for _ in range(count)]
            assert got == list(range(count))
    finally:
        await sub_node.close()


@deadline(30)
async def test_a_callback_subscription_gets_every_message_in_order_and_survives_its_errors(
    keys: irismesh.Keyring, caplog: pytest.LogCaptureFixture
) -> None:
    async with started_nodes(keys, 2, config=CoreConfig(pubsub_window=WINDOW)) as (pub, sub_node):
        got: list[irismesh.Message] = []

        def on_message(message: irismesh.Message) -> None:
            got.append(message)
            if message.payload.endswith(b"7"):
                raise ValueError("a handler bug")

        sub = sub_node.subscribe("jobs.#", callback=on_message)
        local: list[bytes] = []
        pub.subscribe("jobs.local", callback=lambda m: local.append(m.payload))
        await pub.wait_for_subscribers("jobs.x", 1, timeout=5)
        total = WINDOW * 10  # far past one window: a callback holds no credit
        for i in range(total):
            topic = "jobs.a" if i % 3 else "jobs.b.c"
            assert await pub.publish(topic, b"%d" % i, timeout=5) == 1
        assert await pub.publish("jobs.local", b"here") == 2  # the remote one and its own
        await wait_until(lambda: len(got) == total + 1, 10, "every message at the callback")
        assert [m.payload for m in got[:total]] == [b"%d" % i for i in range(total)]
        assert got[1].topic == "jobs.a"
        assert got[0].topic == "jobs.b.c"
        assert all(m.publisher == pub.node_id.hex() and m.missed == 0 for m in got)
        assert local == [b"here"]
        raised = sum(1 for i in range(total) if i % 10 == 7)
        assert sub.errors == raised  # counted, logged, and the messages after still came
        assert sub.received == total + 1
        assert "jobs.#" in caplog.text
        assert "a handler bug" in caplog.text
        with pytest.raises(irismesh.ConfigurationError, match="callback"):
            await sub.get(timeout=1)
        sub.close()
        # Its interest may not have left yet: then the message arrives and goes nowhere.
        if await pub.publish("jobs.a", b"after") == 1:
            await wait_until(
                lambda: sub_node.stats["messages_unmatched"] == 1, 5, "the unmatched message"
            )
        assert len(got) == total + 1
        with pytest.raises(irismesh.ConfigurationError, match="callable"):
            sub_node.subscribe("x", callback="not a function")  # type: ignore[arg-type]
