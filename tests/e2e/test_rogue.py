"""Rogues on one machine. One with another mesh key cannot even become a peer, nor make any
member suspect, dead or departed with forged membership datagrams. An *insider* (the mesh key,
but its own key for the cluster) becomes a peer yet cannot join the cluster, answer for it, or
get a forged, injected or replayed frame past a member. Every attempt is counted.

The real member and the rogue members run as their own processes (examples/failover.py's
worker, each with its own keyring file); the frame-level attacks use a raw connection that
speaks irismesh frames by hand (TCP in irismesh's framing, or a zmq DEALER to a zmq node), and
a recording proxy (tests/wiretap.py) on a real client's connection to capture frames and to
inject them back into that live connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio
from helpers import Workers, wait_until
from wiretap import proxied_client

import irismesh
from irismesh._core.frames import (
    HEADER_SIZE,
    BodyCodec,
    Kind,
    encode_header,
    encode_request,
)
from irismesh._core.gossip import encode_compound, encode_message, seal_datagram, seal_name
from irismesh._core.records import MemberRecord, record_transcript
from irismesh._core.sealing import Sealer
from irismesh.security.identity import Identity
from irismesh.security.keyring import MESH_SCOPE, ScopeKey
from irismesh.security.linksecurity import KeyedLinkSecurity
from irismesh.security.meshkey import MeshDatagramSealer

CLUSTER = "work"  # what examples/failover.py's workers serve
CODEC = BodyCodec(1 << 20)
NOWHERE = "tcp://127.0.0.1:9"  # the discard port: what a rogue claims as its endpoint


def insider_keys(keys: irismesh.Keyring) -> irismesh.Keyring:
    """The mesh's key (its '*' key, as the mesh key) and a '*' key of its own for the rest."""
    mesh = keys.mesh_keys()[0].secret
    return irismesh.Keyring(
        [ScopeKey(scope=MESH_SCOPE, secret=mesh), ScopeKey(scope="*", secret=os.urandom(32))]
    )


@pytest.fixture
def rogues(tmp_path: Path) -> Iterator[Workers]:
    """Workers of the same program, with a keyring of their own (another mesh key)."""
    keyfile = tmp_path / "rogue.keys"
    irismesh.Keyring.generate().save(keyfile)
    with contextlib.closing(Workers(keyfile)) as group:
        yield group


@pytest.fixture
def insiders(tmp_path: Path, keys: irismesh.Keyring) -> Iterator[Workers]:
    """Workers of the same program holding the mesh key, but their own key for "work"."""
    keyfile = tmp_path / "insider.keys"
    insider_keys(keys).save(keyfile)
    with contextlib.closing(Workers(keyfile)) as group:
        yield group


def run(main: Callable[[], Any], timeout: float = 60) -> None:
    asyncio.run(asyncio.wait_for(main(), timeout))


# ---------------------------------------------------------------------- (a), (b): wrong-key nodes


def test_a_rogue_with_another_mesh_key_never_becomes_a_peer(
    keys: irismesh.Keyring, workers: Workers, rogues: Workers
) -> None:
    async def main() -> None:
        member = workers.start("w1")
        rogue = rogues.start("rogue", [member])  # tries to join the mesh through the member
        async with irismesh.Node(keyring=keys, seeds=[member, rogue]) as client:
            await client.wait_for_members(CLUSTER, timeout=10)
            # The client's HELLO to the rogue, and the rogue's to the member, fail their
            # proofs: no WELCOME, no record, no membership either way.
            await wait_until(
                lambda: client.stats.get("dials_failed", 0) >= 1,
                10,
                "the client's handshake with the rogue to time out",
            )
            for i in range(50):
                assert await client.request(CLUSTER, b"%d" % i, timeout=5) == b"w1:%d" % i
            assert [p.endpoint for p in client.peers()] == [member]

    run(main)


def test_an_insider_serving_the_cluster_with_its_own_key_is_a_peer_and_answers_nothing(
    keys: irismesh.Keyring, workers: Workers, insiders: Workers
) -> None:
    async def main() -> None:
        insider = insiders.start("insider")
        workers.start("w1", [insider])  # joins the mesh through the insider
        async with irismesh.Node(keyring=keys, seeds=[insider]) as client:
            await client.wait_for_members(CLUSTER, timeout=10)
            await wait_until(lambda: len(client.peers()) == 2, 10, "both as peers")
            # Its record's tag for "work" is under another key: never dialled for the cluster,
            # and on a link its offer tag would not match either.
            assert len(client.members(CLUSTER)) == 1
            replies = await asyncio.gather(
                *(client.request(CLUSTER, b"%d" % i, timeout=5) for i in range(50))
            )
            assert replies == [b"w1:%d" % i for i in range(50)]  # all from the real member
            assert client.stats.get("requests_timed_out", 0) == 0

    run(main)


