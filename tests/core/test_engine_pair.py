"""Cores wired together in memory (memnet): handshakes, requests, failover, idempotency,
membership, links on demand, hostile frames, and a stateful property test of the whole mesh.

Time is virtual: `net.advance(seconds)` ticks every live core every 0.1 s (unless told
otherwise) and delivers frames in between; nothing here sleeps.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from memnet import Handler, MacLinkSecurity, MemNet, MemNode, echo, hold, member_and_client, mesh

from irismesh._core.config import CoreConfig
from irismesh._core.engine import MeshCore
from irismesh._core.events import OpenLink, PeerDown, PeerUp, RequestArrived
from irismesh._core.frames import (
    STATUS_ERROR,
    STATUS_OK,
    BodyCodec,
    Kind,
    encode_header,
    unpack_error,
)
from irismesh.errors import Closed, NoResponders, Overloaded, RequestTimeout
from irismesh.security.keyring import Keyring


def dropped(core: MeshCore) -> int:
    return sum(n for reason, n in core.stats.items() if reason.startswith("dropped_"))


def pair(
    net: MemNet, handler: Handler = echo, clusters: tuple[str, ...] = ("db",)
) -> tuple[MemNode, MemNode]:
    """A member of `clusters` and a client seeded with it, handshakes done."""
    member = net.add("member", clusters=clusters, handler=handler)
    client = net.add("client", seeds=[member])
    net.advance(0.3)
    return client, member


def outcome_count(node: MemNode, req_id: int) -> int:
    return len(node.replies.get(req_id, ())) + len(node.failures.get(req_id, ()))


# ---------------------------------------------------------------------- handshake, requests


def test_handshake_brings_the_peer_up_on_both_sides() -> None:
    net = MemNet(seed=1)
    client, member = pair(net)
    # Each learnt the other's record, name included, from the handshake (a proven record).
    assert client.ups() == [PeerUp(node_id=member.node_id, endpoint=member.endpoint, name="member")]
    assert member.ups() == [PeerUp(node_id=client.node_id, endpoint=client.endpoint, name="client")]
    [link] = client.core.members("db")
    assert link.peer_id == member.node_id
    assert member.core.members("db") == []  # the client serves nothing
    assert [x.peer_id for x in member.core.inbound()] == [client.node_id]
    assert client.core.inbound() == []  # links are on demand: the member needs none back
    assert member.core.peers() == []
    assert dropped(client.core) == dropped(member.core) == 0


def test_request_reaches_a_member_and_its_reply_comes_back() -> None:
    net = MemNet(seed=2)
    client, member = pair(net)
    req_id = net.request(client, "db", b"GET k", timeout=1.0)
    [arrived] = member.arrived
    assert (arrived.token[:2], arrived.cluster, arrived.payload) == (
        (client.node_id, req_id),
        "db",
        b"GET k",
    )
    [reply] = client.replies[req_id]
    assert (reply.status, reply.payload) == (STATUS_OK, b"re:GET k")
    assert client.core.pending_count == 0
    assert client.core.calls.pending.next_deadline() is None
    assert [link.outstanding for link in client.core.links()] == [0]
    net.advance(2.0)  # nothing more happens to a finished request
    assert client.failures == {}
    assert len(client.replies[req_id]) == 1


def test_a_reply_sink_takes_each_reply_instead_of_an_event() -> None:
    net = MemNet(seed=2)
    client, member = pair(net)
    taken: list[tuple[int, int, bytes, bytes, float]] = []
    client.core.calls.reply_sink = lambda *reply: taken.append(reply)
    first = net.request(client, "db", b"one", timeout=1.0)
    second = net.request(client, "db", b"two", timeout=1.0)
    assert [(r[0], r[1], r[2], r[3]) for r in taken] == [
        (first, STATUS_OK, b"re:one", member.node_id),
        (second, STATUS_OK, b"re:two", member.node_id),
    ]
    assert all(0.0 < r[4] <= net.now for r in taken)  # when the driver read it
    assert client.replies == {}  # no ReplyArrived for them
    assert client.core.pending_count == 0
    client.core.calls.reply_sink = None  # without a sink: events again
    third = net.request(client, "db", b"three", timeout=1.0)
    assert client.replies[third][0].payload == b"re:three"
    assert len(taken) == 2


def test_a_request_event_compares_and_prints_as_the_dataclass_it_was() -> None:
    token = (b"p", 1, b"r", 1)
    event = RequestArrived(token, "db", b"x", deadline=2.0)
    assert event == RequestArrived(token=token, cluster="db", payload=b"x", kind=5, deadline=2.0)
    assert event != RequestArrived(token, "db", b"y", deadline=2.0)
    assert event != (token, "db", b"x", 5, 2.0, 0)
    assert repr(event) == (
        "RequestArrived(token=(b'p', 1, b'r', 1), cluster='db', payload=b'x', kind=5, "
        "deadline=2.0, priority=0, trace=b'')"
    )
    event.priority = 3  # mutable, as it was
    assert event.priority == 3


def test_each_cluster_of_a_member_gets_its_own_requests() -> None:
    net = MemNet(seed=3)
    client, member = pair(net, clusters=("db", "cache"))
    first = net.request(client, "db", b"1")
    second = net.request(client, "cache", b"2")
    assert [(e.cluster, e.payload) for e in member.arrived] == [("db", b"1"), ("cache", b"2")]
    assert client.replies[first][0].payload == b"re:1"
    assert client.replies[second][0].payload == b"re:2"
    with pytest.raises(NoResponders):
        net.request(client, "queue", b"3")


def test_an_unknown_cluster_raises_no_responders_at_once() -> None:
    net = MemNet(seed=4)
    client, _member = pair(net)
    with pytest.raises(NoResponders) as caught:
        net.request(client, "nobody-serves-this", b"x")
    assert caught.value.cluster == "nobody-serves-this"
    assert client.core.pending_count == 0


def test_a_node_without_the_clusters_key_does_not_see_its_members() -> None:
    shared = Keyring.generate(["*"])
    net = MemNet(seed=5, keyring=shared)
    # The member holds a key of its own for db; the client only the shared default.
    member = net.add("member", clusters=["db", "cache"], keyring=shared.with_key("db"))
    client = net.add("client", seeds=[member])
    stranger = net.add("stranger", seeds=[member], keyring=Keyring.generate(["*"]))
    net.advance(0.5)
    assert client.ups()  # the link itself is up
    assert client.core.members("db") == []
    with pytest.raises(NoResponders):
        net.request(client, "db", b"x")
    assert len(client.core.members("cache")) == 1  # cache is under the shared key
    assert stranger.core.members("db") == []
    assert stranger.core.members("cache") == []
    assert member.arrived == []


def test_an_error_reply_carries_the_type_and_message() -> None:
    net = MemNet(seed=6)
    client, member = pair(net, handler=hold)
    req_id = net.request(client, "db", b"x")
    member.core.reply_error(member.held[0], ValueError("no such key"))
    net.settle()
    [reply] = client.replies[req_id]
    assert reply.status == STATUS_ERROR
    assert unpack_error(reply.payload) == ("ValueError", "no such key")


def test_payload_limits_are_inclusive_and_an_oversized_reply_becomes_an_error() -> None:
    net = MemNet(seed=7, config=CoreConfig(max_payload=1000))
    client, member = pair(net, handler=hold)
    first = net.request(client, "db", b"q" * 1000)
    assert member.arrived[0].payload == b"q" * 1000
    net.reply(member, member.held[0], b"r" * 1000)
    assert client.replies[first][0].payload == b"r" * 1000
    second = net.request(client, "db", b"q")
    net.reply(member, member.held[1], b"r" * 1001)
    [reply] = client.replies[second]
    assert reply.status == STATUS_ERROR
    assert unpack_error(reply.payload)[0] == "PayloadTooLarge"
    assert dropped(client.core) == dropped(member.core) == 0


def test_a_request_times_out_at_its_deadline() -> None:
    net = MemNet(seed=8)
    client, member = pair(net, handler=hold)
    start = net.now
    req_id = net.request(client, "db", b"slow", timeout=0.5)
    assert client.core.calls.pending.next_deadline() == start + 0.5
    net.run(start + 0.5 - 1e-6)
    net.tick(client)
    assert client.failures == {}
    net.run(start + 0.5)
    net.tick(client)
    [failed] = client.failures[req_id]
    assert isinstance(failed.error, RequestTimeout)
    assert (failed.error.cluster, failed.error.timeout, failed.error.attempts) == ("db", 0.5, 1)
    assert client.core.pending_count == 0
    assert [link.outstanding for link in client.core.links()] == [0]
    net.reply(member, member.held[0], b"too late")  # dropped and counted, never delivered
    assert client.core.stats["replies_late"] == 1
    assert client.replies == {}


def test_a_reply_at_the_deadline_is_late_even_before_the_timer_has_run() -> None:
    """A member that stops at the same deadline answers "the caller gave up"; that answer
    reaching the caller before its own timer does must not become the request's outcome."""
    net = MemNet(seed=8)
    client, member = pair(net, handler=hold)
    start = net.now
    req_id = net.request(client, "db", b"slow", timeout=0.5)
    net.run(start + 0.5)
    net.reply(member, member.held[0], b"at the deadline")  # before the client's timer
    assert client.replies == {}
    assert client.core.stats["replies_late"] == 1
    net.tick(client)
    [failed] = client.failures[req_id]
    assert isinstance(failed.error, RequestTimeout)


