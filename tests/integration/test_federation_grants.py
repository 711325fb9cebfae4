"""Gateways in meshes that require grants, on 127.0.0.1: a gateway exports and imports only
what its grant's gateway rights allow, refuses and counts the rest, and a gateway without a
gateway right is not made."""

from __future__ import annotations

import asyncio
import logging
from contextlib import AsyncExitStack

import pytest
from federated import Mesh, gateway
from helpers import deadline, until_no_responders, wait_until

import irismesh
from irismesh import Forbidden
from irismesh._core.rights import Rights
from irismesh.federation import far_answers
from irismesh.security.grants import Authority, Grant
from irismesh.security.identity import Identity

AUTHORITY = Authority.generate()


def granted_mesh(name: str) -> Mesh:
    mesh = Mesh(name)
    mesh.keys = mesh.keys.with_trust([AUTHORITY.public], require_grants=True)
    return mesh


def granted(rights: Rights) -> dict[str, Identity | Grant]:
    identity = Identity.generate()
    return {"identity": identity, "grant": AUTHORITY.grant(identity.public, rights)}


@deadline(60)
async def test_a_gateway_exports_only_what_its_grant_allows() -> None:
    a, b = granted_mesh("a"), Mesh("b")
    link = irismesh.Keyring.generate()
    async with AsyncExitStack() as stack:
        writer = Rights(publish=("feeds.#",))
        publisher = await a.node(stack, **granted(writer))
        for cluster in ("db", "payroll"):
            served = await a.node(stack, cluster, **granted(Rights(serve=(cluster,))))
            served.on_request(lambda payload, cluster=cluster: cluster.encode() + payload)
        allowed = Rights(gateway_export=("db", "feeds.public.#"))
        gw_a = await gateway(
            stack,
            a,
            link,
            listen=True,
            export=("db", "payroll"),
            topics=("feeds.public.#", "feeds.secret.#"),
            **granted(allowed),
        )
        assert gw_a.stats["exports_refused_forbidden"] == 2
        assert (gw_a.export.clusters, gw_a.export.topics) == (("db",), ("feeds.public.#",))
        gw_b = await gateway(stack, b, link, peers=(gw_a.endpoint,))
        client = await stack.enter_async_context(b.new_node())
        got: list[str] = []
        client.subscribe("feeds.#", callback=lambda msg: got.append(msg.topic))
        await client.wait_for_members("db", timeout=10)
        assert await client.request("db", b"x", timeout=5) == b"dbx"
        assert gw_b.imports() == ["db"]
        with pytest.raises(irismesh.NoResponders):
            await client.request("payroll", b"x", timeout=1)
        # A far gateway that ignores the exports asks for payroll anyway: refused, counted.
        end = gw_b.transport.ends[0]
        end.send_plain(["req", 99, "payroll", 1000, b"x"])
        gw_b.transport.flush()
        await wait_until(
            lambda: gw_a.stats.get("requests_refused_forbidden", 0) == 1, 5, "the refusal"
        )
        await gw_b.node.wait_for_subscribers("feeds.public.x", 1, timeout=10)
        await publisher.wait_for_subscribers("feeds.public.x", 1, timeout=10)
        for _ in range(20):
            await publisher.publish("feeds.secret.x", b"no")
            await publisher.publish("feeds.public.x", b"yes")
        await wait_until(lambda: len(got) >= 20, 10, "the public messages across")
        await asyncio.sleep(0.2)  # anything else that crossed would have arrived with them
        assert got == ["feeds.public.x"] * 20
        assert gw_a.stats["messages_exported"] == 20


@deadline(60)
async def test_a_gateway_imports_only_what_its_grant_allows() -> None:
    a, b = Mesh("a"), granted_mesh("b")
    link = irismesh.Keyring.generate()
    async with AsyncExitStack() as stack:
        publisher = await a.node(stack)
        gw_a = await gateway(
            stack, a, link, listen=True, export=("db", "payroll"), topics=("news.#", "alerts.#")
        )
        allowed = Rights(gateway_import=("db", "news.#"))
        gw_b = await gateway(stack, b, link, peers=(gw_a.endpoint,), **granted(allowed))
        reader = Rights(subscribe=("news.#", "alerts.#"))
        client = await stack.enter_async_context(b.new_node(**granted(reader)))
        got: list[str] = []
        for pattern in ("news.#", "alerts.#"):
            client.subscribe(pattern, callback=lambda msg: got.append(msg.topic))
        await wait_until(lambda: gw_b.stats.get("imports_refused_forbidden", 0) == 1, 10, "payroll")
        assert gw_b.imports() == ["db"]
        await publisher.wait_for_subscribers("news.x", 1, timeout=10)
        await gw_b.node.wait_for_subscribers("news.x", 1, timeout=10)
        for _ in range(20):
            await publisher.publish("alerts.x", b"no")
            await publisher.publish("news.x", b"yes")
        await wait_until(lambda: len(got) >= 20, 10, "the news across")
        await wait_until(
            lambda: gw_b.stats.get("crossings_refused_forbidden", 0) == 20, 5, "the alerts refused"
        )
        assert got == ["news.x"] * 20
        assert gw_b.stats["messages_republished"] == 20
        assert client.stats.get("dropped_publish_forbidden", 0) == 0


