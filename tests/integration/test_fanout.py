"""Broadcast, survey and hedged requests over real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio

import pytest
from helpers import deadline

import irismesh


async def start_members(keys: irismesh.Keyring, n: int) -> list[irismesh.Node]:
    members: list[irismesh.Node] = []
    for _ in range(n):
        seeds = [members[0].endpoint] if members else []
        members.append(await irismesh.Node("db", keyring=keys, seeds=seeds).start())
    return members


@deadline(30)
async def test_broadcast_reaches_every_member_once_and_lists_them(keys: irismesh.Keyring) -> None:
    members = await start_members(keys, 3)
    got: dict[str, list[bytes]] = {m.node_id.hex(): [] for m in members}
    for member in members:

        def bind(node: irismesh.Node, name: str) -> None:
            @node.on_broadcast
            async def on_broadcast(payload: bytes) -> None:
                got[name].append(payload)

        bind(member, member.node_id.hex())
    client = await irismesh.Node(keyring=keys, seeds=[members[0].endpoint]).start()
    try:
        await client.wait_for_members("db", 3, timeout=5)
        received = await client.broadcast("db", b"flush", timeout=5)
        assert received == sorted(got)
        assert all(payloads == [b"flush"] for payloads in got.values())
        with pytest.raises(irismesh.NoResponders):
            await client.broadcast("nobody", b"x")
    finally:
        await asyncio.gather(*(n.close() for n in [client, *members]))


@deadline(30)
async def test_survey_gathers_answers_errors_and_the_missing(keys: irismesh.Keyring) -> None:
    members = await start_members(keys, 3)
    fine, failing, silent = members
    fine.on_survey(lambda payload: b"ok")
    failing.on_survey(lambda payload: (_ for _ in ()).throw(RuntimeError("disk full")))
    never = asyncio.Event()

    @silent.on_request  # no survey handler: surveys go to the request handler
    async def hang(payload: bytes) -> bytes:
        await never.wait()
        return b"late"

    client = await irismesh.Node(keyring=keys, seeds=[fine.endpoint]).start()
    try:
        await client.wait_for_members("db", 3, timeout=5)
        result = await client.survey("db", b"status?", timeout=0.5)
        assert result.answers == {fine.node_id.hex(): b"ok"}
        [error] = result.errors.values()
        assert isinstance(error, irismesh.RemoteError)
        assert "disk full" in error.remote_message
        assert result.missing == [silent.node_id.hex()]
    finally:
        never.set()
        await asyncio.gather(*(n.close() for n in [client, *members]))


@deadline(30)
async def test_survey_returns_as_soon_as_every_member_answered(keys: irismesh.Keyring) -> None:
    members = await start_members(keys, 2)
    for member in members:
        member.on_request(lambda payload: b"here")
    async with irismesh.Node(keyring=keys, seeds=[members[0].endpoint]) as client:
        await client.wait_for_members("db", 2, timeout=5)
        # A deadline of an hour: returning means everyone answered, not that time ran out.
        result = await asyncio.wait_for(client.survey("db", b"?", timeout=3600), 5)
        assert sorted(result.answers) == sorted(m.node_id.hex() for m in members)
        assert result.missing == []
    await asyncio.gather(*(m.close() for m in members))


@deadline(30)
async def test_hedging_cuts_the_tail_when_a_member_stalls(keys: irismesh.Keyring) -> None:
    fast, slow = await start_members(keys, 2)
    fast.on_request(lambda payload: b"fast")

    @slow.on_request
    async def stall(payload: bytes) -> bytes:
        await asyncio.sleep(2.0)
        return b"slow"

    async with irismesh.Node(keyring=keys, seeds=[fast.endpoint]) as client:
        await client.wait_for_members("db", 2, timeout=5)
        replies = await asyncio.gather(
            *(client.request("db", b"x", timeout=10, hedge=0.05) for _ in range(20))
        )
        # Some requests went to the stalled member first; their hedges answered them.
        assert replies == [b"fast"] * 20
        assert client.stats.get("requests_hedged", 0) >= 1
    await asyncio.gather(fast.close(), slow.close())
