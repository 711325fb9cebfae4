"""One MeshCore at a time: dialling, local errors, bad input, configuration, and the seams it
offers its driver and its security layer. Tests of cores talking live in test_engine_pair."""

from __future__ import annotations

import random
from typing import Any

import pytest
from memnet import MemNet, hold, mesh

from irismesh._core.config import CONTROL_ALLOWANCE, CoreConfig
from irismesh._core.engine import MeshCore
from irismesh._core.events import CloseLink, OpenLink, PeerUp
from irismesh._core.frames import HEADER_SIZE, BodyCodec, Kind, decode_header, encode_header
from irismesh._core.links import LinkState
from irismesh.errors import (
    Closed,
    ConfigurationError,
    MeshError,
    NoKey,
    NoResponders,
    PayloadTooLarge,
)
from irismesh.security.identity import Identity
from irismesh.security.keyring import Keyring
from irismesh.security.linksecurity import KeyedLinkSecurity

ENDPOINT = "tcp://self:7000"


def make_core(
    clusters: tuple[str, ...] = (),
    config: CoreConfig | None = None,
    keyring: Keyring | None = None,
    name: str = "",
    identity: Identity | None = None,
) -> MeshCore:
    rng = random.Random(7)
    return MeshCore(
        node_id=bytes(range(16)) if identity is None else identity.node_id,
        identity=identity,
        endpoint=ENDPOINT,
        clusters=clusters,
        security=KeyedLinkSecurity(keyring or Keyring.generate(randbytes=rng.randbytes)),
        rng=rng,
        randbytes=random.Random(8).randbytes,
        config=config,
        name=name,
    )


# ---------------------------------------------------------------------- a fresh core


def test_fresh_core_is_idle() -> None:
    core = make_core(("db", "cache", "db"))
    assert core.clusters == ("db", "cache")
    assert core.events == []
    assert core.out_frames == []
    assert core.in_frames == []
    assert core.pending_count == 0
    assert core.next_deadline(0.0) == 0.0  # membership's first period starts at once
    assert core.peers() == []
    core.tick(0.0)
    assert 0.0 < core.next_deadline(0.0) <= 0.5
    core.tick(10.0)
    assert core.events == []
    assert core.take_datagrams() == []  # alone: nobody to probe or gossip to
    assert core.out_frames == []


def test_request_without_members_raises_no_responders_at_once() -> None:
    core = make_core()
    with pytest.raises(NoResponders) as caught:
        core.request("db", b"x", 1.0, 0.0)
    assert caught.value.cluster == "db"
    assert core.pending_count == 0
    assert core.out_frames == []


def test_payload_too_large_is_refused_before_anything_is_sent() -> None:
    core = make_core(config=CoreConfig(max_payload=100))
    with pytest.raises(PayloadTooLarge) as caught:
        core.request("db", b"x" * 101, 1.0, 0.0)
    assert (caught.value.size, caught.value.limit) == (101, 100)
    assert core.pending_count == 0


def test_request_after_close_raises_closed() -> None:
    core = make_core()
    core.close()
    core.close()  # idempotent
    with pytest.raises(Closed):
        core.request("db", b"x", 1.0, 0.0)


# ---------------------------------------------------------------------- dialling


def test_a_candidate_is_dialled_once_with_a_hello() -> None:
    identity = Identity.from_private_bytes(bytes(32))
    core = make_core(name="orders-7", identity=identity)
    core.add_candidate("tcp://peer:7000", 0.0)
    core.add_candidate("tcp://peer:7000", 0.0)
    assert core.events == [OpenLink(link_id=1, endpoint="tcp://peer:7000")]
    [(link_id, frame)] = core.out_frames
    assert link_id == 1
    kind, scope, seq = decode_header(frame, core.config.max_frame)
    assert (kind, scope, seq) == (Kind.HELLO, 0, 0)
    node_id, nonce, endpoint, caps = BodyCodec(1000).unpack(frame[HEADER_SIZE:], kind)
    assert (node_id, endpoint) == (core.node_id, ENDPOINT)
    assert set(caps) == {"kx", "rec", "proof", "id", "sig"}
    assert len(caps["kx"]) == 32  # an X25519 public key: the link's key agreement
    assert caps["id"] == identity.public  # the key its id derives from...
    assert len(caps["sig"]) == 64  # ...and its signature over the transcript
    incarnation, address, tags, sealed_name, signed = caps["rec"]  # its membership record
    assert signed == core.membership.signed_me().signature
    assert (incarnation, address, tags) == (0, "self:7000", core.membership.me.tags)
    assert core.membership.open_name(core.node_id, sealed_name) == "orders-7"
    assert b"orders-7" not in frame  # the name is sealed under the mesh key: HELLO is not
    assert len(caps["proof"]) == 16  # a MAC under the mesh key over all of the above
    assert len(nonce) == 16
    assert [link.state for link in core.links()] == [LinkState.HANDSHAKING]


