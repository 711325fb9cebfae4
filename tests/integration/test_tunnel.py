"""Tunnels over real sockets on 127.0.0.1: messages, chunking, windows, half close, resets."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator

import pytest
from helpers import deadline, wait_until

import irismesh
from irismesh.patterns.tunnel import CHUNK, NO_MEMBER


@contextlib.asynccontextmanager
async def paired(keys: irismesh.Keyring) -> AsyncIterator[tuple[irismesh.Node, irismesh.Node]]:
    """A member of "db" and a caller that knows it; both closed at the end."""
    member = await irismesh.Node("db", keyring=keys, telemetry=False).start()
    caller = irismesh.Node(keyring=keys, seeds=[member.endpoint], telemetry=False)
    try:
        await caller.start()
        await caller.wait_for_members("db", 1, timeout=5)
        yield member, caller
    finally:
        await asyncio.gather(caller.close(), member.close())


class Pump:
    """Sends `payload` `count` times into `tunnel`, then its end; `sent` counts the messages
    sent so far and `done` is the sending task. `release` lets the member's reader go on."""

    def __init__(
        self, tunnel: irismesh.Tunnel, payload: bytes, count: int, release: asyncio.Event
    ) -> None:
        self.sent = 0
        self.release = release
        self.done = asyncio.ensure_future(self._run(tunnel, payload, count))

    async def _run(self, tunnel: irismesh.Tunnel, payload: bytes, count: int) -> None:
        while self.sent < count:
            await tunnel.send(payload)
            self.sent += 1
        await tunnel.send_eof()


@contextlib.asynccontextmanager
async def stalled(
    keys: irismesh.Keyring, window: int, payload: bytes, count: int, *, read_first: bool = False
) -> AsyncIterator[tuple[list[irismesh.Tunnel], Pump]]:
    """A tunnel to a member with a receive window of `window` bytes whose handler (after one
    message, with `read_first`) stops reading until the pump's `release`, then reads to the
    end. Yields the member's end (in a list, once it arrived) and the pump already sending."""
    async with paired(keys) as (member, caller):
        held: list[irismesh.Tunnel] = []
        release = asyncio.Event()

        @member.on_tunnel
        async def slow(tunnel: irismesh.Tunnel) -> None:
            held.append(tunnel)
            if read_first:
                await tunnel.recv()
            await release.wait()
            async for _message in tunnel:
                pass

        member._tunnels.window = window
        pump = Pump(await caller.tunnel("db", timeout=5), payload, count, release)
        try:
            yield held, pump
        finally:
            pump.done.cancel()


@deadline(60)
async def test_messages_of_every_size_arrive_whole_in_order_both_ways(
    keys: irismesh.Keyring,
) -> None:
    sizes = [0, 1, 100, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 7, 5 << 20]
    async with paired(keys) as (member, caller):

        @member.on_tunnel
        async def echo(tunnel: irismesh.Tunnel) -> None:
            async for message in tunnel:
                await tunnel.send(hashlib.sha256(message).digest() + message[:10])

        messages = [bytes([i % 251]) * size for i, size in enumerate(sizes)]
        async with caller.tunnel("db", timeout=5, window=256 << 10) as tunnel:
            assert tunnel.peer == member.node_id.hex()
            for message in messages:
                await tunnel.send(message)
            for message in messages:
                assert await tunnel.recv() == hashlib.sha256(message).digest() + message[:10]
            assert tunnel.bytes_sent == sum(sizes)
        await wait_until(lambda: member.stats["tunnels_open"] == 0, 5, "the member to close")
        assert caller.stats["tunnels_open"] == 0


@deadline(60)
async def test_half_close_lets_the_other_end_finish_and_close_resets_a_sender(
    keys: irismesh.Keyring,
) -> None:
    async with paired(keys) as (member, caller):
        handler_saw: list[str] = []

        @member.on_tunnel
        async def count(tunnel: irismesh.Tunnel) -> None:
            total = 0
            async for message in tunnel:  # until the caller's send_eof
                total += len(message)
            handler_saw.append("eof")
            await tunnel.send(b"%d" % total)  # its own side is still open
            await tunnel.send_eof()

        tunnel = await caller.tunnel("db", timeout=5)
        for _ in range(10):
            await tunnel.send(b"x" * 1000)
        await tunnel.send_eof()
        with pytest.raises(irismesh.TunnelError):
            await tunnel.send(b"after eof")
        assert await tunnel.recv() == b"10000"
        with pytest.raises(irismesh.EndOfStream):
            await tunnel.recv()
        assert handler_saw == ["eof"]
        await tunnel.close()

        # close() while the other end still sends: its send raises TunnelReset.
        stopped: list[BaseException] = []

        @member.on_tunnel
        async def chatter(tunnel: irismesh.Tunnel) -> None:
            try:
                while True:
                    await tunnel.send(b"y" * 10_000)
            except irismesh.TunnelReset as exc:
                stopped.append(exc)
                raise

        tunnel = await caller.tunnel("db", timeout=5, window=50_000)
        assert await tunnel.recv() == b"y" * 10_000
        await tunnel.close()
        await wait_until(lambda: stopped, 5, "the member's send to fail")
        assert "closed the tunnel" in str(stopped[0])
        with pytest.raises(irismesh.TunnelReset):
            await tunnel.recv()


