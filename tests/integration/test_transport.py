"""The link transports: irismesh's framing over the event loop's TCP (the default), and zmq.

The framing is tested alone, with frames cut at every possible place; the transport with real
nodes on 127.0.0.1: dials that fail, frames many reads long, a node of the other transport.
"""

from __future__ import annotations

import asyncio
import os
import socket

import pytest
from helpers import deadline, wait_until
from hypothesis import given, settings
from hypothesis import strategies as st

import irismesh
from irismesh import _env
from irismesh._stream import Framer, framed, listen, split_endpoint

# ---------------------------------------------------------------------- framing


@settings(max_examples=200, deadline=None)
@given(
    frames=st.lists(st.binary(max_size=600), max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=8000), max_size=20),
)
def test_frames_come_out_whole_and_in_order_however_the_stream_is_cut(
    frames: list[bytes], cuts: list[int]
) -> None:
    stream = b"".join(framed(frame) for frame in frames)
    framer = Framer(limit=1000)
    at = 0
    for cut in [*sorted(c % (len(stream) + 1) for c in cuts), len(stream)]:
        before = len(framer.frames)
        came = framer.take(stream[at:cut])
        assert came == (len(framer.frames) > before)
        at = max(at, cut)
    assert list(framer.frames) == frames
    assert not framer.oversize
    assert not framer.partial


def test_a_length_beyond_the_limit_stops_reading_and_keeps_the_frames_before_it() -> None:
    framer = Framer(limit=100)
    assert framer.take(framed(b"a" * 100) + framed(b"b"))
    assert not framer.oversize
    assert framer.take(framed(b"c") + (101).to_bytes(4, "big") + b"x" * 101 + framed(b"d"))
    assert framer.oversize
    assert list(framer.frames) == [b"a" * 100, b"b", b"c"]
    assert not framer.take(framed(b"e"))  # nothing after it is read
    assert len(framer.frames) == 3


def test_a_length_beyond_the_limit_is_refused_before_its_frame_arrives() -> None:
    framer = Framer(limit=1 << 20)
    assert not framer.take((1 << 31).to_bytes(4, "big")[:3])
    assert not framer.oversize  # three bytes of a length say nothing yet
    assert not framer.take(b"\x00")
    assert framer.oversize
    assert not framer.partial  # nothing of it was kept


def test_endpoints_are_parsed_or_refused() -> None:
    assert split_endpoint("tcp://127.0.0.1:7400") == ("127.0.0.1", 7400)
    assert split_endpoint("tcp://[::1]:0") == ("::1", 0)
    assert split_endpoint("tcp://*:*") == ("0.0.0.0", 0)
    for bad in ["udp://127.0.0.1:1", "tcp://127.0.0.1", "tcp://:5", "tcp://h:x", "tcp://h:70000"]:
        with pytest.raises(ValueError, match=r"tcp:// endpoint|host and port|port"):
            split_endpoint(bad)
    with pytest.raises(irismesh.ConfigurationError, match="cannot listen on tcp://nowhere"):
        listen("tcp://nowhere")
    sock, endpoint = listen("tcp://127.0.0.1:0")
    try:
        assert endpoint == f"tcp://127.0.0.1:{sock.getsockname()[1]}"
        with pytest.raises(irismesh.ConfigurationError, match="cannot listen"):
            listen(endpoint)
    finally:
        sock.close()


# ---------------------------------------------------------------------- choosing one


def test_the_transport_is_tcp_unless_told_and_a_wrong_name_is_a_clear_error(
    keys: irismesh.Keyring,
) -> None:
    assert _env.transport({}) == "tcp"
    assert _env.transport({"IRISMESH_TRANSPORT": " ZMQ "}) == "zmq"
    with pytest.raises(irismesh.ConfigurationError, match="IRISMESH_TRANSPORT='udp'"):
        _env.transport({"IRISMESH_TRANSPORT": "udp"})
    with pytest.raises(irismesh.ConfigurationError, match="transport must be one of tcp, zmq"):
        irismesh.Node(keyring=keys, transport="udp")
    assert irismesh.Node(keyring=keys, transport="zmq").transport == "zmq"
    expected = os.environ.get("IRISMESH_TRANSPORT", "tcp").strip().lower() or "tcp"
    assert irismesh.Node(keyring=keys).transport == expected


@pytest.mark.parametrize("transport", ["tcp", "zmq"])
@deadline(30)
async def test_each_transport_carries_requests_of_every_size(
    keys: irismesh.Keyring, transport: str
) -> None:
    async with irismesh.Node("db", keyring=keys, transport=transport) as member:
        member.on_request(lambda payload: payload[::-1])
        async with irismesh.Node(
            keyring=keys, seeds=[member.endpoint], transport=transport
        ) as client:
            await client.wait_for_members("db", timeout=5)
            # Small ones, some in one read; and up to the largest payload, many reads long.
            sizes = [0, 1, 100, 65_531, 65_536, 300_000, 1 << 20]
            payloads = [os.urandom(size) for size in sizes]
            replies = await asyncio.gather(*(client.request("db", p) for p in payloads))
            assert replies == [p[::-1] for p in payloads]
            assert client.stats.get("requests_timed_out", 0) == 0


