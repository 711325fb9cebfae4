"""Hostile input fed straight to cores: every bad frame is dropped and counted, real peers are
still served, and a flood grows nothing past a fixed limit.

The frames are the ones real cores exchanged in memory (`frame_fuzz.Scene`), mutated, replayed,
reordered, forged under another keyring, or random. "Dropped and counted" is checked to the
letter by `Scene.feed`: exactly one `dropped_<reason>` counter moves by one, the link's replay
window stays where it was, and the core emits nothing (no event, no frame in answer).
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from collections.abc import Callable

import msgpack
import pytest
from frame_fuzz import ESTABLISHED, FUZZ_CONFIG, TARGETS, Footprint, Scene, seal_on
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from memnet import MemNet, hold, member_and_client

from irismesh._core.config import CoreConfig
from irismesh._core.frames import (
    HEADER_SIZE,
    PUBLISH_FIELDS,
    PUBLISH_STAMP,
    STATUS_OK,
    BodyCodec,
    Kind,
    encode_header,
    encode_reply,
    encode_request,
)
from irismesh._core.gossip import seal_name
from irismesh._core.records import MemberRecord, record_transcript
from irismesh.security.identity import Identity
from irismesh.security.keyring import MESH_SCOPE, Keyring, ScopeKey
from irismesh.security.linksecurity import KeyedLinkSecurity, X25519LinkKeys

# The engine's own caps (engine.py: `_on_hello` and `add_candidate`); a flood stops there.
IN_LINK_LIMIT = 4096
DIAL_RECORD_LIMIT = 4096
CODEC = BodyCodec(FUZZ_CONFIG.max_payload)


def fast(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )


def serves_after(scene: Scene, what: str) -> None:
    """The real client is still answered, and no real peer went down."""
    assert scene.round_trip(what.encode()) == b"re:" + what.encode()
    scene.net.advance(1.5)
    assert scene.round_trip(what.encode() + b" later") == b"re:" + what.encode() + b" later"
    assert scene.losses() == []


# ---------------------------------------------------------------------- each kind of bad frame

Build = Callable[[Scene], tuple[str, bytes]]


def _authentic(scene: Scene, kind: Kind, scope: int, body: bytes) -> tuple[str, bytes]:
    """A frame sealed with the client's real link keys: a peer with the keys that sends junk."""
    link = scene.out_link(scene.client, scene.member)
    return "member<-client", seal_on(link, kind, scope, body, link.send_sealers[scope])


def _to_client(scene: Scene, kind: Kind, scope: int, body: bytes) -> tuple[str, bytes]:
    link = scene.in_link(scene.member, scene.client)
    return "client<-member", seal_on(link, kind, scope, body, link.send_sealers[scope])


def _captured(scene: Scene, kind: Kind) -> bytes:
    return scene.corpus[kind][-1]


def _stamped(
    scene: Scene, stamp: bytes, *, cut: bool = False, kind: Kind = Kind.PUBLISH_STAMPED
) -> tuple[str, bytes]:
    """A PUBLISH_STAMPED (or `kind`) frame in the client's slot for "feeds", its time (or id)
    as given; `cut` ends it three bytes into that field."""
    link = scene.out_link(scene.client, scene.member)
    slot = link.topic_slots["feeds"]
    topic = b"feeds.news.9"
    body = PUBLISH_FIELDS.pack(link.pub_seq + 1, len(topic)) + stamp
    if cut:
        body += b"\x00" * 3  # a stamp needs eight bytes: three and nothing after
    else:
        body += topic + b"payload"
    return "member<-client", seal_on(
        link, Kind.PUBLISH_STAMPED, slot, body, link.send_sealers[slot]
    )


def _reordered(scene: Scene) -> tuple[str, bytes]:
    _, first = _authentic(scene, Kind.PING, 0, CODEC.pack([1, []]))
    _, second = _authentic(scene, Kind.PING, 0, CODEC.pack([2, []]))
    assert scene.feed_valid("member<-client", second)
    return "member<-client", first  # older than what the link has seen


def _stranger_hello(scene: Scene, caps: dict[str, object]) -> tuple[str, bytes]:
    body = CODEC.pack([bytes(16), bytes(16), "tcp://stranger:7000", caps])
    return "member<-stranger", encode_header(Kind.HELLO, 0, 0) + body


def _version_2(scene: Scene) -> tuple[str, bytes]:
    _, frame = _authentic(scene, Kind.PING, 0, CODEC.pack([1, []]))
    return "member<-client", frame[:1] + b"\x02" + frame[2:]


