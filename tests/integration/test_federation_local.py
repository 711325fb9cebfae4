"""Gateways of two meshes in one process, joined by an in-process link, on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
from contextlib import AsyncExitStack

import pytest
from federated import LOCAL, Mesh, echoed_through, member
from helpers import deadline, wait_until

import irismesh
from irismesh._core.events import RequestArrived
from irismesh.federation import Gateway, LinkConfig, LocalGateways, far_answers


@deadline(45)
async def test_requests_cross_one_process_and_the_unexported_cluster_stays_unseen() -> None:
    a, b = Mesh("a"), Mesh("b")
    async with AsyncExitStack() as stack:
        await member(stack, a, "db", b"A:")
        await member(stack, a, "secret", b"S:")
        await member(stack, b, "search", b"B:")
        joined = await stack.enter_async_context(
            LocalGateways([a.gateway(export=["db"]), b.gateway(export=["search"])])
        )
        gw_a, gw_b = joined["a"], joined["b"]
        client_b = await b.node(stack)
        client_a = await a.node(stack)
        await client_b.wait_for_members("db", timeout=10)
        await client_a.wait_for_members("search", timeout=10)
        assert await client_b.request("db", b"x", timeout=5) == b"A:x"
        assert await client_a.request("search", b"y", timeout=5) == b"B:y"
        with pytest.raises(irismesh.RemoteError) as caught:
            await client_b.request("db", b"boom", timeout=5)
        assert caught.value.remote_type == "ValueError"
        replies = await asyncio.gather(
            *(client_b.request("db", b"%d" % i, timeout=5) for i in range(500))
        )
        assert replies == [b"A:%d" % i for i in range(500)]
        # Mesh b sees mesh a's exported cluster only.
        assert gw_b.imports() == ["db"]
        assert gw_a.imports() == ["search"]
        assert client_b.members("secret") == []
        with pytest.raises(irismesh.NoResponders):
            await client_b.request("secret", b"x", timeout=1)
        assert gw_b.stats["requests_forwarded"] == 502
        assert gw_a.stats["requests_served"] == 502
        assert gw_b.stats["links_up"] == gw_a.stats["links_up"] == 1
        assert gw_b.links()[0]["peer_mesh"] == "a"
        # A forged request for the cluster not exported is refused on the far side.
        gw_b.transport.ends[0].send_plain(["req", 99, "secret", 1000, b"x"])
        gw_b.transport.flush()
        await wait_until(
            lambda: gw_a.stats.get("requests_refused_not_exported", 0) == 1, 5, "refusal"
        )


async def relaying(
    stack: AsyncExitStack, a: Mesh, b: Mesh
) -> tuple[Gateway, Gateway, irismesh.Node, irismesh.Node]:
    """Gateways of this process joining mesh a (exporting db) to mesh b, a client in b that
    sees db, and b's node for db (the importer) once it relays core to core: until `stack`
    closes."""
    joined = await stack.enter_async_context(LocalGateways([a.gateway(export=["db"]), b.gateway()]))
    gw_a, gw_b = joined["a"], joined["b"]
    b.seeds.append(gw_b.node.endpoint)
    client = await b.node(stack)
    await client.wait_for_members("db", timeout=10)
    importer = gw_b._imports["db"]
    await wait_until(lambda: "db" in importer._core.calls.relays, 5, "the relay")
    return gw_a, gw_b, client, importer


@deadline(45)
async def test_requests_go_core_to_core_and_failures_come_back_as_before() -> None:
    a, b = Mesh("a"), Mesh("b")
    async with AsyncExitStack() as stack:
        server = await a.node(stack, "db")
        release = asyncio.Event()

        @server.on_request
        async def serve(payload: bytes) -> bytes:
            if payload == b"boom":
                raise ValueError("boom")
            if payload == b"slow":
                await release.wait()
            return b"A:" + payload

        gw_a, gw_b, client, importer = await relaying(stack, a, b)
        replies = await asyncio.gather(
            *(client.request("db", b"%d" % i, timeout=5) for i in range(300))
        )
        assert replies == [b"A:%d" % i for i in range(300)]
        with pytest.raises(irismesh.RemoteError) as caught:
            await client.request("db", b"boom", timeout=5)
        assert (caught.value.remote_type, caught.value.remote_message) == ("ValueError", "boom")
        # Past its deadline the far request fails too, and nothing is left behind: the far
        # node's timer is armed for it as it arrives.
        far = gw_a.node._core.calls
        slow = asyncio.ensure_future(client.request("db", b"slow", timeout=0.3))
        await wait_until(lambda: len(far.relaying) == 1, 5, "the slow request relayed")
        due = far.pending.next_deadline()
        assert due is not None
        assert gw_a.node._driver is not None
        assert gw_a.node._driver.timer_at <= due
        with pytest.raises(irismesh.RequestTimeout):
            await slow
        await wait_until(lambda: not far.relaying, 5, "the far request given up")
        assert importer.stats["requests_relayed"] == 302
        assert gw_b.stats["requests_forwarded"] == 302
        assert gw_a.stats["requests_served"] == 302
        assert gw_b.stats.get("requests_turned_away", 0) == 0
        # With no member left in mesh a the request is turned away unrun, and counted.
        release.set()
        await server.close()
        await wait_until(lambda: not gw_a.node.members("db"), 10, "the member gone")
        with pytest.raises(irismesh.Overloaded):
            await client.request("db", b"x", timeout=2)
        assert gw_b.stats["requests_turned_away"] == 1
        assert importer.stats["requests_shed_noresponders"] == 1


@deadline(45)
async def test_requests_relayed_when_the_far_node_closes_are_turned_away_at_once() -> None:
    a, b = Mesh("a"), Mesh("b")
    async with AsyncExitStack() as stack:
        server = await a.node(stack, "db")
        release = asyncio.Event()

        @server.on_request
        async def serve(payload: bytes) -> bytes:
            await release.wait()
            return payload

        gw_a, gw_b, client, _importer = await relaying(stack, a, b)
        far = gw_a.node._core.calls
        waiting = asyncio.ensure_future(client.request("db", b"x", timeout=10))
        await wait_until(lambda: len(far.relaying) == 1, 5, "the request relayed")
        began = asyncio.get_running_loop().time()
        await gw_a.node.close()
        with pytest.raises(irismesh.Overloaded):
            await waiting
        assert asyncio.get_running_loop().time() - began < 3
        assert not far.relaying
        assert gw_b.stats["requests_turned_away"] == 1
        release.set()


@deadline(45)
async def test_a_node_relays_a_cluster_to_another_node_of_its_process() -> None:
    a, b = Mesh("a"), Mesh("b")
    async with AsyncExitStack() as stack:
        await member(stack, a, "db", b"A:")
        back = await a.node(stack)  # asks mesh a
        front = irismesh.Node("db", keyring=b.keys, bind=LOCAL)  # serves db in mesh b
        forwarded: list[bytes] = []

        def forward(request: RequestArrived) -> None:
            forwarded.append(request.payload)
            front.answer(request, b"forwarded")

        front.forward_requests(forward, lambda event: False)
        with pytest.raises(irismesh.Closed):
            front.relay_requests("db", back)  # not started
        await stack.enter_async_context(front)
        b.seeds.append(front.endpoint)
        client = await b.node(stack)
        await client.wait_for_members("db", timeout=10)
        await back.wait_for_members("db", timeout=10)
        with pytest.raises(irismesh.ConfigurationError):
            front.relay_requests("db", front)
        front.relay_requests("db", back)
        replies = await asyncio.gather(
            *(client.request("db", b"%d" % i, timeout=5) for i in range(100))
        )
        assert replies == [b"A:%d" % i for i in range(100)]
        assert forwarded == []
        assert front.stats["requests_relayed"] == 100
        assert back.stats["requests_relay_served"] == 100
        front.relay_requests("db", None)  # forward gets them again
        assert await client.request("db", b"x", timeout=5) == b"forwarded"
        assert forwarded == [b"x"]


@deadline(45)
async def test_a_broadcast_and_a_survey_cross_one_process() -> None:
    a, b = Mesh("a"), Mesh("b")
    async with AsyncExitStack() as stack:
        got: dict[str, list[bytes]] = {}
        far: dict[str, bytes] = {}
        for prefix in ("1", "2"):
            node = await member(stack, a, "db", prefix.encode())
            got[prefix] = []
            far[node.node_id.hex()] = prefix.encode()
            node.on_broadcast(lambda payload, p=prefix: got[p].append(payload))
        joined = LocalGateways([a.gateway(export=["db"]), b.gateway()])
        await stack.enter_async_context(joined)
        b.seeds.append(joined["b"].node.endpoint)
        client = await b.node(stack)
        await client.wait_for_members("db", timeout=10)
        for i in range(10):
            reached = await client.broadcast("db", b"%d" % i, timeout=5)
            assert len(reached) == 1  # the one gateway that serves db in b
        expected = [b"%d" % i for i in range(10)]
        await wait_until(lambda: got == {"1": expected, "2": expected}, 5, "broadcasts")
        result = await client.survey("db", b"ping", timeout=5)
        assert far_answers(result) == {m: p + b"ping" for m, p in far.items()}


def check_in_order(got: list[bytes], origin: str, n: int) -> None:
    assert got == [f"{origin}:{i}".encode() for i in range(n)]


@deadline(45)
async def test_topics_cross_both_ways_once_in_order_and_loops_end() -> None:
    a, b = Mesh("a"), Mesh("b")
    async with AsyncExitStack() as stack:
        pub_a = await a.node(stack)
        pub_b = await b.node(stack)
        joined = await stack.enter_async_context(
            LocalGateways([a.gateway(topics=["feeds.#"]), b.gateway(topics=["feeds.#"])])
        )
        got: dict[str, list[bytes]] = {"a": [], "b": []}
        for mesh in (a, b):
            node = await mesh.node(stack)
            node.subscribe("feeds.#", callback=lambda m, k=mesh.name: got[k].append(m.payload))
        n = 2000
        for pub in (pub_a, pub_b):  # the subscriber and the gateway of its mesh
            await pub.wait_for_subscribers("feeds.x", 2, timeout=10)

        async def publish(mesh: str, pub: irismesh.Node) -> None:
            for i in range(n):
                await pub.publish("feeds.x", f"{mesh}:{i}".encode())

        await asyncio.gather(publish("a", pub_a), publish("b", pub_b))
        await wait_until(lambda: len(got["a"]) >= 2 * n and len(got["b"]) >= 2 * n, 20, "all")
        await asyncio.sleep(0.2)
        for mesh in ("a", "b"):
            for origin in ("a", "b"):
                check_in_order([p for p in got[mesh] if p.startswith(origin.encode())], origin, n)
        for gateway in joined.gateways:
            assert gateway.stats["messages_exported"] == n
            assert gateway.stats["messages_republished"] == n
            assert gateway.stats["link_buffered"] == 0


@deadline(45)
async def test_a_slow_subscriber_holds_the_publisher_back_by_the_window() -> None:
    a, b = Mesh("a"), Mesh("b")
    config = LinkConfig(window=64)
    async with AsyncExitStack() as stack:
        pub = await a.node(stack)
        joined = await stack.enter_async_context(
            LocalGateways(
                [
                    a.gateway(topics=["feeds.#"], link_config=config),
                    b.gateway(link_config=config),
                ]
            )
        )
        gw_a, gw_b = joined["a"], joined["b"]
        b.seeds.append(gw_b.node.endpoint)
        reader = await b.node(stack)
        sub = reader.subscribe("feeds.#", maxsize=16)  # "block": publishers wait for it
        await gw_b.node.wait_for_subscribers("feeds.x", 1, timeout=10)
        await pub.wait_for_subscribers("feeds.x", 1, timeout=10)
        n = 12_000

        async def publish() -> None:
            for i in range(n):
                await pub.publish("feeds.x", f"a:{i}".encode())

        publishing = asyncio.create_task(publish())
        peak = 0
        for _ in range(40):  # nobody reads for 0.4 s
            await asyncio.sleep(0.01)
            peak = max(peak, gw_b.stats["republish_queue"] + gw_a.stats["link_buffered"])
        assert not publishing.done()
        assert peak <= 3 * 64, peak  # the link's window, not what was published
        got = [(await sub.get()).payload for _ in range(n)]
        await publishing
        check_in_order(got, "a", n)


@deadline(45)
async def test_a_full_buffer_drops_and_counts() -> None:
    a, b = Mesh("a"), Mesh("b")
    config = LinkConfig(window=4, buffer=10)
    async with LocalGateways(
        [a.gateway(link_config=config), b.gateway(link_config=config)]
    ) as joined:
        end = joined["a"].transport.ends[0]
        # Nobody in b consumes these (not crossings b republishes): the window and buffer
        # fill, and what is beyond the buffer is dropped and counted.
        joined["b"]._on_items = lambda end, items: None  # type: ignore[method-assign]
        sent = [end.send(["x", i]) for i in range(15)]
        assert sent == [True] * 10 + [False] * 5
        assert joined["a"].stats["link_dropped_buffer_full"] == 5
        assert joined["a"].stats["link_buffered"] == 10


@deadline(45)
async def test_a_tunnel_crosses_in_order_and_closing_resets_it() -> None:
    a, b = Mesh("a"), Mesh("b")
    async with AsyncExitStack() as stack:
        server = await a.node(stack, "db")

        @server.on_tunnel
        async def echo(tunnel: irismesh.Tunnel) -> None:
            async for message in tunnel:
                await tunnel.send(message)
            await tunnel.send_eof()

        joined = LocalGateways([a.gateway(export=["db"]), b.gateway()])
        await joined.start()
        b.seeds.append(joined["b"].node.endpoint)
        try:
            client = await b.node(stack)
            await client.wait_for_members("db", timeout=10)
            messages = [os.urandom(size) for size in [0, 1, 70_000, 300_000] + [5000] * 50]
            await echoed_through(client, "db", messages)
            assert joined["b"].stats["tunnels_forwarded"] == 1
            assert joined["a"].stats["tunnels_served"] == 1
            # A tunnel open while the process closes is reset at the caller.
            tunnel = await client.tunnel("db", timeout=5)
            await tunnel.send(b"x")
            assert await tunnel.recv() == b"x"
        finally:
            await joined.close()
        with pytest.raises(irismesh.TunnelReset):
            await asyncio.wait_for(tunnel.recv(), 5)
        assert all(g.stats["links_up"] == 0 for g in joined.gateways)
        with pytest.raises(irismesh.NoResponders):  # db has gone from mesh b at once
            await client.request("db", b"x", timeout=2)


def test_bad_combinations_are_refused() -> None:
    keys = irismesh.Keyring.generate()
    with pytest.raises(irismesh.ConfigurationError, match="local=True"):
        irismesh.Gateway("a", keyring=keys)
    with pytest.raises(irismesh.ConfigurationError, match="link_keyring"):
        irismesh.Gateway("a", keyring=keys, listen=LOCAL)
    for window in (0, (1 << 30) + 1, 1.5):
        with pytest.raises(irismesh.ConfigurationError, match="tunnel_window"):
            irismesh.Gateway("a", keyring=keys, local=True, tunnel_window=window)  # type: ignore[arg-type]
    one = irismesh.Gateway("a", keyring=keys, local=True)
    with pytest.raises(irismesh.ConfigurationError, match="two gateways"):
        LocalGateways([one])
    with pytest.raises(irismesh.ConfigurationError, match="another mesh"):
        LocalGateways([one, irismesh.Gateway("a", keyring=keys, local=True)])


@deadline(45)
async def test_a_joined_gateway_also_links_over_tcp_and_passes_topics_on() -> None:
    a, b, c = Mesh("a"), Mesh("b"), Mesh("c")
    link = irismesh.Keyring.generate()
    fast = LinkConfig(heartbeat=0.1, dead_after=0.6, retry=0.2, resend_after=0.4)
    async with AsyncExitStack() as stack:
        pub = await a.node(stack)
        gw_b = b.gateway(topics=["feeds.#"], link_keyring=link, listen=LOCAL, link_config=fast)
        await stack.enter_async_context(LocalGateways([a.gateway(topics=["feeds.#"]), gw_b]))
        gw_c = irismesh.Gateway(
            "c", keyring=c.keys, link_keyring=link, peers=[gw_b.endpoint], bind=LOCAL,
            link_config=fast,
        )  # fmt: skip
        await stack.enter_async_context(gw_c)
        c.seeds.append(gw_c.node.endpoint)
        reader = await c.node(stack)
        got: list[bytes] = []
        reader.subscribe("feeds.#", callback=lambda m: got.append(m.payload))
        await wait_until(lambda: gw_b.stats["links_up"] == 2, 10, "both links")
        await gw_c.node.wait_for_subscribers("feeds.x", 1, timeout=10)
        await pub.wait_for_subscribers("feeds.x", 1, timeout=10)
        await asyncio.sleep(0.3)  # the interest in c reaches b's gateway, then a's
        n = 1000
        for i in range(n):
            await pub.publish("feeds.x", f"a:{i}".encode())
        await wait_until(lambda: len(got) >= n, 20, "every message in c")
        await asyncio.sleep(0.2)
        check_in_order(got, "a", n)


@deadline(45)
async def test_three_meshes_in_one_process_get_each_message_once_in_order() -> None:
    meshes = [Mesh(name) for name in "abc"]
    async with AsyncExitStack() as stack:
        publishers = {m.name: await m.node(stack) for m in meshes}
        joined = LocalGateways([m.gateway(topics=["feeds.#"]) for m in meshes])
        await stack.enter_async_context(joined)
        got: dict[str, list[bytes]] = {}
        for mesh in meshes:
            node = await mesh.node(stack)
            got[mesh.name] = []
            node.subscribe("feeds.#", callback=lambda m, k=mesh.name: got[k].append(m.payload))
        for pub in publishers.values():  # the subscriber and the gateway of its mesh
            await pub.wait_for_subscribers("feeds.x", 2, timeout=10)
        await asyncio.sleep(0.3)  # every mesh's interest reaches the others' gateways
        n = 1000

        async def publish(mesh: str, pub: irismesh.Node) -> None:
            for i in range(n):
                await pub.publish("feeds.x", f"{mesh}:{i}".encode())

        await asyncio.gather(*(publish(m, p) for m, p in publishers.items()))
        await wait_until(lambda: all(len(g) >= 3 * n for g in got.values()), 20, "all")
        await asyncio.sleep(0.2)
        for payloads in got.values():
            assert len(payloads) == 3 * n
            for origin in "abc":
                mine = [p for p in payloads if p.startswith(origin.encode())]
                check_in_order(mine, origin, n)
        assert joined.links()["a"][0]["up"]
