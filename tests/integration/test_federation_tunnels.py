"""Tunnels through a gateway pair on 127.0.0.1: order, flow control, and ends propagating."""

from __future__ import annotations

import asyncio
import os
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
from federated import LOCAL, Mesh, echoed_through, gateway
from helpers import MESH, deadline, wait_until

import irismesh
from irismesh.federation.linkwire import T_DATA, TUNNEL, TunnelItem


async def federation(
    stack: AsyncExitStack, *, window: int | None = None
) -> tuple[Mesh, Mesh, irismesh.Node, irismesh.Gateway, irismesh.Gateway, irismesh.Node]:
    """Mesh a with a member of "db" and a gateway exporting it, mesh b with a gateway and a
    client that sees "db"."""
    a, b = Mesh("a", telemetry=False), Mesh("b", telemetry=False)
    link = irismesh.Keyring.generate()
    member = await a.node(stack, "db")
    gw_a = await gateway(stack, a, link, listen=True, export=("db",), window=window)
    gw_b = await gateway(stack, b, link, peers=(gw_a.endpoint,), window=window)
    client = await b.node(stack)
    await client.wait_for_members("db", timeout=10)
    return a, b, member, gw_a, gw_b, client


async def closed_at_both(*gateways: irismesh.Gateway) -> None:
    await wait_until(
        lambda: all(g.stats["tunnels_open"] == 0 for g in gateways), 5, "the relays to end"
    )
    assert all(g.stats["tunnel_buffered_bytes"] == 0 for g in gateways)


@deadline(60)
async def test_five_megabytes_echo_through_a_gateway_pair_in_order() -> None:
    sizes = [0, 1, 1000, 64 << 10, (64 << 10) + 1, 700_000, 2 << 20] + [37_000] * 60
    async with AsyncExitStack() as stack:
        _, _, member, gw_a, gw_b, client = await federation(stack)
        finished: list[int] = []

        @member.on_tunnel
        async def echo(tunnel: irismesh.Tunnel) -> None:
            count = 0
            async for message in tunnel:
                await tunnel.send(message)
                count += 1
            finished.append(count)
            await tunnel.send_eof()

        messages = [os.urandom(size) for size in sizes]
        assert sum(sizes) > 5_000_000
        await echoed_through(client, "db", messages)
        assert finished == [len(messages)]
        assert gw_b.stats["tunnels_forwarded"] == 1
        assert gw_a.stats["tunnels_served"] == 1
        await closed_at_both(gw_a, gw_b)
        assert gw_a.stats["tunnels_reset"] == 0
        assert gw_b.stats["tunnels_reset"] == 0


