"""A member killed as SIGKILL kills it: its connections close and its endpoint refuses dials.

A caller whose link to a member dropped dials it again at once; a refusal there takes the
member out of the caller's own routing (membership is not told), so a call into a cluster
with no other member fails with NoResponders at once. A handshake with the member, or
membership hearing a newer incarnation of it, puts it back. Cores wired in memory (memnet),
virtual time.
"""

from __future__ import annotations

import pytest
from memnet import MemNet, MemNode, echo, hold, member_and_client, mesh

from irismesh._core.events import PeerDown
from irismesh._core.links import LinkState
from irismesh.errors import NoResponders


def pair(net: MemNet) -> tuple[MemNode, MemNode]:
    member, client = member_and_client(net, handler=hold, settle=0.3)
    return client, member


def test_a_crashed_members_requests_fail_with_no_responders_at_once() -> None:
    net = MemNet(seed=1)
    client, member = pair(net)
    held = net.request(client, "db", b"held", timeout=5.0)
    assert len(member.arrived) == 1
    net.crash(member)  # no time passes from here on
    stats = client.core.stats
    assert stats["links_down_disconnected"] == 1
    assert stats["dials_failed_refused"] == 1  # dialled again at once, and refused
    assert stats["peers_taken_out"] == 1
    [failed] = client.failures[held]
    assert isinstance(failed.error, NoResponders)
    assert stats["requests_unserved"] == 1
    assert client.core.want("db", net.now) == 0
    with pytest.raises(NoResponders):
        client.core.request("db", b"new", 5.0, net.now)
    assert client.downs() == []  # membership was not told: its probes decide
    assert len(client.core.membership) == 1
    net.advance(4.0)
    [down] = client.downs()
    assert (down.node_id, down.reason) == (member.node_id, "dead")
    assert client.core.stats["peers_put_back"] == 0
    assert client.core._demand.unreachable == {}  # membership's verdict now


def test_a_redial_that_connects_and_drops_before_its_handshake_is_tried_again_at_once() -> None:
    """A killed process's listener may still take a connection while its kernel closes its
    sockets (the connections first); it drops at once, and the next dial is refused."""
    net = MemNet(seed=8)
    client, member = pair(net)
    net.kill(member)  # dying: nothing reaches it, but its endpoint does not refuse yet
    net.break_link(client, client.conn_to(member).link_id, "disconnected")
    [redial] = [x for x in client.core.links() if x.state is LinkState.HANDSHAKING]
    net.refusing.add(member.endpoint)  # its listener is closed now
    net.break_link(client, redial.link_id, "disconnected")  # the connection it took drops
    stats = client.core.stats
    assert stats["dials_failed_disconnected"] == 1
    assert stats["dials_failed_refused"] == 1
    assert stats["peers_taken_out"] == 1
    with pytest.raises(NoResponders):
        net.request(client, "db", b"x")


def test_a_member_that_keeps_dropping_connections_before_their_handshake_stays_in() -> None:
    """Connections dropped before their handshake are no refusal: after a few redials at once
    the caller backs off, and the member stays in its routing for membership to judge."""
    net = MemNet(seed=9)
    client, member = pair(net)
    net.kill(member)
    net.break_link(client, client.conn_to(member).link_id, "disconnected")
    for _ in range(5):
        redials = [x for x in client.core.links() if x.state is LinkState.HANDSHAKING]
        if not redials:
            break
        net.break_link(client, redials[0].link_id, "disconnected")
    stats = client.core.stats
    assert stats["dials_failed_disconnected"] == 3  # the redials at once, then backoff
    assert stats["peers_taken_out"] == 0
    assert client.core.want("db", net.now) == 1


def test_the_other_members_take_over_a_crashed_members_requests_at_once() -> None:
    net = MemNet(seed=2)
    nodes = mesh(net, {"doomed": ["db"], "other": ["db"]}, handler=hold)
    doomed, other, client = nodes["doomed"], nodes["other"], nodes["client"]
    ids = [net.request(client, "db", b"%d" % i, timeout=5.0) for i in range(20)]
    on_doomed = {token[1] for token in doomed.held}
    assert on_doomed
    net.crash(doomed)
    assert client.core.stats["peers_taken_out"] == 1
    assert {token[1] for token in other.held} == set(ids)  # resent in the same instant
    assert client.failures == {}
    for token in list(other.held):
        net.reply(other, token, b"ok")
    assert all(client.replies[req_id][0].payload == b"ok" for req_id in ids)
    assert client.core.request("db", b"more", 1.0, net.now) > 0  # the other one serves


def test_a_restarted_member_is_back_as_soon_as_its_handshake_completes() -> None:
    net = MemNet(seed=3)
    client, member = pair(net)
    net.crash(member)
    with pytest.raises(NoResponders):
        net.request(client, "db", b"x")
    fresh = net.restart(member)  # the same endpoint, a new process
    fresh.handler = echo
    restarted_at = net.now
    # The caller still calls the cluster, so it dials the endpoint again (with backoff), and
    # links to whichever node listens there now.
    while fresh.node_id not in client.peer_ids():
        assert net.now - restarted_at < 1.5, "the restarted member was never linked"
        net.advance(0.1)
    req_id = net.request(client, "db", b"back")
    assert [r.payload for r in client.replies[req_id]] == [b"re:back"]