def test_own_endpoint_is_never_dialled() -> None:
    core = make_core()
    core.add_candidate(ENDPOINT, 0.0)
    core.tick(0.1)
    assert core.events == []
    assert core.out_frames == []


def test_own_endpoint_as_a_seed_is_never_dialled() -> None:
    core = make_core()
    core.add_candidate(ENDPOINT, 0.0, seed=True)
    core.tick(0.1)
    assert [e for e in core.events if isinstance(e, OpenLink)] == []


def test_unanswered_dial_times_out_and_a_seed_is_redialled_with_backoff() -> None:
    cfg = CoreConfig()
    core = make_core(config=cfg)
    core.add_candidate("tcp://gone:7000", 0.0, seed=True)
    opened = [0.0]
    closed: list[float] = []
    now = 0.0
    while now < 20.0:
        now = round(now + 0.05, 2)
        core.events.clear()
        core.tick(now)
        closed += [now for e in core.events if isinstance(e, CloseLink)]
        opened += [now for e in core.events if isinstance(e, OpenLink)]
    assert len(closed) >= 2
    # Each attempt lives for handshake_timeout; the next one waits a growing backoff.
    for t_open, t_close in zip(opened, closed, strict=False):
        assert cfg.handshake_timeout < t_close - t_open <= cfg.handshake_timeout + 0.051
    gaps = [t_open - t_close for t_close, t_open in zip(closed, opened[1:], strict=False)]
    assert all(0 < gap <= cfg.redial_max * 1.5 + 0.051 for gap in gaps)
    assert max(gaps) > 4 * cfg.redial_min  # the backoff grew
    assert core.stats["dials_failed"] == len(closed)


def test_an_unanswered_non_seed_is_forgotten_after_a_few_failures() -> None:
    cfg = CoreConfig()
    core = make_core(config=cfg)
    core.add_candidate("tcp://gone:7000", 0.0)
    now = 0.0
    for _ in range(600):
        now += 0.05
        core.tick(now)
    # Redialled with backoff until forget_after_failures, then forgotten (a seed never is).
    assert core.stats["dials"] == cfg.forget_after_failures
    core.add_candidate("tcp://gone:7000", now)  # learned again: dialled again
    assert core.stats["dials"] == cfg.forget_after_failures + 1


# ---------------------------------------------------------------------- bad input


def test_frames_for_unknown_links_are_dropped_and_counted() -> None:
    core = make_core()
    ping = encode_header(Kind.PING, 0, 1) + BodyCodec(100).pack([1])
    core.receive_out(99, ping, 0.0)
    core.receive_in(b"nobody", ping, 0.0)
    core.receive_in(b"nobody", b"\x00" * 3, 0.0)
    core.receive_in(b"nobody", b"\x00" * 20, 0.0)
    core.receive_in(b"nobody", b"\x00" * (core.config.max_frame + 1), 0.0)
    hello = encode_header(Kind.HELLO, 0, 0) + b"\xc1"
    core.receive_in(b"nobody", hello, 0.0)
    assert core.stats == {
        "dropped_closed_link": 1,
        "dropped_unknown_link": 1,
        "dropped_short_frame": 1,
        "dropped_bad_magic": 1,
        "dropped_oversize": 1,
        "dropped_bad_body": 1,
    }
    assert core.events == []
    assert core.in_frames == []


