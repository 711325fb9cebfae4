"""Trace context in the core: carried with calls and publishes, as opaque bytes, to peers that
read it; a message without it is sent as before, and a peer that reads none is sent none."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st
from memnet import MemNet, MemNode, echo, mesh

from irismesh._core.config import CoreConfig
from irismesh._core.events import (
    MessagesArrived,
    RequestArrived,
    TracedRequestArrived,
    TunnelArrived,
)
from irismesh._core.frames import (
    MAX_TRACE,
    Kind,
    TunnelOp,
    decode_header,
    decode_traced,
    encode_header,
    encode_request,
    encode_traced,
    encode_tunnel,
)
from irismesh.errors import ProtocolError

TRACE = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\ncongo=t61rcWkgMzE"


def calls(net: MemNet) -> tuple[MemNode, MemNode]:
    nodes = mesh(net, {"member": ["db"]}, handler=echo)
    return nodes["client"], nodes["member"]


def kinds_sent(node: MemNode) -> list[int]:
    """The kinds of the frames a core has queued on its dialled links."""
    return [
        decode_header(frame, node.core.config.max_frame)[0] for _l, frame in node.core.out_frames
    ]


# ---------------------------------------------------------------------- the codec


@given(
    kind=st.sampled_from([Kind.REQUEST, Kind.BROADCAST, Kind.SURVEY, Kind.JOB, Kind.TUNNEL]),
    trace=st.binary(min_size=1, max_size=MAX_TRACE),
    body=st.binary(max_size=64),
    prefix=st.binary(max_size=8),
)
def test_a_traced_body_round_trips_alone_and_as_a_batch_entry(
    kind: int, trace: bytes, body: bytes, prefix: bytes
) -> None:
    wrapped = encode_traced(int(kind), trace, body)
    inner, got, first = decode_traced(wrapped)
    assert (inner, got, wrapped[first:]) == (kind, trace, body)
    inside = prefix + wrapped  # an entry of a BATCH: decoded in place
    inner, got, first = decode_traced(inside, len(prefix), len(inside))
    assert (inner, got, inside[first:]) == (kind, trace, body)


@pytest.mark.parametrize(
    "body",
    [
        b"",  # no head
        encode_traced(int(Kind.REPLY), TRACE, b"x"),  # only calls are traced
        encode_traced(int(Kind.TRACED), TRACE, b"x"),  # no wrapping twice
        encode_traced(int(Kind.REQUEST), b"", b"x"),  # a context is never empty
        encode_traced(int(Kind.REQUEST), TRACE, b"")[:-5],  # shorter than it says
        encode_traced(int(Kind.REQUEST), b"t" * (MAX_TRACE + 1), b""),
    ],
)
def test_a_bad_traced_body_is_a_protocol_error(body: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_traced(body)


# ---------------------------------------------------------------------- calls


@pytest.mark.parametrize("batching", [False, True], ids=["frames", "batches"])
def test_a_request_carries_its_trace_context_and_one_without_carries_nothing(
    batching: bool,
) -> None:
    net = MemNet(seed=1)
    client, member = calls(net)
    client.core.batching = member.core.batching = batching
    traced = client.core.request("db", b"a", 2.0, net.now, trace=TRACE)
    plain = client.core.request("db", b"b", 2.0, net.now)
    client.core.seal_staged()
    if not batching:
        assert kinds_sent(client) == [Kind.TRACED, Kind.REQUEST]
    net.collect(client)
    net.run(net.now)
    assert [(e.payload, e.trace) for e in member.arrived] == [(b"a", TRACE), (b"b", b"")]
    # A type of its own for the one with context: a member's handlers dispatch on the type.
    assert [type(e) for e in member.arrived] == [TracedRequestArrived, RequestArrived]
    member.core.seal_staged()
    net.collect(member)
    net.run(net.now)
    assert [client.replies[r][0].payload for r in (traced, plain)] == [b"re:a", b"re:b"]


def test_a_resent_request_keeps_its_trace_context() -> None:
    net = MemNet(seed=2)
    nodes = mesh(net, {"m1": ["db"], "m2": ["db"]}, handler=lambda node, event: None)
    client = nodes["client"]
    client.core.request("db", b"x", 5.0, net.now, trace=TRACE)
    net.collect(client)
    net.run(net.now)
    first = next(n for n in (nodes["m1"], nodes["m2"]) if n.arrived)
    other = nodes["m2"] if first is nodes["m1"] else nodes["m1"]
    net.kill(first)
    net.advance(4.0)
    stats = client.core.stats  # moved as its link fell silent, or resent once it was dead
    assert stats["requests_resent"] + stats["requests_migrated"] == 1
    assert [(e.payload, e.trace) for e in other.arrived] == [(b"x", TRACE)]


def test_a_member_that_reads_no_context_gets_the_request_without_it() -> None:
    net = MemNet(seed=3)
    client, member = calls(net)
    [link] = client.core.members("db")
    link.traces = False  # as a member of an older version says in its WELCOME
    client.core.request("db", b"a", 2.0, net.now, trace=TRACE)
    assert kinds_sent(client) == [Kind.REQUEST]
    net.collect(client)
    net.run(net.now)
    assert [(e.payload, e.trace) for e in member.arrived] == [(b"a", b"")]


def test_a_broadcast_and_a_survey_carry_their_trace_context() -> None:
    net = MemNet(seed=4)
    nodes = mesh(net, {"m1": ["db"], "m2": ["db"]}, handler=echo)
    client = nodes["client"]
    for kind in (Kind.BROADCAST, Kind.SURVEY):
        sent = client.core.fanout(int(kind), "db", b"all", 2.0, net.now, TRACE)
        assert len(sent) == 2
        net.collect(client)
        net.run(net.now)
    for name in ("m1", "m2"):
        got = [(e.kind, e.trace) for e in nodes[name].arrived]
        assert got == [(Kind.BROADCAST, TRACE), (Kind.SURVEY, TRACE)]


def test_a_bad_traced_frame_is_dropped_and_counted() -> None:
    net = MemNet(seed=5)
    client, member = calls(net)
    [link] = client.core.members("db")
    body = encode_traced(int(Kind.REPLY), TRACE, encode_request(9, 1000, [], b"x"))
    frame = client.core.outbox.frame(link, link.clusters["db"], int(Kind.TRACED), body)
    client.core.out_frames.append((link.link_id, frame))
    net.collect(client)
    net.run(net.now)
    assert member.arrived == []
    assert member.core.stats["dropped_bad_envelope"] == 1
    net.request(client, "db", b"after")  # the link lives on
    assert [e.payload for e in member.arrived] == [b"after"]


def test_a_tunnel_opens_with_its_trace_context() -> None:
    net = MemNet(seed=6)
    client, member = calls(net)
    client.core.open_tunnel("db", 4096, TRACE)
    net.collect(client)
    net.run(net.now)
    [arrived] = member.events(TunnelArrived)
    assert (arrived.cluster, arrived.trace) == ("db", TRACE)


def test_an_old_format_tunnel_open_still_opens() -> None:
    net = MemNet(seed=7)
    client, member = calls(net)
    [link] = client.core.members("db")
    link.traces = False
    client.core.open_tunnel("db", 4096, TRACE)
    assert kinds_sent(client) == [Kind.TUNNEL]
    net.collect(client)
    net.run(net.now)
    [arrived] = member.events(TunnelArrived)
    assert arrived.trace == b""
    assert encode_tunnel(1, int(TunnelOp.OPEN), 4096)  # the layout is unchanged


def test_a_frame_header_is_unchanged_by_tracing() -> None:
    assert encode_header(Kind.REQUEST, 1, 2)[3] == 0  # the flags byte stays reserved


# ---------------------------------------------------------------------- publishes


def pubsub_pair(net: MemNet) -> tuple[MemNode, MemNode]:
    pub = net.add("pub")
    sub = net.add("sub", seeds=[pub])
    pub.core.add_candidate(sub.endpoint, net.now, seed=True)
    net.advance(0.5)
    sub.core.subscribe("t.#")
    net.collect(sub)
    net.settle()
    net.run(net.now + net.max_delay)
    return pub, sub


def arrived(node: MemNode) -> list[tuple[str, bytes, bytes, float, bytes | None]]:
    """(topic, payload, trace, stamp, id) of every message delivered."""
    out = []
    for event in node.events(MessagesArrived):
        for i, (topic, payload) in enumerate(event.messages):
            trace = (event.traces or {}).get(i, b"")
            stamp = (event.stamps or {}).get(i, 0.0)
            out.append((topic, payload, trace, stamp, (event.ids or {}).get(i)))
    return out


@pytest.mark.parametrize("mode", ["frames", "runs", "batches"])
def test_a_publish_carries_its_trace_context_with_its_stamp_or_its_id(mode: str) -> None:
    net = MemNet(seed=8, config=CoreConfig(pubsub_window=64))
    pub, sub = pubsub_pair(net)
    pub.core.batching = mode != "frames"
    [link] = [p for p in pub.core.peers() if p.peer_id == sub.node_id]
    link.pub_runs = mode == "runs"
    msg_id = bytes(range(16))
    assert pub.core.publish("t.a", b"plain") == 1
    assert pub.core.publish("t.b", b"traced", trace=TRACE) == 1
    assert pub.core.publish("t.c", b"stamped", 1.7e9, trace=TRACE) == 1
    assert pub.core.publish("t.d", b"kept", msg_id=msg_id, trace=TRACE) == 1
    assert pub.core.publish("t.e", b"plain again") == 1
    pub.core.seal_staged()
    net.collect(pub)
    net.settle()
    assert arrived(sub) == [
        ("t.a", b"plain", b"", 0.0, None),
        ("t.b", b"traced", TRACE, 0.0, None),
        ("t.c", b"stamped", TRACE, 1.7e9, None),
        ("t.d", b"kept", TRACE, 0.0, msg_id),
        ("t.e", b"plain again", b"", 0.0, None),
    ]
    assert sum(n for k, n in sub.core.stats.items() if k.startswith("dropped_")) == 0


def test_a_publish_to_a_subscriber_that_reads_no_context_goes_without_it() -> None:
    net = MemNet(seed=9)
    pub, sub = pubsub_pair(net)
    [link] = [p for p in pub.core.peers() if p.peer_id == sub.node_id]
    link.traces = False
    assert pub.core.publish("t.x", b"m", trace=TRACE) == 1
    net.collect(pub)
    net.settle()
    assert arrived(sub) == [("t.x", b"m", b"", 0.0, None)]
    assert pub.core.stats["publish_trace_unread"] == 1


def test_a_publish_whose_context_overruns_its_entry_is_dropped() -> None:
    net = MemNet(seed=10)
    pub, sub = pubsub_pair(net)
    [link] = [p for p in pub.core.peers() if p.peer_id == sub.node_id]
    slot = link.topic_slots.get("t") or pub.core.pubsub._topic_slot(link, "t")
    # PUBLISH_TRACED whose context length runs past the entry's end.
    body = struct.pack("!QB", link.pub_seq + 1, 3) + struct.pack("!BH", int(Kind.PUBLISH), 500)
    body += b"t.x" + b"payload"
    frame = pub.core.outbox.frame(link, slot, int(Kind.PUBLISH_TRACED), body)
    pub.core.out_frames.append((link.link_id, frame))
    net.collect(pub)
    net.settle()
    assert arrived(sub) == []
    assert sub.core.stats["dropped_bad_envelope"] == 1
