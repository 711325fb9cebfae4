"""Request/reply over real pyzmq sockets on 127.0.0.1, nodes in one process."""

from __future__ import annotations

import asyncio
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable

import pytest
from helpers import deadline, until_no_responders, wait_until

import irismesh
from irismesh import sync
from irismesh._core.events import RequestArrived, RequestCancelled
from irismesh._spin import cores
from irismesh.patterns.reqrep import ForwardedError, TurnedAway


async def echo_members(keys: irismesh.Keyring, n: int, cluster: str = "db") -> list[irismesh.Node]:
    members: list[irismesh.Node] = []
    for i in range(n):
        seeds = [members[0].endpoint] if members else []
        node = await irismesh.Node(cluster, keyring=keys, seeds=seeds).start()
        prefix = b"m%d:" % i

        def bind(prefix: bytes) -> Callable[[bytes], bytes]:
            return lambda payload: prefix + payload

        node.on_request(bind(prefix))
        members.append(node)
    return members


async def close_all(*nodes: irismesh.Node) -> None:
    await asyncio.gather(*(n.close() for n in nodes))


@deadline(30)
async def test_request_reply_spreads_over_members(keys: irismesh.Keyring) -> None:
    members = await echo_members(keys, 3)
    client = await irismesh.Node(keyring=keys, seeds=[members[0].endpoint]).start()
    try:
        assert await client.wait_for_members("db", 3, timeout=5) == 3
        replies = await asyncio.gather(
            *(client.request("db", b"%d" % i, timeout=5) for i in range(300))
        )
        served: Counter[bytes] = Counter()
        for i, reply in enumerate(replies):
            who, _, echoed = reply.partition(b":")
            assert echoed == b"%d" % i
            served[who] += 1
        assert set(served) == {b"m0", b"m1", b"m2"}, served
    finally:
        await close_all(client, *members)


@deadline(30)
async def test_no_responders_is_immediate_and_typed(keys: irismesh.Keyring) -> None:
    async with irismesh.Node(keyring=keys) as client:
        # A timeout of an hour: if NoResponders waited for it, wait_for would fail first.
        with pytest.raises(irismesh.NoResponders) as info:
            await asyncio.wait_for(client.request("nobody", b"x", timeout=3600), 2)
        assert info.value.cluster == "nobody"
        assert isinstance(info.value, irismesh.MeshError)


@deadline(30)
async def test_remote_error_carries_message_and_member_keeps_serving(
    keys: irismesh.Keyring,
) -> None:
    async with irismesh.Node("db", keyring=keys) as member:

        @member.on_request
        async def handle(payload: bytes) -> bytes:
            if payload == b"boom":
                raise KeyError("no such key: boom")
            return b"ok:" + payload

        async with irismesh.Node(keyring=keys, seeds=[member.endpoint]) as client:
            await client.wait_for_members("db", timeout=5)
            with pytest.raises(irismesh.RemoteError) as info:
                await client.request("db", b"boom")
            assert info.value.remote_type == "KeyError"
            assert "no such key: boom" in info.value.remote_message
            assert await client.request("db", b"fine") == b"ok:fine"


@deadline(30)
async def test_handler_returning_non_bytes_is_a_remote_error(keys: irismesh.Keyring) -> None:
    async with irismesh.Node("db", keyring=keys) as member:
        member.on_request(lambda payload: 42)  # type: ignore[arg-type,return-value]
        async with irismesh.Node(keyring=keys, seeds=[member.endpoint]) as client:
            await client.wait_for_members("db", timeout=5)
            with pytest.raises(irismesh.RemoteError, match="returned int, not bytes"):
                await client.request("db", b"x")


@deadline(30)
async def test_timeout_is_typed_and_the_late_reply_is_counted(keys: irismesh.Keyring) -> None:
    release = asyncio.Event()
    async with irismesh.Node("db", keyring=keys) as member:

        @member.on_request
        async def handle(payload: bytes) -> bytes:
            await release.wait()
            return payload

        async with irismesh.Node(keyring=keys, seeds=[member.endpoint]) as client:
            await client.wait_for_members("db", timeout=5)
            with pytest.raises(irismesh.RequestTimeout) as info:
                await client.request("db", b"slow", timeout=0.2)
            assert info.value.timeout == 0.2
            assert client.stats["requests_pending"] == 0
            release.set()
            await wait_until(lambda: client.stats.get("replies_late", 0) == 1, 5, "the late reply")
            assert await client.request("db", b"next") == b"next"


