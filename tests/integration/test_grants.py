"""Grants on running nodes: who may serve, call, publish and subscribe; expiry, rereading the
grant file, and revocation (the token format itself is in tests/core/test_grants.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from helpers import deadline, wait_until

import irismesh
from irismesh import Forbidden, Keyring
from irismesh._core.rights import Rights
from irismesh.security.grants import Authority, Grant
from irismesh.security.identity import Identity

AUTHORITY = Authority.generate()


def keyring(*, required: bool = True) -> Keyring:
    return Keyring.generate(["*"]).with_trust([AUTHORITY.public], require_grants=required)


def granted(rights: Rights, *, lifetime: float = 3600) -> tuple[Identity, Grant]:
    identity = Identity.generate()
    return identity, AUTHORITY.grant(identity.public, rights, expires_in=lifetime)


def node(keys: Keyring, rights: Rights | None, cluster: str | None = None, **kw: object):  # type: ignore[no-untyped-def]
    identity, grant = granted(rights) if rights is not None else (Identity.generate(), None)
    return irismesh.Node(
        cluster, keyring=keys, identity=identity, grant=grant, discovery=False, **kw
    )


def caller_with_file(keys: Keyring, identity: Identity, path: Path, member: irismesh.Node):  # type: ignore[no-untyped-def]
    """A caller whose grant is the file at `path` (reread while it runs), seeded with `member`."""
    return irismesh.Node(
        keyring=keys, identity=identity, grant=path, seeds=[member.endpoint], discovery=False
    )


def test_a_member_without_serve_is_never_called_and_counts_its_refusal() -> None:
    """The node holds db's key and starts as a member of db, but its grant says `call db`
    only: it never offers db, and none of 10,000 requests from callers reaches it."""

    async def main() -> None:
        keys = keyring()
        async with node(keys, Rights(serve=("db",)), "db") as member:  # noqa: SIM117
            async with node(keys, Rights(call=("db",)), "db", seeds=[member.endpoint]) as rogue:
                reached: list[int] = [0, 0]

                def serve_member(payload: bytes) -> bytes:
                    reached[0] += 1
                    return b"member"

                def serve_rogue(payload: bytes) -> bytes:
                    reached[1] += 1
                    return b"rogue"

                member.on_request(serve_member)
                rogue.on_request(serve_rogue)
                assert rogue.stats["serve_refused"] == 1
                async with node(keys, Rights(call=("db",)), seeds=[member.endpoint]) as caller:
                    await caller.wait_for_peers(2, timeout=5)
                    await caller.wait_for_members("db", timeout=5)
                    answers: set[bytes] = set()
                    for _ in range(100):  # 100 at a time: one member's queue takes them
                        batch = [caller.request("db", b"x", timeout=10) for _ in range(100)]
                        answers.update(await asyncio.gather(*batch))
                    assert answers == {b"member"}
                    assert reached == [10_000, 0]
                    assert caller.members("db") == [member.node_id.hex()]

    asyncio.run(main())


def test_a_caller_without_call_gets_forbidden_at_once() -> None:
    async def main() -> None:
        keys = keyring()
        async with node(keys, Rights(serve=("db", "payroll")), "db", clusters=["payroll"]) as m:
            m.on_request(lambda payload: payload)
            async with node(keys, Rights(call=("db",)), seeds=[m.endpoint]) as caller:
                await caller.wait_for_members("db", timeout=5)
                assert await caller.request("db", b"x", timeout=5) == b"x"
                started = time.perf_counter()
                with pytest.raises(Forbidden) as caught:
                    await caller.request("payroll", b"x", timeout=5)
                assert time.perf_counter() - started < 0.1
                assert (caught.value.name, caught.value.right) == ("payroll", "call")
                with pytest.raises(Forbidden):
                    await caller.broadcast("payroll", b"x")
                with pytest.raises(Forbidden):
                    await caller.survey("payroll", b"x", timeout=1)

    asyncio.run(main())


def test_a_member_refuses_a_caller_whose_grant_lacks_call() -> None:
    """A caller that ignores its own grant (its local check bypassed) is refused by the
    member with a typed Forbidden, at once, and the member counts it."""

    async def main() -> None:
        keys = keyring()
        async with node(keys, Rights(serve=("payroll",)), "payroll") as member:
            member.on_request(lambda payload: payload)
            async with node(keys, Rights(call=("db",)), seeds=[member.endpoint]) as caller:
                await caller.wait_for_peers(1, timeout=5)
                core = caller._core
                assert core is not None
                core.calls.rights = Rights(call=("*",))  # as a modified node would
                await wait_until(lambda: caller.known_members("payroll"), 5, "the member")
                with pytest.raises(Forbidden) as caught:
                    await caller.request("payroll", b"x", timeout=5)
                assert caught.value.detail == "refused by the member"
                assert member.stats["refused_forbidden"] == 1

    asyncio.run(main())


def test_subscribing_and_publishing_need_their_rights() -> None:
    async def main() -> None:
        keys = keyring()
        reader = Rights(subscribe=("feeds.#",), publish=("feeds.#",))
        async with node(keys, reader) as subscriber:
            async with node(keys, Rights(call=("db",)), seeds=[subscriber.endpoint]) as outsider:
                with pytest.raises(Forbidden) as caught:
                    async with outsider.subscribe("feeds.#"):
                        pass
                assert caught.value.right == "subscribe"
                with pytest.raises(Forbidden):
                    await outsider.publish("feeds.x", b"no")
                # The memory's paths follow the same rights, checked before anything is sent.
                with pytest.raises(Forbidden):
                    await outsider.publish("feeds.x", b"no", retain=True)
                with pytest.raises(Forbidden):
                    await outsider.reread("feeds.#")
                with pytest.raises(Forbidden):
                    await outsider.enqueue("payroll", b"job")
            async with (
                subscriber.subscribe("feeds.#") as sub,
                node(keys, reader, seeds=[subscriber.endpoint]) as publisher,
            ):
                await publisher.wait_for_subscribers("feeds.x", 1, timeout=5)
                await publisher.publish("feeds.x", b"yes")
                message = await asyncio.wait_for(sub.__anext__(), 5)
                assert message.payload == b"yes"

    asyncio.run(main())


def test_a_publisher_never_sends_to_a_subscriber_without_the_right() -> None:
    """A subscriber that ignores its own grant tells the publisher its pattern anyway: the
    publisher keeps none of it, so it never gets a message."""

    async def main() -> None:
        keys = keyring()
        async with node(keys, Rights(call=("db",))) as rogue:
            core = rogue._core
            assert core is not None
            core.pubsub.rights = Rights(subscribe=("#",))  # as a modified node would
            async with rogue.subscribe("feeds.#") as sub:
                writer = Rights(publish=("feeds.#",))
                async with node(keys, writer, seeds=[rogue.endpoint]) as publisher:
                    await publisher.wait_for_peers(1, timeout=5)
                    await wait_until(
                        lambda: publisher.stats.get("refused_forbidden", 0) >= 1,
                        5,
                        "the publisher to refuse the interest",
                    )
                    for _ in range(20):
                        await publisher.publish("feeds.x", b"secret")
                    with pytest.raises(asyncio.TimeoutError):
                        await asyncio.wait_for(sub.__anext__(), 0.5)

    asyncio.run(main())


def test_without_require_grants_nothing_changes() -> None:
    async def main() -> None:
        keys = keyring(required=False)
        async with node(keys, None, "db") as member:
            member.on_request(lambda payload: payload)
            async with node(keys, None, seeds=[member.endpoint]) as caller:
                await caller.wait_for_members("db", timeout=5)
                assert await caller.request("db", b"x", timeout=5) == b"x"

    asyncio.run(main())


def test_an_expired_grant_stops_and_a_renewed_file_is_taken(tmp_path: Path) -> None:
    async def main() -> None:
        keys = keyring()
        identity = Identity.generate()
        path = tmp_path / "caller.grant"
        AUTHORITY.grant(identity.public, Rights(call=("db",)), expires_in=3).save(path)
        async with node(keys, Rights(serve=("db",)), "db") as member:
            member.on_request(lambda payload: payload)
            async with caller_with_file(keys, identity, path, member) as caller:
                await caller.wait_for_members("db", timeout=5)
                assert await caller.request("db", b"x", timeout=5) == b"x"
                expires = caller.grants.grant.expires  # type: ignore[union-attr]
                while time.time() < expires - 0.3:
                    assert await caller.request("db", b"x", timeout=5) == b"x"
                    await asyncio.sleep(0.05)
                failing = 0.0
                deadline = expires + 2
                while time.time() < deadline:
                    try:
                        await caller.request("db", b"x", timeout=1)
                    except Forbidden:
                        failing = time.time()
                        break
                    await asyncio.sleep(0.02)
                assert failing
                assert failing - expires < 1.0
                AUTHORITY.grant(identity.public, Rights(call=("db",))).save(path)

                async def works() -> bool:
                    try:
                        return await caller.request("db", b"y", timeout=1) == b"y"
                    except (Forbidden, irismesh.RequestTimeout):  # not yet taken; redialling
                        return False

                # Taken within two polls of the file; a busy machine may add the redial to
                # the member, whose links closed at the expiry.
                deadline = time.time() + 10
                renewed = False
                while not renewed and time.time() < deadline:
                    renewed = await works()
                    await asyncio.sleep(0.05)
                assert renewed

    asyncio.run(main())


def test_a_call_in_flight_fails_forbidden_when_the_grant_stops_allowing_it(
    tmp_path: Path,
) -> None:
    """The grant file is rewritten without `call db` while a request waits on db's handler:
    the request fails with Forbidden within two polls of the file, not at its deadline, and
    the member hears that the caller gave up."""

    async def main() -> None:
        keys = keyring()
        identity = Identity.generate()
        path = tmp_path / "caller.grant"
        AUTHORITY.grant(identity.public, Rights(call=("db",))).save(path)
        arrived = asyncio.Event()
        release = asyncio.Event()

        async def slow(payload: bytes) -> bytes:
            arrived.set()
            await release.wait()
            return payload

        async with node(keys, Rights(serve=("db",)), "db") as member:
            member.on_request(slow)
            async with caller_with_file(keys, identity, path, member) as caller:
                await caller.wait_for_members("db", timeout=5)
                call = asyncio.ensure_future(caller.request("db", b"x", timeout=60))
                await asyncio.wait_for(arrived.wait(), 5)
                AUTHORITY.grant(identity.public, Rights(call=("other",))).save(path)
                with pytest.raises(Forbidden):
                    await asyncio.wait_for(call, 5)
                assert caller.stats["calls_forbidden"] == 1
                await wait_until(
                    lambda: member.stats.get("cancels_received", 0) == 1, 5, "the member heard"
                )
                release.set()

    asyncio.run(main())


def test_a_revoked_caller_is_refused_and_others_go_on() -> None:
    async def main() -> None:
        keys = keyring()
        async with node(keys, Rights(serve=("db",)), "db") as member:
            member.on_request(lambda payload: payload)
            async with (
                node(keys, Rights(call=("db",)), seeds=[member.endpoint]) as revoked,
                node(keys, Rights(call=("db",)), seeds=[member.endpoint]) as other,
            ):
                await revoked.wait_for_members("db", timeout=5)
                await other.wait_for_members("db", timeout=5)
                assert await revoked.request("db", b"x", timeout=5) == b"x"
                assert member.revoke(AUTHORITY.revoke(revoked.identity.public))
                await wait_until(
                    lambda: member.stats.get("links_closed_grant", 0) >= 1, 2, "the link closed"
                )
                with pytest.raises(irismesh.MeshError):
                    await revoked.request("db", b"x", timeout=1)
                assert await other.request("db", b"y", timeout=5) == b"y"

    asyncio.run(main())


def test_the_memory_keeps_revocations_for_nodes_that_start_later(tmp_path: Path) -> None:
    async def main() -> None:
        keys = keyring()
        victim = Identity.generate()
        revocation = AUTHORITY.revoke(victim.public)
        async with node(keys, Rights(memory=True), memory=tmp_path / "memory") as store:
            async with node(keys, Rights(call=("db",)), seeds=[store.endpoint]) as announcer:
                await announcer.wait_for_members("_memory", timeout=5)
                assert announcer.revoke(revocation)
                await announcer.keep_revocation(revocation)
            async with node(keys, Rights(call=("db",)), seeds=[store.endpoint]) as late:
                await wait_until(
                    lambda: victim.public in late.grants.revocations, 5, "the late node to learn it"
                )
                assert late.stats["revocations_applied"] == 1

    asyncio.run(main())


def test_a_grant_of_the_largest_size_travels_in_a_handshake() -> None:
    names = (*(f"cluster-{i:03d}" for i in range(70)), "db")
    identity = Identity.generate()
    grant = AUTHORITY.grant(identity.public, Rights(call=names))
    assert 1000 < len(grant.token) <= 1024
    with pytest.raises(irismesh.ConfigurationError):
        AUTHORITY.grant(identity.public, Rights(call=(*names, *names)))

    async def main() -> None:
        keys = keyring()
        async with node(keys, Rights(serve=("db",)), "db") as member:
            member.on_request(lambda payload: payload)
            async with irismesh.Node(
                keyring=keys,
                identity=identity,
                grant=grant,
                seeds=[member.endpoint],
                discovery=False,
            ) as caller:
                await caller.wait_for_members("db", timeout=5)
                assert await caller.request("db", b"x", timeout=5) == b"x"

    asyncio.run(main())


@deadline(60)
async def test_a_revoked_member_leaves_every_table_and_cannot_refute() -> None:
    """Four nodes; a caller loads db's two members while one of them is revoked. Every other
    node drops the revoked one from membership within 2 s, its refutations are refused and
    counted, it is never routed to again, and none of the caller's requests fails. A grant
    issued after the revocation brings it back everywhere."""
    keys = keyring()
    db = Rights(serve=("db",), call=("db",))
    async with node(keys, db, "db") as kept:
        kept.on_request(lambda payload: b"kept")
        async with (
            node(keys, db, "db", seeds=[kept.endpoint]) as revoked,
            node(keys, Rights(call=("db",)), seeds=[kept.endpoint]) as caller,
            node(keys, Rights(call=("db",)), seeds=[kept.endpoint]) as watcher,
        ):
            revoked.on_request(lambda payload: b"revoked")
            others = (kept, caller, watcher)
            for each in (*others, revoked):
                await each.wait_for_peers(3, timeout=10)
            await wait_until(lambda: len(caller.members("db")) == 2, 10, "both db members")
            failed = answered = 0
            stop = asyncio.Event()

            async def load() -> None:
                nonlocal failed, answered
                while not stop.is_set():
                    batch = [caller.request("db", b"x", timeout=5) for _ in range(20)]
                    for outcome in await asyncio.gather(*batch, return_exceptions=True):
                        if isinstance(outcome, BaseException):
                            failed += 1
                        else:
                            answered += 1

            loader = asyncio.create_task(load())
            await wait_until(lambda: answered >= 200, 10, "the load to start")
            gone = revoked.node_id.hex()
            kept.revoke(AUTHORITY.revoke(revoked.identity.public))
            taken = await wait_until(
                lambda: all(gone not in {p.node_id for p in n.peers()} for n in others),
                2,
                "every other node to drop the revoked member",
            )
            await wait_until(
                lambda: revoked.stats.get("refutations", 0) >= 1, 5, "the revoked node to refute"
            )
            # Gossip no longer reaches it: it is told of its revocation along with its death.
            await wait_until(
                lambda: revoked.identity.public in revoked.grants.revocations,
                2,
                "the revoked node to learn why",
            )
            await wait_until(
                lambda: sum(n.stats.get("dropped_revoked_alive", 0) for n in others) >= 1,
                5,
                "a refutation refused",
            )
            # Its refutations change nothing: it stays out of every table, and unrouted.
            settled = answered
            await wait_until(lambda: answered >= settled + 500, 10, "more requests answered")
            stop.set()
            await loader
            assert failed == 0
            assert taken < 2
            for each in others:
                assert gone not in {p.node_id for p in each.peers()}
                assert each.stats["members_revoked"] == 1
            assert caller.members("db") == [kept.node_id.hex()]
            after = [await caller.request("db", b"x", timeout=5) for _ in range(50)]
            assert set(after) == {b"kept"}
            # A grant issued after the revocation brings it back: dialled when it speaks, it
            # proves the grant at the handshake, and every node takes its records again.
            revoked.use_grant(AUTHORITY.grant(revoked.identity.public, db, issued=time.time() + 2))
            await wait_until(
                lambda: all(gone in {p.node_id for p in n.peers()} for n in others),
                20,
                "the member granted again to be back",
            )
            assert [n.stats.get("revoked_members_regranted", 0) for n in others] == [1, 1, 1]
            await wait_until(lambda: len(caller.members("db")) == 2, 10, "both db members")
            # Routed to again: bursts of concurrent requests until it answers one, for at most
            # 10 s (which member the balancer prefers meanwhile is not what this test is about).
            served: set[bytes] = set()
            until = time.monotonic() + 10
            while b"revoked" not in served and time.monotonic() < until:
                burst = [caller.request("db", b"x", timeout=5) for _ in range(20)]
                served.update(await asyncio.gather(*burst))
            assert b"revoked" in served


@deadline(30)
async def test_a_subscriber_drops_what_its_publisher_may_not_publish() -> None:
    """A publisher that ignores its own grant (its check bypassed, as a modified node would)
    really sends a topic its grant does not allow: the subscriber drops and counts each such
    message, delivers the allowed ones, and decides each (link, topic) once."""
    keys = keyring()
    writer = Rights(publish=("feeds.public",))
    async with (
        node(keys, Rights(subscribe=("feeds.#",))) as subscriber,
        subscriber.subscribe("feeds.#") as sub,
        node(keys, writer, seeds=[subscriber.endpoint]) as rogue,
    ):
        core = rogue._core
        assert core is not None
        core.pubsub.rights = Rights(publish=("#",))  # its own check bypassed
        await rogue.wait_for_subscribers("feeds.public", 1, timeout=5)
        for i in range(50):
            await rogue.publish("feeds.secret", b"%d" % i)
            await rogue.publish("feeds.public", b"%d" % i)
        assert rogue.stats.get("publishes_forbidden", 0) == 0  # it really sent
        got = []
        for _ in range(50):
            message = await asyncio.wait_for(sub.__anext__(), 5)
            got.append((message.topic, message.payload))
        assert got == [("feeds.public", b"%d" % i) for i in range(50)]
        await wait_until(
            lambda: subscriber.stats.get("dropped_publish_forbidden", 0) == 50,
            5,
            "the forbidden messages counted",
        )
        assert subscriber.stats["publisher_topics_checked"] == 2
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(sub.__anext__(), 0.3)


@deadline(30)
async def test_without_grants_a_subscriber_checks_no_publisher() -> None:
    keys = keyring(required=False)
    async with (
        node(keys, None) as subscriber,
        subscriber.subscribe("feeds.#") as sub,
        node(keys, None, seeds=[subscriber.endpoint]) as publisher,
    ):
        await publisher.wait_for_subscribers("feeds.x", 1, timeout=5)
        await publisher.publish("feeds.x", b"x")
        assert (await asyncio.wait_for(sub.__anext__(), 5)).payload == b"x"
        assert "publisher_topics_checked" not in subscriber.stats


@deadline(60)
async def test_the_memory_checks_its_callers_topic_rights(tmp_path: Path) -> None:
    """A caller that ignores its own grant (its checks bypassed) asks the memory for what its
    grant does not allow: the memory member refuses each with Forbidden, which the caller
    raises, counts it, and still serves what the grant allows."""
    keys = keyring()
    feeds = Rights(publish=("feeds.#",), subscribe=("feeds.#",), call=("db",))
    holder = Rights(memory=True, subscribe=("#",))
    async with node(keys, holder, memory=tmp_path / "memory") as store:  # noqa: SIM117
        async with node(keys, feeds, seeds=[store.endpoint]) as rogue:
            await rogue.wait_for_members("_memory", timeout=5)
            core = rogue._core
            assert core is not None
            core.pubsub.rights = Rights(publish=("#",), subscribe=("#",))  # as modified
            core.calls.rights = Rights(call=("*",))
            await rogue.publish("feeds.x", b"kept", retain=True)
            with pytest.raises(Forbidden) as caught:
                await rogue.publish("secret.x", b"no", retain=True, timeout=5)
            assert (caught.value.name, caught.value.right) == ("secret.x", "publish")
            with pytest.raises(Forbidden) as caught:
                await rogue.reread("secret.#", timeout=5)
            assert (caught.value.name, caught.value.right) == ("secret.#", "subscribe")
            with pytest.raises(Forbidden) as caught:
                await rogue.enqueue("payroll", b"job", timeout=5)
            assert (caught.value.name, caught.value.right) == ("payroll", "call")
            assert [m.payload for m in await rogue.reread("feeds.#", timeout=5)] == [b"kept"]
            assert store.stats["memory_refused_forbidden"] == 3
            assert [m.topic for m in await store.reread("#", timeout=5)] == ["feeds.x"]