def test_a_gateway_without_a_gateway_right_is_not_made() -> None:
    mesh = granted_mesh("a")
    link = irismesh.Keyring.generate()
    options = {"keyring": mesh.keys, "link_keyring": link, "listen": "tcp://127.0.0.1:0"}
    with pytest.raises(Forbidden) as caught:
        irismesh.Gateway("a", export=("db",), **options, **granted(Rights(call=("db",))))
    assert (caught.value.name, caught.value.right) == ("a", "gateway")
    assert "no gateway right" in str(caught.value)
    with pytest.raises(Forbidden) as caught:
        irismesh.Gateway("a", export=("db",), **options, identity=Identity.generate())
    assert "has none" in str(caught.value)


@deadline(90)
async def test_imported_clusters_are_served_where_both_meshes_require_grants() -> None:
    # Where grants are required, the gateway's own node serves what it imports: it holds the
    # grant whose `import` lets it, which callers there check as any member's.
    a, b = granted_mesh("a"), granted_mesh("b")
    link = irismesh.Keyring.generate()
    async with AsyncExitStack() as stack:
        for cluster in ("db", "payroll"):
            served = await a.node(stack, cluster, **granted(Rights(serve=(cluster,))))
            served.on_request(lambda payload, cluster=cluster: cluster.encode() + payload)
            served.on_survey(lambda payload, cluster=cluster: b"survey " + cluster.encode())

            @served.on_tunnel
            async def echo(tunnel: irismesh.Tunnel) -> None:
                async for message in tunnel:
                    await tunnel.send(message)

        exporter = Rights(gateway_export=("db", "payroll"))
        gw_a = await gateway(
            stack, a, link, listen=True, export=("db", "payroll"), **granted(exporter)
        )
        importer = Rights(gateway_import=("db",))
        gw_b = await gateway(stack, b, link, peers=(gw_a.endpoint,), **granted(importer))
        caller = Rights(call=("db", "payroll", "_gateway"))
        client = await stack.enter_async_context(b.new_node(**granted(caller)))
        await client.wait_for_members("db", timeout=10)
        assert gw_b.imports() == ["db"]
        assert client.members("db") == [gw_b.node.node_id.hex()]  # the gateway's own node
        failed = 0
        for i in range(200):
            try:
                reply = await client.request("db", b"%d" % i, timeout=5)
            except irismesh.MeshError:
                failed += 1
            else:
                failed += reply != b"db%d" % i
        assert failed == 0
        assert gw_b.stats["requests_forwarded"] >= 200
        survey = await client.survey("db", b"", timeout=5)
        assert list(far_answers(survey).values()) == [b"survey db"]
        async with client.tunnel("db", timeout=5) as tunnel:
            await tunnel.send(b"through")
            assert await tunnel.recv() == b"through"
        # The gateway's own cluster is still answered (what `mesh top` asks).
        report = await client.survey("_gateway", b"", timeout=5)
        assert len(report.answers) == 1
        # A cluster beyond the gateway's import right is still refused.
        assert gw_b.stats["imports_refused_forbidden"] == 1
        with pytest.raises(irismesh.NoResponders):
            await client.request("payroll", b"x", timeout=1)
        # The link gone, nothing exports db: the gateway's node stops serving it.
        await gw_a.close()
        await wait_until(lambda: gw_b.imports() == [], 10, "db no longer imported")
        assert "db" not in gw_b.node.clusters
        # Its callers hear of it at once (their links handshake again), and every node of the
        # mesh from the gateway node's new record: requests then fail at once.
        await wait_until(lambda: not client.members("db"), 10, "the client to leave db")
        await until_no_responders(client, "db", 10)