@deadline(30)
async def test_payload_too_large_is_refused_before_sending(keys: irismesh.Keyring) -> None:
    config = irismesh.CoreConfig(max_payload=1000)
    async with irismesh.Node("db", keyring=keys, config=config) as member:
        member.on_request(lambda payload: payload)
        async with irismesh.Node(keyring=keys, seeds=[member.endpoint], config=config) as c:
            await c.wait_for_members("db", timeout=5)
            with pytest.raises(irismesh.PayloadTooLarge) as info:
                await c.request("db", b"x" * 1001)
            assert (info.value.size, info.value.limit) == (1001, 1000)
            assert await c.request("db", b"x" * 1000) == b"x" * 1000


@deadline(60)
async def test_slow_member_gets_a_small_share(keys: irismesh.Keyring) -> None:
    """A member ten times slower than its peers must not get a third of the traffic."""
    members = []
    for i, delay in enumerate([0.002, 0.002, 0.02]):
        seeds = [members[0].endpoint] if members else []
        node = await irismesh.Node("db", keyring=keys, seeds=seeds).start()

        def bind(name: bytes, delay: float) -> Callable[[bytes], Awaitable[bytes]]:
            async def handle(payload: bytes) -> bytes:
                await asyncio.sleep(delay)
                return name

            return handle

        node.on_request(bind(b"m%d" % i, delay))
        members.append(node)
    client = await irismesh.Node(keyring=keys, seeds=[members[0].endpoint]).start()
    try:
        await client.wait_for_members("db", 3, timeout=5)
        served: Counter[bytes] = Counter()

        async def loop() -> None:
            for _ in range(40):
                served[await client.request("db", b"x", timeout=10)] += 1

        await asyncio.gather(*(loop() for _ in range(12)))
        share = served[b"m2"] / sum(served.values())
        assert share < 0.15, f"slow member got {share:.0%} of requests: {served}"
    finally:
        await close_all(client, *members)


@deadline(30)
async def test_closed_member_leaves_at_once_and_requests_fail_over(keys: irismesh.Keyring) -> None:
    members = await echo_members(keys, 2)
    client = await irismesh.Node(keyring=keys, seeds=[members[0].endpoint]).start()
    try:
        await client.wait_for_members("db", 2, timeout=5)
        await members[1].close()
        # BYE is immediate: no heartbeat timeout needed.
        await wait_until(lambda: len(client.members("db")) == 1, 0.5, "the goodbye")
        for i in range(20):
            assert (await client.request("db", b"%d" % i)).startswith(b"m0:")
    finally:
        await close_all(client, *members)


@deadline(30)
async def test_paused_loop_causes_no_false_death(keys: irismesh.Keyring) -> None:
    """A member whose event loop blocks for 300 ms is not declared dead, nor is the caller."""
    async with irismesh.Node("db", keyring=keys) as member:

        @member.on_request
        def handle(payload: bytes) -> bytes:
            time.sleep(0.3)  # blocks the whole loop, heartbeats included
            return payload

        async with irismesh.Node(keyring=keys, seeds=[member.endpoint]) as client:
            await client.wait_for_members("db", timeout=5)
            for _ in range(3):
                assert await client.request("db", b"x", timeout=5) == b"x"
                time.sleep(0.3)  # noqa: ASYNC251 - the caller's loop stalls on purpose
            assert len(client.members("db")) == 1
            down = {k: v for k, v in client.stats.items() if k.startswith("peers_down")}
            assert not down, down


def test_sync_node_blocking_api(keyfile: object, keys: irismesh.Keyring) -> None:
    with sync.Node("db", keyring=keys) as member:

        @member.on_request
        def handle(payload: bytes) -> bytes:
            time.sleep(0.01)  # runs in a handler thread, not on the loop
            return payload.upper()

        with sync.Node(keyring=keys, seeds=[member.endpoint]) as client:
            client.wait_for_members("db", timeout=5)
            assert client.request("db", b"abc", timeout=5) == b"ABC"
            with pytest.raises(irismesh.NoResponders):
                client.request("other", b"x")
            assert client.ejected_by(["db"]) == {}  # nobody keeps the member out
            member.set_clusters(["db", "cache"])  # the client, linked, handshakes again
            client.wait_for_members("cache", timeout=5)
            assert client.request("cache", b"def", timeout=5) == b"DEF"
    with pytest.raises(irismesh.Closed):
        client.request("db", b"x")