def test_a_cancelled_request_ignores_its_reply() -> None:
    net = MemNet(seed=9)
    client, member = pair(net, handler=hold)
    req_id = net.request(client, "db", b"x")
    client.core.cancel(req_id)
    client.core.cancel(req_id)  # twice is harmless
    assert client.core.pending_count == 0
    assert [link.outstanding for link in client.core.links()] == [0]
    net.reply(member, member.held[0], b"ignored")
    assert client.replies == {}
    assert client.core.stats["replies_late"] == 1


def test_reply_cache_is_bounded_by_entries_and_bytes() -> None:
    by_entries = CoreConfig(reply_cache_entries=5)
    by_bytes = CoreConfig(reply_cache_bytes=250)
    for seed, config, bound in [(10, by_entries, 5), (11, by_bytes, 2)]:
        net = MemNet(seed=seed)
        member = net.add("member", clusters=["db"], config=config, handler=hold)
        client = net.add("client", seeds=[member])
        net.advance(0.3)
        ids = [net.request(client, "db", b"%d" % i) for i in range(20)]
        for token in member.held:  # 20 replies in transit, none acknowledged yet
            net.reply(member, token, b"r" * 100)
        assert all(client.replies[req_id][0].payload == b"r" * 100 for req_id in ids)
        cache = member.core.reply_cache
        assert len(cache) == bound
        assert cache.size_bytes == 100 * bound <= config.reply_cache_bytes
        assert cache.evicted == 20 - bound