@deadline(60)
async def test_a_slow_reader_across_the_gateways_holds_the_writer_back_with_bounded_buffers() -> (
    None
):
    window = 128 << 10
    size = 16 << 10
    count = 1200  # 19.7 MB offered, far more than every window on the way together
    async with AsyncExitStack() as stack:
        _, _, member, gw_a, gw_b, client = await federation(stack, window=window)
        release = asyncio.Event()
        got: list[bytes] = []

        @member.on_tunnel
        async def slow(tunnel: irismesh.Tunnel) -> None:
            await release.wait()
            async for message in tunnel:
                got.append(message)
                if len(got) % 50 == 0:
                    await asyncio.sleep(0.01)  # slower than the writer

        tunnel = await client.tunnel("db", timeout=5)

        async def write() -> None:
            for i in range(count):
                await tunnel.send(i.to_bytes(4, "big") * (size // 4))
            await tunnel.send_eof()

        writer = asyncio.create_task(write())
        # The writer stops: the member reads nothing, and every hop's window fills.
        last = -1

        def stalled() -> bool:
            nonlocal last
            sent, last = last, tunnel.bytes_sent
            return sent == tunnel.bytes_sent and gw_a.stats["tunnel_buffered_bytes"] > 0

        await wait_until(lambda: tunnel.bytes_sent > 0, 5, "the writer to start")
        for _ in range(3):  # the same figure three polls 0.1 s apart
            await wait_until(stalled, 5, "the writer to stall")
            await asyncio.sleep(0.1)
        await wait_until(stalled, 5, "the writer to stall")
        assert not writer.done()
        # Each tunnel end buffers its window plus one message; each relay its window
        # plus one message: far below what the writer offered.
        default = 1 << 20  # the member's and the gateway node's tunnel windows
        bound = 2 * (default + size) + 2 * (window + size) + window + size
        assert tunnel.bytes_sent <= bound, (tunnel.bytes_sent, bound)
        for gw in (gw_a, gw_b):
            assert gw.stats["tunnel_buffered_peak"] <= window + 2 * size, gw.stats

        release.set()
        await asyncio.wait_for(writer, 30)
        await wait_until(lambda: len(got) == count, 30, "the reader to read it all")
        assert [int.from_bytes(m[:4], "big") for m in got] == list(range(count))
        for gw in (gw_a, gw_b):
            assert gw.stats["tunnel_buffered_peak"] <= window + 2 * size, gw.stats
            assert gw.stats["tunnel_items_over_credit"] == 0
        await tunnel.close()
        await closed_at_both(gw_a, gw_b)


@deadline(60)
async def test_closes_and_resets_propagate_both_ways() -> None:
    async with AsyncExitStack() as stack:
        _, _, member, gw_a, gw_b, client = await federation(stack)
        seen: list[BaseException] = []

        @member.on_tunnel
        async def serve(tunnel: irismesh.Tunnel) -> None:
            try:
                while True:
                    message = await tunnel.recv()
                    if message == b"raise":
                        raise ValueError("the member gave up")
                    if message == b"close":
                        await tunnel.close()
                        return
                    await tunnel.send(message)
            except irismesh.TunnelReset as exc:
                seen.append(exc)

        # The caller closes (a reset, the member not done): the member's recv raises.
        tunnel = await client.tunnel("db", timeout=5)
        await tunnel.send(b"hello")
        assert await tunnel.recv() == b"hello"
        await tunnel.close()
        await wait_until(lambda: seen, 5, "the member to see the reset")
        assert "closed the tunnel" in str(seen[0])
        await closed_at_both(gw_a, gw_b)

        # The member's handler raises, or it closes: the caller's recv and send raise.
        for word, reason in ((b"raise", "the member gave up"), (b"close", "closed")):
            tunnel = await client.tunnel("db", timeout=5)
            await tunnel.send(word)
            with pytest.raises(irismesh.TunnelReset) as caught:
                await tunnel.recv()
            assert reason in str(caught.value)
            with pytest.raises(irismesh.TunnelReset):
                await tunnel.send(b"more")
            await tunnel.close()
            await closed_at_both(gw_a, gw_b)

        # The member's node closes under an open tunnel.
        tunnel = await client.tunnel("db", timeout=5)
        await tunnel.send(b"x")
        assert await tunnel.recv() == b"x"
        await member.close()
        with pytest.raises(irismesh.TunnelReset):
            await asyncio.wait_for(tunnel.recv(), 5)
        await closed_at_both(gw_a, gw_b)
        # No member left in mesh a: opening raises NoResponders, as inside one mesh.
        with pytest.raises(irismesh.NoResponders):
            await client.tunnel("db", timeout=5)
        assert gw_a.stats["tunnels_refused_no_member"] == 1
        await closed_at_both(gw_a, gw_b)


@deadline(60)
async def test_a_reset_after_a_half_close_reaches_a_member_that_only_waits() -> None:
    async with AsyncExitStack() as stack:
        _, _, member, gw_a, gw_b, client = await federation(stack)
        reasons: list[str] = []

        @member.on_tunnel
        async def idle(tunnel: irismesh.Tunnel) -> None:
            async for _ in tunnel:  # to the caller's end of stream
                pass
            await tunnel.send(b"done reading")
            reasons.append(await tunnel.wait_reset())  # sends nothing more, reads nothing

        tunnel = await client.tunnel("db", timeout=5)
        await tunnel.send(b"x")
        await tunnel.send_eof()
        assert await tunnel.recv() == b"done reading"
        await tunnel.close()  # the member had not finished: a reset
        await wait_until(lambda: reasons, 5, "the member to see the reset")
        assert "closed the tunnel" in reasons[0]
        await closed_at_both(gw_a, gw_b)


@deadline(60)
async def test_a_killed_member_resets_the_callers_tunnel_across_the_gateways(
    tmp_path: Path,
) -> None:
    async with AsyncExitStack() as stack:
        a, b = Mesh("a", telemetry=False), Mesh("b", telemetry=False)
        link = irismesh.Keyring.generate()
        gw_a = await gateway(stack, a, link, listen=True, export=("db",))
        gw_b = await gateway(stack, b, link, peers=(gw_a.endpoint,))
        client = await b.node(stack)
        keyfile = tmp_path / "a.keys"
        a.keys.save(keyfile)
        env = dict(os.environ, IRISMESH_KEYFILE=str(keyfile), IRISMESH_DISCOVERY="0")
        env.pop("IRISMESH_KEYS", None)
        proc = await asyncio.create_subprocess_exec(
            *MESH, "node", "--cluster", "db", "--bind", LOCAL, "--seed", a.seeds[0],
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            env=env,
        )  # fmt: skip

        async def reap() -> None:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()

        stack.push_async_callback(reap)
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
        assert "member of 'db'" in line, line
        # The line comes as the member starts, before its link to the seed is up: the
        # gateway of mesh a opens the tunnel there once its node knows the member.
        await gw_a.node.wait_for_members("db", timeout=10)
        await client.wait_for_members("db", timeout=10)
        tunnel = await client.tunnel("db", timeout=5)
        await tunnel.send(b"echo me")  # `mesh node` echoes tunnels
        assert await tunnel.recv() == b"echo me"
        proc.kill()
        with pytest.raises(irismesh.TunnelReset) as caught:
            await asyncio.wait_for(tunnel.recv(), 10)
        assert "member is gone" in str(caught.value)  # its node id stays in mesh a
        await tunnel.close()
        await closed_at_both(gw_a, gw_b)


@deadline(60)
async def test_a_link_going_down_or_a_gateway_closing_resets_tunnels_at_both_ends() -> None:
    async with AsyncExitStack() as stack:
        _, _, member, gw_a, gw_b, client = await federation(stack)
        seen: list[BaseException] = []

        @member.on_tunnel
        async def echo(tunnel: irismesh.Tunnel) -> None:
            try:
                async for message in tunnel:
                    await tunnel.send(message)
            except irismesh.TunnelReset as exc:
                seen.append(exc)

        tunnel = await client.tunnel("db", timeout=5)
        await tunnel.send(b"x")
        assert await tunnel.recv() == b"x"
        # The link goes down (as when its dead_after passes): both ends reset.
        (end,) = gw_b.transport.ends
        end.down()
        gw_b._on_link_state(end, False)
        with pytest.raises(irismesh.TunnelReset) as caught:
            await asyncio.wait_for(tunnel.recv(), 5)
        assert "link to mesh 'a' went down" in str(caught.value)
        await wait_until(lambda: seen, 5, "the member's end to be reset")
        # Gateway a hears of it from b's new session (the link went down), or first finds
        # frames it could not send on the old one (items lost): either way, a reset.
        reason = str(seen[0])
        assert "link to mesh 'b' went down" in reason or "were lost on the gateway" in reason
        await closed_at_both(gw_a, gw_b)
        await tunnel.close()

        # The link comes back; then the exporting gateway closes under a tunnel.
        await wait_until(lambda: gw_b.stats["links_up"] == 1, 10, "the link again")
        await client.wait_for_members("db", timeout=10)
        tunnel = await client.tunnel("db", timeout=5)
        await tunnel.send(b"y")
        assert await tunnel.recv() == b"y"
        await gw_a.close()
        with pytest.raises(irismesh.TunnelReset) as caught:
            await asyncio.wait_for(tunnel.recv(), 5)
        # The closing gateway's word, or the link's end if its last frames were lost, or
        # frames b could not send to the gateway that went.
        reason = str(caught.value)
        assert any(
            words in reason for words in ("gateway closed", "went down", "were lost on the")
        ), reason
        await wait_until(lambda: len(seen) == 2, 5, "the member's end to be reset")
        await tunnel.close()
        # No link up: the gateway leaves "db", and a tunnel is refused at once.
        # (A gateway that still serves "db" as its link goes refuses it at once too: below.)
        await wait_until(lambda: not client.members("db"), 10, "the gateway to leave db")
        started = asyncio.get_running_loop().time()
        with pytest.raises(irismesh.NoResponders):
            await client.tunnel("db", timeout=5)
        assert asyncio.get_running_loop().time() - started < 1.0


@deadline(60)
async def test_malformed_and_stray_tunnel_items_are_counted_and_dropped() -> None:
    async with AsyncExitStack() as stack:
        _, _, member, gw_a, gw_b, client = await federation(stack)

        @member.on_tunnel
        async def echo(tunnel: irismesh.Tunnel) -> None:
            async for message in tunnel:
                await tunnel.send(message)

        (end,) = gw_b.transport.ends
        bad = [
            [TUNNEL, 2, 1, True, 1, 1, 1, b"db"],  # a version this gateway does not speak
            [TUNNEL, 1, 1, True, 1],  # short
            [TUNNEL, 1, 0, True, 1, 1, 1, b"db"],  # tunnel id 0
            [TUNNEL, 1, 1, True, 1, 9, 0, b""],  # no such op
            [TUNNEL, 1, 1, True, 2, 1, 1, b"db"],  # OPEN not first
            [TUNNEL, 1, 1, True, 2, T_DATA, 0, b"x" * ((64 << 10) + 1)],  # chunk too big
            [TUNNEL, 1, 1, "yes", 1, 1, 1, b"db"],  # not a bool
        ]
        for item in bad:
            assert end.send_plain(item)
        stray = TunnelItem(999, True, 5, T_DATA, 0, b"late")  # no such tunnel
        assert end.send_plain(stray.wire())
        gw_b.transport.flush_soon()
        await wait_until(
            lambda: (
                gw_a.stats["tunnel_items_malformed"] == 6
                and gw_a.stats["tunnel_items_version"] == 1
                and gw_a.stats["tunnel_items_late"] == 1
            ),
            5,
            "the drops to be counted",
        )
        assert gw_a.stats["tunnels_served"] == 0
        async with client.tunnel("db", timeout=5) as tunnel:  # the link goes on
            await tunnel.send(b"still here")
            assert await tunnel.recv() == b"still here"


@deadline(60)
async def test_a_gateway_whose_link_just_went_refuses_a_tunnel_with_no_responders() -> None:
    async with AsyncExitStack() as stack:
        _, _, member, _, gw_b, client = await federation(stack)

        @member.on_tunnel
        async def echo(tunnel: irismesh.Tunnel) -> None:
            async for message in tunnel:
                await tunnel.send(message)

        # The link is down but the gateway has not left "db" yet (nobody told it).
        (end,) = gw_b.transport.ends
        end.down()
        started = asyncio.get_running_loop().time()
        with pytest.raises(irismesh.NoResponders):
            await client.tunnel("db", timeout=5)
        assert asyncio.get_running_loop().time() - started < 1.0
        assert gw_b.stats["tunnels_refused_no_link"] == 1


@deadline(60)
async def test_opening_waits_for_the_far_member_and_times_out_as_inside_one_mesh() -> None:
    async with AsyncExitStack() as stack:
        _, _, member, gw_a, gw_b, client = await federation(stack)
        opened: list[irismesh.Tunnel] = []

        # The far member's node accepts late (a member whose handler accepts itself).
        gate = asyncio.Event()

        async def late(tunnel: irismesh.Tunnel) -> None:
            await gate.wait()
            tunnel.accept()
            opened.append(tunnel)
            async for message in tunnel:
                await tunnel.send(message)

        member.on_tunnel(late, accept=False)

        async def open_it() -> irismesh.Tunnel:
            return await client.tunnel("db", timeout=5)

        opening = asyncio.create_task(open_it())
        await wait_until(lambda: gw_a.stats["tunnels_served"] == 1, 5, "the far open")
        assert not opening.done()  # the caller waits for the far member, not the gateway
        gate.set()
        tunnel = await opening
        await tunnel.send(b"late")
        assert await tunnel.recv() == b"late"
        await tunnel.close()
        # A far member that never accepts: the caller's timeout, and both relays end.
        gate.clear()
        with pytest.raises(irismesh.RequestTimeout):
            await client.tunnel("db", timeout=0.5)
        gate.set()
        await closed_at_both(gw_a, gw_b)


@deadline(60)
async def test_a_frame_the_link_could_not_send_resets_the_tunnels_on_it() -> None:
    async with AsyncExitStack() as stack:
        _, _, member, gw_a, gw_b, client = await federation(stack)
        seen: list[str] = []

        @member.on_tunnel
        async def idle(tunnel: irismesh.Tunnel) -> None:
            await tunnel.send(b"hi")
            seen.append(await tunnel.wait_reset())

        tunnel = await client.tunnel("db", timeout=5)
        assert await tunnel.recv() == b"hi"
        # As the link's send does when its socket refuses a frame (its plain items lost).
        (end,) = gw_b.transport.ends
        end.stats["frames_unsent"] += 1
        with pytest.raises(irismesh.TunnelReset, match="lost on the gateway link"):
            await asyncio.wait_for(tunnel.recv(), 5)
        await wait_until(lambda: seen, 5, "the member's end to be reset")
        assert "lost on the gateway link" in seen[0]
        assert gw_b.stats["tunnel_items_lost"] == 1
        await closed_at_both(gw_a, gw_b)