@deadline(30)
async def test_bad_arguments_are_clear_errors(keys: irismesh.Keyring) -> None:
    with pytest.raises(irismesh.NoKey, match="'db'"):
        irismesh.Node("db", keyring=irismesh.Keyring.generate(["other"]))
    with pytest.raises(irismesh.ConfigurationError, match="bad endpoint"):
        irismesh.Node(keyring=keys, seeds=["localhost:1"])
    with pytest.raises(irismesh.ConfigurationError, match="bad cluster name"):
        irismesh.Node("has space", keyring=keys)
    with pytest.raises(irismesh.ConfigurationError, match="serves no requests"):
        irismesh.Node(keyring=keys).on_request(lambda p: p)
    async with irismesh.Node(keyring=keys) as client:
        with pytest.raises(irismesh.ConfigurationError, match="timeout"):
            await client.request("db", b"x", timeout=0)
        with pytest.raises(TypeError, match="bytes"):
            await client.request("db", "text")  # type: ignore[arg-type]
    with pytest.raises(irismesh.Closed):
        await client.request("db", b"x")


@deadline(30)
async def test_a_port_in_use_is_a_clear_error(keys: irismesh.Keyring) -> None:
    async with irismesh.Node(keyring=keys) as first:
        with pytest.raises(irismesh.ConfigurationError, match="cannot listen"):
            await irismesh.Node(keyring=keys, bind=first.endpoint).start()