def test_a_handshake_with_the_member_puts_it_back() -> None:
    """The refusal was no proof after all (the member refused connections for a moment):
    the next handshake with it puts it back."""
    net = MemNet(seed=4)
    client, member = pair(net)
    member.handler = echo
    net.refusing.add(member.endpoint)
    net.break_link(client, client.conn_to(member).link_id, "disconnected")
    assert client.core.stats["peers_taken_out"] == 1
    with pytest.raises(NoResponders):
        net.request(client, "db", b"x")
    net.refusing.discard(member.endpoint)
    net.advance(1.5)  # the caller redials (it still calls the cluster), and is let in
    assert client.core.stats["peers_put_back"] == 1
    assert client.core._demand.unreachable == {}
    req_id = net.request(client, "db", b"y")
    assert [r.payload for r in client.replies[req_id]] == [b"re:y"]
    assert client.downs() == []


def test_the_member_dialling_the_caller_puts_it_back() -> None:
    """A handshake either way proves the member lives: one it dials to the caller too."""
    net = MemNet(seed=11)
    client, member = pair(net)
    net.refusing.add(member.endpoint)  # the caller's dials stay refused
    net.break_link(client, client.conn_to(member).link_id, "disconnected")
    assert client.core.stats["peers_taken_out"] == 1
    member.core.add_candidate(client.endpoint, net.now, seed=True)
    net.collect(member)
    net.settle()
    assert client.core.stats["peers_put_back"] == 1
    assert client.core.want("db", net.now) == 1


def test_a_newer_incarnation_heard_by_membership_puts_the_member_back() -> None:
    net = MemNet(seed=5)
    client, member = pair(net)
    net.refusing.add(member.endpoint)  # every dial refused, to the end of the test
    net.break_link(client, client.conn_to(member).link_id, "disconnected")
    assert client.core.stats["peers_taken_out"] == 1
    member.core.membership.update(net.now)  # the member announces a newer incarnation
    net.collect(member)
    net.advance(1.5)  # gossip, then the caller's housekeeping compares incarnations
    assert client.core.stats["peers_put_back"] == 1
    assert client.core.want("db", net.now) == 1


def test_a_reset_connection_to_a_live_member_takes_nothing_out() -> None:
    net = MemNet(seed=6)
    client, member = pair(net)
    req_id = net.request(client, "db", b"once", timeout=5.0)
    old = client.conn_to(member)
    net.break_link(client, old.link_id, "disconnected")
    stats = client.core.stats
    assert stats["peers_taken_out"] == 0
    assert client.conn_to(member).routing_id != old.routing_id  # redialled at once
    assert stats["requests_resent"] == 1
    assert member.core.stats["requests_duplicate"] == 1
    net.reply(member, member.held[0], b"done")
    assert [r.payload for r in client.replies[req_id]] == [b"done"]
    assert client.failures == {}


def test_a_refused_dial_without_a_dropped_link_is_left_to_membership() -> None:
    """A refusal alone is no proof (an endpoint may be stale): the request waits for
    membership's verdict, and fails with NoResponders when that comes, before its deadline."""
    net = MemNet(seed=7)
    first = net.add("first", clusters=["a"])
    second = net.add("second", clusters=["b"], seeds=[first])
    client = net.add("client", seeds=[first])
    net.advance(1.0)
    assert len(client.core.membership) == 2  # knows `second`, not linked to it
    assert second.node_id not in client.peer_ids()
    net.crash(second)
    req_id = net.request(client, "b", b"x", timeout=10.0)
    assert client.core.stats["dials_failed_refused"] == 1
    assert client.core.stats["peers_taken_out"] == 0
    assert client.core.pending_count == 1  # parked: membership still holds `second` alive
    while not client.timed(PeerDown):
        assert net.now < 9.0, "membership never declared the member dead"
        net.advance(0.1)
    [down] = client.downs()
    assert down.node_id == second.node_id
    [failed] = client.failures[req_id]
    assert isinstance(failed.error, NoResponders)  # at the verdict, not at the deadline
    assert client.core.pending_count == 0


def test_a_crashed_subscriber_holds_no_publish_up() -> None:
    """A publisher waits until it is linked to every reader of a topic scope membership
    knows: not for one taken out of its routing."""
    net = MemNet(seed=10)
    publisher = net.add("publisher")
    reader = net.add("reader", seeds=[publisher])
    net.advance(0.5)
    reader.core.subscribe("news.#")
    net.collect(reader)
    net.advance(1.0)  # membership spreads the interest
    publisher.core.subscribers("news.today")  # the publisher links to its readers
    net.collect(publisher)
    net.advance(0.5)
    assert publisher.core.publish("news.today", b"one") == 1
    net.crash(reader)
    assert publisher.core.stats["peers_taken_out"] == 1
    assert publisher.core.publish("news.today", b"two") == 0  # no reader left: not held
    assert publisher.core.stats["publish_awaiting_readers"] == 0
