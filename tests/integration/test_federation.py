"""Gateways between meshes on 127.0.0.1: each mesh its own keyring, joined only by gateways."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from contextlib import AsyncExitStack

import pytest
from helpers import wait_until

import irismesh
from irismesh.federation import LinkConfig

LOCAL = "tcp://127.0.0.1:0"
FAST = LinkConfig(heartbeat=0.1, dead_after=0.6, retry=0.2, resend_after=0.4)


def run(coro: Awaitable[None], timeout: float = 45) -> None:
    async def bounded() -> None:
        await asyncio.wait_for(coro, timeout)

    asyncio.run(bounded())


class Mesh:
    """One mesh: its keyring, and the endpoint of a node that others join through."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.keys = irismesh.Keyring.generate()
        self.seeds: list[str] = []

    def node(self, cluster: str | None = None, **kwargs: object) -> irismesh.Node:
        return irismesh.Node(
            cluster,
            keyring=self.keys,
            seeds=list(self.seeds),
            bind=LOCAL,
            **kwargs,  # type: ignore[arg-type]
        )


async def member(stack: AsyncExitStack, mesh: Mesh, cluster: str, prefix: bytes) -> irismesh.Node:
    node = await stack.enter_async_context(mesh.node(cluster))
    if not mesh.seeds:
        mesh.seeds.append(node.endpoint)

    @node.on_request
    def echo(payload: bytes) -> bytes:
        if payload == b"boom":
            raise ValueError("boom")
        return prefix + payload

    return node


async def gateway(
    stack: AsyncExitStack,
    mesh: Mesh,
    link_keys: irismesh.Keyring,
    *,
    listen: bool = False,
    peers: tuple[str, ...] = (),
    export: tuple[str, ...] = (),
    topics: tuple[str, ...] = (),
    config: LinkConfig = FAST,
) -> irismesh.Gateway:
    gw = irismesh.Gateway(
        mesh.name,
        keyring=mesh.keys,
        link_keyring=link_keys,
        listen=LOCAL if listen else None,
        peers=peers,
        export=export,
        topics=topics,
        link_config=config,
        seeds=list(mesh.seeds),
        bind=LOCAL,
    )
    await stack.enter_async_context(gw)
    if not mesh.seeds:
        mesh.seeds.append(gw.node.endpoint)
    return gw


def test_request_crosses_a_gateway_pair_and_errors_come_back() -> None:
    async def main() -> None:
        a, b = Mesh("a"), Mesh("b")
        link = irismesh.Keyring.generate()
        async with AsyncExitStack() as stack:
            await member(stack, a, "db", b"A:")
            await member(stack, a, "secret", b"S:")
            gw_a = await gateway(stack, a, link, listen=True, export=("db",))
            gw_b = await gateway(stack, b, link, peers=(gw_a.endpoint,))
            client = await stack.enter_async_context(b.node())
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

    run(main())


def test_wrong_link_key_is_refused_and_counted() -> None:
    async def main() -> None:
        a, b = Mesh("a"), Mesh("b")
        async with AsyncExitStack() as stack:
            await member(stack, a, "db", b"A:")
            gw_a = await gateway(stack, a, irismesh.Keyring.generate(), listen=True, export=("db",))
            gw_b = await gateway(stack, b, irismesh.Keyring.generate(), peers=(gw_a.endpoint,))
            await wait_until(
                lambda: gw_a.stats.get("link_dropped_bad_proof", 0) >= 2, 5, "bad proofs"
            )
            assert gw_a.stats["links_up"] == 0
            assert gw_b.stats["links_up"] == 0
            assert gw_b.imports() == []

    run(main())


def test_a_request_for_a_cluster_not_exported_is_refused_on_the_far_side() -> None:
    async def main() -> None:
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

    run(main())