def test_a_handshaking_link_drops_anything_but_welcome_or_refuse() -> None:
    core = make_core()
    core.add_candidate("tcp://peer:7000", 0.0)
    core.events.clear()
    core.receive_out(1, encode_header(Kind.PING, 0, 1) + BodyCodec(100).pack([1]), 0.1)
    core.receive_out(1, encode_header(Kind.WELCOME, 0, 0) + BodyCodec(100).pack([1]), 0.1)
    assert core.stats["dropped_unexpected"] == 1  # a PING before WELCOME: dropped, link kept
    assert core.stats["dropped_bad_envelope"] == 1
    # A malformed WELCOME comes from the listener itself (nobody else writes on this
    # connection): the link is given up at once rather than at the handshake timeout.
    assert core.events == [CloseLink(link_id=1)]
    assert core.links() == []


def test_refuse_closes_the_dial() -> None:
    core = make_core()
    core.add_candidate("tcp://peer:7000", 0.0, seed=True)
    core.events.clear()
    core.receive_out(1, encode_header(Kind.REFUSE, 0, 0) + BodyCodec(100).pack(["closing"]), 0.1)
    assert core.events == [CloseLink(link_id=1)]
    assert core.links() == []
    assert core.stats["dials_failed"] == 1


# ---------------------------------------------------------------------- keys


def test_no_key_is_raised_for_a_cluster_the_keyring_cannot_serve() -> None:
    net = MemNet(seed=1, keyring=Keyring.generate(["db"]))
    nodes = mesh(net, {"m": ["db"]})
    client = nodes["client"]
    assert len(client.core.members("db")) == 1
    with pytest.raises(NoKey) as caught:
        net.request(client, "cache", b"x")
    assert caught.value.scope == "cache"
    with pytest.raises(NoKey):
        client.core.members("cache")


def test_no_key_is_raised_even_before_any_peer_is_up() -> None:
    core = make_core(keyring=Keyring.generate(["db"]))
    with pytest.raises(NoKey):
        core.request("cache", b"x", 1.0, 0.0)


# ---------------------------------------------------------------------- limits


def test_a_member_of_many_clusters_can_be_joined_or_is_refused_at_construction() -> None:
    net = MemNet(seed=3)
    clusters = [f"c{i}" for i in range(65)]
    try:
        member = net.add("member", clusters=clusters)
    except ConfigurationError:
        return
    client = net.add("client", seeds=[member])
    net.advance(0.5)
    assert client.events(PeerUp)
    assert len(client.core.members("c64")) == 1


def test_a_small_max_payload_still_allows_handshakes() -> None:
    net = MemNet(seed=4, config=CoreConfig(max_payload=8))
    mesh(net, {"m": ["db"]})
    assert net.nodes["client"].events(PeerUp)


def test_membership_works_with_a_small_max_payload() -> None:
    net = MemNet(seed=5, config=CoreConfig(max_payload=1000))
    hub = net.add("hub")
    for i in range(40):
        net.add(f"node-with-a-longish-name-{i:03d}", seeds=[hub])
    net.advance(2.0)
    newcomer = net.add("newcomer", seeds=[hub])
    net.advance(2.0)
    assert newcomer.core.stats["dropped_oversize"] == 0
    assert len(newcomer.core.membership) == 41
    assert [link.peer_id for link in newcomer.core.peers()] == [hub.node_id]  # the join's link


def test_max_pending_is_enforced() -> None:
    net = MemNet(seed=6, config=CoreConfig(max_pending=3))
    client = mesh(net, {"m": ["db"]}, handler=hold)["client"]
    for _ in range(3):
        net.request(client, "db", b"x")
    with pytest.raises(MeshError):
        net.request(client, "db", b"x")
    assert client.core.pending_count == 3


@pytest.mark.parametrize(
    "options",
    [
        {"max_payload": 0},
        {"max_payload": (256 << 20) + 1},
        {"heartbeat_interval": 0},
        {"heartbeat_interval": 0.5, "dead_after": 0.9},
        {"max_pending": 0},
    ],
)
def test_bad_configuration_is_refused(options: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        CoreConfig(**options)


def test_config_is_frozen_and_keyword_only() -> None:
    cfg = CoreConfig()
    with pytest.raises(AttributeError):
        cfg.dead_after = 5.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        CoreConfig(1000)  # type: ignore[call-arg]
    assert cfg.max_frame == cfg.max_payload + CONTROL_ALLOWANCE