def _truncated(scene: Scene) -> tuple[str, bytes]:
    _, frame = _authentic(scene, Kind.REQUEST, 1, encode_request(99, 1000, [], b"cut short"))
    return "member<-client", frame[:-5]


BAD_FRAMES: dict[str, tuple[str, Build]] = {
    # malformed, truncated, oversize, wrong version: stopped by the header
    "empty": ("short_frame", lambda s: ("member<-client", b"")),
    "shorter than a header": ("short_frame", lambda s: ("client<-member", b"\x49\x01\x05")),
    "foreign magic": ("bad_magic", lambda s: ("member<-client", b"GET / HTTP/1.1\r\n\r\n")),
    "unknown kind": ("bad_kind", lambda s: ("member<-client", b"\x49\x01\x63" + bytes(27))),
    "version 2": ("bad_version", _version_2),
    "oversize": (
        "oversize",
        lambda s: ("member<-client", encode_header(Kind.PING, 0, 1 << 40) + bytes(s.max_frame)),
    ),
    "truncated seal": ("bad_seal", _truncated),
    # wrong key, replayed, reordered, no handshake
    "sealed with another keyring": ("bad_seal", lambda s: ("member<-rogue", s.corpus[-1][-1])),
    "replayed request": ("replay", lambda s: ("member<-client", _captured(s, Kind.REQUEST))),
    "replayed reply": ("replay", lambda s: ("client<-member", _captured(s, Kind.REPLY))),
    "replayed hello": ("replay", lambda s: ("member<-client", _captured(s, Kind.HELLO))),
    "replayed welcome": ("replay", lambda s: ("client<-member", _captured(s, Kind.WELCOME))),
    "reordered": ("replay", _reordered),
    "request without a handshake": (
        "unknown_link",
        lambda s: ("member<-stranger", _captured(s, Kind.REQUEST)),
    ),
    "hello without key agreement": ("bad_handshake", lambda s: _stranger_hello(s, {})),
    "hello with a short key": ("bad_handshake", lambda s: _stranger_hello(s, {"kx": b"short"})),
    "hello with a low-order key": (
        "bad_handshake",
        lambda s: _stranger_hello(s, {"kx": bytes(32)}),
    ),
    "request in a scope never offered": (
        "bad_scope",
        lambda s: ("member<-client", encode_header(Kind.REQUEST, 9, 1 << 40) + bytes(30)),
    ),
}

# Sealed correctly by a peer holding the keys (a buggy or compromised one), nonsense inside.
JUNK_IN_A_SEAL: dict[str, tuple[str, Build]] = {
    "ping not msgpack": ("bad_body", lambda s: _authentic(s, Kind.PING, 0, b"\xc1")),
    "ping not an array": ("bad_body", lambda s: _authentic(s, Kind.PING, 0, msgpack.packb({}))),
    "ping of the wrong shape": (
        "bad_envelope",
        lambda s: _authentic(s, Kind.PING, 0, CODEC.pack([1])),
    ),
    "bye of the wrong shape": (
        "bad_envelope",
        lambda s: _authentic(s, Kind.BYE, 0, CODEC.pack([1])),
    ),
    "credit of nothing": ("bad_envelope", lambda s: _to_client(s, Kind.CREDIT, 0, CODEC.pack([0]))),
    "request in the link's scope": (
        "bad_scope",
        lambda s: _authentic(s, Kind.REQUEST, 0, encode_request(7, 1000, [], b"x")),
    ),
    "request body too short": ("bad_envelope", lambda s: _authentic(s, Kind.REQUEST, 1, b"\x00")),
    "request with nine acks": (
        "bad_envelope",
        lambda s: _authentic(s, Kind.REQUEST, 1, b"\x00" * 8 + b"\x00\x00\x03\xe8\x09" + bytes(72)),
    ),
    "request payload over the limit": (
        "oversize",
        lambda s: _authentic(
            s, Kind.REQUEST, 1, encode_request(8, 1000, [], bytes(FUZZ_CONFIG.max_payload + 1))
        ),
    ),
    "pong sent to a listener": (
        "unexpected",
        lambda s: _authentic(s, Kind.PONG, 0, CODEC.pack([1, 0])),
    ),
    "ping sent to a dialler": (
        "unexpected",
        lambda s: _to_client(s, Kind.PING, 0, CODEC.pack([1, []])),
    ),
    "reply with an unknown status": (
        "bad_envelope",
        lambda s: _to_client(s, Kind.REPLY, 1, encode_reply(1, STATUS_OK, b"")[:-1] + b"\x07"),
    ),
    "stamped publish with a NaN time": (
        "bad_envelope",
        lambda s: _stamped(s, PUBLISH_STAMP.pack(float("nan"))),
    ),
    "stamped publish with no time": (
        "bad_envelope",
        lambda s: _stamped(s, PUBLISH_STAMP.pack(0.0)),
    ),
    "stamped publish cut inside its time": ("bad_envelope", lambda s: _stamped(s, b"", cut=True)),
    "retained publish cut inside its id": (
        "bad_envelope",
        lambda s: _stamped(s, b"", cut=True, kind=Kind.PUBLISH_RETAINED),
    ),
    "the link's goodbye of the wrong shape": (
        "bad_envelope",
        lambda s: _authentic(s, Kind.BYE, 0, CODEC.pack([1])),
    ),
}


