"""Meshes joined by gateways, for the federation tests: each mesh has a keyring of its own, and
the first node or gateway started in it is the seed every later one joins through. All of it
on 127.0.0.1, on ports the system picks."""

from __future__ import annotations

import asyncio
import hashlib
from contextlib import AsyncExitStack
from typing import Any

import pytest

import irismesh
from irismesh.federation import LinkConfig

LOCAL = "tcp://127.0.0.1:0"
# Links that notice a dead peer, redial and resend within a second: tests of failures end fast.
FAST = LinkConfig(heartbeat=0.1, dead_after=0.6, retry=0.2, resend_after=0.4)


class Mesh:
    """One mesh: its keyring, and the endpoints that others join through. `node_options` go to
    every node made here."""

    def __init__(self, name: str, **node_options: Any) -> None:
        self.name = name
        self.keys = irismesh.Keyring.generate()
        self.seeds: list[str] = []
        self.node_options = node_options

    def new_node(self, cluster: str | None = None, **kwargs: Any) -> irismesh.Node:
        """A node of this mesh, not started (nor made a seed)."""
        options = self.node_options | kwargs
        return irismesh.Node(
            cluster, keyring=self.keys, seeds=list(self.seeds), bind=LOCAL, **options
        )

    async def node(
        self, stack: AsyncExitStack, cluster: str | None = None, **kwargs: Any
    ) -> irismesh.Node:
        """A node of this mesh, running until `stack` closes; the seed if it is the first."""
        node = await stack.enter_async_context(self.new_node(cluster, **kwargs))
        if not self.seeds:
            self.seeds.append(node.endpoint)
        return node

    def gateway(self, **kwargs: Any) -> irismesh.Gateway:
        """A gateway of this mesh for `LocalGateways` (linked in-process), not started."""
        return irismesh.Gateway(
            self.name, keyring=self.keys, seeds=list(self.seeds), bind=LOCAL, local=True, **kwargs
        )


async def member(stack: AsyncExitStack, mesh: Mesh, cluster: str, prefix: bytes) -> irismesh.Node:
    """A member of `cluster` that answers `prefix` + the request, or raises ValueError("boom")
    for b"boom"."""
    node = await mesh.node(stack, cluster)

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
    window: int | None = None,
    **options: Any,
) -> irismesh.Gateway:
    """A gateway of `mesh` linked over TCP (listening, or dialling `peers`), running until
    `stack` closes; the mesh's seed if it is the first of it to start. `options` go to the
    gateway (its identity and grant, say)."""
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
        **({} if window is None else {"tunnel_window": window}),
        **options,
    )
    await stack.enter_async_context(gw)
    if not mesh.seeds:
        mesh.seeds.append(gw.node.endpoint)
    return gw


async def echoed_through(client: irismesh.Node, cluster: str, messages: list[bytes]) -> None:
    """Send `messages` down a tunnel to `cluster` (an echoing member) while reading; fail unless
    each comes back whole and in order, and then the end of the stream."""
    async with client.tunnel(cluster, timeout=5) as tunnel:

        async def write() -> None:
            for message in messages:
                await tunnel.send(message)
            await tunnel.send_eof()

        writer = asyncio.create_task(write())
        got = [await tunnel.recv() for _ in messages]
        with pytest.raises(irismesh.EndOfStream):
            await tunnel.recv()
        await writer
    digest = hashlib.sha256
    assert [digest(m).digest() for m in got] == [digest(m).digest() for m in messages]
