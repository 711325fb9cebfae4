"""Hostile frames for cores: real frames captured in memory, their mutations, and a verdict.

A `Scene` is a small mesh on the in-memory network (`memnet`): a member of "db", a client with
the same keys, and a rogue holding the mesh key but other keys for everything else (linked to
the member, but a member of nothing it can prove). Its `corpus` holds every frame those cores
really exchanged, by kind: HELLO, WELCOME, PING, PONG, REQUEST, REPLY, BROADCAST, SURVEY, BATCH,
CANCEL, BYE (from a node that left), REFUSE (from a closed core), and REQUESTs the rogue sealed with
its own key for "db".

`mutate` turns one frame into a hostile one (bit flips, truncation, rewritten header fields,
splices, replays, random bytes), drawing every choice from the `random.Random` it is given, so
a seeded run (bench/fuzz.py, the slow test) or hypothesis (`st.randoms()`) replays exactly.

`Scene.feed` hands a frame straight to one core, as its driver would, and returns the verdict:
the `dropped_<reason>` counter it incremented, or `hello_accepted` when a stranger's mutated
HELLO was a valid handshake (HELLO is the one frame anyone may send unsealed). Anything else
(two counters, a changed sequence window, an event, an answer to a dropped frame, an exception)
raises `Escaped`.

Used by tests/core/test_hostile.py and bench/fuzz.py.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from memnet import MemNet, MemNode

from irismesh._core.config import CoreConfig
from irismesh._core.engine import MeshCore
from irismesh._core.events import TunnelArrived
from irismesh._core.frames import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    STATUS_OK,
    VERSION,
    BodyCodec,
    Kind,
    TunnelOp,
    encode_header,
    encode_reply,
    encode_request,
)
from irismesh._core.links import InLink, OutLink
from irismesh._core.sealing import Sealer
from irismesh.security.keyring import MESH_SCOPE, Keyring, ScopeKey
from irismesh.security.linksecurity import KeyedLinkSecurity

# A config whose largest frame is small enough to allocate an oversize one per case cheaply.
FUZZ_CONFIG = CoreConfig(max_payload=16 << 10)

# Where a hostile frame can be fed. Established links must drop every hostile frame; a stranger
# (a routing id the member has never seen) may also open a link with a valid HELLO.
TARGETS = ("member<-client", "client<-member", "member<-rogue", "member<-stranger")
ESTABLISHED = frozenset(TARGETS[:3])

MUTATIONS = (
    "flip",
    "flips",
    "byte",
    "truncate",
    "extend",
    "insert",
    "header",
    "splice",
    "replay",
    "random",
    "forged",
    "oversize",
)
_CHANGING = tuple(how for how in MUTATIONS if how != "replay")


class Escaped(AssertionError):
    """A hostile frame did something other than one counted drop (or a valid handshake)."""


def dropped(core: MeshCore) -> int:
    return sum(n for reason, n in core.stats.items() if reason.startswith("dropped_"))


def _moved(core: MeshCore, before: Counter[str]) -> list[str]:
    return [key for key, n in core.stats.items() if n != before.get(key, 0)]


def _problems(core: MeshCore, before: Counter[str]) -> list[str]:
    """What is wrong with the core's reaction to one hostile frame, if anything."""
    moved = {key: core.stats[key] - before.get(key, 0) for key in _moved(core, before)}
    problems = []
    if list(moved.values()) != [1]:
        problems.append(f"counters moved by {moved}")
    elif not next(iter(moved)).startswith("dropped_"):
        problems.append(f"counted under {next(iter(moved))!r}, not as a drop")
    if core.events or core.out_frames or core.in_frames:
        problems.append(f"output {core.events[:3]} {core.out_frames[:2]} {core.in_frames[:2]}")
    return problems


def seal_on(link: OutLink | InLink, kind: int, scope: int, body: bytes, sealer: Sealer) -> bytes:
    """A frame as `link`'s own end would send it next (its send_seq advances)."""
    link.send_seq += 1
    header = encode_header(kind, scope, link.send_seq)
    return header + sealer.seal(header, link.send_seq, body)