@deadline(30)
async def test_garbage_on_the_listening_socket_is_counted_not_fatal(keys: irismesh.Keyring) -> None:
    import zmq

    junk = [b"", b"\x49", b"\x49\x01\x05" + b"\x00" * 20, b"x" * 100, b"\xff" * 14]
    members = await echo_members(keys, 1)
    member = members[0]
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    streams: list[asyncio.StreamWriter] = []
    try:
        if member.transport == "zmq":
            rogue.connect(member.endpoint)
            for frame in junk:
                rogue.send(frame)
            rogue.send_multipart([b"a", b"b", b"c"])
        else:  # irismesh's framing: frames of junk, then a length no HELLO may have
            host, _, port = member.endpoint.removeprefix("tcp://").rpartition(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            streams.append(writer)
            writer.write(b"".join(len(frame).to_bytes(4, "big") + frame for frame in junk))
            await writer.drain()
            assert await asyncio.wait_for(reader.read(), 5) == b""  # no HELLO: closed
            assert member.stats["dropped_stranger_unproven"] == 1
            reader, writer = await asyncio.open_connection(host, int(port))
            streams.append(writer)
            writer.write((1 << 30).to_bytes(4, "big") + b"x" * 1000)
            await writer.drain()
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed on it
            assert member.stats["dropped_stranger_oversize"] == 1
        await wait_until(
            lambda: sum(v for k, v in member.stats.items() if k.startswith("dropped_")) >= 6,
            5,
            "the garbage to be counted",
        )
        async with irismesh.Node(keyring=keys, seeds=[member.endpoint]) as client:
            await client.wait_for_members("db", timeout=5)
            assert await client.request("db", b"still") == b"m0:still"
    finally:
        for writer in streams:
            writer.close()
        rogue.close()
        ctx.term()
        await close_all(*members)


@deadline(30)
async def test_default_bind_is_loopback(keys: irismesh.Keyring) -> None:
    async with irismesh.Node(keyring=keys) as node:
        host = node.endpoint.removeprefix("tcp://").rsplit(":", 1)[0]
        assert host == "127.0.0.1"
        assert socket.inet_aton(host)


@deadline(30)
async def test_a_node_with_another_key_can_neither_see_nor_serve_the_cluster(
    keys: irismesh.Keyring,
) -> None:
    """Same cluster name, different key: no membership either way, nothing leaks."""
    rogue_keys = irismesh.Keyring.generate()
    async with irismesh.Node("db", keyring=keys) as member:
        member.on_request(lambda payload: b"real:" + payload)
        async with (
            irismesh.Node("db", keyring=rogue_keys, seeds=[member.endpoint]) as rogue,
            irismesh.Node(keyring=keys, seeds=[member.endpoint, rogue.endpoint]) as client,
        ):
            rogue.on_request(lambda payload: b"rogue:" + payload)
            await client.wait_for_members("db", timeout=5)
            # The rogue holds another mesh key: its handshake fails its proof both ways,
            # so it never becomes a peer of either node, let alone a member.
            await wait_until(
                lambda: (
                    member.stats.get("dropped_bad_proof", 0) >= 1
                    and rogue.stats.get("dropped_bad_proof", 0) >= 1
                ),
                5,
                "the handshakes with the rogue refused",
            )
            assert [p.node_id for p in client.peers()] == [member.node_id.hex()]
            assert rogue.peers() == []
            assert client.members("db") == [member.node_id.hex()]
            assert rogue.members("db") == []
            for i in range(30):
                assert await client.request("db", b"%d" % i) == b"real:%d" % i
            with pytest.raises(irismesh.NoResponders):
                await rogue.request("db", b"steal")


def test_sync_node_broadcast_and_survey(keys: irismesh.Keyring) -> None:
    seen: list[bytes] = []
    with sync.Node("db", keyring=keys) as member:
        member.on_broadcast(seen.append)
        member.on_survey(lambda payload: b"up")
        with sync.Node(keyring=keys, seeds=[member.endpoint]) as client:
            client.wait_for_members("db", timeout=5)
            assert client.broadcast("db", b"flush", timeout=5) == [member.node_id.hex()]
            assert seen == [b"flush"]
            result = client.survey("db", b"status?", timeout=5)
            assert result.answers == {member.node_id.hex(): b"up"}
            with pytest.raises(irismesh.RemoteError, match="no request handler"):
                client.request("db", b"x", hedge=True)


@deadline(60)
async def test_a_member_keeps_accepting_clients_that_come_and_go(keys: irismesh.Keyring) -> None:
    """Each client's departure closes the member's dial-back link (and its monitor)."""
    async with irismesh.Node("db", keyring=keys) as member:
        member.on_request(lambda payload: b"hi:" + payload)
        for i in range(20):
            async with irismesh.Node(keyring=keys, seeds=[member.endpoint]) as client:
                await client.wait_for_members("db", timeout=5)
                assert await client.request("db", b"%d" % i) == b"hi:%d" % i
                await wait_until(lambda: len(member.peers()) == 1, 5, "the dial-back")


@deadline(30)
async def test_busy_polling_nodes_answer_lone_and_concurrent_requests_and_awaiting_handlers(
    keys: irismesh.Keyring,
) -> None:
    member = await irismesh.Node("db", keyring=keys, busy_poll=0.001).start()
    caller = irismesh.Node(keyring=keys, seeds=[member.endpoint], busy_poll=0.001)
    await caller.start()
    try:

        @member.on_request
        async def handle(payload: bytes) -> bytes:
            if payload.startswith(b"slow"):
                await asyncio.sleep(0.01)  # the member must leave its spin to run this
            return b"re:" + payload

        await caller.wait_for_members("db", 1, timeout=5)
        for i in range(200):  # alone: the caller spins for the reply
            assert await caller.request("db", b"%d" % i, timeout=2) == b"re:%d" % i
        # Each lone request's wait was decided (spun for or slept), what spinning cost is
        # counted, and the member decided each wait for the next request likewise.
        decided = caller.stats["busy_poll_replies_spins"] + caller.stats["busy_poll_replies_slept"]
        served = member.stats["busy_poll_requests_spins"] + member.stats["busy_poll_requests_slept"]
        if cores() >= 2:  # with one core busy polling is off
            assert decided == 200
            assert caller.stats["busy_poll_replies_spun_us"] > 0
            assert served >= 190  # after serving each (the first ones: while starting)
        else:
            assert decided == served == 0
        payloads = [b"%d" % i for i in range(50)] + [b"slow%d" % i for i in range(5)]
        replies = await asyncio.gather(*(caller.request("db", p, timeout=5) for p in payloads))
        assert replies == [b"re:" + p for p in payloads]
        assert await caller.request("db", b"slow-alone", timeout=2) == b"re:slow-alone"
    finally:
        await asyncio.gather(caller.close(), member.close())
    with pytest.raises(irismesh.ConfigurationError):
        irismesh.Node(keyring=keys, busy_poll=1.0)


def test_sync_node_publishes_subscribes_and_tunnels(keys: irismesh.Keyring) -> None:
    with sync.Node("files", keyring=keys) as member:

        @member.on_tunnel
        def upper(tunnel: sync.Tunnel) -> None:
            for message in tunnel:
                tunnel.send(message.upper())

        with sync.Node(keyring=keys, seeds=[member.endpoint]) as client:
            client.wait_for_members("files", 1, timeout=5)
            with member.subscribe("news.#") as sub:
                client.wait_for_subscribers("news.x", 1, timeout=5)
                assert client.publish("news.x", b"one") == 1
                assert client.publish("news.y", b"two") == 1
                got = [sub.get(timeout=5).payload for _ in range(2)]
                assert got == [b"one", b"two"]
                assert sub.missed == 0
            with client.tunnel("files", timeout=5) as tunnel:
                tunnel.send(b"abc")
                tunnel.send(b"x" * 100_000)
                assert tunnel.recv() == b"ABC"
                assert tunnel.recv() == b"X" * 100_000
                tunnel.send_eof()
                assert list(tunnel) == []


@deadline(30)
async def test_peers_report_suspect_and_departed_states(keys: irismesh.Keyring) -> None:
    member = await irismesh.Node("db", keyring=keys).start()
    caller = await irismesh.Node(keyring=keys, seeds=[member.endpoint]).start()
    try:
        await caller.wait_for_members("db", 1, timeout=5)
        [peer] = caller.peers()
        assert (peer.node_id, peer.state) == (member.node_id.hex(), "alive")
        await member.close()
        await wait_until(lambda: not caller.peers(), 5, "the member to leave")
        [gone] = caller.peers(departed=True)
        assert (gone.node_id, gone.state) == (member.node_id.hex(), "left")
    finally:
        await asyncio.gather(caller.close(), member.close())


@deadline(30)
async def test_a_forwarder_answers_later_and_a_reply_callback_gets_each_answer(
    keys: irismesh.Keyring,
) -> None:
    """`forward_requests` hands each request over as it arrives, answered later with `answer`
    (bytes, another member's error, or turned away); a caller that gives up is heard of.
    `request_callback` gets each reply, or each failure, once."""
    member = await irismesh.Node("db", keyring=keys).start()
    held: list[RequestArrived] = []
    gave_up: list[bytes] = []
    loop = asyncio.get_running_loop()

    def forward(request: RequestArrived) -> None:
        assert request.cluster == "db"
        assert request.deadline > loop.time()
        if request.payload == b"hold":
            held.append(request)
        elif request.payload == b"fail":
            member.answer(request, ForwardedError("KeyError", "nope"))
        elif request.payload == b"away":
            member.answer(request, TurnedAway("busy"))
        else:
            loop.call_later(0.01, member.answer, request, b"later:" + request.payload)

    def cancelled(event: RequestCancelled) -> bool:
        known = [r for r in held if r.token[:2] == event.token[:2]]
        for request in known:
            gave_up.append(request.payload)
            member.answer(request, ConnectionAbortedError("gave up"))
        return bool(known)

    member.forward_requests(forward, cancelled)
    client = await irismesh.Node(keyring=keys, seeds=[member.endpoint]).start()
    try:
        await client.wait_for_members("db", timeout=5)
        got: dict[bytes, tuple[bytes | None, BaseException | None]] = {}
        for payload in [b"%d" % i for i in range(50)] + [b"fail", b"away"]:
            client.request_callback(
                "db",
                payload,
                lambda reply, error, payload=payload: got.__setitem__(payload, (reply, error)),
                timeout=5,
            )
        await wait_until(lambda: len(got) == 52, 5, "every answer")
        assert all(got[b"%d" % i] == (b"later:%d" % i, None) for i in range(50))
        failed = got[b"fail"][1]
        assert isinstance(failed, irismesh.RemoteError)
        assert failed.remote_type == "KeyError"
        assert isinstance(got[b"away"][1], irismesh.Overloaded)
        with pytest.raises(irismesh.NoResponders):
            client.request_callback("nobody", b"x", lambda r, e: None, timeout=1)
        holding = client.start_request("db", b"hold", timeout=5)
        await wait_until(lambda: len(held) == 1, 2, "the held request")
        holding.cancel()
        await wait_until(lambda: gave_up == [b"hold"], 2, "the forwarder to hear of it")
        assert client.stats["requests_pending"] == 0
        # Every request was answered: none keeps its place in the member's reply window.
        core = member._core
        assert core is not None
        await wait_until(
            lambda: all(e.status >= 0 for e in core.reply_cache._entries.values()),
            2,
            "every request answered",
        )
    finally:
        await close_all(client, member)


@deadline(30)
async def test_a_handler_may_answer_with_a_future_and_start_request_gives_one(
    keys: irismesh.Keyring,
) -> None:
    """A forwarding handler returns a future (no Task); the caller's side can start a request
    as a future too. An unresolved future is cancelled at its request's deadline."""
    member = await irismesh.Node("db", keyring=keys).start()
    held: list[asyncio.Future[bytes]] = []

    def handle(payload: bytes) -> asyncio.Future[bytes]:
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        if payload == b"hold":
            held.append(future)
        elif payload == b"fail":
            future.set_exception(ValueError("no"))
        else:
            asyncio.get_running_loop().call_later(0.01, future.set_result, b"later:" + payload)
        return future

    member.on_request(handle, admission=False)
    client = await irismesh.Node(keyring=keys, seeds=[member.endpoint]).start()
    try:
        await client.wait_for_members("db", timeout=5)
        replies = [client.start_request("db", b"%d" % i, timeout=5) for i in range(50)]
        assert all(isinstance(r, asyncio.Future) for r in replies)
        assert await asyncio.gather(*replies) == [b"later:%d" % i for i in range(50)]
        with pytest.raises(irismesh.RemoteError, match="ValueError: no"):
            await client.start_request("db", b"fail", timeout=5)
        with pytest.raises(irismesh.RequestTimeout):
            await client.request("db", b"hold", timeout=0.2)
        await wait_until(lambda: held and held[0].cancelled(), 2, "the held future cancelled")
        cancelled = client.start_request("db", b"hold", timeout=5)
        await wait_until(lambda: len(held) == 2, 2, "the second hold")
        cancelled.cancel()
        await wait_until(lambda: held[1].cancelled(), 2, "the member to cancel it too")
        assert client.stats["requests_pending"] == 0
    finally:
        await close_all(client, member)


@deadline(30)
async def test_a_member_serves_clusters_added_and_leaves_those_dropped(
    keys: irismesh.Keyring,
) -> None:
    (member,) = await echo_members(keys, 1)
    client = await irismesh.Node(keyring=keys, seeds=[member.endpoint]).start()
    try:
        await client.wait_for_members("db", timeout=5)
        loop = asyncio.get_running_loop()
        failed = sent = 0
        stop = loop.time() + 20  # bounds the calls below if the change never shows

        async def call_db() -> None:  # requests in flight while the clusters change
            nonlocal failed, sent
            while sent < 2000 and loop.time() < stop:
                sent += 1
                try:
                    reply = await client.request("db", b"x", timeout=5)
                except irismesh.MeshError:
                    failed += 1
                else:
                    failed += reply != b"m0:x"

        calling = asyncio.create_task(call_db())
        await wait_until(lambda: sent > 50, 5, "requests under way")
        member.set_clusters(["db", "cache"])
        assert member.clusters == ("db", "cache")
        # The client, linked before, handshakes again and finds the cluster added.
        await client.wait_for_members("cache", timeout=5)
        assert await client.request("cache", b"y", timeout=5) == b"m0:y"
        await calling
        assert (sent, failed) == (2000, 0)
        member.set_clusters(["cache"])
        await wait_until(lambda: not client.members("db"), 5, "the client to leave db")
        await until_no_responders(client, "db", 10)
        assert await client.request("cache", b"z", timeout=5) == b"m0:z"
        with pytest.raises(irismesh.ConfigurationError):
            member.set_clusters([f"c{i}" for i in range(65)])
        assert member.clusters == ("cache",)
    finally:
        await close_all(client, member)