def test_acknowledged_replies_are_forgotten() -> None:
    net = MemNet(seed=29)
    client, member = pair(net, handler=hold)
    for i in range(3):
        net.request(client, "db", b"%d" % i)
    for token in member.held:
        net.reply(member, token, b"done")
    cache = member.core.reply_cache
    assert len(cache) == 3
    net.request(client, "db", b"next")  # carries the acks of the three replies
    assert len(cache) == 1  # only the request now running
    net.reply(member, member.held[-1], b"done")
    net.advance(0.3)  # the next heartbeat carries the last ack
    assert len(cache) == 0
    assert cache.size_bytes == 0
    assert cache.evicted == 0


def test_a_steady_stream_of_requests_keeps_the_reply_cache_small() -> None:
    net = MemNet(seed=30)
    client, member = pair(net)
    for i in range(500):
        net.request(client, "db", b"%d" % i)
        assert len(member.core.reply_cache) <= 8 + 1
    assert member.core.reply_cache.evicted == 0


# ---------------------------------------------------------------------- failover, idempotency


def test_failover_resends_a_dead_members_requests_to_the_others() -> None:
    net = MemNet(seed=12)
    doomed = net.add("doomed", clusters=["db"], handler=hold)
    others = [net.add(f"m{i}", clusters=["db"], handler=hold) for i in range(2)]
    client = net.add("client", seeds=[doomed, *others])
    net.advance(0.5)
    assert len(client.core.members("db")) == 3
    ids = {net.request(client, "db", b"%d" % i, timeout=5.0): b"%d" % i for i in range(60)}
    held = {token[1] for token in doomed.held}
    assert 10 <= len(held) <= 30  # spread by outstanding work
    for member in others:  # the live members answer, and from now on at once
        for event in member.arrived:
            net.reply(member, event.token, b"re:" + event.payload)
        member.handler = echo
    killed_at = net.now
    net.kill(doomed)  # silently: no transport error, only silence
    net.advance(4.0)

    [down] = client.timed(PeerDown)
    assert (down[1].node_id, down[1].reason) == (doomed.node_id, "dead")
    assert down[0] - killed_at < 3.0  # membership's verdict
    for req_id, payload in ids.items():  # every request answered exactly once, correctly
        assert [r.payload for r in client.replies[req_id]] == [b"re:" + payload]
    assert client.failures == {}
    assert client.core.pending_count == 0
    # Moved when the busy link fell silent (dead_after), or resent when membership said dead.
    stats = client.core.stats
    assert stats["requests_resent"] + stats["requests_migrated"] == len(held)
    # The resends kept their ids, and no member ran any request twice.
    for member in others:
        tokens = [e.token for e in member.arrived]
        assert len(tokens) == len(set(tokens))
    rerun = [e.token[1] for m in others for e in m.arrived if e.token[1] in held]
    assert sorted(rerun) == sorted(held)
    assert all(e.token[0] == client.node_id for m in others for e in m.arrived)