@deadline(60)
async def test_gateways_in_one_process_serve_each_others_clusters_under_grants() -> None:
    # Each gateway's node serves what the other exports and relays its requests core to core
    # to the other gateway's node, which asks its own mesh: both ways at once.
    a, b = granted_mesh("a"), granted_mesh("b")
    async with AsyncExitStack() as stack:
        for mesh, cluster in ((a, "db"), (b, "search")):
            served = await mesh.node(stack, cluster, **granted(Rights(serve=(cluster,))))
            served.on_request(lambda payload, cluster=cluster: cluster.encode() + payload)
        rights_a = Rights(gateway_export=("db",), gateway_import=("search",))
        rights_b = Rights(gateway_export=("search",), gateway_import=("db",))
        joined = await stack.enter_async_context(
            irismesh.LocalGateways(
                [
                    a.gateway(export=["db"], **granted(rights_a)),
                    b.gateway(export=["search"], **granted(rights_b)),
                ]
            )
        )
        client_a = await stack.enter_async_context(a.new_node(**granted(Rights(call=("search",)))))
        client_b = await stack.enter_async_context(b.new_node(**granted(Rights(call=("db",)))))
        await client_a.wait_for_members("search", timeout=10)
        await client_b.wait_for_members("db", timeout=10)
        assert client_b.members("db") == [joined["b"].node.node_id.hex()]

        async def calls(client: irismesh.Node, cluster: str) -> int:
            replies = await asyncio.gather(
                *(client.request(cluster, b"%d" % i, timeout=5) for i in range(200)),
                return_exceptions=True,
            )
            return sum(reply != cluster.encode() + b"%d" % i for i, reply in enumerate(replies))

        failed = await asyncio.gather(calls(client_a, "search"), calls(client_b, "db"))
        assert failed == [0, 0]
        assert joined["a"].stats["requests_forwarded"] >= 200
        assert joined["b"].stats["requests_forwarded"] >= 200


def trusting_link() -> irismesh.Keyring:
    """A link keyring whose gateways trust AUTHORITY for far gateways' grants."""
    return irismesh.Keyring.generate().with_trust([AUTHORITY.public])


@deadline(60)
async def test_a_gateway_requiring_far_grants_refuses_far_gateways_without_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "irismesh.federation")
    a, b = Mesh("a"), Mesh("b")
    link = trusting_link()
    async with AsyncExitStack() as stack:
        gw_a = await gateway(
            stack,
            a,
            link,
            listen=True,
            export=("db",),
            require_far_grants=True,
            **granted(Rights(gateway_export=("db",))),
        )
        # An earlier release's gateway, or one without the switch: it shows no grant.
        plain = await gateway(stack, b, link, peers=(gw_a.endpoint,))
        await wait_until(lambda: gw_a.stats.get("link_dropped_no_grant", 0) >= 1, 10, "no grant")
        # A grant from an authority nobody here trusts.
        stranger = Authority.generate()
        identity = Identity.generate()
        untrusted = stranger.grant(identity.public, Rights(gateway_import=("db",)))
        await gateway(
            stack,
            b,
            link,
            peers=(gw_a.endpoint,),
            require_far_grants=True,
            identity=identity,
            grant=untrusted,
        )
        await wait_until(
            lambda: gw_a.stats.get("link_dropped_grant_refused", 0) >= 1, 10, "untrusted grant"
        )
        assert gw_a.stats["links_up"] == 0
        assert plain.stats["links_up"] == 0
        assert gw_a.stats["links"] == 0  # a refused gateway keeps no link end there
        refusals = [r.getMessage() for r in caplog.records if "link refused" in r.getMessage()]
        assert len(refusals) == 2  # once per gateway and reason, though each dials again
        assert "no_grant: the far gateway presented no grant" in refusals[0]
        assert "grant_refused" in refusals[1]


