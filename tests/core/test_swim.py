"""SWIM-style failure detection: suspicion, indirect probes through peers, refutation."""

from __future__ import annotations

from memnet import MemNet, MemNode, mesh

from irismesh._core.config import CoreConfig
from irismesh._core.events import PeerDown, PeerSuspect

CONFIG = CoreConfig(heartbeat_interval=0.1, dead_after=0.5)  # suspect at 0.3 s


def link_to(node: MemNode, peer: MemNode):  # type: ignore[no-untyped-def]
    return next((p for p in node.core.peers() if p.peer_id == peer.node_id), None)


def downs_of(node: MemNode, peer: MemNode) -> list[tuple[float, PeerDown]]:
    return [(t, e) for t, e in node.timed(PeerDown) if e.node_id == peer.node_id]


def four(seed: int) -> tuple[MemNet, dict[str, MemNode]]:
    net = MemNet(seed=seed, config=CONFIG)
    nodes = mesh(net, {"a": ["db"], "b": ["db"], "c": ["db"]}, client="d", settle=1.0)
    return net, nodes


def test_a_peer_others_still_hear_is_suspected_but_not_declared_dead() -> None:
    net, nodes = four(seed=1)
    a, b = nodes["a"], nodes["b"]
    net.partition(a, b)  # only the a-b links fail: c and d still hear b
    net.advance(1.2)  # more than twice dead_after (b forgets a silent caller at 3x)
    link = link_to(a, b)
    assert link is not None, "b was declared dead although its other peers hear it"
    assert link.suspect
    assert a.core.stats["probes_vouched"] > 0
    assert downs_of(a, b) == []
    net.heal()
    net.advance(0.3)
    assert not link.suspect  # heard again: refuted
    assert a.core.stats["suspicions_refuted"] >= 1
    states = [e.suspect for e in a.events(PeerSuspect) if e.node_id == b.node_id]
    assert states[:1] == [True]
    assert states[-1] is False  # the telemetry sees suspect, then alive


def test_vouching_has_a_limit_then_the_link_is_redialled() -> None:
    net, nodes = four(seed=2)
    a, b = nodes["a"], nodes["b"]
    net.partition(a, b)
    net.advance(CONFIG.max_vouched_silence + 1.0)
    [(_, down)] = downs_of(a, b)[:1]
    assert down.reason == "unreachable"
    net.heal()
    net.advance(3.0)  # the dial record redials b
    assert link_to(a, b) is not None


def test_a_crashed_peer_nobody_hears_is_dead_at_dead_after() -> None:
    net, nodes = four(seed=3)
    a, b = nodes["a"], nodes["b"]
    killed_at = net.now
    net.kill(b)
    net.advance(1.5)
    for name in ("a", "c", "d"):
        [(at, down)] = downs_of(nodes[name], b)
        assert down.reason == "silent"
        # Suspected at suspect_after, probes find nobody who hears it, dead at dead_after.
        assert CONFIG.dead_after <= at - killed_at <= CONFIG.dead_after + 2 * 0.1 + 1e-9
    assert a.core.stats["probes_vouched"] == 0


def test_a_short_stall_is_never_suspected() -> None:
    net, nodes = four(seed=4)
    b = nodes["b"]
    net.pause(b)
    net.advance(0.2)  # below suspect_after (0.3 s)
    net.resume(b)
    net.advance(1.0)
    for name in ("a", "c", "d"):
        assert nodes[name].core.stats["peers_suspected"] == 0
        assert downs_of(nodes[name], b) == []


def test_requests_avoid_a_suspect_member_while_another_answers() -> None:
    net, nodes = four(seed=5)
    d, b = nodes["d"], nodes["b"]
    net.partition(d, b)
    net.advance(0.4)  # d suspects b; c and a vouch for it
    link = link_to(d, b)
    assert link is not None
    assert link.suspect
    for i in range(30):
        req_id = net.request(d, "db", b"%d" % i)
        net.advance(0.05)
        [reply] = d.replies[req_id]
        assert reply.peer != b.node_id


def test_requests_waiting_on_a_vouched_but_silent_member_move_to_another() -> None:
    net = MemNet(seed=6, config=CONFIG)
    nodes = mesh(net, {"a": ["db"], "b": ["db"]}, client="d", settle=1.0)
    d, a, b = nodes["d"], nodes["a"], nodes["b"]
    net.partition(d, b)  # d cannot hear b; a still does
    # Requests already on their way to b: without help they would wait until the deadline.
    [link] = [p for p in d.core.peers() if p.peer_id == b.node_id]
    sent = []
    for i in range(20):
        req_id = d.core.request("db", b"%d" % i, 3.0, net.now)
        sent.append(req_id)
    net.collect(d)
    net.advance(0.9)
    assert link.outstanding == 0
    assert d.core.stats["requests_migrated"] >= 1
    for req_id in sent:
        [reply] = d.replies[req_id]
        assert reply.peer == a.node_id
    assert [p for p in d.core.peers() if p.peer_id == b.node_id] == [link]  # not declared dead