def test_a_transport_failure_resends_at_once_and_counts_the_attempt() -> None:
    net = MemNet(seed=13)
    nodes = mesh(net, {"first": ["db"], "second": ["db"]}, handler=hold)
    first, second, client = nodes["first"], nodes["second"], nodes["client"]
    req_id = net.request(client, "db", b"x", timeout=1.0)
    holder, other = (first, second) if first.held else (second, first)
    net.break_link(client, client.conn_to(holder).link_id)
    assert [e.token[1] for e in other.arrived] == [req_id]  # resent in the same instant
    net.advance(1.1)
    [failed] = client.failures[req_id]
    assert isinstance(failed.error, RequestTimeout)
    assert failed.error.attempts == 2


def _single_member_with_a_held_request() -> tuple[MemNet, MemNode, MemNode, int]:
    net = MemNet(seed=14)
    member, client = member_and_client(net, handler=hold, settle=0.3)
    req_id = net.request(client, "db", b"once", timeout=5.0)
    assert len(member.arrived) == 1
    return net, client, member, req_id


def test_a_resend_while_the_first_attempt_runs_waits_for_it() -> None:
    net, client, member, req_id = _single_member_with_a_held_request()
    old = client.conn_to(member)
    net.break_link(client, old.link_id)
    assert client.core.stats["links_down_transport"] == 1
    assert client.downs() == []  # a link broke; membership still hears the member
    assert client.core.pending_count == 1  # parked: no other member
    net.advance(1.0)  # the member is redialled; the request goes again on the new link
    assert client.conn_to(member).routing_id != old.routing_id
    assert client.core.stats["requests_resent"] == 1
    assert member.core.stats["requests_duplicate"] == 1
    assert len(member.arrived) == 1  # the handler was not asked twice
    assert client.replies == {}
    net.reply(member, member.held[0], b"done")
    net.advance(0.1)
    assert [r.payload for r in client.replies[req_id]] == [b"done"]


def test_a_resend_after_the_reply_was_lost_gets_the_remembered_reply() -> None:
    net, client, member, req_id = _single_member_with_a_held_request()
    member.core.reply(member.held[0], b"done")  # queued on the member's side...
    old = client.conn_to(member)
    net.break_link(client, old.link_id)  # ...when the connection dies
    net.advance(1.0)  # redialled at once; the resend is answered from the member's cache
    assert client.conn_to(member).routing_id != old.routing_id
    assert member.core.stats["requests_duplicate"] == 1
    assert len(member.arrived) == 1
    assert [r.payload for r in client.replies[req_id]] == [b"done"]


def test_a_replayed_request_frame_is_dropped() -> None:
    net = MemNet(seed=15)
    client, member = pair(net, handler=hold)
    client.core.request("db", b"x", 1.0, net.now)
    [(link_id, frame)] = client.core.out_frames
    net.settle()
    assert len(member.arrived) == 1
    routing_id = client.conns[link_id].routing_id
    member.core.receive_in(routing_id, frame, net.now)
    assert member.core.stats["dropped_replay"] == 1
    assert len(member.arrived) == 1
    assert member.core.stats["requests_duplicate"] == 0  # stopped before the cache


def test_frames_reordered_within_a_link_are_rejected_as_replays() -> None:
    net = MemNet(seed=16)
    client, member = pair(net, handler=hold)
    first = client.core.request("db", b"1", 1.0, net.now)
    second = client.core.request("db", b"2", 1.0, net.now)
    (link_id, frame1), (_, frame2) = client.core.out_frames
    client.core.out_frames.clear()
    routing_id = client.conns[link_id].routing_id
    member.core.receive_in(routing_id, frame2, net.now)
    member.core.receive_in(routing_id, frame1, net.now)
    net.settle()
    assert [e.token[1] for e in member.arrived] == [second]
    assert member.core.stats["dropped_replay"] == 1
    net.advance(1.1)
    assert isinstance(client.failures[first][0].error, RequestTimeout)


# ---------------------------------------------------------------------- liveness


def test_an_idle_mesh_sends_nothing_on_its_links_and_closes_them() -> None:
    config = CoreConfig(idle_link_after=3.0)
    net = MemNet(seed=17, max_delay=0.005, config=config)
    nodes = mesh(net, {"m1": ["db"], "m2": ["db"]})
    client = nodes["client"]
    net.request(client, "db", b"x")
    net.advance(1.0)
    frames = len(net.delivered)
    datagrams = net.datagrams_sent
    net.advance(10.0)
    for node in nodes.values():
        assert node.downs() == []
        assert len(node.core.membership) == 2  # everyone alive, without a word on a link
        assert node.core.peers() == []  # idle links closed, least needed first
    byes = [d for d in net.delivered[frames:] if d.kind != Kind.BYE]
    assert byes == []  # nothing but goodbyes on the links
    # Membership costs each node about a probe and an ack per period, whatever the mesh.
    per_node_period = (
        (net.datagrams_sent - datagrams) / 3 / (10.0 / config.membership.probe_interval)
    )
    assert 1.0 <= per_node_period <= 3.0, per_node_period
    assert net.request(client, "db", b"y") in client.replies or client.core.pending_count == 1
    net.advance(0.5)  # the request waited for its link to open again
    assert client.core.pending_count == 0