def test_a_node_without_the_clusters_key_gets_a_local_error_naming_it(
    workers: Workers,
) -> None:
    async def main() -> None:
        member = workers.start("w1")
        stranger_keys = irismesh.Keyring.generate(["billing"])  # no "work", no "*"
        async with irismesh.Node(keyring=stranger_keys, seeds=[member]) as stranger:
            with pytest.raises(irismesh.NoKey) as caught:
                await stranger.request(CLUSTER, b"x")
            assert caught.value.scope == CLUSTER
            with pytest.raises(irismesh.NoKey):
                await stranger.broadcast(CLUSTER, b"x")

    run(main)


# ---------------------------------------------------------------------- (c): frames by hand


class RawPeer:
    """A connection speaking irismesh frames by hand, with a keyring of its own: a zmq DEALER
    to a node on the zmq transport, else a TCP connection in irismesh's own framing."""

    def __init__(self, ctx: zmq.asyncio.Context, member: irismesh.Node, keys: irismesh.Keyring):
        self.zmq = member.transport == "zmq"
        self.endpoint = member.endpoint
        if self.zmq:
            self.sock = ctx.socket(zmq.DEALER)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.connect(member.endpoint)
        self.stream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self.security = KeyedLinkSecurity(keys)
        self.keys = self.security.begin()
        self.nonce = os.urandom(16)
        self.peer_nonce = b""
        self.offers: list[bytes] = []
        self.seq = 0

    def hello(self, node_id: bytes | None = None) -> bytes:
        """A HELLO with a record, a proof under this peer's mesh key and a fresh identity's
        signature (whose id is `node_id`'s only if none is given)."""
        identity = Identity.generate()
        node_id = node_id or identity.node_id
        name = seal_name(self.security.datagram_sealer(node_id), node_id, 1, "rogue")
        address = NOWHERE.removeprefix("tcp://")
        signed = record_transcript(MemberRecord(node_id, NOWHERE, address, b"", "rogue"), 0)
        record = [0, address, b"", name, identity.sign(signed)]
        said = [node_id, self.nonce, NOWHERE, self.keys.public, record]
        caps = {"kx": self.keys.public, "rec": record, "id": identity.public}
        caps["proof"] = self.security.mesh_proof(b"hello", CODEC.pack(said))
        caps["sig"] = identity.sign(b"hello" + CODEC.pack([*said, identity.public]))
        return encode_header(Kind.HELLO, 0, 0) + CODEC.pack([node_id, self.nonce, NOWHERE, caps])

    async def handshake(self, node_id: bytes | None = None) -> None:
        await self.send(self.hello(node_id))
        while True:
            frame = await asyncio.wait_for(self.recv(), 5)
            if frame[2] == Kind.WELCOME:
                break
        env = CODEC.unpack(frame[HEADER_SIZE:], Kind.WELCOME)
        self.peer_nonce, self.offers = env[1], env[3]
        self.keys.establish(env[4]["kx"], self.peer_nonce, self.nonce)

    def sealer(self, cluster: str | None) -> Sealer:
        """The link's own sealer (None), or one for `cluster` under this peer's key for it."""
        if cluster is None:
            return self.keys.sealer(None, True)
        [(_tag, handle)] = self.security.offers(cluster, self.peer_nonce, self.nonce)
        return self.keys.sealer(handle, True)

    def seal(self, kind: int, scope: int, body: bytes, sealer: Sealer) -> bytes:
        self.seq += 1
        header = encode_header(kind, scope, self.seq)
        return header + sealer.seal(header, self.seq, body)

    async def _connected(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.stream is None:
            host, _, port = self.endpoint.removeprefix("tcp://").rpartition(":")
            self.stream = await asyncio.open_connection(host, int(port))
        return self.stream

    async def send(self, *frames: bytes) -> None:
        if self.zmq:
            for frame in frames:
                await self.sock.send(frame)
            return
        await self.send_raw(b"".join(len(frame).to_bytes(4, "big") + frame for frame in frames))

    async def send_raw(self, data: bytes) -> None:
        """Bytes as they are, on the TCP connection (not the zmq transport's)."""
        _reader, writer = await self._connected()
        writer.write(data)
        await writer.drain()

    async def recv(self) -> bytes:
        if self.zmq:
            frame: bytes = await self.sock.recv()
            return frame
        reader, _writer = await self._connected()
        size = int.from_bytes(await reader.readexactly(4), "big")
        return await reader.readexactly(size)

    def close(self) -> None:
        if self.stream is not None:
            self.stream[1].close()


@asynccontextmanager
async def served_member(
    keys: irismesh.Keyring,
) -> AsyncIterator[tuple[irismesh.Node, list[bytes], list[bytes]]]:
    """A member of "work" with counting request and broadcast handlers."""
    requests: list[bytes] = []
    broadcasts: list[bytes] = []
    async with irismesh.Node(CLUSTER, keyring=keys) as member:

        @member.on_request
        def answer(payload: bytes) -> bytes:
            requests.append(payload)
            return b"ok:" + payload

        member.on_broadcast(broadcasts.append)
        yield member, requests, broadcasts


async def counted(member: irismesh.Node, reason: str, before: dict[str, int], n: int) -> None:
    key = "dropped_" + reason
    await wait_until(lambda: member.stats.get(key, 0) - before.get(key, 0) >= n, 5, f"{n} x {key}")
    assert member.stats.get(key, 0) - before.get(key, 0) == n


def test_forged_injected_and_replayed_frames_are_counted_and_never_handled(
    keys: irismesh.Keyring,
) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        peers: list[RawPeer] = []
        stranger_keys = irismesh.Keyring.generate()  # another mesh
        rogue_keys = insider_keys(keys)  # the mesh key, and a '*' key that says it serves "work"
        try:
            async with (
                served_member(keys) as (member, requests, broadcasts),
                proxied_client(member, CLUSTER, keyring=keys) as (client, proxy),
            ):
                for i in range(10):
                    assert await client.request(CLUSTER, b"real %d" % i) == b"ok:real %d" % i
                assert await client.broadcast(CLUSTER, b"real broadcast") == [member.node_id.hex()]
                [conn] = proxy.connections
                captured = conn.messages(upstream=True)
                kinds = [frame[2] for frame in captured]
                hello = captured[kinds.index(Kind.HELLO)]
                sealed = [f for f in captured if f[2] != Kind.HELLO]
                real = [f for f in sealed if f[2] in (Kind.REQUEST, Kind.BROADCAST)]
                assert len(real) == 11
                before = dict(member.stats)

                # 1. Requests and broadcasts with no handshake at all.
                bare = RawPeer(ctx, member, rogue_keys)
                peers.append(bare)
                await bare.send(*real)
                await counted(member, "unknown_link", before, len(real))

                # 2. A handshake under another mesh key: its proof fails, nothing answers it.
                stranger = RawPeer(ctx, member, stranger_keys)
                peers.append(stranger)
                await stranger.send(stranger.hello())
                await counted(member, "bad_proof", before, 1)

                # 3. A handshake under the mesh key, then frames sealed with the wrong key.
                rogue = RawPeer(ctx, member, rogue_keys)
                peers.append(rogue)
                await rogue.handshake()
                # The member's WELCOME offered "work" (and the topics under its default key),
                # but not in a way the rogue can tell.
                assert len(rogue.offers) == 2
                offered = {tag: slot for slot, tag in enumerate(rogue.offers, start=1)}
                assert rogue.security.match(CLUSTER, rogue.peer_nonce, rogue.nonce, offered) is None
                wrong_key = rogue.sealer(CLUSTER)
                forged = [
                    rogue.seal(kind, 1, encode_request(900 + i, 1000, [], b"forged"), wrong_key)
                    for i, kind in enumerate([Kind.REQUEST] * 5 + [Kind.BROADCAST] * 3)
                ]
                await rogue.send(*forged)
                await counted(member, "bad_seal", before, len(forged))
                # Sealed with the link key, which the rogue does hold: no cluster scope.
                link_sealed = rogue.seal(
                    Kind.REQUEST, 0, encode_request(950, 1000, [], b"x"), rogue.sealer(None)
                )
                await rogue.send(link_sealed)
                await counted(member, "bad_scope", before, 1)
                # Garbage, and a message of several frames (zmq), or a frame longer than any
                # the member takes (irismesh's framing: the connection is closed, as zmq's
                # MAXMSGSIZE closes it).
                await rogue.send(b"\x00" * 40, b"\x49\x02" + bytes(30))
                await counted(member, "bad_magic", before, 1)
                await counted(member, "bad_version", before, 1)
                if rogue.zmq:
                    await rogue.sock.send_multipart([real[0], real[0]])
                    await counted(member, "multipart", before, 1)
                else:
                    # Before its HELLO, a length beyond any HELLO; after it, beyond any frame.
                    stranger_size = RawPeer(ctx, member, rogue_keys)
                    peers.append(stranger_size)
                    await stranger_size.send_raw((64 << 10).to_bytes(4, "big") + bytes(100))
                    await counted(member, "stranger_oversize", before, 1)
                    reader, _writer = await stranger_size._connected()
                    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed on it
                    oversize = RawPeer(ctx, member, rogue_keys)
                    peers.append(oversize)
                    await oversize.handshake()
                    await oversize.send_raw((1 << 31).to_bytes(4, "big") + bytes(100))
                    await counted(member, "stream_oversize", before, 1)
                    reader, _writer = await oversize._connected()
                    await asyncio.wait_for(reader.read(), 5)  # what the member said, then
                    assert reader.at_eof()  # closed on it

                # 4. The real client's captured frames, replayed on a new connection after its
                #    captured HELLO: the new link has fresh keys, so every one fails its seal.
                replayer = RawPeer(ctx, member, rogue_keys)
                peers.append(replayer)
                await replayer.send(hello, *sealed)
                await counted(member, "bad_seal", before, len(forged) + len(sealed))

                # 5. The same frames injected into the client's live connection (a man in the
                #    middle): the right keys, but sequence numbers the link has seen.
                conn.inject(sealed)
                await counted(member, "replay", before, len(sealed))

                assert len(requests) == 10  # the handler ran for the real requests only
                assert broadcasts == [b"real broadcast"]
                for i in range(10):  # and the real client is served as before
                    assert await client.request(CLUSTER, b"after %d" % i) == b"ok:after %d" % i
                assert len(requests) == 20
                assert client.stats.get("requests_timed_out", 0) == 0
        finally:
            for peer in peers:
                peer.close()
            ctx.destroy(linger=0)

    run(main)


# ---------------------------------------------------------------------- found bugs


def test_forged_membership_datagrams_make_no_member_suspect_dead_or_departed(
    keys: irismesh.Keyring,
) -> None:
    """Datagrams to a member's membership port, sealed under another mesh key or none, saying
    that the other member died, left or is suspect, or that a stranger joined."""

    async def main() -> None:
        async with (
            served_member(keys) as (member, _requests, _broadcasts),
            irismesh.Node("other", keyring=keys, seeds=[member.endpoint]) as other,
            irismesh.Node(keyring=keys, seeds=[member.endpoint]) as client,
        ):
            await client.wait_for_members(CLUSTER, timeout=10)
            await wait_until(lambda: len(member.peers()) == 2, 10, "the member to know both")
            before = dict(member.stats)
            host, port = member.endpoint.removeprefix("tcp://").rsplit(":", 1)
            victim, stranger = other.node_id, os.urandom(16)
            lies = [
                [7, victim, 99, stranger],  # DEAD, declared by a stranger
                [7, victim, 99, victim],  # "it left"
                [6, victim, 99, stranger],  # SUSPECT
                [5, stranger, 1, "tcp://127.0.0.1:9", "127.0.0.1:9", b"", "evil", b"", b""],
            ]
            sender = MeshDatagramSealer([os.urandom(32)], victim)  # another mesh's key
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                for counter, lie in enumerate(lies, 1):
                    body = encode_compound([encode_message(lie)])
                    udp.sendto(seal_datagram(sender, victim, counter, body), (host, int(port)))
                    udp.sendto(b"S\x02" + os.urandom(60), (host, int(port)))  # noise
            await counted(member, "bad_seal", before, 2 * len(lies))
            assert {p.node_id for p in member.peers()} == {
                other.node_id.hex(),
                client.node_id.hex(),
            }
            assert all(p.state == "alive" for p in member.peers())
            assert member.peers(departed=True) == member.peers()  # nobody dead or gone
            assert await client.request(CLUSTER, b"still") == b"ok:still"

    run(main)
