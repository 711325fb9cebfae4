"""Gateways between meshes on 127.0.0.1: each mesh its own keyring, joined only by gateways;
gateways on the ports they are given, and subscribers that deliver each message once."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import time
from collections.abc import Awaitable
from contextlib import AsyncExitStack, ExitStack
from pathlib import Path

import pytest
from federated import FAST, LOCAL, Mesh, gateway, member
from helpers import deadline, run_with_deadline, wait_until

import irismesh
from irismesh._cli.top import gateway_views
from irismesh.federation import LinkConfig, far_answers
from irismesh.federation import imports as imports_module
from irismesh.federation import topics as topics_module
from irismesh.federation.crossing import CROSSING, RESENT, Crossing
from irismesh.patterns import pubsub as pubsub_module


def run(coro: Awaitable[None], timeout: float = 45) -> None:
    run_with_deadline(coro, timeout)


@deadline(45)
async def test_request_crosses_a_gateway_pair_and_errors_come_back() -> None:
    a, b = Mesh("a"), Mesh("b")
    link = irismesh.Keyring.generate()
    async with AsyncExitStack() as stack:
        await member(stack, a, "db", b"A:")
        await member(stack, a, "secret", b"S:")
        gw_a = await gateway(stack, a, link, listen=True, export=("db",))
        gw_b = await gateway(stack, b, link, peers=(gw_a.endpoint,))
        client = await stack.enter_async_context(b.new_node())
        await client.wait_for_members("db", timeout=10)
        assert await client.request("db", b"x", timeout=5) == b"A:x"
        with pytest.raises(irismesh.RemoteError) as caught:
            await client.request("db", b"boom", timeout=5)
        assert caught.value.remote_type == "ValueError"
        assert "boom" in caught.value.remote_message
        # Mesh b cannot name mesh a's cluster that is not exported, nor reach it.
        assert gw_b.imports() == ["db"]
        with pytest.raises(irismesh.NoResponders):
            await client.request("secret", b"x", timeout=1)
        assert gw_b.stats["requests_forwarded"] == 2
        assert gw_a.stats["requests_served"] == 2


@deadline(45)
async def test_a_request_given_up_or_never_answered_is_forgotten_by_the_gateway() -> None:
    a, b = Mesh("a"), Mesh("b")
    link = irismesh.Keyring.generate()
    async with AsyncExitStack() as stack:
        await member(stack, a, "db", b"A:")
        gw_a = await gateway(stack, a, link, listen=True, export=("db",))
        gw_b = await gateway(stack, b, link, peers=(gw_a.endpoint,))
        client = await stack.enter_async_context(b.new_node())
        await client.wait_for_members("db", timeout=10)
        assert await client.request("db", b"x", timeout=5) == b"A:x"
        gw_a._on_request = lambda end, item: None  # type: ignore[method-assign]
        # The caller gives up: the gateway hears of it and forgets the request at once.
        waiting = asyncio.ensure_future(client.request("db", b"y", timeout=30))
        await wait_until(lambda: gw_b.stats["requests_in_flight"] == 1, 5, "passed on")
        waiting.cancel()
        await wait_until(lambda: gw_b.stats["requests_in_flight"] == 0, 2, "given up")
        # No reply ever comes: forgotten once the caller's deadline is gone.
        with pytest.raises(irismesh.RequestTimeout):
            await client.request("db", b"z", timeout=0.3)
        await wait_until(lambda: gw_b.stats["requests_in_flight"] == 0, 5, "forgotten")
        assert gw_b.stats["requests_forwarded"] == 3
        # Each was answered all the same: none keeps its place in the gateway's node.
        core = gw_b._imports["db"]._core
        assert core is not None
        assert all(e.status >= 0 for e in core.reply_cache._entries.values())


@deadline(45)
async def test_wrong_link_key_is_refused_and_counted() -> None:
    a, b = Mesh("a"), Mesh("b")
    async with AsyncExitStack() as stack:
        await member(stack, a, "db", b"A:")
        gw_a = await gateway(stack, a, irismesh.Keyring.generate(), listen=True, export=("db",))
        gw_b = await gateway(stack, b, irismesh.Keyring.generate(), peers=(gw_a.endpoint,))
        await wait_until(lambda: gw_a.stats.get("link_dropped_bad_proof", 0) >= 2, 5, "bad proofs")
        assert gw_a.stats["links_up"] == 0
        assert gw_b.stats["links_up"] == 0
        assert gw_b.imports() == []


@deadline(45)
async def test_a_request_for_a_cluster_not_exported_is_refused_on_the_far_side() -> None:
    a, b = Mesh("a"), Mesh("b")
    link = irismesh.Keyring.generate()
    async with AsyncExitStack() as stack:
        await member(stack, a, "secret", b"S:")
        gw_a = await gateway(stack, a, link, listen=True, export=("db",))
        gw_b = await gateway(stack, b, link, peers=(gw_a.endpoint,))
        await wait_until(lambda: gw_b.stats["links_up"] == 1, 5, "the link")
        end = gw_b.transport.ends[0]
        # A forged request for "secret", as a gateway that ignored the exports would send.
        end.send_plain(["req", 99, "secret", 1000, b"x"])
        gw_b.transport.flush()
        await wait_until(
            lambda: gw_a.stats.get("requests_refused_not_exported", 0) == 1, 5, "refusal"
        )
        assert gw_a.stats.get("requests_served", 0) == 0


async def subscribed(
    stack: AsyncExitStack, mesh: Mesh, pattern: str
) -> tuple[irismesh.Node, list[bytes]]:
    node = await stack.enter_async_context(mesh.new_node())
    got: list[bytes] = []
    node.subscribe(pattern, callback=lambda msg: got.append(msg.payload))
    return node, got


def check_once_in_order(got: list[bytes], meshes: list[str], n: int) -> None:
    """Every mesh's messages 0..n-1 exactly once, each mesh's in the order published."""
    by_origin: dict[str, list[int]] = {m: [] for m in meshes}
    for payload in got:
        origin, index = payload.decode().split(":")
        by_origin[origin].append(int(index))
    for origin, indices in by_origin.items():
        assert indices == list(range(n)), f"from {origin}: {len(indices)} of {n}, in order?"


async def publish_all(
    publishers: dict[str, irismesh.Node], readers: int, n: int, topic: str = "feeds.x"
) -> None:
    for node in publishers.values():
        await node.wait_for_subscribers(topic, readers, timeout=10)

    async def one(mesh: str, node: irismesh.Node) -> None:
        for i in range(n):
            await node.publish(topic, f"{mesh}:{i}".encode())

    await asyncio.gather(*(one(m, node) for m, node in publishers.items()))


@deadline(45)
async def test_topics_cross_a_gateway_pair_once_and_in_order() -> None:
    a, b = Mesh("a"), Mesh("b")
    link = irismesh.Keyring.generate()
    async with AsyncExitStack() as stack:
        pub = await stack.enter_async_context(a.new_node())
        a.seeds.append(pub.endpoint)
        gw_a = await gateway(stack, a, link, listen=True, topics=("feeds.#",))
        gw_b = await gateway(stack, b, link, peers=(gw_a.endpoint,))
        _, got_a = await subscribed(stack, a, "feeds.#")
        _, got_b = await subscribed(stack, b, "feeds.#")
        await gw_b.node.wait_for_subscribers("feeds.x", 1, timeout=10)
        await wait_until(lambda: gw_a.stats["links_up"] == 1, 10, "the link")
        await publish_all({"a": pub}, 2, 3000)  # the subscriber and the gateway
        await wait_until(lambda: len(got_b) >= 3000, 20, "every message across")
        await asyncio.sleep(0.2)
        check_once_in_order(got_b, ["a"], 3000)
        check_once_in_order(got_a, ["a"], 3000)
        assert gw_a.stats["messages_exported"] == 3000
        assert gw_b.stats["messages_republished"] == 3000


@pytest.mark.parametrize("shape", ["complete", "ring"])
def test_three_meshes_every_subscriber_gets_each_message_once_in_order(shape: str) -> None:
    """complete: one gateway per mesh, linked to both others (copies meet at the barrier);
    ring: a gateway pair per edge, each mesh's messages crossing only from their own mesh."""
    run(three_meshes(shape, 1500), timeout=90)


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["complete", "ring"])
def test_three_meshes_ten_thousand_messages_each(shape: str) -> None:
    run(three_meshes(shape, 10_000), timeout=240)