@deadline(60)
async def test_a_far_grant_limits_what_crosses_and_its_revocation_closes_the_link() -> None:
    a, b = Mesh("a"), Mesh("b")
    link = trusting_link()
    async with AsyncExitStack() as stack:
        publisher = await a.node(stack)
        for cluster in ("db", "payroll", "audit"):
            served = await a.node(stack, cluster)
            served.on_request(lambda payload, cluster=cluster: cluster.encode() + payload)
        # a's gateway offers payroll, which its grant does not let it export: b takes it not.
        # And it sends secret.#, which its grant does not let it export: b drops it.
        exporting = Rights(gateway_export=("db", "audit", "news.#", "alerts.#"))
        gw_a = await gateway(
            stack,
            a,
            link,
            listen=True,
            export=("db", "payroll", "audit"),
            topics=("news.#", "alerts.#", "secret.#"),
            require_far_grants=True,
            **granted(exporting),
        )
        # b's gateway may import db, payroll and news: its calls to audit go unanswered, and
        # alerts are not sent to it.
        importing = granted(Rights(gateway_import=("db", "payroll", "news.#", "secret.#")))
        gw_b = await gateway(
            stack, b, link, peers=(gw_a.endpoint,), require_far_grants=True, **importing
        )
        client = await stack.enter_async_context(b.new_node())
        got: list[str] = []
        for pattern in ("news.#", "alerts.#", "secret.#"):
            client.subscribe(pattern, callback=lambda msg: got.append(msg.topic))
        await client.wait_for_members("db", timeout=10)
        assert await client.request("db", b"x", timeout=5) == b"dbx"
        assert gw_b.imports() == ["audit", "db"]
        assert gw_b.stats["link_far_exports_refused"] >= 1
        await client.wait_for_members("audit", timeout=10)
        with pytest.raises(irismesh.MeshError) as caught:
            await client.request("audit", b"x", timeout=5)
        assert "does not import it" in str(caught.value)
        assert gw_a.stats["requests_refused_far_grant"] == 1
        with pytest.raises(irismesh.NoResponders):
            await client.request("payroll", b"x", timeout=1)
        await publisher.wait_for_subscribers("news.x", 1, timeout=10)
        await gw_b.node.wait_for_subscribers("news.x", 1, timeout=10)
        await publisher.wait_for_subscribers("secret.x", 1, timeout=10)
        for _ in range(20):
            await publisher.publish("alerts.x", b"no")
            await publisher.publish("secret.x", b"no")
            await publisher.publish("news.x", b"yes")
        await wait_until(lambda: len(got) >= 20, 10, "the news across")
        await wait_until(
            lambda: gw_a.stats.get("crossings_withheld_far_grant", 0) == 20, 5, "alerts withheld"
        )
        await wait_until(
            lambda: gw_b.stats.get("crossings_refused_far_grant", 0) == 20, 5, "secrets dropped"
        )
        assert got == ["news.x"] * 20
        # b's gateway is revoked: its link closes at a's next tick, and stays refused.
        b_key = importing["identity"].public  # type: ignore[union-attr]
        assert gw_a.revoke(AUTHORITY.revoke(b_key))
        await wait_until(lambda: gw_a.stats.get("link_closed_grant", 0) == 1, 5, "link closed")
        await wait_until(
            lambda: gw_a.stats.get("link_dropped_revoked", 0) >= 1, 10, "its HELLO refused"
        )
        assert gw_a.stats["links_up"] == 0


@deadline(60)
async def test_a_changed_grant_is_shown_to_the_far_gateway_at_once() -> None:
    a, b = Mesh("a"), Mesh("b")
    link = trusting_link()
    async with AsyncExitStack() as stack:
        for cluster in ("db", "audit"):
            served = await a.node(stack, cluster)
            served.on_request(lambda payload, cluster=cluster: cluster.encode() + payload)
        everything = Rights(gateway_export=("db", "audit"))
        gw_a = await gateway(
            stack,
            a,
            link,
            listen=True,
            export=("db", "audit"),
            require_far_grants=True,
            **granted(everything),
        )
        importing = granted(Rights(gateway_import=("db",)))
        gw_b = await gateway(
            stack, b, link, peers=(gw_a.endpoint,), require_far_grants=True, **importing
        )
        client = await stack.enter_async_context(b.new_node())
        await client.wait_for_members("audit", timeout=10)
        [shown] = gw_a.links()
        identity = importing["identity"]
        assert isinstance(identity, Identity)
        assert shown["identity"] == identity.public.hex()
        assert shown["grant"] == {"gateway_import": ["db"]}
        with pytest.raises(irismesh.MeshError):
            await client.request("audit", b"x", timeout=5)
        # Its grant renewed with audit: it handshakes again, and a's gateway answers for audit.
        gw_b.node.use_grant(
            AUTHORITY.grant(identity.public, Rights(gateway_import=("db", "audit")))
        )
        await wait_until(lambda: gw_b.stats.get("link_rehandshakes", 0) == 1, 5, "handshake")
        await wait_until(
            lambda: (
                [g["grant"] for g in gw_a.links() if g["up"]]
                == [{"gateway_import": ["db", "audit"]}]
            ),
            5,
            "the new grant seen",
        )
        # The link went down for the handshake, and with it what b's gateway imports over it.
        await client.wait_for_members("audit", timeout=10)
        assert await client.request("audit", b"x", timeout=5) == b"auditx"
        assert gw_a.stats["requests_refused_far_grant"] == 1
        # a's gateway, which listens, renews its grant: it asks b's to handshake again.
        a_identity = gw_a.node.identity
        gw_a.node.use_grant(AUTHORITY.grant(a_identity.public, Rights(gateway_export=("db",))))
        await wait_until(lambda: gw_a.stats.get("link_rehandshakes_asked", 0) == 1, 5, "asked")
        await wait_until(
            lambda: [g["grant"] for g in gw_b.links() if g["up"]] == [{"gateway_export": ["db"]}],
            5,
            "a's new grant seen",
        )
        assert gw_b.stats["link_rehandshakes"] == 2
        await wait_until(lambda: gw_b.imports() == ["db"], 5, "audit no longer imported")
