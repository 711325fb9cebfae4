"""Broadcast and survey fan-out, and hedged requests, over cores wired in memory."""

from __future__ import annotations

import pytest
from memnet import MemNet, MemNode, echo, hold, mesh

from irismesh._core.config import CoreConfig
from irismesh._core.events import RequestArrived
from irismesh._core.frames import STATUS_OK, Kind
from irismesh.errors import MemberLost, NoResponders


def fanout(
    net: MemNet, node: MemNode, kind: Kind, cluster: str, timeout: float = 2.0
) -> dict[int, bytes]:
    sent = node.core.fanout(int(kind), cluster, b"hello", timeout, net.now)
    net.collect(node)
    net.run(net.now)
    return dict(sent)


@pytest.mark.parametrize("kind", [Kind.BROADCAST, Kind.SURVEY])
def test_fanout_reaches_every_member_once_and_each_answers(kind: Kind) -> None:
    net = MemNet(seed=1)
    nodes = mesh(net, {"a": ["db"], "b": ["db"], "c": ["db"], "d": ["other"]})
    client = nodes["client"]
    sent = fanout(net, client, kind, "db")
    assert sorted(sent.values()) == sorted(nodes[n].node_id for n in "abc")
    for name in "abc":
        arrived = nodes[name].arrived
        assert [(e.kind, e.payload) for e in arrived] == [(int(kind), b"hello")]
    assert nodes["d"].arrived == []
    for req_id in sent:
        [reply] = client.replies[req_id]
        assert reply.status == STATUS_OK
        assert reply.peer == sent[req_id]
    assert client.core.pending_count == 0


def test_fanout_to_a_cluster_without_members_is_no_responders() -> None:
    net = MemNet(seed=2)
    nodes = mesh(net, {"a": ["db"]})
    with pytest.raises(NoResponders):
        nodes["client"].core.fanout(int(Kind.SURVEY), "cache", b"x", 1.0, net.now)


def test_a_member_that_dies_is_reported_lost_not_resent_elsewhere() -> None:
    net = MemNet(seed=3)
    nodes = mesh(net, {"a": ["db"], "b": ["db"]}, handler=hold)
    client = nodes["client"]
    sent = fanout(net, client, Kind.SURVEY, "db", timeout=10.0)
    victim = nodes["b"]
    net.kill(victim)
    [lost_id] = [r for r, peer in sent.items() if peer == victim.node_id]
    # Its link falls silent (dead_after), or membership declares it dead: whichever first.
    for _ in range(10):  # 5 s of simulated time at most
        net.advance(0.5)
        if lost_id in client.failures:
            break
    [failure] = client.failures[lost_id]
    assert isinstance(failure.error, MemberLost)
    assert failure.error.member == victim.node_id.hex()
    assert len(nodes["a"].arrived) == 1  # the survivor was asked once, never twice
    [token] = nodes["a"].held
    net.reply(nodes["a"], token, b"fine")
    [survivor_id] = [r for r in sent if r != lost_id]
    assert client.replies[survivor_id][0].payload == b"fine"


def slow_b(node: MemNode, event: RequestArrived) -> bytes | None:
    return None if node.name == "b" else echo(node, event)


def test_a_hedged_request_is_answered_by_the_second_member_when_the_first_stalls() -> None:
    net = MemNet(seed=4)
    nodes = mesh(net, {"a": ["db"], "b": ["db"]}, handler=slow_b)
    client = nodes["client"]
    answered = 0
    for i in range(20):
        req_id = client.core.request("db", b"%d" % i, 2.0, net.now, hedge=0.05)
        net.collect(client)
        net.run(net.now)
        net.advance(0.2, step=0.01)
        replies = client.replies.get(req_id, [])
        assert len(replies) == 1, f"request {i}: {replies}"
        assert replies[0].payload == b"re:%d" % i
        answered += 1
    assert answered == 20
    stats = client.core.stats
    assert stats["requests_hedged"] >= 1  # b held some: their hedges went to a
    assert client.core.pending_count == 0
    # Every request that b held got exactly one copy at a as well.
    held = {token[1] for token in nodes["b"].held}
    assert stats["requests_hedged"] == len(held)
    assert all(
        link.outstanding == 0 for link in client.core.peers() if link.peer_id != nodes["b"].node_id
    )


def test_no_hedge_when_the_first_reply_comes_in_time() -> None:
    net = MemNet(seed=5)
    nodes = mesh(net, {"a": ["db"], "b": ["db"]})
    client = nodes["client"]
    for i in range(10):
        net.request(client, "db", b"%d" % i, hedge=0.05)
    net.advance(0.3, step=0.01)
    assert client.core.stats["requests_hedged"] == 0
    assert sum(len(n.arrived) for n in (nodes["a"], nodes["b"])) == 10


def test_hedges_stay_within_their_budget_when_a_whole_cluster_is_slow() -> None:
    config = CoreConfig(hedge_ratio=0.2, hedge_rate=10.0, hedge_burst=20.0)
    net = MemNet(seed=6, config=config)
    nodes = mesh(net, {"a": ["db"], "b": ["db"]}, handler=hold)  # nobody answers in time
    client = nodes["client"]
    for i in range(300):  # all at once: 300 hedges would double the load
        client.core.request("db", b"%d" % i, 5.0, net.now, hedge=0.05)
    net.collect(client)
    net.advance(0.1, step=0.01)
    stats = client.core.stats
    # At most the bucket (20: a fifth of each request is deposited, the bucket never holds
    # more), plus 10 per second for the 0.1 s that passed.
    assert 20 <= stats["requests_hedged"] <= 20 + 10 * 0.1 + 1
    assert stats["hedges_over_budget"] == 300 - stats["requests_hedged"]
    assert sum(len(nodes[n].arrived) for n in "ab") == 300 + stats["requests_hedged"]