async def three_meshes(shape: str, n: int) -> None:
    meshes = {m: Mesh(m) for m in "abc"}
    link = irismesh.Keyring.generate()
    async with AsyncExitStack() as stack:
        publishers = {}
        for m, mesh in meshes.items():
            publishers[m] = node = await stack.enter_async_context(mesh.new_node())
            mesh.seeds.append(node.endpoint)
        gws: list[irismesh.Gateway] = []
        t = ("feeds.#",)
        if shape == "complete":
            ga = await gateway(stack, meshes["a"], link, listen=True, topics=t)
            gb = await gateway(
                stack, meshes["b"], link, listen=True, peers=(ga.endpoint,), topics=t
            )
            gc = await gateway(stack, meshes["c"], link, peers=(ga.endpoint, gb.endpoint), topics=t)
            gws = [ga, gb, gc]
            links = 2
        else:
            for x, y in ("ab", "bc", "ca"):
                gx = await gateway(stack, meshes[x], link, listen=True, topics=t)
                gy = await gateway(stack, meshes[y], link, peers=(gx.endpoint,), topics=t)
                gws += [gx, gy]
            links = 1
        readers = {m: await subscribed(stack, mesh, "feeds.#") for m, mesh in meshes.items()}
        await wait_until(
            lambda: all(g.stats["links_up"] == links for g in gws), 10, "every link up"
        )
        for g in gws:  # gateways know the others of their mesh, and have readers
            await g.node.wait_for_subscribers("feeds.x", 1, timeout=10)
            if shape == "ring":
                await g.node.wait_for_members("_gateway", 1, timeout=10)
        await wait_until(
            lambda: all(len(g._gateway_ids) == (1 if shape == "complete" else 2) for g in gws),
            10,
            "gateways to know each other",
        )
        # Each publisher: its mesh's reader and its mesh's gateways.
        await publish_all(publishers, 1 + (1 if shape == "complete" else 2), n)
        total = 3 * n
        await wait_until(
            lambda: all(len(got) >= total for _, got in readers.values()), 30, "all messages"
        )
        await asyncio.sleep(0.3)  # a duplicate would come now
        for _, got in readers.values():
            check_once_in_order(got, list("abc"), n)
        if shape == "complete":
            assert sum(g.stats["duplicates_dropped"] for g in gws) > 0


@deadline(90)
@pytest.mark.parametrize("first", ["pair", "others"])
async def test_three_meshes_with_a_redundant_pair_on_one_edge_deliver_each_message_once(
    first: str,
) -> None:
    """A complete graph of three meshes, one gateway per mesh linked to both others, and a
    second gateway pair on the edge a-b. Whichever of a's gateways forwards to b (`first`
    started), a's messages reach b once: the gateway that sends them to c marks them as seen
    in b (another gateway of a forwards there, or it holds them as a standby), so c does not
    relay them to b, where they would come through another gateway process than the pair's."""
    meshes = {m: Mesh(m) for m in "abc"}
    link = irismesh.Keyring.generate()
    t = ("feeds.#",)
    async with AsyncExitStack() as stack:
        publishers = {}
        for m, mesh in meshes.items():
            publishers[m] = node = await stack.enter_async_context(mesh.new_node())
            mesh.seeds.append(node.endpoint)
        gws: dict[str, irismesh.Gateway] = {}

        async def pair() -> None:
            gws["a2"] = await gateway(stack, meshes["a"], link, listen=True, topics=t)
            peer = (gws["a2"].endpoint,)
            gws["b2"] = await gateway(stack, meshes["b"], link, peers=peer, topics=t)

        if first == "pair":
            await pair()
        gws["a"] = ga = await gateway(stack, meshes["a"], link, listen=True, topics=t)
        gws["b"] = gb = await gateway(
            stack, meshes["b"], link, listen=True, peers=(ga.endpoint,), topics=t
        )
        gws["c"] = await gateway(
            stack, meshes["c"], link, peers=(ga.endpoint, gb.endpoint), topics=t
        )
        if first == "others":
            await pair()
        readers = {m: await subscribed(stack, mesh, "feeds.#") for m, mesh in meshes.items()}
        links = {"a": 2, "b": 2, "c": 2, "a2": 1, "b2": 1}
        await wait_until(
            lambda: all(g.stats["links_up"] == links[k] for k, g in gws.items()), 10, "links"
        )
        for k in ("a", "b", "a2", "b2"):
            await wait_until(lambda k=k: gws[k].stats["fellows"] == 1, 10, f"{k}'s fellow")

        def forwards(gw: irismesh.Gateway, mesh: str) -> bool:
            assert gw._redundancy is not None
            return gw._redundancy.forwarding.get(mesh, False)

        for x, y in ("ab", "ba"):  # one forwarder each way: the one started first
            pair_gw, other = gws[x + "2"], gws[x]
            if first == "others":
                pair_gw, other = other, pair_gw
            await wait_until(
                lambda g=pair_gw, o=other, y=y: forwards(g, y) and not forwards(o, y),
                10,
                f"one forwarder from {x} to {y}",
            )
        n = 1500
        for m, node in publishers.items():  # its reader, and its mesh's gateways
            await node.wait_for_subscribers("feeds.x", 1 + (1 if m == "c" else 2), timeout=10)
        await publish_all(publishers, 1, n)
        await wait_until(
            lambda: all(len(got) >= 3 * n for _, got in readers.values()), 30, "all messages"
        )
        await asyncio.sleep(0.3)  # a double would come now
        for _, got in readers.values():
            check_once_in_order(got, list("abc"), n)
        # Whichever forwards, nothing a takeover would resend was lost on the way.
        assert all(g.stats.get("standby_dropped", 0) == 0 for g in gws.values())