@pytest.mark.parametrize("name", list(BAD_FRAMES))
def test_each_kind_of_bad_frame_is_dropped_under_its_reason(name: str) -> None:
    reason, build = BAD_FRAMES[name]
    scene = Scene(seed=1)
    target, frame = build(scene)
    assert scene.feed(target, frame) == "dropped_" + reason
    serves_after(scene, name)


@pytest.mark.parametrize("name", list(JUNK_IN_A_SEAL))
def test_junk_under_a_valid_seal_is_dropped_under_its_reason(name: str) -> None:
    """The seal proves who sent it, so its seq counts; what it says is still refused."""
    reason, build = JUNK_IN_A_SEAL[name]
    scene = Scene(seed=1)
    target, frame = build(scene)
    assert scene.feed(target, frame, authentic=True) == "dropped_" + reason
    serves_after(scene, name)


# ---------------------------------------------------------------------- mutations of real frames


def _flips(frame: bytes) -> list[bytes]:
    """Every one-bit flip of the header, and one flip (at a varying bit) per body byte."""
    header = [_flip(frame, bit) for bit in range(HEADER_SIZE * 8)]
    return header + [_flip(frame, i * 8 + i % 8) for i in range(HEADER_SIZE, len(frame))]


def _flip(frame: bytes, bit: int) -> bytes:
    data = bytearray(frame)
    data[bit // 8] ^= 1 << (bit % 8)
    return bytes(data)


CAPTURED_KINDS = [*Kind, -1]  # -1: the rogue's REQUESTs sealed with another key


@pytest.mark.parametrize("kind", CAPTURED_KINDS, ids=lambda k: k.name if k != -1 else "WRONG_KEY")
def test_every_bit_flip_of_a_captured_frame_is_dropped(kind: int) -> None:
    scene = Scene(seed=2)
    frame = scene.corpus[kind][0]
    verdicts: Counter[str] = Counter()
    for variant in _flips(frame):
        for target in sorted(ESTABLISHED):
            verdicts[scene.feed(target, variant)] += 1
    assert all(v.startswith("dropped_") for v in verdicts), verdicts
    serves_after(scene, f"after flipping {kind}")


FRESH = [
    ("member<-client", Kind.PING, 0),
    ("member<-client", Kind.REQUEST, 1),
    ("member<-client", Kind.BROADCAST, 1),
    ("member<-client", Kind.SURVEY, 1),
    ("client<-member", Kind.PONG, 0),
    ("client<-member", Kind.REPLY, 1),
]


@pytest.mark.parametrize(("target", "kind", "scope"), FRESH, ids=lambda x: str(x))
def test_every_bit_flip_of_an_unseen_sealed_frame_fails_its_seal(
    target: str, kind: Kind, scope: int
) -> None:
    """Frames the receiver has not seen yet reach the AEAD: a flip of the body or of the
    header's seq, flags or scope fails the seal; the untouched original is then accepted."""
    scene = Scene(seed=3)
    body = {
        Kind.PING: CODEC.pack([5, []]),
        Kind.PONG: CODEC.pack([5, 0]),
        Kind.REPLY: encode_reply(12345, STATUS_OK, b"fresh reply"),
    }.get(kind, encode_request(777, 1000, [], b"fresh request"))
    make = _authentic if target == "member<-client" else _to_client
    _, original = make(scene, kind, scope, body)
    verdicts: Counter[str] = Counter()
    for variant in _flips(original):
        verdicts[scene.feed(target, variant)] += 1
    assert verdicts["dropped_bad_seal"] >= len(original) - HEADER_SIZE, verdicts
    assert set(verdicts) <= {
        "dropped_bad_seal",
        "dropped_bad_magic",
        "dropped_bad_version",
        "dropped_bad_kind",
        "dropped_bad_scope",
        "dropped_replay",
    }, verdicts
    assert scene.feed_valid(target, original)  # the control: only the flips were refused
    serves_after(scene, f"after flipping a fresh {kind.name}")


@fast(60)
@given(st.data())
def test_any_mix_of_hostile_frames_is_dropped_and_counted(data: st.DataObject) -> None:
    """Mutations (flips, truncation, header rewrites, splices, replays, forgeries, oversize) of
    captured and unseen real frames, fed to every link end and to strangers."""
    scene = Scene(seed=4)
    rng = data.draw(st.randoms(use_true_random=False))
    n = data.draw(st.integers(1, 25))
    verdicts = Counter(scene.feed(*scene.case(rng)) for _ in range(n))
    assert set(verdicts) <= {"hello_accepted"} | {v for v in verdicts if v.startswith("dropped_")}
    serves_after(scene, "after a mix")


@fast(40)
@given(target=st.sampled_from(TARGETS), frame=st.binary(max_size=300))
def test_random_bytes_are_dropped_and_counted(target: str, frame: bytes) -> None:
    scene = Scene(seed=5)
    assert scene.feed(target, frame).startswith("dropped_")
    assert scene.round_trip(b"after noise") == b"re:after noise"


# ---------------------------------------------------------------------- bounded memory


def _stranger(i: int) -> Identity:
    return Identity.from_private_bytes(hashlib.sha256(b"stranger %d" % i).digest())


def _hello(scene: Scene, i: int, *, proven: bool, name: bytes | None = None) -> bytes:
    """A stranger's HELLO: with a proof under the mesh key (an insider), or a made-up one;
    its name sealed as a node's own would be, unless `name` gives the field's bytes. Signed
    by the stranger's own identity, as a real node's is."""
    identity = _stranger(i)
    ident = identity.node_id
    endpoint, public = f"tcp://stranger-{i}:7000", X25519LinkKeys(sealing=True).public
    keys = KeyedLinkSecurity(scene.net.keyring)
    address, plain = f"stranger-{i}:7000", f"stranger-{i}"
    if name is None:
        name = seal_name(keys.datagram_sealer(ident), ident, 1, plain)
    signed = record_transcript(MemberRecord(ident, endpoint, address, b"", plain), 0)
    record = [0, address, b"", name, identity.sign(signed)]
    said = [ident, ident, endpoint, public, record]
    proof = keys.mesh_proof(b"hello", CODEC.pack(said)) if proven else bytes(16)
    sig = identity.sign(b"hello" + CODEC.pack([*said, identity.public]))
    caps = {"kx": public, "rec": record, "proof": proof, "id": identity.public, "sig": sig}
    return encode_header(Kind.HELLO, 0, 0) + CODEC.pack([ident, ident, endpoint, caps])


def test_five_thousand_hellos_without_the_mesh_key_leave_no_trace() -> None:
    scene = Scene(seed=6)
    member = scene.member.core
    before = Footprint.of(member)
    known = len(member.membership)
    for i in range(5000):
        member.receive_in(b"s%d" % i, _hello(scene, i, proven=False), scene.net.now)
        assert not member.in_frames, "a stranger without the mesh key was answered"
    assert member.stats["dropped_bad_proof"] == 5000
    assert Footprint.of(member) == before
    assert len(member.membership) == known
    serves_after(scene, "after the flood")


def test_five_thousand_hellos_from_insiders_stop_at_the_in_link_limit() -> None:
    scene = Scene(seed=6)
    member = scene.member.core
    before = Footprint.of(member)
    for i in range(5000):
        member.receive_in(b"s%d" % i, _hello(scene, i, proven=True), scene.net.now)
        scene.net.collect(scene.member)  # WELCOMEs to nowhere
    flooded = Footprint.of(member)
    assert flooded.in_links == IN_LINK_LIMIT
    assert member.stats["dropped_too_many_links"] == 5000 - (IN_LINK_LIMIT - before.in_links)
    assert flooded.out_links == before.out_links  # no dialling back: links are on demand
    assert scene.round_trip(b"under a flood") == b"re:under a flood"


def test_an_insiders_hello_names_it_and_a_bad_name_drops_the_hello() -> None:
    scene = Scene(seed=6)
    assert scene.feed("member<-stranger", _hello(scene, 1, proven=True)) == "hello_accepted"
    member = scene.member.core.membership.get(_stranger(1).node_id)
    assert member is not None
    assert member.record.name == "stranger-1"
    ident = _stranger(2).node_id
    sealer = KeyedLinkSecurity(scene.net.keyring).datagram_sealer(ident)
    other = KeyedLinkSecurity(Keyring.generate()).datagram_sealer(ident)
    bad = {
        "unprintable": ("bad_name", seal_name(sealer, ident, 1, "w1\x1b[2J")),
        "whitespace": ("bad_name", seal_name(sealer, ident, 1, "w 1")),
        "too long": ("bad_name", seal_name(sealer, ident, 1, "w" * 65)),
        "sealed for another node": ("bad_seal", seal_name(sealer, bytes(16), 1, "w1")),
        "sealed under another mesh key": ("bad_seal", seal_name(other, ident, 1, "w1")),
        "in clear": ("bad_seal", (1).to_bytes(8, "big") + b"w1"),
        "no counter": ("bad_name", b"w1"),
        "oversize": ("bad_handshake", bytes(400)),
    }
    for what, (reason, field) in bad.items():
        verdict = scene.feed("member<-stranger", _hello(scene, 2, proven=True, name=field))
        assert verdict == "dropped_" + reason, what
    assert scene.member.core.membership.get(ident) is None
    assert scene.round_trip(b"after bad names") == b"re:after bad names"


def test_a_caller_that_never_acknowledges_cannot_grow_the_reply_cache() -> None:
    config = CoreConfig(reply_cache_entries=64, reply_cache_bytes=16 << 10)
    scene = Scene(seed=8, config=config)
    member = scene.member.core
    for req_id in range(1_000_000, 1_002_000):
        # Long deadlines and no acks: only the cache's own bounds can let go of these.
        body = encode_request(req_id, 0xFFFFFFFF, [], bytes(1024))
        assert scene.feed_valid("member<-client", _authentic(scene, Kind.REQUEST, 1, body)[1])
        assert len(member.reply_cache) <= 64
        assert member.reply_cache.size_bytes <= 16 << 10
    assert member.reply_cache.evicted >= 2000 - 64
    serves_after(scene, "after 2000 unacknowledged requests")


# ---------------------------------------------------------------------- found bugs


def test_a_keyless_node_cannot_make_a_member_forget_a_callers_reply() -> None:
    net = MemNet(seed=15)
    member, client = member_and_client(net, handler=hold, settle=0.3)
    req_id = net.request(client, "db", b"charge card", timeout=5.0)
    member.core.reply(member.held[0], b"charged")  # queued on the member's side...
    net.break_link(client, client.conn_to(member).link_id)  # ...when the connection dies
    net.settle()
    # A rogue with the mesh key but another key for everything else says it is the client
    # (a holder of the mesh key may claim any node id) and acknowledges the reply the client
    # never got.
    mesh = net.keyring.mesh_keys()[0].secret
    other = ScopeKey(scope="*", secret=net.rng.randbytes(32))
    rogue = net.add("rogue", keyring=Keyring([ScopeKey(scope=MESH_SCOPE, secret=mesh), other]))
    rogue.core.node_id = client.node_id
    rogue.core.add_candidate(member.endpoint, net.now, seed=True)
    net.settle()
    [link] = rogue.core.links()
    link.acks.append(req_id)
    link.last_ping = float("-inf")
    net.tick(rogue)
    net.settle()
    net.advance(1.0)  # the client redials and resends its request with the same id
    assert len(member.arrived) == 1, "the handler ran a second time for one request"


# ---------------------------------------------------------------------- the long run


@pytest.mark.slow
def test_a_hundred_thousand_seeded_mutations_only_ever_drop_or_handshake() -> None:
    """bench/fuzz.py's cases, deterministic: the verdicts are counted drops (and strangers'
    valid HELLOs), the real client is served throughout, and memory stays bounded."""
    scene = Scene(seed=9)
    rng = random.Random(20261122)
    verdicts: Counter[str] = Counter()
    for checkpoint in range(10):
        for _ in range(10_000):
            verdicts[scene.feed(*scene.case(rng))] += 1
        assert scene.round_trip(b"checkpoint %d" % checkpoint) == b"re:checkpoint %d" % checkpoint
        footprint = Footprint.of(scene.member.core)
        assert footprint.in_links <= IN_LINK_LIMIT
        assert footprint.dial_records <= DIAL_RECORD_LIMIT
        assert footprint.reply_cache <= 64, footprint  # nothing but the real client's requests
        scene.net.advance(0.5)
    assert sum(verdicts.values()) == 100_000
    assert {v for v in verdicts if not v.startswith("dropped_")} <= {"hello_accepted"}
    assert verdicts["dropped_bad_seal"] > 10_000, verdicts  # the AEAD saw many of them
    assert scene.losses() == []