def test_a_busy_link_is_pinged_and_a_silent_member_is_declared_dead() -> None:
    net = MemNet(seed=18)
    client, member = pair(net, handler=hold)
    net.request(client, "db", b"x", timeout=10.0)
    net.advance(1.0)
    [link] = client.core.peers()
    assert link.rtt > 0  # pinged while a request was in flight, and answered
    killed_at = net.now
    net.kill(member)
    net.advance(4.0)
    [(at, down)] = client.timed(PeerDown)
    assert (down.node_id, down.reason) == (member.node_id, "dead")
    assert at - killed_at < 3.0
    assert client.core.members("db") == []
    with pytest.raises(NoResponders):
        net.request(client, "db", b"x")


STALLS = [
    # (how late the tick is, config, tick step): margins such that without the stall
    # compensation the silence would exceed dead_after.
    (0.3, CoreConfig(heartbeat_interval=0.1, dead_after=0.3), 0.05),
    (1.3, CoreConfig(), 0.1),
    (5.0, CoreConfig(), 0.1),
]


@pytest.mark.parametrize(("late", "config", "step"), STALLS, ids=["0.3s", "1.3s", "5s"])
def test_a_stalled_loop_is_not_held_against_peers(
    late: float, config: CoreConfig, step: float
) -> None:
    net = MemNet(seed=19, config=config)
    member = net.add("member", clusters=["db"], handler=hold)
    client = net.add("client", seeds=[member])
    net.advance(1.0, step)
    req_id = net.request(client, "db", b"x", timeout=30.0)  # the link is busy: watched
    net.advance(1.0, step)
    # Both nodes share one process, whose loop stalls: their ticks come `late`.
    net.pause(client)
    net.pause(member)
    net.run(net.now + step + late)
    net.resume(client, member)
    net.advance(3.0, step)
    assert client.downs() == member.downs() == []
    assert client.core.stats["loop_stalls"] == 1
    assert client.core.stats["links_silent"] == 0
    net.reply(member, member.held[0], b"late")
    assert [r.payload for r in client.replies[req_id]] == [b"late"]


def test_the_same_silence_without_a_stall_is_a_silent_link() -> None:
    """The control for the stall test: there, the silence alone would have counted."""
    config, step = CoreConfig(heartbeat_interval=0.1, dead_after=0.3), 0.05
    net = MemNet(seed=19, config=config)
    member = net.add("member", clusters=["db"], handler=hold)
    client = net.add("client", seeds=[member])
    net.advance(1.0, step)
    net.request(client, "db", b"x", timeout=30.0)
    net.advance(1.0, step)
    net.partition(client, member)
    net.advance(step + 0.4, step)
    assert client.core.stats["links_silent"] == 1


def test_a_link_suspect_for_its_silence_is_routed_to_again_once_it_answers() -> None:
    """A link silent while busy turns suspect and its requests move to the other member; the
    link is idle then, and still pinged until it answers (or is closed): once the silence
    ends, it is no longer suspect and takes its share again, long before an idle close."""
    config = CoreConfig(heartbeat_interval=0.1, dead_after=0.3)
    net = MemNet(seed=23, config=config)
    nodes = mesh(net, {"m1": ["db"], "m2": ["db"]})
    client, m1, m2 = nodes["client"], nodes["m1"], nodes["m2"]
    for _ in range(20):
        net.request(client, "db", b"x", timeout=10.0)
        net.advance(0.05, 0.05)
    assert m1.arrived
    assert m2.arrived
    net.partition(client, m1)
    for _ in range(10):  # some go to m1, are not answered, and move to m2
        net.request(client, "db", b"x", timeout=10.0)
    net.advance(0.5, 0.05)
    assert client.core.stats["links_silent"] == 1
    net.heal(client, m1)
    net.advance(1.0, 0.05)
    assert client.downs() == []
    assert not any(link.suspect for link in client.core.peers())
    before = len(m1.arrived)
    for _ in range(40):
        net.request(client, "db", b"x", timeout=10.0)
        net.advance(0.05, 0.05)
    assert len(m1.arrived) > before