@deadline(45)
async def test_a_gateway_not_yet_in_the_snapshot_of_its_fellow_is_known_by_its_first_message() -> (
    None
):
    """Mesh a has two gateways: a1 exports feeds.#, a2 republishes what comes from mesh b. a1's
    snapshot of its mesh's gateways is a second old at worst: were a2 missing from it (it
    joined since), a2's republished messages would look published in a, and a1 would export
    them again under new origin ids (delivered twice in a complete graph). A publisher a1 does
    not know is looked up in membership at its first message instead; a native one once."""
    a, b = Mesh("a"), Mesh("b")
    link = irismesh.Keyring.generate()
    async with AsyncExitStack() as stack:
        pub = await stack.enter_async_context(a.new_node())
        a.seeds.append(pub.endpoint)
        a1 = await gateway(stack, a, link, listen=True, topics=("feeds.#",))
        a2 = await gateway(stack, a, link, listen=True)
        pub_b = await stack.enter_async_context(b.new_node())
        b.seeds.append(pub_b.endpoint)
        b1 = await gateway(stack, b, link, peers=(a2.endpoint,), topics=("feeds.#",))
        _, got_a = await subscribed(stack, a, "feeds.#")
        await wait_until(lambda: b1.stats["links_up"] == 1, 10, "the link")
        await a2.node.wait_for_subscribers("feeds.x", 2, timeout=10)  # a1 and the reader
        await pub_b.wait_for_subscribers("feeds.x", 1, timeout=10)  # b1
        # a1's snapshot as if a2 had joined after it was taken, and not refreshed.
        own = a1.node.node_id.hex()
        for task in a1._tasks:
            if task.get_coro().__name__ == "_watch_gateways":  # type: ignore[union-attr]
                task.cancel()
        a1._gateway_ids = {own}
        await pub_b.publish("feeds.x", b"b:0")
        await wait_until(lambda: got_a == [b"b:0"], 10, "b's message republished in a")

        def judged() -> int:
            s = a1.stats
            return s.get("gateways_learned_from_messages", 0) + s.get("messages_exported", 0)

        await wait_until(lambda: judged() >= 1, 10, "a1 to judge a2's message")
        assert a1.stats.get("messages_exported", 0) == 0  # not taken for a's own
        assert a1.stats["gateways_learned_from_messages"] == 1
        assert a2.node.node_id.hex() in a1._gateway_ids
        await pub.wait_for_subscribers("feeds.x", 2, timeout=10)  # a1 and the reader
        for i in range(3):  # a's own messages: exported, their publisher looked up once
            await pub.publish("feeds.x", f"a:{i}".encode())
        await wait_until(lambda: a1.stats.get("messages_exported", 0) == 3, 10, "a's own")
        assert a1._native_publishers == {pub.node_id.hex(): None}
        assert a1.stats["gateways_learned_from_messages"] == 1