# ---------------------------------------------------------------------- failures


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.mark.parametrize("transport", ["tcp", "zmq"])
@deadline(30)
async def test_a_refused_dial_fails_at_once_not_at_the_handshake_timeout(
    keys: irismesh.Keyring, transport: str
) -> None:
    """Over zmq too: a DEALER retries a refused connect quietly, and its monitor's
    EVENT_CONNECT_RETRIED fails the link."""
    nowhere = f"tcp://127.0.0.1:{_closed_port()}"
    async with irismesh.Node(keyring=keys, seeds=[nowhere], transport=transport) as node:
        await wait_until(
            lambda: node.stats.get("dials_failed_refused", 0) >= 1, 5, "the dial to fail"
        )
        assert node.stats.get("dials_failed_handshake_timeout", 0) == 0
        assert node.stats["dials_unconnected"] >= 1


@deadline(30)
async def test_a_node_of_the_other_transport_is_no_peer_and_breaks_nothing(
    keys: irismesh.Keyring,
) -> None:
    """A mesh runs one transport. A node dialling one of the other fails its dial (counted, on
    both sides where the transport can tell) and both go on serving their own."""
    async with (
        irismesh.Node("db", keyring=keys, transport="zmq") as zmq_member,
        irismesh.Node("db", keyring=keys, transport="tcp") as tcp_member,
    ):
        zmq_member.on_request(lambda payload: b"zmq:" + payload)
        tcp_member.on_request(lambda payload: b"tcp:" + payload)

        async def refused(member: irismesh.Node, transport: str, counter: str, by: str) -> None:
            """A `transport` node dials `member` and sees no member: the dial is refused and
            counted as `counter` by the side that can tell (`by`: "member" or "stranger")."""
            async with irismesh.Node(
                keyring=keys, seeds=[member.endpoint], transport=transport
            ) as stranger:
                teller = member if by == "member" else stranger
                await wait_until(
                    lambda: teller.stats.get(counter, 0) >= 1, 5, "the ZMTP greeting to be refused"
                )
                assert stranger.members("db") == []

        # A tcp node dials the zmq member: ZMTP's greeting is no length it accepts.
        await refused(zmq_member, "tcp", "dropped_stream_oversize", by="stranger")
        # A zmq node dials the tcp member: a frame is no ZMTP greeting, and the member
        # drops the connection (its first bytes are a length far beyond any HELLO).
        await refused(tcp_member, "zmq", "dropped_stranger_oversize", by="member")
        for member, transport in [(zmq_member, "zmq"), (tcp_member, "tcp")]:
            async with irismesh.Node(
                keyring=keys, seeds=[member.endpoint], transport=transport
            ) as client:
                await client.wait_for_members("db", timeout=5)
                assert await client.request("db", b"x") == transport.encode() + b":x"


@deadline(30)
async def test_a_member_that_goes_fails_its_link_at_once_and_close_waits_for_its_goodbyes(
    keys: irismesh.Keyring,
) -> None:
    async with irismesh.Node("db", keyring=keys, transport="tcp") as steady:
        steady.on_request(lambda payload: b"steady")
        leaving = await irismesh.Node(
            "db", keyring=keys, seeds=[steady.endpoint], transport="tcp"
        ).start()
        leaving.on_request(lambda payload: b"leaving")
        async with irismesh.Node(keyring=keys, seeds=[steady.endpoint], transport="tcp") as client:
            await client.wait_for_members("db", 2, timeout=5)
            assert {await client.request("db", b"x") for _ in range(20)} == {
                b"steady",
                b"leaving",
            }
            await leaving.close()
            # Its goodbye went out and was read before close() returned.
            assert len(client.members("db")) == 1
            assert {await client.request("db", b"x") for _ in range(10)} == {b"steady"}
            assert client.stats.get("requests_timed_out", 0) == 0


@deadline(30)
async def test_a_link_whose_connection_breaks_is_forgotten_by_the_member_at_once(
    keys: irismesh.Keyring,
) -> None:
    """A connection reset under a live link: the caller's link fails and is dialled again, and
    the member forgets the old inbound link when its connection closes (it does not wait for
    membership to declare a live peer dead), so links do not pile up on a flapping network."""
    async with irismesh.Node("db", keyring=keys, transport="tcp") as member:
        member.on_request(lambda payload: b"ok:" + payload)
        async with irismesh.Node(keyring=keys, seeds=[member.endpoint], transport="tcp") as client:
            await client.wait_for_members("db", timeout=5)
            assert await client.request("db", b"1") == b"ok:1"
            core = member._core
            assert core is not None
            assert len(core._in) == 1
            for round_ in range(1, 4):
                driver = client._driver
                assert driver is not None
                [conn] = [c for c in driver._out.values() if c.transport is not None]
                conn.transport.abort()  # as a reset on the wire
                await wait_until(
                    lambda r=round_: member.stats.get("links_in_closed", 0) == r,
                    5,
                    "the member to forget the link",
                )
                assert await client.request("db", b"again") == b"ok:again"  # dialled anew
                assert len(core._in) == 1
            assert client.stats["links_down_disconnected"] == 3
            # Each redial was let in: a live member whose connection reset stays routable.
            assert client.stats.get("peers_taken_out", 0) == 0