def test_goodbye_takes_the_peer_down_at_once_and_fails_pending_requests() -> None:
    net = MemNet(seed=20)
    client, member = pair(net, handler=hold)
    req_id = net.request(client, "db", b"x")
    member.core.close()
    net.settle()
    [down] = client.downs()
    assert (down.node_id, down.reason) == (member.node_id, "left")
    assert client.core.members("db") == []
    assert client.core.peers() == []
    client.core.close()
    net.settle()
    [failed] = client.failures[req_id]
    assert isinstance(failed.error, Closed)
    assert client.core.pending_count == 0


def test_a_partition_heals() -> None:
    net = MemNet(seed=21)
    client, member = pair(net)
    net.partition(client, member)
    net.advance(4.0)
    assert [d.reason for d in client.downs()] == ["dead"]
    assert [d.reason for d in member.downs()] == ["dead"]
    net.heal()
    net.advance(6.0)  # each side tries the one it holds dead, and each refutes its death
    assert len(client.ups()) == len(member.ups()) == 2
    req_id = net.request(client, "db", b"x")
    net.advance(0.5)
    assert req_id in client.replies


def test_a_broken_link_is_redialled_on_demand() -> None:
    net = MemNet(seed=22)
    first = net.add("first", clusters=["db"])
    second = net.add("second", clusters=["db"], seeds=[first])
    client = net.add("client", seeds=[second])
    net.advance(0.5)
    net.request(client, "db", b"warm")
    net.advance(0.5)
    assert len(client.core.members("db")) == 2
    net.break_link(client, client.conn_to(first).link_id)
    net.advance(2.0)
    assert len(client.core.members("db")) == 2  # the cluster is called: its members relinked


# ---------------------------------------------------------------------- membership


def test_a_newcomer_learns_the_whole_mesh_through_one_seed_and_links_only_on_demand() -> None:
    net = MemNet(seed=23)
    a = net.add("a", clusters=["db"])
    b = net.add("b", clusters=["db"], seeds=[a])
    net.advance(0.5)
    c = net.add("c", seeds=[a])
    net.advance(0.5)
    known = {m.record.node_id for m, _link in c.core.known()}
    assert known == {a.node_id, b.node_id}
    assert c.node_id in {m.record.node_id for m, _link in b.core.known()}
    assert c.peer_ids() <= {a.node_id}  # only the link it joined through
    req_id = net.request(c, "db", b"x")  # a call opens links to the cluster's members
    net.advance(0.5)
    assert req_id in c.replies
    assert len(c.core.members("db")) == 2


def test_dialling_oneself_under_another_name_is_given_up() -> None:
    net = MemNet(seed=24)
    node = net.add("node", clusters=["db"])
    net.listeners["tcp://alias:7000"] = node  # the same node, reached by another name
    node.core.add_candidate("tcp://alias:7000", net.now, seed=True)
    net.settle()
    net.advance(10.0)
    assert len(node.events(OpenLink)) == 1  # tried once, then never again
    assert node.ups() == []
    assert node.core.links() == []


def test_a_member_reached_under_two_names_serves_requests_at_once() -> None:
    net = MemNet(seed=25)
    member = net.add("member", clusters=["db"])
    net.listeners["tcp://alias:7000"] = member
    client = net.add("client", seeds=[member, "tcp://alias:7000"])
    net.advance(0.3)
    req_id = net.request(client, "db", b"x", timeout=2.0)
    net.advance(0.2)
    assert req_id in client.replies
    assert member.core.stats["dropped_unknown_link"] == 0


# ---------------------------------------------------------------------- hostile frames


def assert_untouched(core: MeshCore) -> None:
    """A dropped frame made the core neither emit an event nor a frame."""
    assert core.events == []
    assert core.out_frames == []
    assert core.in_frames == []


def assert_still_linked(
    net: MemNet, client: MemNode, member: MemNode, payload: bytes, seconds: float
) -> None:
    """The pair serves a request after the hostile frames, and no link goes down for
    `seconds`."""
    req_id = net.request(client, "db", payload)
    assert client.replies[req_id][0].payload == b"re:" + payload
    net.advance(seconds)
    assert client.downs() == member.downs() == []