class Cable:
    """A TCP proxy on 127.0.0.1 between two gateways that the test can cut and mend."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self.target = (host, int(port))
        self.port = 0
        self.server: asyncio.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    async def mend(self) -> None:
        self.server = await asyncio.start_server(self._connected, "127.0.0.1", self.port)
        self.port = self.server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in list(self.writers):
            writer.transport.abort()
        self.writers.clear()
        await self.server.wait_closed()

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self.writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (OSError, ConnectionError):
                pass
            finally:
                dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


@deadline(45)
async def test_an_outage_buffers_to_the_bound_counts_the_rest_and_replays_in_order() -> None:
    a, b = Mesh("a"), Mesh("b")
    link = irismesh.Keyring.generate()
    cfg = LinkConfig(buffer=200, heartbeat=0.1, dead_after=0.6, retry=0.2, resend_after=0.4)
    async with AsyncExitStack() as stack:
        pub = await stack.enter_async_context(a.new_node())
        a.seeds.append(pub.endpoint)
        await member(stack, a, "db", b"A:")
        gw_a = await gateway(
            stack, a, link, listen=True, export=("db",), topics=("feeds.#",), config=cfg
        )
        cable = Cable(gw_a.endpoint)
        await cable.mend()
        gw_b = await gateway(stack, b, link, peers=(cable.endpoint,), config=cfg)
        client, got = await subscribed(stack, b, "feeds.#")
        await gw_b.node.wait_for_subscribers("feeds.x", 1, timeout=10)
        await client.wait_for_members("db", timeout=10)
        await publish_all({"a": pub}, 1, 100)
        await wait_until(lambda: len(got) == 100, 10, "the first 100")
        await wait_until(lambda: gw_a.stats["link_buffered"] == 0, 5, "their acks")

        await cable.cut()
        await wait_until(lambda: gw_a.stats["links_up"] == 0, 5, "the link to go down")
        await wait_until(lambda: not client.members("db"), 5, "the gateway to leave db")
        with pytest.raises(irismesh.NoResponders):  # fails fast, not at its deadline
            await client.request("db", b"x", timeout=5)
        for i in range(100, 400):
            await pub.publish("feeds.x", f"a:{i}".encode())
        await wait_until(lambda: gw_a.stats["messages_exported"] == 400, 5, "the exports")
        assert gw_a.stats["link_buffered"] == 200
        assert gw_a.stats["link_dropped_buffer_full"] == 100
        assert len(got) == 100

        await cable.mend()
        await wait_until(lambda: len(got) == 300, 10, "the buffered 200")
        await asyncio.sleep(0.3)
        assert got == [f"a:{i}".encode() for i in range(300)]
        await client.wait_for_members("db", timeout=10)
        assert await client.request("db", b"y", timeout=5) == b"A:y"


@deadline(45)
async def test_a_publisher_faster_than_the_link_waits_for_its_acks_and_loses_nothing() -> None:
    """More messages than the link's window holds: the exporting gateway waits for acks (its
    subscription then holds the publisher back) and every message arrives."""
    a, b = Mesh("a"), Mesh("b")
    link = irismesh.Keyring.generate()
    cfg = LinkConfig(window=64, heartbeat=0.1, dead_after=0.6, retry=0.2)
    async with AsyncExitStack() as stack:
        pub = await stack.enter_async_context(a.new_node())
        a.seeds.append(pub.endpoint)
        gw_a = await gateway(stack, a, link, listen=True, topics=("feeds.#",), config=cfg)
        gw_b = await gateway(stack, b, link, peers=(gw_a.endpoint,), config=cfg)
        _, got = await subscribed(stack, b, "feeds.#")
        await gw_b.node.wait_for_subscribers("feeds.x", 1, timeout=10)
        await wait_until(lambda: gw_a.stats["links_up"] == 1, 10, "the link")
        await publish_all({"a": pub}, 1, 5000)
        await wait_until(lambda: len(got) >= 5000, 20, "every message")
        check_once_in_order(got, ["a"], 5000)
        assert gw_a.stats.get("link_dropped_buffer_full", 0) == 0


@deadline(45)
async def test_a_peer_gone_for_good_is_forgotten_with_what_it_had_buffered() -> None:
    a, b = Mesh("a"), Mesh("b")
    link = irismesh.Keyring.generate()
    cfg = LinkConfig(heartbeat=0.1, dead_after=0.6, retry=0.2, forget_after=1.5)
    async with AsyncExitStack() as stack:
        pub = await stack.enter_async_context(a.new_node())
        a.seeds.append(pub.endpoint)
        gw_a = await gateway(stack, a, link, listen=True, topics=("feeds.#",), config=cfg)
        async with AsyncExitStack() as b_side:
            await gateway(b_side, b, link, peers=(gw_a.endpoint,), config=cfg)
            await wait_until(lambda: gw_a.stats["links_up"] == 1, 10, "the link")
        await wait_until(lambda: gw_a.stats["links_up"] == 0, 5, "the link down")
        await pub.wait_for_subscribers("feeds.x", 1, timeout=5)
        for i in range(10):
            await pub.publish("feeds.x", b"%d" % i)
        await wait_until(lambda: gw_a.stats["link_buffered"] == 10, 5, "the buffer")
        await wait_until(lambda: gw_a.stats["links"] == 0, 5, "the peer forgotten")
        assert gw_a.stats["link_buffered"] == 0
        assert gw_a.stats["link_dropped_forgotten"] == 10


@deadline(45)
async def test_a_slow_reader_across_the_link_holds_the_publisher_back_not_the_gateways_memory() -> (
    None
):
    a, b = Mesh("a"), Mesh("b")
    link = irismesh.Keyring.generate()
    cfg = LinkConfig(window=64, heartbeat=0.1, dead_after=0.6, retry=0.2)
    async with AsyncExitStack() as stack:
        pub = await stack.enter_async_context(a.new_node())
        a.seeds.append(pub.endpoint)
        gw_a = await gateway(stack, a, link, listen=True, topics=("feeds.#",), config=cfg)
        gw_b = await gateway(stack, b, link, peers=(gw_a.endpoint,), config=cfg)
        reader = await stack.enter_async_context(b.new_node())
        sub = reader.subscribe("feeds.#", maxsize=16)  # "block": publishers wait for it
        await gw_b.node.wait_for_subscribers("feeds.x", 1, timeout=10)
        await wait_until(lambda: gw_a.stats["links_up"] == 1, 10, "the link")
        await pub.wait_for_subscribers("feeds.x", 1, timeout=10)
        # More than every buffer on the way holds: credit windows (1024 per subscriber
        # node), the exporting gateway's subscription (4096), the link's window (64).
        n = 12_000
        publishing = asyncio.create_task(publish_all({"a": pub}, 1, n))
        peak = 0
        for _ in range(40):  # nobody reads for 0.4 s
            await asyncio.sleep(0.01)
            peak = max(peak, gw_b.stats["republish_queue"] + gw_a.stats["link_buffered"])
        assert not publishing.done()
        assert peak <= 3 * 64, peak  # the link's window, not what was published
        got = [(await sub.get()).payload for _ in range(n)]
        await publishing
        check_once_in_order(got, ["a"], n)


@deadline(45)
async def test_two_gateway_pairs_for_the_same_topics_deliver_each_message_once() -> None:
    """Two gateways of mesh a export feeds.# to two of mesh b: one forwards, the other stands by
    with what is not yet delivered, which the forwarder's acknowledgements keep trimmed."""
    a, b = Mesh("a"), Mesh("b")
    link = irismesh.Keyring.generate()
    n = 5000
    async with AsyncExitStack() as stack:
        pub = await stack.enter_async_context(a.new_node())
        a.seeds.append(pub.endpoint)
        a1 = await gateway(stack, a, link, listen=True, topics=("feeds.#",))
        a2 = await gateway(stack, a, link, listen=True, topics=("feeds.#",))
        b1 = await gateway(stack, b, link, peers=(a1.endpoint,))
        b2 = await gateway(stack, b, link, peers=(a2.endpoint,))
        _, got_b = await subscribed(stack, b, "feeds.#")
        for gw in (b1, b2):
            await gw.node.wait_for_subscribers("feeds.x", 1, timeout=10)
        await wait_until(
            lambda: a1.stats["links_up"] == a2.stats["links_up"] == 1, 10, "both links"
        )
        await wait_until(
            lambda: a1.stats["fellows"] == a2.stats["fellows"] == 1, 10, "fellows known"
        )
        await wait_until(
            lambda: a1.stats["forwarding"] + a2.stats["forwarding"] == 1, 10, "one forwarder"
        )
        assert a1.stats["forwarding"] == 1  # the one that started first
        await publish_all({"a": pub}, 2, n)  # the two gateways
        await wait_until(lambda: len(got_b) >= n, 30, "every message across")
        # Every message got the same origin id in both gateways: the standby's buffer
        # empties as the forwarder reports what was delivered.
        await wait_until(lambda: a2.stats["standby_held"] == 0, 10, "the standby trimmed")
        await asyncio.sleep(0.2)
        check_once_in_order(got_b, ["a"], n)
        assert b1.stats["messages_republished"] == n
        assert b2.stats.get("messages_republished", 0) == 0
        assert a2.stats.get("takeover_resent", 0) == 0
        assert a2.stats.get("standby_dropped", 0) == 0