@deadline(60)
async def test_a_slow_reader_bounds_what_is_buffered_and_the_sender_waits(
    keys: irismesh.Keyring,
) -> None:
    window, size = 200_000, 10_000
    async with stalled(keys, window, b"z" * size, 50 * window // size) as (held, pump):
        await wait_until(lambda: held and held[0].bytes_received >= window, 5, "a window")
        before = pump.sent
        await asyncio.sleep(0.3)  # a reader that does not read: nothing more may arrive
        assert held[0].bytes_received <= window
        assert pump.sent - before <= 1
        assert not pump.done.done()
        pump.release.set()
        await asyncio.wait_for(pump.done, 30)
        assert pump.sent * size == 50 * window


@deadline(60)
async def test_refusals_and_errors_are_clear(keys: irismesh.Keyring) -> None:
    async with paired(keys) as (member, caller):
        with pytest.raises(irismesh.TunnelReset, match="serves no tunnels"):
            await caller.tunnel("db", timeout=5)
        with pytest.raises(irismesh.NoResponders):
            await caller.tunnel("nobody", timeout=1)

        @member.on_tunnel
        async def broken(tunnel: irismesh.Tunnel) -> None:
            await tunnel.recv()
            raise ValueError("disk full")

        async with caller.tunnel("db", timeout=5) as tunnel:
            await tunnel.send(b"write this")
            with pytest.raises(irismesh.TunnelReset, match="ValueError: disk full"):
                await tunnel.recv()
        with pytest.raises(irismesh.ConfigurationError):
            caller.tunnel("db", window=0)
        with pytest.raises(irismesh.ConfigurationError):
            caller.tunnel("db", max_message=0)
        async with caller.tunnel("db", timeout=5, max_message=10) as tunnel:
            with pytest.raises(irismesh.ConfigurationError, match="max_message"):
                await tunnel.send(b"x" * 11)


@deadline(60)
async def test_a_member_that_leaves_resets_the_tunnel_at_once(keys: irismesh.Keyring) -> None:
    async with paired(keys) as (member, caller):

        @member.on_tunnel
        async def idle(tunnel: irismesh.Tunnel) -> None:
            await asyncio.Event().wait()

        tunnel = await caller.tunnel("db", timeout=5)
        reading = asyncio.ensure_future(tunnel.recv())
        await member.close()
        with pytest.raises(irismesh.TunnelReset):
            await asyncio.wait_for(reading, 5)
        with pytest.raises(irismesh.TunnelReset):
            await tunnel.send(b"x")


@deadline(60)
async def test_a_member_that_answers_and_returns_ends_the_stream_cleanly(
    keys: irismesh.Keyring,
) -> None:
    async with paired(keys) as (member, caller):

        @member.on_tunnel
        async def answer(tunnel: irismesh.Tunnel) -> None:
            await tunnel.send(b"answer")
            await tunnel.send_eof()  # and returns before the caller ends its side

        async with caller.tunnel("db", timeout=5) as tunnel:
            await wait_until(lambda: member.stats["tunnels_open"] == 0, 5, "handler done")
            assert await tunnel.recv() == b"answer"
            with pytest.raises(irismesh.EndOfStream):
                await tunnel.recv()
            with pytest.raises(irismesh.TunnelReset):  # nobody reads what we would send
                await tunnel.send(b"late")


@deadline(60)
async def test_a_slow_reader_of_large_messages_buffers_a_window_and_one_message(
    keys: irismesh.Keyring,
) -> None:
    window, size = 256 << 10, 1 << 20  # messages four times the window
    async with stalled(keys, window, b"m" * size, 12, read_first=True) as (held, pump):
        await wait_until(lambda: held and held[0].bytes_received >= size, 5, "one message")
        await asyncio.sleep(0.5)  # the reader does not read: what may still arrive?
        # The message it read, then at most a window plus one message being assembled.
        assert held[0].bytes_received <= size + window + size
        assert not pump.done.done()
        pump.release.set()
        await asyncio.wait_for(pump.done, 30)
        assert pump.sent == 12


@deadline(60)
async def test_reset_carries_its_reason_and_wait_reset_sees_it(keys: irismesh.Keyring) -> None:
    async with paired(keys) as (member, caller):
        reasons: list[str] = []

        @member.on_tunnel
        async def refuse(tunnel: irismesh.Tunnel) -> None:
            assert await tunnel.recv() == b"hello"
            tunnel.reset("no more today")
            reasons.append(await tunnel.wait_reset())

        tunnel = await caller.tunnel("db", timeout=5)
        waiting = asyncio.create_task(tunnel.wait_reset())
        await tunnel.send(b"hello")
        assert await asyncio.wait_for(waiting, 5) == "no more today"
        with pytest.raises(irismesh.TunnelReset, match="no more today"):
            await tunnel.recv()
        await wait_until(lambda: reasons == ["no more today"], 5, "the member's own end")
        await tunnel.close()


@deadline(60)
async def test_a_handler_that_accepts_itself_decides_what_the_opener_gets(
    keys: irismesh.Keyring,
) -> None:
    async with paired(keys) as (member, caller):
        decide = asyncio.Queue[str]()

        async def handler(tunnel: irismesh.Tunnel) -> None:
            verdict = await decide.get()
            if verdict == "accept":
                tunnel.accept()
                await tunnel.send(b"welcome")
            else:
                tunnel.reset(verdict)

        member.on_tunnel(handler, accept=False)

        async def open_it() -> irismesh.Tunnel:
            return await caller.tunnel("db", timeout=5)

        opening = asyncio.create_task(open_it())
        await wait_until(lambda: member.stats["tunnels_open"] == 1, 5, "the member's end")
        assert not opening.done()  # the opener waits for the handler's accept
        decide.put_nowait("accept")
        tunnel = await opening
        assert await tunnel.recv() == b"welcome"
        await tunnel.close()

        decide.put_nowait(f"{NO_MEMBER} here, ask elsewhere")
        with pytest.raises(irismesh.NoResponders):
            await caller.tunnel("db", timeout=5)
        decide.put_nowait("not today")
        with pytest.raises(irismesh.TunnelReset, match="not today"):
            await caller.tunnel("db", timeout=5)
