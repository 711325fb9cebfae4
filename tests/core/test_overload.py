"""Deadlines travel, members turn work away, callers go elsewhere or back off, cancels reach
members: the core's side of overload, over cores wired in memory."""

from __future__ import annotations

import pytest
from memnet import MemNet, MemNode, echo, hold, mesh

from irismesh._core.events import RequestArrived, RequestCancelled
from irismesh._core.frames import STATUS_OK
from irismesh.errors import Overloaded


def refuse(node: MemNode, event: RequestArrived) -> bytes | None:
    """A member at capacity: it turns every request away, unrun."""
    node.core.calls.turn_away(event.token, "queue")
    return None


def test_a_request_carries_its_remaining_budget_as_the_members_deadline() -> None:
    net = MemNet(seed=1)
    nodes = mesh(net, {"a": ["db"]}, handler=hold)
    net.request(nodes["client"], "db", b"x", timeout=0.3)
    [arrived] = nodes["a"].arrived
    assert net.now + 0.3 <= arrived.deadline <= net.now + 0.302


def test_a_request_turned_away_goes_to_a_member_not_asked_yet() -> None:
    net = MemNet(seed=2)

    def b_refuses(node: MemNode, event: RequestArrived) -> bytes | None:
        return refuse(node, event) if node.name == "b" else echo(node, event)

    nodes = mesh(net, {"a": ["db"], "b": ["db"]}, handler=b_refuses)
    client = nodes["client"]
    for i in range(20):
        req_id = net.request(client, "db", b"%d" % i)
        net.settle()
        [reply] = client.replies[req_id]
        assert reply.status == STATUS_OK
        assert reply.peer == nodes["a"].node_id
    refused = len(nodes["b"].arrived)
    assert refused >= 1
    assert client.core.stats["requests_retried_elsewhere"] == refused
    assert nodes["b"].core.stats["requests_shed_queue"] == refused
    assert len(nodes["a"].arrived) == 20  # each ran once, never twice


def test_turned_away_by_the_only_member_fails_with_overloaded_at_once() -> None:
    net = MemNet(seed=3)
    nodes = mesh(net, {"a": ["db"]}, handler=refuse)
    client = nodes["client"]
    req_id = net.request(client, "db", b"x", timeout=5.0)
    net.settle()
    [failure] = client.failures[req_id]
    assert isinstance(failure.error, Overloaded)
    assert failure.error.reason == "member"
    assert failure.error.detail == "queue"
    assert client.core.pending_count == 0


def test_a_caller_turned_away_again_and_again_throttles_itself() -> None:
    net = MemNet(seed=4)
    nodes = mesh(net, {"a": ["db"]}, handler=refuse)
    client = nodes["client"]
    throttled: list[Overloaded] = []
    for i in range(200):
        try:
            net.request(client, "db", b"%d" % i)
        except Overloaded as exc:
            throttled.append(exc)
        net.settle()
    assert {exc.reason for exc in throttled} == {"throttled"}
    assert len(throttled) > 100  # most never left the caller
    assert client.core.stats["requests_throttled"] == len(throttled)
    assert len(nodes["a"].arrived) == 200 - len(throttled)


def test_a_cancelled_request_is_reported_to_its_member() -> None:
    net = MemNet(seed=5)
    nodes = mesh(net, {"a": ["db"]}, handler=hold)
    client, member = nodes["client"], nodes["a"]
    req_id = net.request(client, "db", b"x")
    client.core.cancel(req_id)
    net.collect(client)
    net.settle()
    [arrived] = member.arrived
    [cancelled] = member.events(RequestCancelled)
    assert cancelled.token == arrived.token
    assert member.core.stats["cancels_received"] == 1


def test_a_cancel_for_an_answered_request_does_nothing() -> None:
    net = MemNet(seed=6)
    nodes = mesh(net, {"a": ["db"]})
    client, member = nodes["client"], nodes["a"]
    req_id = client.core.request("db", b"x", 2.0, net.now)
    net.collect(client)
    net.settle()
    assert client.replies[req_id]
    # A cancel that crosses the reply: the member answered already.
    client.core.calls._send_cancel(client.core.peers()[0], req_id)
    net.collect(client)
    net.settle()
    assert member.events(RequestCancelled) == []


def test_the_losing_copy_of_a_hedged_request_is_cancelled() -> None:
    net = MemNet(seed=7)

    def slow_b(node: MemNode, event: RequestArrived) -> bytes | None:
        return None if node.name == "b" else echo(node, event)

    nodes = mesh(net, {"a": ["db"], "b": ["db"]}, handler=slow_b)
    client = nodes["client"]
    for i in range(10):
        net.request(client, "db", b"%d" % i, hedge=0.05)
        net.advance(0.2, step=0.01)
    held = {token for token in nodes["b"].held}
    cancelled = {event.token for event in nodes["b"].events(RequestCancelled)}
    assert held
    assert cancelled == held


@pytest.mark.parametrize("timeout", [0.05, 1.0])
def test_a_resent_request_carries_what_is_left_of_its_budget(timeout: float) -> None:
    net = MemNet(seed=8)
    nodes = mesh(net, {"a": ["db"], "b": ["db"]}, handler=hold)
    client = nodes["client"]
    net.request(client, "db", b"x", timeout=timeout)
    [first] = [e for n in "ab" for e in nodes[n].arrived]
    victim = nodes["a"] if nodes["a"].arrived else nodes["b"]
    net.advance(0.02, step=0.01)
    net.kill(victim)
    net.advance(0.5, step=0.01)
    resent = [e for n in "ab" if nodes[n] is not victim for e in nodes[n].arrived]
    for event in resent:  # never more than the caller's own deadline
        assert event.deadline <= first.deadline + 0.002