@deadline(45)
async def test_resends_another_gateway_of_the_mesh_republished_are_dropped_the_others_not() -> None:
    """What a takeover resends (a standby of mesh a, through its own pair) reaches a gateway
    of mesh b that asks the other gateways of b which of them they republished already, from
    the forwarder that went: those it drops, the others it republishes, in order."""
    a, b = Mesh("a"), Mesh("b")
    link = irismesh.Keyring.generate()
    async with AsyncExitStack() as stack:
        # Two gateway pairs, no topics exported: the test sends the crossings itself.
        a1 = await gateway(stack, a, link, listen=True)
        a2 = await gateway(stack, a, link, listen=True)
        b1 = await gateway(stack, b, link, peers=(a1.endpoint,))
        b2 = await gateway(stack, b, link, peers=(a2.endpoint,))
        _, got = await subscribed(stack, b, "feeds.#")
        for gw in (b1, b2):
            await gw.node.wait_for_subscribers("feeds.x", 1, timeout=10)
            await gw.node.wait_for_members("_gateway", 1, timeout=10)
        await wait_until(lambda: a1.stats["links_up"] == a2.stats["links_up"] == 1, 10, "up")

        def crossing(i: int) -> Crossing:
            return Crossing("a", i.to_bytes(16, "big"), ("a",), "feeds.x", b"a:%d" % i)

        def send(gw: irismesh.Gateway, kind: str, indices: range) -> None:
            [end] = gw.transport.ends
            for i in indices:
                assert end.send(crossing(i).wire(kind))
            gw.transport.flush_soon()

        send(a1, CROSSING, range(60))  # the forwarder's, republished by b1
        await wait_until(lambda: len(got) == 60, 10, "the first 60")
        send(a2, RESENT, range(40, 100))  # a takeover's: 40..59 were there already
        await wait_until(lambda: len(got) >= 100, 10, "the rest")
        await asyncio.sleep(0.2)  # a double would come now
        check_once_in_order(got, ["a"], 100)
        assert b2.stats["resends_received"] == 60
        assert b2.stats["resends_dropped_republished_elsewhere"] == 20
        assert b2.stats["messages_republished"] == 40
        assert b2.stats.get("resends_unchecked", 0) == 0
        assert b1.stats["resends_asked"] >= 60


@deadline(45)
async def test_a_gateway_that_starts_late_stands_by_and_takes_over_when_the_forwarder_goes() -> (
    None
):
    a, b = Mesh("a"), Mesh("b")
    link = irismesh.Keyring.generate()
    async with AsyncExitStack() as stack:
        pub = await stack.enter_async_context(a.new_node())
        a.seeds.append(pub.endpoint)
        _, got_b = await subscribed(stack, b, "feeds.#")
        b.seeds.append(_.endpoint)
        a1 = irismesh.Gateway(
            "a",
            keyring=a.keys,
            link_keyring=link,
            listen=LOCAL,
            topics=("feeds.#",),
            link_config=FAST,
            seeds=list(a.seeds),
            bind=LOCAL,
        )
        await a1.start()
        try:
            await gateway(stack, b, link, peers=(a1.endpoint,))
            await wait_until(lambda: a1.stats["forwarding"] == 1, 10, "a1 forwards")
            await publish_all({"a": pub}, 1, 100)  # before a2 is there
            a2 = await gateway(stack, a, link, listen=True, topics=("feeds.#",))
            await gateway(stack, b, link, peers=(a2.endpoint,))
            await wait_until(lambda: a2.stats.get("fellows", 0) == 1, 10, "a2 knows a1")
            await wait_until(lambda: a2.stats["links_up"] == 1, 10, "a2's link")
            await asyncio.sleep(1.0)  # a few elections: a2 must stay standby
            assert a2.stats["forwarding"] == 0
            for i in range(100, 200):
                await pub.publish("feeds.x", f"a:{i}".encode())
            await wait_until(lambda: len(got_b) >= 200, 20, "the first 200")
            # a2 gives a1's messages the same ids: a1's acknowledgements trim its buffer
            await wait_until(lambda: a2.stats["standby_held"] == 0, 10, "a2 trimmed")
        finally:
            await a1.close()  # the forwarder goes: a2 takes over
        await wait_until(lambda: a2.stats["forwarding"] == 1, 10, "a2 takes over")
        for i in range(200, 300):
            await pub.publish("feeds.x", f"a:{i}".encode())
        await wait_until(lambda: len(got_b) >= 300, 20, "all 300")
        await asyncio.sleep(0.2)
        check_once_in_order(got_b, ["a"], 300)
        assert a2.stats.get("takeover_resent", 0) == 0