@dataclass(frozen=True)
class Footprint:
    """What a core holds per peer or per candidate: the state a flood could grow."""

    in_links: int
    out_links: int
    dial_records: int
    reply_cache: int
    pending: int

    @classmethod
    def of(cls, core: MeshCore) -> Footprint:
        return cls(
            in_links=len(core.inbound()),
            out_links=len(core.links()),
            # No public view of the dial records exists; their bound is what is under test.
            dial_records=len(core._dials),
            reply_cache=len(core.reply_cache),
            pending=core.pending_count,
        )


FUZZ_TRACE = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class Scene:
    """A member, a client and a rogue with another key, linked in memory, and their frames."""

    def __init__(self, seed: int, config: CoreConfig = FUZZ_CONFIG) -> None:
        self.net = net = MemNet(seed=seed, config=config)
        self.member = net.add("member", clusters=["db"])
        self.client = net.add("client", seeds=[self.member])
        mesh = net.keyring.mesh_keys()[0].secret
        self.rogue_keys = Keyring(
            [
                ScopeKey(scope=MESH_SCOPE, secret=mesh),
                ScopeKey(scope="*", secret=net.rng.randbytes(32)),
            ]
        )
        self.rogue = net.add("rogue", seeds=[self.member], keyring=self.rogue_keys)
        net.advance(0.5)  # handshakes and membership
        net.request(self.client, "db", b"warm-up")
        net.advance(0.5)  # the reply's acknowledgement rides on a ping, answered by a pong
        for kind in (Kind.BROADCAST, Kind.SURVEY):
            self.client.core.fanout(int(kind), "db", b"fan-out", 1.0, net.now)
            net.settle()
        # JOB: a queued job the memory hands out (its 16-byte id, then the job).
        self.client.core.request("db", bytes(16) + b"job", 1.0, net.now, None, int(Kind.JOB))
        net.settle()
        # TRACED: a request with its caller's trace context.
        self.client.core.request("db", b"traced", 1.0, net.now, trace=FUZZ_TRACE)
        net.settle()
        # CANCEL: a caller that gives up on a request it sent.
        req_id = self.client.core.request("db", b"given up", 1.0, net.now)
        self.client.core.cancel(req_id)
        net.collect(self.client)
        net.settle()
        # BATCH both ways, as the driver batches: requests staged by the client, then the
        # replies the member stages while answering them.
        client_core, member_core = self.client.core, self.member.core
        client_core.batching = member_core.batching = True
        for i in range(3):
            client_core.request("db", b"batched-%d" % i, 1.0, net.now)
        client_core.seal_staged()
        net.collect(self.client)
        net.run(net.now)
        member_core.seal_staged()
        net.collect(self.member)
        net.run(net.now)
        client_core.batching = member_core.batching = False
        net.settle()
        # Publish/subscribe: interest, messages (alone and batched), credit, loss of interest.
        member_core.subscribe("feeds.#")
        net.collect(self.member)
        net.settle()
        client_core.publish("feeds.news.1", b"published")
        client_core.publish("feeds.news.1", b"stamped", stamp=1.8e9)
        client_core.publish("feeds.news.1", b"retained", msg_id=bytes(range(16)))
        client_core.publish("feeds.news.1", b"traced", trace=FUZZ_TRACE)
        net.collect(self.client)
        client_core.batching = True
        for i in range(3):
            client_core.publish(f"feeds.news.{i}", b"batched", stamp=1.8e9 if i == 1 else 0.0)
        client_core.seal_staged()
        client_core.batching = False
        net.collect(self.client)
        net.settle()
        [client_in] = [
            link for link in member_core.inbound() if link.peer_id == self.client.node_id
        ]
        member_core.release(client_in.routing_id, config.pubsub_window)  # a CREDIT frame
        member_core.unsubscribe("feeds.#")
        net.collect(self.member)
        net.settle()
        # A tunnel: open, accept, data and credit both ways, a half close, a reset.
        handle = client_core.open_tunnel("db", 1000)
        net.collect(self.client)
        net.settle()
        [arrived] = self.member.events(TunnelArrived)
        member_core.tunnel_accept(arrived.handle, 1000)
        member_core.tunnel_send(arrived.handle, int(TunnelOp.DATA), 0, b"from the member")
        net.collect(self.member)
        net.settle()
        client_core.tunnel_send(handle, int(TunnelOp.DATA), 1, b"from the ")
        client_core.tunnel_send(handle, int(TunnelOp.DATA), 0, b"caller")
        client_core.tunnel_send(handle, int(TunnelOp.CREDIT), 500)
        client_core.tunnel_send(handle, int(TunnelOp.FIN))
        net.collect(self.client)
        net.settle()
        member_core.tunnel_send(arrived.handle, int(TunnelOp.RESET), 0, b"done")
        net.collect(self.member)
        net.settle()
        # Indirect probes: the client suspects the member (its link falls silent) and asks the
        # rogue, which hears the member, whether it is alive.
        net.pause(self.member)
        net.advance(0.7)
        net.resume(self.member)
        net.settle()
        leaver = net.add("leaver", seeds=[self.member])
        net.advance(0.3)
        self.leaver_id = leaver.node_id
        leaver.core.close()  # BYE on both of its links
        net.settle()
        net.kill(leaver)  # and its process ends: no driver ticks a closed core
        self.corpus: dict[int, list[bytes]] = {}
        for delivery in net.delivered:
            self.corpus.setdefault(delivery.kind, []).append(delivery.frame)
        [hello, *_] = self.corpus[Kind.HELLO]
        leaver.core.receive_in(b"knocking", hello, net.now)  # a closed core refuses
        self.corpus[Kind.REFUSE] = [frame for _rid, frame in leaver.core.in_frames]
        leaver.core.in_frames.clear()
        self.corpus[-1] = self.wrong_key_requests(4)  # pseudo-kind: sealed with another key
        missing = {int(k) for k in Kind} - set(self.corpus)
        # A new kind of frame must be fuzzed too: make the scene send one above.
        assert not missing, f"the scene sent no frame of kinds {sorted(missing)}"
        self.frames = [frame for frames in self.corpus.values() for frame in frames]
        self._strangers = 0
        self._codec = BodyCodec(config.max_payload)
        self.max_frame = config.max_frame
        self._targets: dict[str, tuple[MeshCore, Callable[[bytes], None], OutLink | InLink]] = {}
        self._bind_targets()

    # ------------------------------------------------------------------ the links under attack

    def out_link(self, node: MemNode, to: MemNode) -> OutLink:
        return next(x for x in node.core.links() if x.link_id == node.conn_to(to).link_id)

    def in_link(self, node: MemNode, peer: MemNode) -> InLink:
        routing_id = peer.conn_to(node).routing_id
        return next(x for x in node.core.inbound() if x.routing_id == routing_id)

    def _bind_targets(self) -> None:
        net, member, client, rogue = self.net, self.member, self.client, self.rogue
        from_client = client.conn_to(member)
        from_rogue = rogue.conn_to(member)

        def to_member(routing_id: bytes) -> Callable[[bytes], None]:
            return lambda frame: member.core.receive_in(routing_id, frame, net.now)

        def to_client(frame: bytes) -> None:
            client.core.receive_out(from_client.link_id, frame, net.now)

        self._targets = {
            "member<-client": (
                member.core,
                to_member(from_client.routing_id),
                self.in_link(member, client),
            ),
            "client<-member": (client.core, to_client, self.out_link(client, member)),
            "member<-rogue": (
                member.core,
                to_member(from_rogue.routing_id),
                self.in_link(member, rogue),
            ),
        }
        self._senders: dict[str, OutLink | InLink] = {
            "member<-client": self.out_link(client, member),
            "client<-member": self.in_link(member, client),
            "member<-rogue": self.out_link(rogue, member),
        }

    def wrong_key_requests(self, n: int) -> list[bytes]:
        """REQUESTs for "db" the rogue sealed with its own key, as if it held one for db."""
        link = self.out_link(self.rogue, self.member)
        assert link.keys is not None
        [(_tag, handle)] = KeyedLinkSecurity(self.rogue_keys).offers(
            "db", link.peer_nonce, link.nonce
        )
        sealer = link.keys.sealer(handle, True)
        return [
            seal_on(link, Kind.REQUEST, 1, encode_request(i, 1000, [], b"forged"), sealer)
            for i in range(1, n + 1)
        ]

    def fresh(self, target: str, rng: random.Random) -> bytes:
        """A frame `target` has not seen yet, sealed by its real sender (valid as it is)."""
        link = self._senders[target]
        if target == "member<-client":
            kind = rng.choice((Kind.PING, Kind.REQUEST, Kind.BROADCAST, Kind.SURVEY, Kind.JOB))
        elif target == "client<-member":
            kind = rng.choice((Kind.PONG, Kind.REPLY))
        else:  # all the rogue may validly send the member is its link's own control traffic
            kind = Kind.PING
        scope = 0
        if kind in (Kind.REQUEST, Kind.BROADCAST, Kind.SURVEY, Kind.JOB):
            scope, body = 1, encode_request(rng.getrandbits(32), 1000, [], rng.randbytes(8))
        elif kind == Kind.REPLY:
            scope, body = 1, encode_reply(rng.getrandbits(32), STATUS_OK, rng.randbytes(8))
        elif kind == Kind.PING:
            body = self._codec.pack([rng.getrandbits(32), []])
        elif kind == Kind.PONG:
            body = self._codec.pack([rng.getrandbits(32), 0])
        else:
            body = self._codec.pack([])
        return seal_on(link, kind, scope, body, link.send_sealers[scope])

    def case(self, rng: random.Random) -> tuple[str, bytes]:
        """One hostile case: where to feed it, and the frame."""
        target = rng.choice(TARGETS)
        if target in ESTABLISHED and rng.random() < 0.5:
            original = self.fresh(target, rng)
            frame = mutate(original, rng, self.frames, self.max_frame, replay=False)
            if frame == original:  # a mutation that happened to change nothing
                frame = original[:-1] + bytes([original[-1] ^ 1])
        else:
            frame = mutate(rng.choice(self.frames), rng, self.frames, self.max_frame)
        return target, frame

    # ------------------------------------------------------------------ feeding

    def feed(self, target: str, frame: bytes, *, authentic: bool = False) -> str:
        """Give `frame` to `target` as its driver would; the verdict, or raise Escaped.

        An `authentic` frame (sealed with the link's real keys, junk inside) moves the replay
        window to its seq, as it must: its seal proves that its sender sent it.
        """
        if target == "member<-stranger":
            return self._feed_stranger(frame)
        core, deliver, link = self._targets[target]
        before = Counter(core.stats)
        window = HEADER.unpack_from(frame)[-1] if authentic else link.recv_seq
        deliver(frame)
        problems = _problems(core, before)
        if link.recv_seq != window:
            problems.append(f"window at {link.recv_seq}, expected {window}")
        if problems:
            raise Escaped(f"{target} took {frame[:40].hex()}...: " + "; ".join(problems))
        return _moved(core, before)[0]

    def feed_valid(self, target: str, frame: bytes) -> bool:
        """Give `target` a frame meant to be accepted; True if nothing was dropped."""
        core, deliver, _link = self._targets[target]
        before = dropped(core)
        deliver(frame)
        self.net.collect(self.client if target == "client<-member" else self.member)
        self.net.run(self.net.now)
        return dropped(core) == before

    def _feed_stranger(self, frame: bytes) -> str:
        core = self.member.core
        self._strangers += 1
        before, links = Counter(core.stats), len(core.inbound())
        core.receive_in(b"stranger-%d" % self._strangers, frame, self.net.now)
        if len(core.inbound()) == links + 1 and frame[2] == Kind.HELLO:
            if any(key.startswith("dropped_") for key in _moved(core, before)):
                raise Escaped("a stranger's HELLO opened a link and was counted as dropped")
            self.net.collect(self.member)  # the WELCOME goes nowhere; the dial-back fails later
            return "hello_accepted"
        problems = _problems(core, before)
        if len(core.inbound()) != links:
            problems.append("the in-links changed")
        if problems:
            raise Escaped(f"a stranger's {frame[:40].hex()}...: " + "; ".join(problems))
        return _moved(core, before)[0]

    # ------------------------------------------------------------------ the real peers

    def losses(self) -> list[str]:
        """Real peers that went down since the scene was set (the leaver left on purpose)."""
        return [
            f"{node.name} lost {down.endpoint} ({down.reason})"
            for node in (self.member, self.client, self.rogue)
            for down in node.downs()
            if down.node_id != self.leaver_id
        ]

    def round_trip(self, payload: bytes) -> bytes:
        """A real request from the client, answered by the member; its reply payload."""
        req_id = self.net.request(self.client, "db", payload, timeout=2.0)
        replies = self.client.replies.get(req_id)
        if not replies:
            raise Escaped(f"the real client got no reply to {payload!r}")
        return replies[0].payload