def test_bad_frames_are_counted_under_their_reason_and_change_nothing() -> None:
    net = MemNet(seed=26)
    client, member = pair(net)
    net.request(client, "db", b"warm")  # frames have flowed both ways: seqs are past 1
    net.advance(0.5)
    link = client.conn_to(member)
    codec = BodyCodec(1000)
    before_client, before_member = dict(client.core.stats), dict(member.core.stats)
    bad = {
        "short_frame": b"\x49\x01",
        "bad_magic": b"\x00" * 30,
        "bad_version": b"\x49\x02" + b"\x00" * 28,
        "bad_kind": b"\x49\x01\x63" + b"\x00" * 27,
        "oversize": b"\x49" * (client.core.config.max_frame + 1),
        "replay": encode_header(Kind.PING, 0, 1) + codec.pack([1]),
        "bad_scope": encode_header(Kind.REQUEST, 9, 10**6) + codec.pack([1, 1, b""]),
    }
    for reason, frame in bad.items():
        member.core.receive_in(link.routing_id, frame, net.now)
        client.core.receive_out(link.link_id, frame, net.now)
        assert member.core.stats["dropped_" + reason] == 1
        assert client.core.stats["dropped_" + reason] == 1
    for core, before in [(client.core, before_client), (member.core, before_member)]:
        changed = {k for k in core.stats if core.stats[k] != before.get(k, 0)}
        assert changed == {"dropped_" + reason for reason in bad}
        assert_untouched(core)
    assert_still_linked(net, client, member, b"still fine", 2.0)