@deadline(45)
async def test_a_rotated_link_keyring_applies_without_a_restart_and_a_bad_file_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The link keyring files of both gateways go through the three steps of a rotation (new
    key second, then first, then the old one removed): requests cross after each; once the old
    key is gone the link's session is made again under the new one. A bad file is refused with
    one logged line and the keys in use stay."""
    old = irismesh.Keyring.generate()
    new_secret = os.urandom(32)
    files = [tmp_path / "a-link.keys", tmp_path / "b-link.keys"]

    def write(keys: irismesh.Keyring) -> None:
        for path in files:
            keys.save(path, overwrite=True)

    write(old)
    a, b = Mesh("a"), Mesh("b")
    async with AsyncExitStack() as stack:
        await member(stack, a, "db", b"a:")
        gw_a = irismesh.Gateway(
            "a",
            keyring=a.keys,
            link_keyring=irismesh.Keyring.load(files[0]),
            listen=LOCAL,
            export=["db"],
            link_config=FAST,
            seeds=list(a.seeds),
            bind=LOCAL,
        )
        await stack.enter_async_context(gw_a)
        gw_b = irismesh.Gateway(
            "b",
            keyring=b.keys,
            link_keyring=irismesh.Keyring.load(files[1]),
            peers=[gw_a.endpoint],
            link_config=FAST,
            bind=LOCAL,
        )
        await stack.enter_async_context(gw_b)
        b.seeds.append(gw_b.node.endpoint)
        client = await stack.enter_async_context(b.new_node())
        await client.wait_for_members("db", 1, timeout=10)
        assert await client.request("db", b"0", timeout=5) == b"a:0"

        steps = [
            old.with_key("*", new_secret, primary=False),
            old.with_key("*", new_secret),
            irismesh.Keyring().with_key("*", new_secret),
        ]
        for step, keys in enumerate(steps, 1):
            write(keys)
            for gw in (gw_a, gw_b):
                await wait_until(
                    lambda gw=gw, keys=keys: gw.link_keyring == keys, 10, f"step {step}"
                )
            if step == 3:  # the session under the old key ends, and is made again
                await wait_until(lambda: gw_b.stats["link_sessions"] >= 2, 10, "a new one")
            await wait_until(
                lambda: gw_a.stats["links_up"] == gw_b.stats["links_up"] == 1, 10, "the link"
            )
            await wait_until(lambda: gw_b.imports() == ["db"], 10, "db served in b")
            await wait_until(lambda: len(client.members("db")) == 1, 10, "db's member")
            assert await client.request("db", b"%d" % step, timeout=5) == b"a:%d" % step
        assert gw_b.stats["link_rekeyed"] + gw_a.stats["link_rekeyed"] >= 1

        caplog.clear()
        files[0].write_text("not a keyring\n")
        await wait_until(lambda: gw_a.stats["link_keyring_refused"] == 1, 10, "a refusal")
        await asyncio.sleep(1.2)  # more polls: the same bad file is not read again
        refusals = [r for r in caplog.records if "not reloaded" in r.getMessage()]
        assert len(refusals) == 1, refusals
        assert gw_a.link_keyring == steps[2]
        assert await client.request("db", b"after", timeout=5) == b"a:after"


@deadline(45)
async def test_a_broadcast_crosses_two_gateway_pairs_and_reaches_each_far_member_once() -> None:
    a, b = Mesh("a"), Mesh("b")
    link = irismesh.Keyring.generate()
    async with AsyncExitStack() as stack:
        got: dict[str, list[bytes]] = {"1": [], "2": []}
        for prefix in got:
            node = await member(stack, a, "db", prefix.encode())
            node.on_broadcast(lambda payload, p=prefix: got[p].append(payload))
        a1 = await gateway(stack, a, link, listen=True, export=("db",))
        a2 = await gateway(stack, a, link, listen=True, export=("db",))
        b1 = await gateway(stack, b, link, peers=(a1.endpoint,))
        b2 = await gateway(stack, b, link, peers=(a2.endpoint,))
        client = await stack.enter_async_context(b.new_node())
        await wait_until(lambda: b1.imports() == b2.imports() == ["db"], 10, "db in b")
        await client.wait_for_members("db", 2, timeout=10)
        for gw in (b1, b2):  # each gateway sees the other serving db
            node = gw._imports["db"]
            await wait_until(lambda node=node: len(node.members("db")) == 1, 10, "linked")
        for i in range(20):
            reached = await client.broadcast("db", b"%d" % i, timeout=5)
            assert len(reached) == 2  # the two gateways, which serve db here
        expected = [b"%d" % i for i in range(20)]
        assert got == {"1": expected, "2": expected}  # once each, in order
        forwarded = b1.stats.get("broadcasts_forwarded", 0)
        forwarded += b2.stats.get("broadcasts_forwarded", 0)
        assert forwarded == 20
        assert a1.stats.get("broadcasts_served", 0) + a2.stats.get("broadcasts_served", 0) == 20


@deadline(45)
async def test_a_survey_crosses_two_gateway_pairs_and_the_far_answers_come_back_merged() -> None:
    a, b = Mesh("a"), Mesh("b")
    link = irismesh.Keyring.generate()
    async with AsyncExitStack() as stack:
        far: dict[str, bytes] = {}
        for prefix in (b"1:", b"2:"):
            node = await member(stack, a, "db", prefix)
            far[node.node_id.hex()] = prefix
        a1 = await gateway(stack, a, link, listen=True, export=("db",))
        a2 = await gateway(stack, a, link, listen=True, export=("db",))
        b1 = await gateway(stack, b, link, peers=(a1.endpoint,))
        b2 = await gateway(stack, b, link, peers=(a2.endpoint,))
        client = await stack.enter_async_context(b.new_node())
        await wait_until(lambda: b1.imports() == b2.imports() == ["db"], 10, "db in b")
        await client.wait_for_members("db", 2, timeout=10)
        for gw in (b1, b2):
            node = gw._imports["db"]
            await wait_until(lambda node=node: len(node.members("db")) == 1, 10, "linked")
        result = await client.survey("db", b"ping", timeout=5)
        assert len(result.answers) == 2  # the two gateways
        assert not result.errors
        assert not result.missing
        merged = far_answers(result)
        assert merged == {member_id: prefix + b"ping" for member_id, prefix in far.items()}
        asked = b1.stats.get("surveys_forwarded", 0) + b2.stats.get("surveys_forwarded", 0)
        assert asked == 1


# ------------------------------------------------ fixed ports, and each message once


def free_ports(count: int) -> list[int]:
    """`count` consecutive ports free on 127.0.0.1 for TCP and UDP now (held by nobody once
    returned: a test binds them at once). They lie below Linux's ephemeral range (from 32768),
    where no outgoing connection takes one between this look and the test's bind."""
    for _ in range(200):
        first = random.randrange(20000, 32768 - count)
        with ExitStack() as held:
            try:
                for port in range(first, first + count):
                    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
                        sock = held.enter_context(socket.socket(socket.AF_INET, kind))
                        sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return list(range(first, first + count))
    raise RuntimeError("no free run of ports on 127.0.0.1")


def port_of(endpoint: str) -> int:
    return int(endpoint.rpartition(":")[2])


async def fixed_gateway(
    stack: AsyncExitStack,
    mesh: Mesh,
    link: irismesh.Keyring,
    bind: str,
    **kwargs: object,
) -> irismesh.Gateway:
    gw = irismesh.Gateway(
        mesh.name,
        keyring=mesh.keys,
        link_keyring=link,
        link_config=FAST,
        seeds=list(mesh.seeds),
        bind=bind,
        **kwargs,  # type: ignore[arg-type]
    )
    return await stack.enter_async_context(gw)