def mutate(
    frame: bytes, rng: random.Random, corpus: list[bytes], max_frame: int, *, replay: bool = True
) -> bytes:
    """A hostile variant of `frame`; every choice drawn from `rng` (`replay`: may be `frame`)."""
    how = rng.choice(MUTATIONS if replay else _CHANGING)
    data = bytearray(frame)
    if how == "flip":
        bit = rng.randrange(len(data) * 8)
        data[bit // 8] ^= 1 << (bit % 8)
    elif how == "flips":
        for _ in range(rng.randint(2, 8)):
            bit = rng.randrange(len(data) * 8)
            data[bit // 8] ^= 1 << (bit % 8)
    elif how == "byte":
        data[rng.randrange(len(data))] = rng.randrange(256)
    elif how == "truncate":
        del data[rng.randrange(len(data)) :]
    elif how == "extend":
        data += rng.randbytes(rng.randint(1, 64))
    elif how == "insert":
        at = rng.randrange(len(data) + 1)
        data[at:at] = rng.randbytes(rng.randint(1, 16))
    elif how == "header":
        _magic, version, kind, flags, scope, seq = HEADER.unpack_from(data)
        field = rng.choice(("magic", "version", "kind", "flags", "scope", "seq"))
        if field == "magic":
            _magic = rng.choice([m for m in range(256) if m != MAGIC])
        elif field == "version":
            version = rng.choice([v for v in range(256) if v != VERSION])
        elif field == "kind":
            kind = rng.randrange(256)
        elif field == "flags":
            flags = rng.randrange(1, 256)
        elif field == "scope":
            scope = rng.choice([0, 1, 2, scope + 1, rng.randrange(1 << 16)]) % (1 << 16)
        else:
            seq = rng.choice([0, max(seq - 1, 0), seq + 1, (1 << 64) - 1, rng.getrandbits(64)])
            seq %= 1 << 64
        data[:HEADER_SIZE] = HEADER.pack(_magic, version, kind, flags, scope, seq)
    elif how == "splice":
        other = rng.choice(corpus)
        data = data[:HEADER_SIZE] + bytearray(other[HEADER_SIZE:])
    elif how == "replay":
        pass
    elif how == "random":
        return rng.randbytes(rng.randrange(0, 200))
    elif how == "forged":
        kind = rng.choice(list(Kind))
        header = encode_header(kind, rng.randrange(4), rng.getrandbits(64))
        return header + rng.randbytes(rng.randrange(0, 120))
    else:  # oversize
        data += bytes(max_frame + 1 - len(data))
    return bytes(data)