def _garbage(captured: list[bytes]) -> st.SearchStrategy[bytes]:
    @st.composite
    def mutate(draw: st.DrawFn) -> bytes:
        frame = bytearray(draw(st.sampled_from(captured)))
        how = draw(st.sampled_from(["flip", "truncate", "extend", "as is"]))
        if how == "flip":
            bit = draw(st.integers(0, len(frame) * 8 - 1))
            frame[bit // 8] ^= 1 << (bit % 8)
        elif how == "truncate":
            del frame[draw(st.integers(0, len(frame) - 1)) :]
        elif how == "extend":
            frame += draw(st.binary(min_size=1, max_size=20))
        return bytes(frame)

    forged = st.builds(
        lambda kind, scope, seq, body: encode_header(kind, scope, seq) + body,
        st.sampled_from(list(Kind)),
        st.integers(0, 3),
        st.integers(0, 2**64 - 1),
        st.binary(max_size=60),
    )
    return st.one_of(st.binary(max_size=100), mutate(), forged)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_any_hostile_frame_is_dropped_counted_and_harmless(data: st.DataObject) -> None:
    # MacLinkSecurity: a sealer that, like the promised AEAD, rejects any tampered frame.
    net = MemNet(seed=27, security=MacLinkSecurity)
    client, member = pair(net)
    net.request(client, "db", b"warm-up")
    link = client.conn_to(member)
    captured = [d.frame for d in net.delivered if d.conn is link]
    [out_link] = client.core.links()
    [in_link] = member.core.inbound()
    frames = data.draw(st.lists(st.tuples(st.booleans(), _garbage(captured)), max_size=10))
    for to_member, frame in frames:
        core = member.core if to_member else client.core
        seqs = (out_link.recv_seq, in_link.recv_seq)
        count = dropped(core)
        if to_member:
            core.receive_in(link.routing_id, frame, net.now)
        else:
            core.receive_out(link.link_id, frame, net.now)
        assert dropped(core) == count + 1
        assert (out_link.recv_seq, in_link.recv_seq) == seqs
        assert_untouched(core)
    assert_still_linked(net, client, member, b"after", 1.5)


# ---------------------------------------------------------------------- loss and reordering


def test_loss_and_cross_link_delays_never_lose_or_duplicate_an_outcome() -> None:
    net = MemNet(seed=28, max_delay=0.02)
    nodes = mesh(net, {"m1": ["db"], "m2": ["db"], "m3": ["db"]})
    client = nodes["client"]
    net.loss = 0.05
    ids: dict[int, bytes] = {}
    for i in range(200):
        ids[net.request(client, "db", b"%d" % i, timeout=1.0)] = b"%d" % i
        net.advance(0.01, step=0.01)
    net.loss = 0.0
    net.advance(3.0)
    replied = 0
    for req_id, payload in ids.items():
        assert outcome_count(client, req_id) == 1
        if req_id in client.replies:
            replied += 1
            assert client.replies[req_id][0].payload == b"re:" + payload
    assert replied > 150
    assert client.core.pending_count == 0
    # Frames crossed each other between links, never within one.
    assert any(
        a.sent > b.sent and a.conn is not b.conn
        for a, b in zip(net.delivered, net.delivered[1:], strict=False)
    )
    for node in nodes.values():
        assert node.core.stats["dropped_replay"] == 0


# ---------------------------------------------------------------------- the whole mesh


class MeshMachine(RuleBasedStateMachine):
    """A client and three members under random requests, time, loss, crashes, restarts and
    partitions. Invariants: each request ends exactly once and in time, replies answer the
    request they belong to, and no member incarnation runs a request twice."""

    MEMBERS = ("m0", "m1", "m2")

    @initialize(seed=st.integers(0, 2**32 - 1))
    def start(self, seed: int) -> None:
        self.net = MemNet(seed=seed, max_delay=0.01)
        rng = self.net.rng
        self.released: list[tuple[MemNode, tuple[bytes, int]]] = []

        def maybe_hold(node: MemNode, event: RequestArrived) -> bytes | None:
            return None if rng.random() < 0.3 else b"re:" + event.payload

        endpoints = [f"tcp://{name}:7000" for name in self.MEMBERS]
        for name in self.MEMBERS:
            self.net.add(name, clusters=["db"], seeds=endpoints, handler=maybe_hold)
        self.client = self.net.add("client", seeds=endpoints)
        self.incarnations: list[MemNode] = list(self.net.nodes.values())
        self.requests: dict[int, tuple[bytes, float]] = {}  # req_id -> (payload, deadline)
        self.net.advance(0.3)
        self.last_tick = self.net.now

    def member(self, index: int) -> MemNode:
        return self.net.nodes[self.MEMBERS[index]]

    @rule(count=st.integers(1, 6), timeout=st.sampled_from([0.2, 0.5, 1.5, 3.0]))
    def request(self, count: int, timeout: float) -> None:
        for _ in range(count):
            payload = b"%d" % self.net.rng.randrange(10**9)
            try:
                req_id = self.net.request(self.client, "db", payload, timeout)
            except NoResponders:
                assert self.client.core.members("db") == []
                return
            except Overloaded as exc:
                # Members held requests past their deadlines: the caller throttles itself.
                reason = exc.reason
                assert reason == "throttled"
                assert self.client.core.calls.throttle.probability("db") > 0
                return
            self.requests[req_id] = (payload, self.net.now + timeout)

    @rule(duration=st.sampled_from([0.05, 0.1, 0.3, 1.0]))
    def advance(self, duration: float) -> None:
        self.net.advance(duration, step=0.05)
        self.last_tick = self.net.now

    @rule(index=st.integers(0, 2))
    def release_held(self, index: int) -> None:
        node = self.member(index)
        if node.alive:
            payloads = {e.token: e.payload for e in node.arrived}
            for token in node.held:
                self.net.reply(node, token, b"re:" + payloads[token])
            node.held.clear()

    @rule(index=st.integers(0, 2))
    def crash_or_restart(self, index: int) -> None:
        node = self.member(index)
        if node.alive:
            self.net.kill(node)
        else:
            self.incarnations.append(self.net.restart(node))

    @rule(index=st.integers(0, 2))
    def break_link(self, index: int) -> None:
        """The client's connection to a member fails; it redials the same member (a seed)."""
        try:
            conn = self.client.conn_to(self.member(index))
        except LookupError:
            return
        self.net.break_link(self.client, conn.link_id)

    @rule()
    def flap(self) -> None:
        """All the client's connections fail at once: its requests park, then go out again,
        some to the member that already has them."""
        for link_id in list(self.client.conns):
            self.net.break_link(self.client, link_id)

    @rule(index=st.integers(0, 2))
    def toggle_partition(self, index: int) -> None:
        cut = frozenset((self.client.name, self.MEMBERS[index]))
        if cut in self.net.partitions:
            self.net.partitions.discard(cut)
        else:
            self.net.partitions.add(cut)

    @rule(loss=st.sampled_from([0.0, 0.1, 0.3]))
    def set_loss(self, loss: float) -> None:
        self.net.loss = loss

    @precondition(lambda self: hasattr(self, "net"))
    @invariant()
    def outcomes(self) -> None:
        client = self.client
        open_requests = 0
        for req_id, (payload, deadline) in self.requests.items():
            count = outcome_count(client, req_id)
            assert count <= 1
            if deadline <= self.last_tick:
                assert count == 1, f"request {req_id} still open after its deadline"
            open_requests += count == 0
            for reply in client.replies.get(req_id, ()):
                assert reply.payload == b"re:" + payload
        assert client.core.pending_count == open_requests
        outstanding = [link.outstanding for link in client.core.links()]
        assert all(n >= 0 for n in outstanding)
        assert sum(outstanding) <= open_requests

    @precondition(lambda self: hasattr(self, "net"))
    @invariant()
    def each_incarnation_runs_a_request_once(self) -> None:
        for node in self.incarnations:
            tokens = [e.token for e in node.arrived]
            assert len(tokens) == len(set(tokens)), node.name

    def teardown(self) -> None:
        if not hasattr(self, "net"):
            return
        self.net.heal()
        self.net.loss = 0.0
        self.net.advance(3.5, step=0.05)
        self.last_tick = self.net.now
        self.outcomes()
        assert self.client.core.pending_count == 0


MeshMachine.TestCase.settings = settings(
    max_examples=30,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_mesh_machine = MeshMachine.TestCase