@deadline(45)
async def test_a_gateway_on_a_fixed_port_serves_every_import_on_ports_of_its_range() -> None:
    a, b = Mesh("a"), Mesh("b")
    link = irismesh.Keyring.generate()
    node_port, *range_ports = free_ports(4)
    async with AsyncExitStack() as stack:
        await member(stack, a, "db", b"A:")
        await member(stack, a, "search", b"S:")
        gw_a = irismesh.Gateway(
            "a", keyring=a.keys, link_keyring=link, listen=LOCAL, export=("db", "search"),
            link_config=FAST, seeds=list(a.seeds), bind=LOCAL,
        )  # fmt: skip
        await stack.enter_async_context(gw_a)
        gw_b = await fixed_gateway(
            stack, b, link, f"tcp://127.0.0.1:{node_port}", peers=(gw_a.endpoint,),
            import_ports=(range_ports[0], range_ports[-1]),
        )  # fmt: skip
        b.seeds.append(gw_b.node.endpoint)
        client = await stack.enter_async_context(b.new_node())
        await wait_until(lambda: gw_b.imports() == ["db", "search"], 10, "both imports")
        assert port_of(gw_b.node.endpoint) == node_port
        ports = {port_of(n.endpoint) for n in gw_b._imports.values()}
        assert ports <= set(range_ports), ports
        assert len(ports) == 2
        for cluster, prefix in (("db", b"A:"), ("search", b"S:")):
            await client.wait_for_members(cluster, timeout=10)
            assert await client.request(cluster, b"x", timeout=5) == prefix + b"x"
        assert gw_b.stats.get("imports_failed", 0) == 0
        assert gw_b.import_errors == {}


@deadline(45)
async def test_a_fixed_bind_without_a_range_imports_on_free_ports_of_its_host() -> None:
    a, b = Mesh("a"), Mesh("b")
    link = irismesh.Keyring.generate()
    [node_port] = free_ports(1)
    async with AsyncExitStack() as stack:
        await member(stack, a, "db", b"A:")
        gw_a = irismesh.Gateway(
            "a", keyring=a.keys, link_keyring=link, listen=LOCAL, export=("db",),
            link_config=FAST, seeds=list(a.seeds), bind=LOCAL,
        )  # fmt: skip
        await stack.enter_async_context(gw_a)
        gw_b = await fixed_gateway(
            stack, b, link, f"tcp://127.0.0.1:{node_port}", peers=(gw_a.endpoint,)
        )
        b.seeds.append(gw_b.node.endpoint)
        client = await stack.enter_async_context(b.new_node())
        await wait_until(lambda: gw_b.imports() == ["db"], 10, "the import")
        await client.wait_for_members("db", timeout=10)
        assert await client.request("db", b"x", timeout=5) == b"A:x"
        [node] = gw_b._imports.values()
        assert node.endpoint.startswith("tcp://127.0.0.1:")
        assert port_of(node.endpoint) != node_port


def test_an_import_that_cannot_start_is_an_error_once_shown_by_top_and_retried(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(imports_module, "_IMPORT_RETRY", 0.3)

    async def main() -> None:
        a, b = Mesh("a"), Mesh("b")
        link = irismesh.Keyring.generate()
        node_port, taken = free_ports(2)
        squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        try:
            async with AsyncExitStack() as stack:
                await member(stack, a, "db", b"A:")
                gw_a = irismesh.Gateway(
                    "a", keyring=a.keys, link_keyring=link, listen=LOCAL, export=("db",),
                    link_config=FAST, seeds=list(a.seeds), bind=LOCAL,
                )  # fmt: skip
                await stack.enter_async_context(gw_a)
                gw_b = await fixed_gateway(
                    stack, b, link, f"tcp://127.0.0.1:{node_port}", peers=(gw_a.endpoint,),
                    import_ports=(taken, taken),
                )  # fmt: skip
                b.seeds.append(gw_b.node.endpoint)
                await wait_until(lambda: gw_b.stats.get("imports_failed", 0) >= 3, 10, "retries")
                assert "db" in gw_b.import_errors
                assert "Address already in use" in gw_b.import_errors["db"]
                assert gw_b.stats["imports_not_started"] == 1
                errors = [
                    r
                    for r in caplog.records
                    if r.levelno == logging.ERROR and "cannot serve cluster 'db'" in r.message
                ]
                assert len(errors) == 1  # once, not at each retry
                # mesh top's view of the gateway shows it.
                viewer = await stack.enter_async_context(b.new_node())
                await viewer.wait_for_members("_gateway", timeout=10)
                views = await gateway_views(viewer, 5.0, wait=True)
                [view] = views
                assert any("cannot serve cluster 'db'" in e for e in view.errors), view
                # The port is freed: the next retry serves the cluster there.
                squatter.close()
                await wait_until(lambda: gw_b.imports() == ["db"], 10, "the import")
                assert port_of(gw_b._imports["db"].endpoint) == taken
                assert gw_b.import_errors == {}
                await viewer.wait_for_members("db", timeout=10)
                assert await viewer.request("db", b"y", timeout=5) == b"A:y"
        finally:
            squatter.close()

    with caplog.at_level(logging.WARNING, logger="irismesh.federation"):
        run(main())


def test_bad_import_ports_are_refused() -> None:
    keys = irismesh.Keyring.generate()
    for bad in ((0, 10), (10, 9), (1, 70000)):
        with pytest.raises(irismesh.ConfigurationError, match="import_ports"):
            irismesh.Gateway("a", keyring=keys, link_keyring=keys, listen=LOCAL, import_ports=bad)


@deadline(45)
async def test_a_message_two_gateways_republish_reaches_each_subscriber_once_and_in_order() -> None:
    """Mesh b's two gateways are both sent messages 40..59 (as when a gateway died before it
    acknowledged them, or restarted and was sent them again): each republishes them, with the
    origin id, and the subscribers of b deliver each id once."""
    a, b = Mesh("a"), Mesh("b")
    link = irismesh.Keyring.generate()
    async with AsyncExitStack() as stack:
        a1 = irismesh.Gateway(
            "a", keyring=a.keys, link_keyring=link, listen=LOCAL, link_config=FAST,
            bind=LOCAL,
        )  # fmt: skip
        await stack.enter_async_context(a1)
        a.seeds.append(a1.node.endpoint)
        a2 = irismesh.Gateway(
            "a", keyring=a.keys, link_keyring=link, listen=LOCAL, link_config=FAST,
            bind=LOCAL, seeds=list(a.seeds),
        )  # fmt: skip
        await stack.enter_async_context(a2)
        b1 = await fixed_gateway(stack, b, link, LOCAL, peers=(a1.endpoint,))
        b.seeds.append(b1.node.endpoint)
        b2 = await fixed_gateway(stack, b, link, LOCAL, peers=(a2.endpoint,))
        sub, got = await subscribed(stack, b, "feeds.#")
        queued = sub.subscribe("feeds.#")  # a buffered subscription too
        for gw in (b1, b2):
            await gw.node.wait_for_subscribers("feeds.x", 1, timeout=10)
        await wait_until(lambda: a1.stats["links_up"] == a2.stats["links_up"] == 1, 10, "up")

        def send(gw: irismesh.Gateway, indices: range) -> None:
            [end] = gw.transport.ends
            for i in indices:
                wire = Crossing("a", i.to_bytes(16, "big"), ("a",), "feeds.x", b"a:%d" % i)
                assert end.send(wire.wire(CROSSING))
            gw.transport.flush_soon()

        send(a1, range(60))
        await wait_until(lambda: len(got) == 60, 10, "the first 60")
        send(a2, range(40, 100))
        await wait_until(lambda: len(got) >= 100, 10, "the rest")
        await wait_until(
            lambda: sub.stats["messages_duplicates_dropped"] == 2 * 20, 10, "the copies"
        )
        check_once_in_order(got, ["a"], 100)
        assert b1.stats["messages_republished"] == 60
        assert b2.stats["messages_republished"] == 60  # b2 did not know: its subscribers did
        buffered = [queued.get_nowait() for _ in range(queued.qsize())]
        check_once_in_order([m.payload for m in buffered if m is not None], ["a"], 100)
        assert queued.duplicates == 20
        assert buffered[0] is not None
        assert buffered[0].id == (0).to_bytes(16, "big")  # the origin id, as Message.id


@deadline(45)
async def test_a_subscription_delivers_an_id_once_within_its_window_and_again_past_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pubsub_module, "SEEN_IDS", 8)
    mesh = Mesh("a")
    async with AsyncExitStack() as stack:
        pub = await stack.enter_async_context(mesh.new_node())
        mesh.seeds.append(pub.endpoint)
        _, got = await subscribed(stack, mesh, "t.#")
        await pub.wait_for_subscribers("t.x", 1, timeout=10)
        publish = topics_module.publish_identified

        def ident(i: int) -> bytes:
            return i.to_bytes(16, "big")

        for i in range(4):  # each twice: delivered once
            await publish(pub, "t.x", b"%d" % i, ident(i))
            await publish(pub, "t.x", b"%d" % i, ident(i))
        for i in range(4, 20):  # 16 more ids: the first four leave the window of 8
            await publish(pub, "t.x", b"%d" % i, ident(i))
        await publish(pub, "t.x", b"0", ident(0))  # past the window: delivered again
        await pub.publish("t.x", b"plain")  # no id: always delivered
        await pub.publish("t.x", b"plain")
        await wait_until(lambda: len(got) == 23, 10, "every message")
        await asyncio.sleep(0.1)
        assert got[:4] == [b"0", b"1", b"2", b"3"]
        assert got[20:] == [b"0", b"plain", b"plain"]


def test_what_a_link_held_for_a_gateway_that_died_goes_first_to_the_one_that_replaced_it() -> None:
    """Mesh b's gateway goes (its link on a's side still up, not knowing yet) and a new one
    dials in as a new peer: what a's link to the first held unacknowledged is carried over to
    the new link, before the new messages, and b's subscriber gets every message once in
    order."""

    async def main() -> None:
        a, b = Mesh("a"), Mesh("b")
        link = irismesh.Keyring.generate()
        async with AsyncExitStack() as stack:
            pub = await stack.enter_async_context(a.new_node())
            a.seeds.append(pub.endpoint)
            gw_a = await gateway(stack, a, link, listen=True, topics=("feeds.#",))
            reader, got = await subscribed(stack, b, "feeds.#")
            b.seeds.append(reader.endpoint)
            first = irismesh.Gateway(
                "b", keyring=b.keys, link_keyring=link, peers=(gw_a.endpoint,),
                link_config=FAST, seeds=list(b.seeds), bind=LOCAL,
            )  # fmt: skip
            await first.start()
            try:
                await first.node.wait_for_subscribers("feeds.x", 1, timeout=10)
                await wait_until(lambda: gw_a.stats["links_up"] == 1, 10, "the link")
                await pub.wait_for_subscribers("feeds.x", 1, timeout=10)
                for i in range(50):
                    await pub.publish("feeds.x", b"a:%d" % i)
                await wait_until(lambda: len(got) == 50, 10, "the first 50")
            finally:
                await first.close()
            for i in range(50, 150):  # held by a's link to the gateway that went
                await pub.publish("feeds.x", b"a:%d" % i)
            await wait_until(lambda: gw_a.stats["link_buffered"] >= 100, 10, "held")
            second = await gateway(stack, b, link, peers=(gw_a.endpoint,))
            await second.node.wait_for_subscribers("feeds.x", 1, timeout=10)
            for i in range(150, 200):
                await pub.publish("feeds.x", b"a:%d" % i)
            await wait_until(lambda: len(got) >= 200, 15, "every message")
            await asyncio.sleep(0.2)  # a double would come now
            check_once_in_order(got, ["a"], 200)
            assert gw_a.stats["messages_carried_over"] >= 100
            assert second.stats["resends_received"] >= 100

    run(main())


@deadline(30)
async def test_a_stall_of_the_gateways_own_loop_does_not_take_its_link_down() -> None:
    """The process stalls (its loop blocked) longer than the link's dead_after: what the far
    gateway sent meanwhile is read before silence is judged, and the link stays up."""
    a, b = Mesh("a"), Mesh("b")
    link = irismesh.Keyring.generate()
    async with AsyncExitStack() as stack:
        ga = await gateway(stack, a, link, listen=True, topics=("feeds.#",))
        gb = await gateway(stack, b, link, peers=(ga.endpoint,))
        await wait_until(lambda: ga.stats["links_up"] == gb.stats["links_up"] == 1, 10, "the link")
        for _ in range(3):
            time.sleep(3 * FAST.dead_after)  # noqa: ASYNC251 -- the stall is the point
            await asyncio.sleep(4 * FAST.heartbeat)  # ticks judge again, after reading
        assert ga.stats.get("link_down_events", 0) == gb.stats.get("link_down_events", 0) == 0
        assert ga.stats["link_loop_stalls"] >= 3
        assert gb.stats["link_loop_stalls"] >= 3
